"""decode_attention against the float64 decode reference, for every implementation the backend offers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashlax
from conftest import TOLERANCES, normal, rel_err, sub_jaxprs
from flashlax import masks, score_mods
from flashlax.fallbacks.decode import choose_num_splits, decode_attention_xla
from flashlax.reference import attention_reference, decode_reference

IMPLS = flashlax.available_impls("decode_attention")


def _inputs(seed, batch, q_heads, kv_heads, q_len, max_len, head_dim, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = normal(rng, (batch, q_heads, q_len, head_dim), dtype)
    k = normal(rng, (batch, kv_heads, max_len, head_dim), dtype)
    v = normal(rng, (batch, kv_heads, max_len, head_dim), dtype)
    lens = jnp.asarray(rng.integers(q_len, max_len + 1, (batch,)), jnp.int32)
    return q, k, v, lens


def _poison(cache, kv_lens):
    """NaN in every cache row at or past kv_lens: must never reach the result."""
    rows = jnp.arange(cache.shape[2])[None, None, :, None] < kv_lens[:, None, None, None]
    return jnp.where(rows, cache, jnp.nan)


def _reference(q, k, v, kv_lens, **mods):
    with jax.enable_x64():
        run = jax.jit(lambda q, k, v, kv_lens: decode_reference(q, k, v, kv_lens=kv_lens, **mods))
        out, lse = run(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), kv_lens)
        return np.asarray(out), np.asarray(lse)


def _check(out, lse, ref_out, ref_lse, dtype):
    tol = TOLERANCES[jnp.dtype(dtype).name]
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert rel_err(out, ref_out) <= tol
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) <= tol


@st.composite
def decode_case(draw):
    kv_heads = draw(st.sampled_from((1, 2)))
    q_len = draw(st.sampled_from((1, 2, 4, 7, 16)))
    return dict(batch=draw(st.integers(1, 3)), q_heads=kv_heads * draw(st.sampled_from((1, 2, 3, 4, 6, 8))),
                kv_heads=kv_heads, q_len=q_len, max_len=draw(st.integers(q_len, 150)),
                head_dim=draw(st.sampled_from((32, 64, 96, 128))), num_splits=draw(st.sampled_from((None, 1, 2, 3, 5))),
                block_kv=draw(st.integers(4, 64)), seed=draw(st.integers(0, 2 ** 16)))


@given(case=decode_case())
def test_matches_reference(case):
    """Shapes, GQA groups, Lq 1..16, several splits and chunk sizes, ragged kv_lens with NaN past them."""
    num_splits = case["num_splits"]
    if num_splits is not None:
        num_splits = min(num_splits, case["max_len"])
    q, k, v, lens = _inputs(case["seed"], case["batch"], case["q_heads"], case["kv_heads"], case["q_len"],
                            case["max_len"], case["head_dim"])
    k, v = _poison(k, lens), _poison(v, lens)
    ref_out, ref_lse = _reference(q, k, v, lens)
    for impl in IMPLS:
        out, lse = jax.jit(lambda q, k, v, lens: flashlax.decode_attention(
            q, k, v, kv_lens=lens, num_splits=num_splits, return_lse=True, impl=impl))(q, k, v, lens)
        _check(out, lse, ref_out, ref_lse, q.dtype)
    out, lse = jax.jit(lambda q, k, v, lens: decode_attention_xla(
        q, k, v, kv_lens=lens, scale=case["head_dim"] ** -0.5, num_splits=num_splits, return_lse=True,
        block_kv=case["block_kv"]))(q, k, v, lens)
    _check(out, lse, ref_out, ref_lse, q.dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mods", ["alibi+window", "softcap+prefix", "relative_bias"])
def test_mods(impl, mods):
    """Mods see the new tokens' absolute positions (kv_lens - Lq + i) as q_idx."""
    q, k, v, lens = _inputs(3, 2, 8, 2, 4, 90, 32)
    k, v = _poison(k, lens), _poison(v, lens)
    kw = {"alibi+window": dict(score_mod=score_mods.alibi(jnp.linspace(0.1, 0.8, 8)),
                               mask_mod=masks.sliding_window(17)),
          "softcap+prefix": dict(score_mod=score_mods.softcap(1.5), mask_mod=masks.or_masks(
              masks.sliding_window(5), masks.prefix_lm(3))),
          "relative_bias": dict(score_mod=score_mods.relative_bias(jnp.linspace(-1, 1, 179)))}[mods]
    out, lse = flashlax.decode_attention(q, k, v, kv_lens=lens, num_splits=3, return_lse=True, impl=impl, **kw)
    _check(out, lse, *_reference(q, k, v, lens, **kw), q.dtype)


def test_reference_agrees_with_attention_reference():
    """decode_reference is attention over the first kv_lens rows, query rows bottom-right aligned."""
    q, k, v, _ = _inputs(4, 1, 4, 2, 3, 20, 16)
    lens = jnp.array([13], jnp.int32)
    ref, _ = _reference(q, k, v, lens)
    with jax.enable_x64():
        shifted_causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 10
        direct, _ = attention_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k[:, :, :13], v[:, :, :13])),
                                        mask_mod=shifted_causal)
    np.testing.assert_allclose(ref, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(dtype):
    q, k, v, lens = _inputs(5, 2, 8, 2, 16, 70, 64, jnp.dtype(dtype))
    ref_out, ref_lse = _reference(q, k, v, lens)
    for impl in IMPLS:
        out, lse = flashlax.decode_attention(q, k, v, kv_lens=lens, return_lse=True, impl=impl)
        _check(out, lse, ref_out, ref_lse, q.dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_lens_never_recompile(impl):
    q, k, v, _ = _inputs(6, 2, 4, 2, 4, 64, 32)
    f = jax.jit(lambda q, k, v, lens: flashlax.decode_attention(q, k, v, kv_lens=lens, impl=impl))
    for lens in ([4, 64], [30, 9], [64, 64], [5, 33]):
        lens = jnp.asarray(lens, jnp.int32)
        out = f(q, k, v, lens)
        assert rel_err(out, _reference(q, k, v, lens)[0]) <= TOLERANCES["float32"]
    assert f._cache_size() == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_default_kv_lens_is_full_cache(impl):
    q, k, v, _ = _inputs(7, 1, 4, 4, 2, 33, 32)
    full = jnp.array([33], jnp.int32)
    np.testing.assert_array_equal(flashlax.decode_attention(q, k, v, impl=impl),
                                  flashlax.decode_attention(q, k, v, kv_lens=full, impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_and_vmap(impl):
    q, k, v, lens = _inputs(8, 2, 4, 2, 4, 50, 32)
    f = jax.jit(lambda q, k, v, lens: flashlax.decode_attention(q, k, v, kv_lens=lens, num_splits=2, impl=impl))
    np.testing.assert_array_equal(f(q, k, v, lens), f(q, k, v, lens))
    stacked = jax.vmap(f)(q[:, None], k[:, None], v[:, None], lens[:, None])[:, 0]
    np.testing.assert_allclose(stacked, f(q, k, v, lens), rtol=1e-5, atol=1e-6)


def test_num_splits_choice():
    assert choose_num_splits(1, 8, 65536, backend="cpu") == 1
    gpu = choose_num_splits(1, 8, 65536, backend="gpu")
    assert 1 < gpu <= 64 and 65536 // gpu >= 512
    assert choose_num_splits(64, 8, 4096, backend="gpu") == 1


def _bad_calls():
    q = jnp.ones((2, 4, 2, 16))
    k = jnp.ones((2, 2, 20, 16))
    return [
        ("1..16 new tokens", (jnp.ones((2, 4, 17, 16)), k, k), {}),
        ("kv_lens must lie in", (q, k, k), dict(kv_lens=jnp.array([21, 5], jnp.int32))),
        ("kv_lens must lie in", (q, k, k), dict(kv_lens=jnp.array([1, 5], jnp.int32))),
        ("kv_lens must be integer [B=2]", (q, k, k), dict(kv_lens=jnp.array([5, 5, 5], jnp.int32))),
        ("kv_lens must be integer [B=2]", (q, k, k), dict(kv_lens=jnp.array([5.0, 5.0]))),
        ("batch sizes", (jnp.ones((1, 4, 2, 16)), k, k), {}),
        ("multiple of cache heads", (jnp.ones((2, 3, 2, 16)), k, k), {}),
        ("head dims", (jnp.ones((2, 4, 2, 8)), k, k), {}),
        ("must agree in", (q, k, jnp.ones((2, 2, 19, 16))), {}),
        ("num_splits", (q, k, k), dict(num_splits=0)),
        ("mask_mod must be callable", (q, k, k), dict(mask_mod=1)),
        ("share a dtype", (q.astype(jnp.bfloat16), k, k), {}),
        ("unknown impl", (q, k, k), dict(impl="nope")),
    ]


@pytest.mark.parametrize("message,args,kwargs", _bad_calls(), ids=[f"{i}-{c[0]}" for i, c in enumerate(_bad_calls())])
def test_errors(message, args, kwargs):
    with pytest.raises(ValueError, match=re.escape(message)):
        flashlax.decode_attention(*args, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [65, 0, -5, 1, 2 ** 31 - 1, -2 ** 31])
def test_traced_out_of_range_kv_lens_give_nan_rows(impl, bad):
    """Under jit kv_lens cannot be range-checked: a length outside [Lq, Lmax] gives NaN rows for that batch
    element (output and lse), never plausible numbers (the int32 extremes too: int32 lengths reach the
    implementations unclipped); the other batch elements are unaffected."""
    q, k, v, _ = _inputs(9, 2, 4, 2, 2, 64, 16)
    lens = jnp.array([64, bad], jnp.int32)
    out, lse = jax.jit(lambda lens: flashlax.decode_attention(q, k, v, kv_lens=lens, return_lse=True,
                                                              impl=impl))(lens)
    ok_out, ok_lse = flashlax.decode_attention(q[:1], k[:1], v[:1], kv_lens=lens[:1], return_lse=True, impl=impl)
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(lse[1]))
    np.testing.assert_allclose(out[:1], ok_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse[:1], ok_lse, rtol=1e-6, atol=1e-6)


def _primitives(jaxpr) -> list[str]:
    """The primitives a jaxpr runs, in order, nested calls inlined, a pallas_call as one name."""
    names = []
    for eqn in jaxpr.eqns:
        subs = [] if eqn.primitive.name == "pallas_call" else [
            sub for param in eqn.params.values() for sub in sub_jaxprs(param)]
        if not subs:
            names.append(eqn.primitive.name)
        for sub in subs:
            names += _primitives(sub)
    return names


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_traced_kv_lens_guard_in_the_kernel(num_splits, dtype):
    """The Pallas path (interpreted) with traced kv_lens: NaN rows outside [Lq, Lmax] for int32 and (x64)
    int64 lengths, extremes included; the guard is the kernel's final store (one split, or the merge in the
    kernel): nothing but reshapes follows the pallas_call, and int32 lengths reach it unclipped (in a
    serving step every op around the kernel costs host time)."""
    q, k, v, _ = _inputs(10, 4, 4, 2, 2, 200, 16)
    big = 2 ** 31 - 1 if dtype == "int32" else 2 ** 40
    with jax.enable_x64(dtype == "int64"):
        lens = jnp.array([200, big, 130, -big], dtype)
        call = lambda lens: flashlax.decode_attention(q, k, v, kv_lens=lens, return_lse=True,  # noqa: E731
                                                      impl="pallas", interpret=True, num_splits=num_splits)
        out, lse = (np.asarray(x) for x in jax.jit(call)(lens))
        prims = _primitives(jax.make_jaxpr(call)(lens).jaxpr)
    want_out, want_lse = flashlax.decode_attention(q[::2], k[::2], v[::2], kv_lens=jnp.array([200, 130]),
                                                   return_lse=True, impl="xla")
    assert np.isnan(out[1::2]).all() and np.isnan(lse[1::2]).all()
    np.testing.assert_allclose(out[::2], want_out, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse[::2], want_lse, rtol=2e-5, atol=2e-6)
    kernel = prims.index("pallas_call")
    assert set(prims[kernel + 1:]) == {"reshape"}, prims
    before = {"reshape", "broadcast_in_dim"} if num_splits > 1 else {"reshape"}   # the merge's counters
    if dtype == "int32":
        assert set(prims[:kernel]) == before, prims


@pytest.mark.parametrize("num_splits,max_len", [(4, 96), (1, 40), (3, 90)])
def test_one_step_per_split_in_place(num_splits, max_len):
    """The GPU default (one loop step per split, the cache viewed in place as [B, Hkv, S, len / S, D]),
    forced on any backend by block_kv = the split length: matches the reference, NaN past kv_lens stays
    out, and kv_lens shorter than one split still work."""
    q, k, v, lens = _inputs(11, 3, 8, 2, 4, max_len, 32)
    lens = lens.at[0].set(4).at[1].set(max_len)
    k, v = _poison(k, lens), _poison(v, lens)
    split_len = -(-max_len // num_splits)
    assert split_len * num_splits == max_len  # the in-place view applies
    out, lse = jax.jit(lambda q, k, v, lens: decode_attention_xla(
        q, k, v, kv_lens=lens, scale=32 ** -0.5, num_splits=num_splits, return_lse=True,
        block_kv=split_len))(q, k, v, lens)
    _check(out, lse, *_reference(q, k, v, lens), q.dtype)


@pytest.mark.parametrize("jit", [False, True])
def test_not_differentiable_says_so(jit):
    """decode_attention is an inference op: reverse mode raises the same clear error eagerly and under jit
    (before this, eager grad silently worked and jit gave jax's while_loop error)."""
    q, k, v, lens = _inputs(13, 1, 2, 1, 2, 20, 16)
    loss = lambda q: flashlax.decode_attention(q, k, v, kv_lens=lens).sum()
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    with pytest.raises(TypeError, match="decode_attention is not differentiable"):
        grad(q)
