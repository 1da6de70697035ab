"""flex_attention against the float64 reference, for every implementation the backend offers."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashlax
from flashlax import masks, score_mods
from flashlax.fallbacks import attention as xla_attention
from flashlax.reference import attention_reference
from conftest import TOLERANCES, normal, rel_err

IMPLS = flashlax.available_impls("flex_attention")
GROUPS = (1, 2, 3, 4, 6, 8)
HEAD_DIMS = (32, 64, 96, 128, 256)


def _inputs(seed, batch, q_heads, kv_heads, q_len, kv_len, head_dim, v_dim, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = normal(rng, (batch, q_heads, q_len, head_dim), dtype)
    k = normal(rng, (batch, kv_heads, kv_len, head_dim), dtype)
    v = normal(rng, (batch, kv_heads, kv_len, v_dim), dtype)
    dout = normal(rng, (batch, q_heads, q_len, v_dim))
    dlse = normal(rng, (batch, q_heads, q_len))
    return q, k, v, dout, dlse


def make_mask(name, batch, q_len, kv_len, seed=0):
    """Library masks and combinations by name (document masks capture random segment ids)."""
    if name == "none":
        return None
    if name == "causal":
        return masks.causal
    if name == "sliding_window":
        return masks.sliding_window(5, 2)
    if name == "prefix_lm":
        return masks.prefix_lm(7)
    rng = np.random.default_rng(seed)
    q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (batch, q_len)), axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, (batch, kv_len)), axis=1), jnp.int32)
    doc = masks.document(q_seg, kv_seg)
    if name == "document":
        return doc
    if name == "document_and_causal":
        return masks.and_masks(doc, masks.causal)
    if name == "window_or_prefix":
        return masks.or_masks(masks.sliding_window(3), masks.prefix_lm(4))
    raise ValueError(name)


MASK_NAMES = ("none", "causal", "sliding_window", "prefix_lm", "document", "document_and_causal",
              "window_or_prefix")
SCORE_NAMES = ("none", "alibi", "softcap", "relative_bias")


def make_score_mod(name, q_heads, q_len, kv_len, seed=0):
    """(score_mod factory taking the captured array, that array or None)."""
    if name == "none":
        return None, None
    if name == "alibi":
        return score_mods.alibi, jnp.linspace(0.05, 0.5, q_heads, dtype=jnp.float32)
    if name == "softcap":
        return (lambda _: score_mods.softcap(2.0)), None
    if name == "relative_bias":
        span = 2 * max(q_len, kv_len) - 1
        table = normal(seed + 7, (q_heads, span))
        return score_mods.relative_bias, table
    raise ValueError(name)


def _loss(fn, dout, dlse, mask_mod, score_factory, q, k, v, cap):
    score_mod = score_factory(cap) if score_factory is not None else None
    out, lse = fn(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse.astype(lse.dtype))
    return jnp.sum(out.astype(lse.dtype) * dout.astype(lse.dtype)) + lse_term, (out, lse)


def _reference_run(q, k, v, *, score_mod, mask_mod):
    return attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod)


def run_and_compare(runs, q, k, v, dout, dlse, *, mask_mod=None, score_factory=None, captured=None, tol=None,
                    check_grads=True):
    """Compares out, lse and grads (q, k, v and the score_mod's captured array) of each of ``runs`` with
    the float64 reference. ``run(q, k, v, score_mod=..., mask_mod=...) -> (out, lse)``. Returns the
    (out, lse) of the last run."""
    runs = runs if isinstance(runs, (list, tuple)) else [runs]
    tol = tol or TOLERANCES[jnp.dtype(q.dtype).name]
    argnums = (0, 1, 2, 3) if captured is not None else (0, 1, 2)
    with jax.enable_x64():
        ref_loss = functools.partial(_loss, _reference_run, jnp.asarray(dout, jnp.float64),
                                     jnp.asarray(dlse, jnp.float64), mask_mod, score_factory)
        ref_args = [None if x is None else jnp.asarray(x, jnp.float64) for x in (q, k, v, captured)]
        (_, (ref_out, ref_lse)), ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums, has_aux=True))(*ref_args)
        ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
        ref_grads = [np.asarray(g) for g in ref_grads]
    for run in runs:
        loss = functools.partial(_loss, run, dout, dlse, mask_mod, score_factory)
        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, captured)
        assert out.dtype == q.dtype and out.shape == ref_out.shape
        assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
        assert rel_err(out, ref_out) <= tol
        lse = np.asarray(lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        if finite.any():
            assert rel_err(lse[finite], ref_lse[finite]) <= tol
        if check_grads:
            for name, g, ref_g in zip(("dq", "dk", "dv", "dcaptured"), grads, ref_grads):
                assert g.shape == ref_g.shape, name
                err = rel_err(g, ref_g)
                assert err <= 4 * tol, f"{name}: relative error {err:.2e} > {4 * tol:.1e}"
    return out, lse


def _front_end(impl):
    def run(q, k, v, *, score_mod, mask_mod):
        return flashlax.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True, impl=impl)
    return run


@st.composite
def attention_case(draw, max_len=72):
    groups = draw(st.sampled_from(GROUPS))
    kv_heads = draw(st.sampled_from((1, 2)))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    v_dim = draw(st.sampled_from((head_dim, 16, 48)))
    return dict(batch=draw(st.integers(1, 2)), q_heads=groups * kv_heads, kv_heads=kv_heads,
                q_len=draw(st.integers(1, max_len)), kv_len=draw(st.integers(1, max_len)), head_dim=head_dim,
                v_dim=v_dim, mask=draw(st.sampled_from(MASK_NAMES)), score=draw(st.sampled_from(SCORE_NAMES)),
                seed=draw(st.integers(0, 2 ** 16)))


def _run_case(run, case, dtype=jnp.float32, tol=None):
    q, k, v, dout, dlse = _inputs(case["seed"], case["batch"], case["q_heads"], case["kv_heads"], case["q_len"],
                                  case["kv_len"], case["head_dim"], case["v_dim"], dtype)
    mask_mod = make_mask(case["mask"], case["batch"], case["q_len"], case["kv_len"], case["seed"])
    factory, captured = make_score_mod(case["score"], case["q_heads"], case["q_len"], case["kv_len"], case["seed"])
    return run_and_compare(run, q, k, v, dout, dlse, mask_mod=mask_mod, score_factory=factory, captured=captured,
                           tol=tol)


def _small_tiles(block_q, block_kv):
    def run(q, k, v, *, score_mod, mask_mod):
        return xla_attention.flex_attention_xla(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                scale=q.shape[-1] ** -0.5, return_lse=True, block_q=block_q,
                                                block_kv=block_kv)
    return run


@given(case=attention_case(max_len=90), block_q=st.integers(3, 24), block_kv=st.integers(3, 40))
def test_matches_reference(case, block_q, block_kv):
    """Every impl of the backend (and the xla path with many small ragged tiles: tile skipping,
    partial/full classification, shifted last tiles, dK/dV accumulation) against one float64 reference:
    odd lengths, Lq != Lkv, GQA groups 1-8, D 32-256, Dv != D, masks and mods; out, lse and grads."""
    _run_case([_front_end(impl) for impl in IMPLS] + [_small_tiles(block_q, block_kv)], case)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(dtype):
    case = dict(batch=1, q_heads=4, kv_heads=2, q_len=45, kv_len=61, head_dim=64, v_dim=32, mask="causal",
                score="alibi", seed=3)
    _run_case([_front_end(impl) for impl in IMPLS], case, dtype=jnp.dtype(dtype))


def test_long_causal_multi_tile():
    """Default tile sizes with several (ragged) tiles: Lq = Lkv = 700, GQA 4, causal, relative bias."""
    case = dict(batch=1, q_heads=4, kv_heads=1, q_len=700, kv_len=700, head_dim=32, v_dim=32, mask="causal",
                score="relative_bias", seed=5)
    _run_case([_front_end(impl) for impl in IMPLS], case)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows(impl):
    """Rows that see no key: output 0, lse -inf, no NaN anywhere, finite (zero) gradients for them."""
    q, k, v, dout, dlse = _inputs(11, 2, 4, 2, 19, 23, 32, 32)
    dead_rows = lambda b, h, q_idx, kv_idx: (q_idx % 4 != 1) & ((b + h) % 3 != 2)
    mask_mod = masks.and_masks(masks.causal, dead_rows)
    out, lse = run_and_compare(_front_end(impl), q, k, v, dout, dlse, mask_mod=mask_mod)
    dead = np.asarray(jnp.broadcast_to(dead_rows(jnp.arange(2)[:, None, None], jnp.arange(4)[None, :, None],
                                                 jnp.arange(19)[None, None, :], 0), lse.shape)) == 0
    assert dead.any()
    assert np.all(np.isneginf(lse[dead])) and np.all(np.isfinite(lse[~dead]))
    assert np.all(np.asarray(out)[dead] == 0)
    grads = jax.grad(lambda q, k, v: jnp.sum(flashlax.flex_attention(q, k, v, mask_mod=mask_mod, impl=impl)),
                     (0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(np.asarray(grads[0])[dead] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_masked(impl):
    q, k, v, _, _ = _inputs(2, 1, 2, 1, 9, 14, 32, 32)
    nothing = lambda b, h, q_idx, kv_idx: q_idx < 0
    out, lse = flashlax.flex_attention(q, k, v, mask_mod=nothing, return_lse=True, impl=impl)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))
    grads = jax.grad(lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=nothing, impl=impl).sum(),
                     (0, 1, 2))(q, k, v)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


@pytest.mark.parametrize("impl", IMPLS)
def test_block_mask_forms_agree(impl):
    """mask_mod alone, block_mask alone (carrying its mod) and both give the same result; block sizes of
    the block mask need not match the implementation's tiles."""
    q, k, v, _, _ = _inputs(4, 2, 6, 2, 50, 77, 32, 32)
    mask_mod = masks.and_masks(masks.sliding_window(20, 3), make_mask("document", 2, 50, 77, seed=4))
    bm = flashlax.create_block_mask(mask_mod, 2, None, 50, 77, block_q=16, block_kv=8)
    a = flashlax.flex_attention(q, k, v, mask_mod=mask_mod, impl=impl)
    b = flashlax.flex_attention(q, k, v, block_mask=bm, impl=impl)
    c = flashlax.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=bm, impl=impl)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
    with jax.enable_x64():
        ref, _ = attention_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), mask_mod=mask_mod)
    assert rel_err(b, ref) <= TOLERANCES["float32"]


def test_block_mask_under_jit_with_traced_segments():
    """The block mask of a captured-array mod is built inside jit from traced segment ids."""
    q, k, v, _, _ = _inputs(6, 2, 4, 2, 40, 40, 32, 32)
    seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 4, (2, 40)), axis=1), jnp.int32)

    @jax.jit
    def run(q, k, v, seg):
        mod = masks.and_masks(masks.document(seg), masks.causal)
        bm = flashlax.create_block_mask(mod, 2, None, 40, 40, block_q=16, block_kv=16)
        return flashlax.flex_attention(q, k, v, block_mask=bm)

    out = run(q, k, v, seg)
    with jax.enable_x64():
        ref, _ = attention_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)),
                                     mask_mod=masks.and_masks(masks.document(seg), masks.causal))
    assert rel_err(out, ref) <= TOLERANCES["float32"]


def test_schedule_skips_empty_tiles():
    """Causal with 64-row tiles over 256 x 256: row tile i visits tiles 0..i; only the diagonal is masked."""
    bm = flashlax.create_block_mask(masks.causal, None, None, 256, 256, block_q=64, block_kv=64)
    sched = xla_attention.build_schedule(bm, 256, 256, 64, 64)
    np.testing.assert_array_equal(sched.count, [1, 2, 3, 4])
    for i in range(4):
        np.testing.assert_array_equal(sched.kv_tiles[i, : i + 1], np.arange(i + 1))
        visited = np.asarray(sched.kv_tiles[i, : i + 1])
        np.testing.assert_array_equal(np.asarray(sched.masked)[i, visited], visited == i)
    # Sliding window 64 wide: each row tile touches at most 2 kv tiles.
    bm = flashlax.create_block_mask(masks.sliding_window(60), None, None, 1024, 1024, block_q=64, block_kv=64)
    sched = xla_attention.build_schedule(bm, 1024, 1024, 64, 64)
    assert int(np.max(sched.count)) == 2


def test_gqa_never_repeats_kv():
    """Native GQA: no [B, Hq, Lkv, D]-shaped array appears in the forward or backward program."""
    q, k, v, _, _ = _inputs(0, 1, 12, 3, 37, 41, 24, 24)
    f = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl="xla").sum()
    text = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v))
    assert not re.search(r"f32\[1,12,41,24\]", text)
    text_repeat = str(jax.make_jaxpr(lambda q, k, v: flashlax.flex_attention(q, k, v, impl="repeat"))(q, k, v))
    assert re.search(r"f32\[1,12,41,24\]", text_repeat)  # the check can fail: the baseline does repeat


def test_memory_linear_in_length():
    """Compiled temporary memory of fwd+bwd at L=8192 stays far below one L x L score matrix (256 MB)."""
    shape = jax.ShapeDtypeStruct((1, 2, 8192, 32), jnp.float32)
    kv_shape = jax.ShapeDtypeStruct((1, 1, 8192, 32), jnp.float32)
    f = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl="xla").sum()
    compiled = jax.jit(jax.grad(f, (0, 1, 2))).lower(shape, kv_shape, kv_shape).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 64 * 2 ** 20, f"{temp / 2 ** 20:.1f} MB of temporaries"


def test_residuals_are_inputs_output_and_lse():
    """The custom_vjp saves q, k, v, out and lse only (plus mod arrays and the tile schedule)."""
    q, k, v, _, _ = _inputs(1, 1, 4, 2, 64, 80, 32, 16)
    f = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl="xla")
    _, residuals = jax.vjp(f, q, k, v)
    leaves = [x for x in jax.tree_util.tree_leaves(residuals) if hasattr(x, "shape")]
    float_sizes = sorted(int(np.prod(x.shape)) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
    expected = sorted([q.size, k.size, v.size, 4 * 64 * 16, 4 * 64])
    assert float_sizes == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    q, k, v, dout, _ = _inputs(8, 1, 4, 2, 70, 90, 32, 32)
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flashlax.flex_attention(
        q, k, v, mask_mod=masks.causal, score_mod=score_mods.softcap(3.0), impl=impl) * dout), (0, 1, 2)))
    first, second = f(q, k, v), f(q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_and_jit(impl):
    q, k, v, _, _ = _inputs(9, 2, 4, 2, 21, 33, 32, 32)
    f = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl=impl)
    stacked = jax.jit(jax.vmap(f))(q[:, None], k[:, None], v[:, None])[:, 0]
    looped = jnp.concatenate([f(q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(2)])
    np.testing.assert_allclose(stacked, looped, rtol=1e-5, atol=1e-6)


def test_scale_argument():
    q, k, v, _, _ = _inputs(10, 1, 2, 2, 10, 12, 32, 32)
    out = flashlax.flex_attention(q, k, v, scale=0.37)
    with jax.enable_x64():
        ref, _ = attention_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), scale=0.37)
    assert rel_err(out, ref) <= TOLERANCES["float32"]


def _bad_calls():
    q = jnp.ones((2, 4, 8, 16))
    k = jnp.ones((2, 2, 10, 16))
    v = jnp.ones((2, 2, 10, 16))
    bm = flashlax.create_block_mask(masks.causal, None, None, 8, 12)
    bm_heads = flashlax.create_block_mask(masks.causal, None, 3, 8, 10)
    return [
        ("q must be 4-D", (q[0], k, v), {}),
        ("multiple of KV heads", (jnp.ones((2, 3, 8, 16)), k, v), {}),
        ("head dims", (jnp.ones((2, 4, 8, 32)), k, v), {}),
        ("v length", (q, k, jnp.ones((2, 2, 9, 16))), {}),
        ("batch size that is q's or 1", (jnp.ones((1, 4, 8, 16)), k, v), {}),
        ("batch size that is q's or 1", (q, k[:1], v), {}),
        ("same dtype", (q.astype(jnp.bfloat16), k, v), {}),
        ("floating dtype", (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), {}),
        ("mask_mod must be callable", (q, k, v), dict(mask_mod=3)),
        ("score_mod must be callable", (q, k, v), dict(score_mod="x")),
        ("block_mask was built for", (q, k, v), dict(block_mask=bm)),
        ("Hm=3", (q, k, v), dict(block_mask=bm_heads)),
        ("block_mask must be a BlockMask", (q, k, v), dict(block_mask=np.ones(3))),
        ("unknown impl", (q, k, v), dict(impl="cuda")),
    ]


@pytest.mark.parametrize("message,args,kwargs", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_errors(message, args, kwargs):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        flashlax.flex_attention(*args, **kwargs)
    if "dtype" not in message and "callable" not in message and "impl" not in message:
        assert "(" in str(info.value)  # names the shapes it saw


@pytest.mark.parametrize("impl,interpret", [("xla", False), ("repeat", False), ("pallas", True)])
def test_kv_batch_one_broadcasts(impl, interpret):
    """K/V with batch 1 against q with batch B (as FlexAttention): equal to K/V repeated over the batch,
    and the K/V gradient is the sum over the batch."""
    q, k, v, dout, _ = _inputs(21, 3, 4, 2, 19, 23, 16, 16)
    k1, v1 = k[:1], v[:1]
    kw = dict(mask_mod=masks.causal, impl=impl, interpret=interpret)

    def loss(q, k, v):
        return jnp.sum(flashlax.flex_attention(q, k, v, **kw) * dout)

    out = flashlax.flex_attention(q, k1, v1, **kw)
    grads = jax.grad(loss, (0, 1, 2))(q, k1, v1)
    rep = lambda x: jnp.broadcast_to(x, (3,) + x.shape[1:])
    ref = flashlax.flex_attention(q, rep(k1), rep(v1), **kw)
    ref_dq, ref_dk, ref_dv = jax.grad(loss, (0, 1, 2))(q, rep(k1), rep(v1))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert grads[1].shape == k1.shape
    np.testing.assert_allclose(grads[0], ref_dq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], ref_dk.sum(0, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[2], ref_dv.sum(0, keepdims=True), rtol=1e-5, atol=1e-5)


def test_pallas_on_cpu_needs_interpret():
    if flashlax.dispatch.backend_family() == "gpu":
        pytest.skip("CPU-only check")
    q = jnp.ones((1, 2, 8, 16))
    with pytest.raises(RuntimeError, match="pallas requires an accelerator backend."):
        flashlax.flex_attention(q, q, q, impl="pallas")


@pytest.mark.slow
def test_long_sequence_runs_in_linear_memory():
    """B1 Hq32 Hkv8 L16384 D128 causal (the contract's long case): fwd+bwd temporaries stay far below one
    Hq x L x L score tensor (32 GB), and the forward runs (about 45 s on the 2-core CI machine)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (1, 32, 16384, 128))
    k = jax.random.normal(keys[1], (1, 8, 16384, 128))
    v = jax.random.normal(keys[2], (1, 8, 16384, 128))
    f = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl="xla")
    grad = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), (0, 1, 2))).lower(q, k, v).compile()
    assert grad.memory_analysis().temp_size_in_bytes < 2 ** 30
    out = jax.jit(f)(q, k, v)
    assert np.all(np.isfinite(out[0, :, ::997]))


def test_vmap_over_captured_arrays():
    """vmap over per-example segment ids and bias tables (traced block masks, batched schedules)."""
    rng = np.random.default_rng(12)
    q = normal(rng, (3, 1, 4, 40, 16))
    k = normal(rng, (3, 1, 2, 40, 16))
    v = normal(rng, (3, 1, 2, 40, 16))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (3, 1, 40)), axis=-1), jnp.int32)
    table = normal(rng, (3, 4, 79))

    def f(q, k, v, seg, table):
        return flashlax.flex_attention(q, k, v, mask_mod=masks.document(seg),
                                       score_mod=score_mods.relative_bias(table), impl="xla")

    out = jax.jit(jax.vmap(f))(q, k, v, seg, table)
    dq, dtable = jax.jit(jax.vmap(jax.grad(lambda *a: f(*a).sum(), (0, 4))))(q, k, v, seg, table)
    with jax.enable_x64():
        for i in range(3):
            ref = lambda q, t: attention_reference(q, jnp.asarray(k[i], jnp.float64), jnp.asarray(v[i], jnp.float64),
                                                   mask_mod=masks.document(seg[i]),
                                                   score_mod=score_mods.relative_bias(t))[0]
            q64, t64 = jnp.asarray(q[i], jnp.float64), jnp.asarray(table[i], jnp.float64)
            assert rel_err(out[i], ref(q64, t64)) <= TOLERANCES["float32"]
            ref_dq, ref_dtable = jax.grad(lambda q, t: ref(q, t).sum(), (0, 1))(q64, t64)
            assert rel_err(dq[i], ref_dq) <= 4 * TOLERANCES["float32"]
            assert rel_err(dtable[i], ref_dtable) <= 4 * TOLERANCES["float32"]
