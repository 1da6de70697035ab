"""dot_product_attention: a drop-in for jax.nn.dot_product_attention (checked against jax in float64)
and for flax's attention_fn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from conftest import TOLERANCES, normal, rel_err

B, T, S, N, K, H = 2, 13, 17, 6, 2, 32


def _inputs(seed=0, dtype=jnp.float32, t=T, s=S, n=N, k=K, h=H):
    rng = np.random.default_rng(seed)
    q = normal(rng, (B, t, n, h), dtype)
    key = normal(rng, (B, s, k, h), dtype)
    value = normal(rng, (B, s, k, h), dtype)
    mask = rng.random((B, 1, t, s)) < 0.7
    mask[0, 0, 3] = False                                                              # a fully masked row
    extras = dict(
        bias=normal(rng, (1, n, t, s)),
        bias_b=normal(rng, (B, 1, 1, s)),
        mask=jnp.asarray(mask),
        mask_full=jnp.asarray(rng.random((B, n, t, s)) < 0.8),
        dout=normal(rng, (B, t, n, h)),
    )
    return q, key, value, extras


CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "bias": dict(bias="bias"),
    "bias_broadcast_heads_query": dict(bias="bias_b"),
    "mask": dict(mask="mask"),
    "mask_per_head": dict(mask="mask_full"),
    "window_tuple": dict(local_window_size=(3, 1)),
    "window_int_causal": dict(local_window_size=4, is_causal=True),
    "scale": dict(scale=0.21, bias="bias"),
    "seq_lengths": dict(query_seq_lengths=[5, 13], key_value_seq_lengths=[9, 17]),
    "seq_lengths_empty_kv_causal_bias": dict(query_seq_lengths=[13, 7], key_value_seq_lengths=[0, 11],
                                             is_causal=True, bias="bias"),
    "everything": dict(mask="mask", bias="bias", is_causal=True, local_window_size=(5, 0),
                       key_value_seq_lengths=[12, 17], scale=0.3),
}


def _kwargs(case, extras):
    kw = {}
    for name, value in CASES[case].items():
        if name in ("bias", "mask"):
            value = extras[value]
        elif name.endswith("seq_lengths"):
            value = jnp.asarray(value, jnp.int32)
        kw[name] = value
    return kw


def _loss_and_grads(fn, q, k, v, kw, dout):
    has_bias = "bias" in kw

    def loss(q, k, v, bias):
        call_kw = dict(kw, bias=bias) if has_bias else kw
        out = fn(q, k, v, **call_kw)
        return jnp.sum(out * dout.astype(out.dtype)), out

    argnums = (0, 1, 2, 3) if has_bias else (0, 1, 2)
    (_, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(q, k, v, kw.get("bias"))
    return out, grads


@pytest.mark.parametrize("case,implementation", [(case, None) for case in CASES] + [("everything", "xla")])
def test_matches_jax_float64(case, implementation):
    """Outputs and gradients (query, key, value, bias) against jax.nn.dot_product_attention in float64."""
    q, k, v, extras = _inputs(seed=len(case))
    kw = _kwargs(case, extras)
    out, grads = jax.jit(lambda q, k, v: _loss_and_grads(
        lambda *a, **k_: flashlax.dot_product_attention(*a, implementation=implementation, **k_), q, k, v, kw,
        extras["dout"]))(q, k, v)
    with jax.enable_x64():
        to64 = lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x
        kw64 = {name: to64(x) if name == "bias" else x for name, x in kw.items()}
        ref, ref_grads = _loss_and_grads(jax.nn.dot_product_attention, to64(q), to64(k), to64(v), kw64,
                                         to64(extras["dout"]))
        ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref) <= TOLERANCES["float32"]
    for name, g, ref_g in zip(("dquery", "dkey", "dvalue", "dbias"), grads, ref_grads):
        assert g.shape == ref_g.shape
        assert rel_err(g, ref_g) <= 4 * TOLERANCES["float32"], name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_matches_jax(dtype):
    q, k, v, extras = _inputs(seed=3, dtype=jnp.dtype(dtype))
    kw = dict(is_causal=True, bias=extras["bias"].astype(dtype))
    out = flashlax.dot_product_attention(q, k, v, **kw)
    with jax.enable_x64():
        ref = jax.nn.dot_product_attention(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), is_causal=True,
                                           bias=jnp.asarray(kw["bias"], jnp.float64))
    assert out.dtype == q.dtype
    assert rel_err(out, ref) <= TOLERANCES[dtype]


def test_three_dim_inputs_and_mqa():
    q, k, v, _ = _inputs(seed=4, k=1)
    out = flashlax.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    ref = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert out.shape == q[0].shape
    assert rel_err(out, ref) <= TOLERANCES["float32"]


def test_return_residual():
    q, k, v, _ = _inputs(seed=5)
    out, lse = flashlax.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    ref_out, ref_lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert lse.shape == ref_lse.shape == (B, T, N)
    assert rel_err(out, ref_out) <= TOLERANCES["float32"]
    assert rel_err(lse, ref_lse) <= TOLERANCES["float32"]


def test_residual_has_no_gradient_and_jax_value_on_fully_masked_rows():
    """jax returns the residual through stop_gradient, and a fully masked row's residual is the finite
    log-sum-exp of its large negative logits."""
    q, k, v, extras = _inputs(seed=6)
    mask = extras["mask"]  # row 3 of batch 0 fully masked

    def residual_sum(fn, q, k, v):
        return fn(q, k, v, mask=mask, return_residual=True)[1].sum()

    grads = jax.grad(lambda *a: residual_sum(flashlax.dot_product_attention, *a), (0, 1, 2))(q, k, v)
    ref_grads = jax.grad(lambda *a: residual_sum(jax.nn.dot_product_attention, *a), (0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_array_equal(g, r)            # zeros, as jax's
    _, res = flashlax.dot_product_attention(q, k, v, mask=mask, return_residual=True)
    _, ref = jax.nn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
    assert np.all(np.isfinite(res))
    np.testing.assert_allclose(res[0, 3], ref[0, 3], rtol=1e-6)   # the fully masked row, every head
    assert rel_err(res, ref) <= TOLERANCES["float32"]


def test_unknown_keyword_is_a_type_error():
    q, k, v, _ = _inputs()
    with pytest.raises(TypeError, match="is_casual"):
        flashlax.dot_product_attention(q, k, v, is_casual=True)
    with pytest.raises(TypeError):
        jax.nn.dot_product_attention(q, k, v, is_casual=True)  # the behaviour we copy


def test_traced_scale_jit_argument_and_gradient():
    q, k, v, extras = _inputs(seed=8)

    def loss(fn, scale, q):
        return jnp.sum(fn(q, k, v, scale=scale, is_causal=True) * extras["dout"])

    value, dscale = jax.jit(jax.value_and_grad(lambda s, q: loss(flashlax.dot_product_attention, s, q)))(0.37, q)
    ref_value, ref_dscale = jax.value_and_grad(lambda s, q: loss(jax.nn.dot_product_attention, s, q))(0.37, q)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(dscale, ref_dscale, rtol=1e-4)


@pytest.mark.parametrize("window", [(-1, 3), (2, -1), (-2, -2)])
def test_negative_window_entries_match_jax(window):
    q, k, v, _ = _inputs(seed=9)
    out = flashlax.dot_product_attention(q, k, v, local_window_size=window)
    ref = jax.nn.dot_product_attention(q, k, v, local_window_size=window)
    assert rel_err(out, ref) <= TOLERANCES["float32"]


def test_debug_infs_with_fully_masked_rows():
    q, k, v, extras = _inputs(seed=10)
    mask = extras["mask"]
    with jax.debug_infs(True):
        out = flashlax.dot_product_attention(q, k, v, mask=mask)
        grads = jax.grad(lambda q: flashlax.dot_product_attention(q, k, v, mask=mask).sum())(q)
        ref = jax.nn.dot_product_attention(q, k, v, mask=mask)
    assert rel_err(out, ref) <= TOLERANCES["float32"]
    assert np.all(np.isfinite(grads))


def test_vmap_over_an_extra_batch_axis():
    """jax's batching tests: vmap over a leading axis of q/k/v and the bias (with rank promotion 'raise')."""
    rng = np.random.default_rng(12)
    qs = normal(rng, (3, B, T, N, H))
    ks = normal(rng, (3, B, S, K, H))
    vs = normal(rng, (3, B, S, K, H))
    bias = normal(rng, (3, 1, N, T, S))
    fn = lambda impl: jax.vmap(lambda q, k, v, b: impl(q, k, v, bias=b, is_causal=True))
    out = fn(flashlax.dot_product_attention)(qs, ks, vs, bias)
    ref = fn(jax.nn.dot_product_attention)(qs, ks, vs, bias)
    assert rel_err(out, ref) <= TOLERANCES["float32"]
    dbias = jax.grad(lambda b: fn(flashlax.dot_product_attention)(qs, ks, vs, b).sum())(bias)
    ref_dbias = jax.grad(lambda b: fn(jax.nn.dot_product_attention)(qs, ks, vs, b).sum())(bias)
    assert rel_err(dbias, ref_dbias) <= 4 * TOLERANCES["float32"]


def test_flax_nnx_attention_fn():
    nnx = pytest.importorskip("flax.nnx")
    features, heads, length = 48, 4, 11
    x = normal(0, (2, length, features))
    mask = nnx.make_causal_mask(jnp.ones((2, length)))
    mask = mask * jnp.asarray(np.random.default_rng(1).random((2, 1, length, length)) < 0.8)  # float, as flax's
    make = lambda fn: nnx.MultiHeadAttention(num_heads=heads, in_features=features, decode=False,
                                             attention_fn=fn, rngs=nnx.Rngs(0))
    ours, theirs = make(flashlax.dot_product_attention), make(nnx.dot_product_attention)
    out = nnx.jit(lambda m, x, mask: m(x, mask=mask))(ours, x, mask)
    ref = theirs(x, mask=mask)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= TOLERANCES["float32"]


def test_flax_linen_attention_fn():
    linen = pytest.importorskip("flax.linen")
    features, heads, length = 32, 4, 9
    x = normal(2, (2, length, features))
    mask = linen.make_causal_mask(jnp.ones((2, length)))
    ours = linen.MultiHeadDotProductAttention(num_heads=heads, attention_fn=flashlax.dot_product_attention)
    theirs = linen.MultiHeadDotProductAttention(num_heads=heads)
    params = theirs.init(jax.random.PRNGKey(3), x, mask=mask)
    out, ref = ours.apply(params, x, mask=mask), theirs.apply(params, x, mask=mask)
    assert rel_err(out, ref) <= TOLERANCES["float32"]


def test_dropout_is_refused():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="dropout"):
        flashlax.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False)
    flashlax.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=True)  # inference: fine


def test_pallas_implementation_on_cpu():
    if flashlax.dispatch.backend_family() == "gpu":
        pytest.skip("CPU-only check")
    q, k, v, _ = _inputs()
    with pytest.raises(RuntimeError, match="pallas requires an accelerator backend."):
        flashlax.dot_product_attention(q, k, v, implementation="pallas")


@pytest.mark.parametrize("kwargs,message", [
    (dict(implementation="triton"), "unsupported implementation"),
    (dict(mask=jnp.ones((1, 1, T, S + 1), bool)), "mask shape"),
    (dict(bias=jnp.ones((1, 4, T, S))), "not broadcastable"),
    (dict(bias=jnp.ones((1, 1, 1, T, S))), "bias must be 4-D"),
    (dict(query_seq_lengths=jnp.ones((B,), jnp.float32)), "query_seq_lengths must be integer"),
    (dict(key_value_seq_lengths=jnp.ones((B + 1,), jnp.int32)), "key_value_seq_lengths must be integer"),
])
def test_errors(kwargs, message):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=message):
        flashlax.dot_product_attention(q, k, v, **kwargs)


def test_shape_errors():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flashlax.dot_product_attention(q[:, :, :5], k, v)
    with pytest.raises(ValueError, match="value must have the shape of key"):
        flashlax.dot_product_attention(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="share a dtype"):
        flashlax.dot_product_attention(q.astype(jnp.bfloat16), k, v)
