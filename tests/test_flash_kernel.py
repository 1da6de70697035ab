"""Tests of the Pallas flash-attention forward (flashlax/kernels/flash_attention.py, _tiles.py).

On CPU the kernel runs in the Pallas interpreter (interpret=True) with tiny tiles, against the float64
materialised reference. The interpreter fills output buffers with NaN before the kernel runs, so the
NaN-free checks below also prove that every output element was written. ``gpu``-marked tests run the
compiled kernel at realistic shapes (pytest -m gpu on the device machine).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import TOLERANCES, normal, on_gpu, rel_err
from flashlax import masks, score_mods
from flashlax.kernels import _tiles
from flashlax.kernels.configs import FlashConfig, flash_config
from flashlax.kernels.flash_attention import flex_attention_pallas
from flashlax.masks import create_block_mask
from flashlax.reference import attention_reference

TINY = FlashConfig(block_q=16, block_kv=32, num_warps=4, num_stages=1)
TINY_PACK = FlashConfig(block_q=32, block_kv=16, num_warps=4, num_stages=1, pack_gqa=True)


def _inputs(seed, bsz, hq, hkv, lq, lkv, d, dv=None, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = normal(rng, (bsz, hq, lq, d), dtype)
    k = normal(rng, (bsz, hkv, lkv, d), dtype)
    v = normal(rng, (bsz, hkv, lkv, dv or d), dtype)
    return q, k, v


def _reference(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """float64 (out, lse) as numpy arrays (one jitted program, not one compile per eager op)."""
    with jax.enable_x64():
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        out, lse = jax.jit(lambda q, k, v: attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                               scale=scale))(f64(q), f64(k), f64(v))
        return np.asarray(out), np.asarray(lse)


def _check(out, lse, ref_out, ref_lse, dtype=jnp.float32):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "unwritten (NaN) or NaN output"
    assert rel_err(out, ref_out) < TOLERANCES[jnp.dtype(dtype).name]
    empty = ~np.isfinite(ref_lse)
    np.testing.assert_array_equal(lse[empty], -np.inf)
    np.testing.assert_array_equal(out[empty], 0.0)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol)


def _run(q, k, v, config=TINY, **kw):
    return flex_attention_pallas(q, k, v, return_lse=True, interpret=True, config=config, **kw)


def _segments(bsz, length, n_docs, seed=0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), size=n_docs - 1, replace=False))
    ids = np.zeros((bsz, length), np.int32)
    for c in cuts:
        ids[:, c:] += 1
    return jnp.asarray(ids)


# ----------------------------------------------------------------------------------------------------
# Forward against the float64 reference
# ----------------------------------------------------------------------------------------------------

CASES = [
    # (id, B, Hq, Hkv, Lq, Lkv, D, Dv, mask, mod)
    ("g1_full_odd", 1, 2, 2, 37, 45, 32, 32, None, None),
    ("g2_causal", 2, 4, 2, 48, 48, 64, 64, "causal", None),
    ("g3_causal_lq_ne_lkv", 1, 6, 2, 29, 61, 32, 32, "causal", None),
    ("g4_window_d96", 1, 4, 1, 50, 50, 96, 96, "window", None),
    ("g2_document", 2, 4, 2, 45, 45, 32, 32, "document", None),
    ("g1_prefix_alibi", 1, 3, 3, 40, 53, 32, 32, "prefix", "alibi"),
    ("g2_softcap_dv_ne_d", 1, 4, 2, 33, 40, 64, 32, None, "softcap"),
    ("g4_causal_relbias", 1, 4, 1, 41, 41, 32, 32, "causal", "relative_bias"),
    ("g2_fully_masked_rows", 1, 2, 1, 40, 40, 32, 32, "late", None),
    # full tiles 0 and 2 with a gap: the non-consecutive part of the list goes through the index ref
    ("g2_striped_full_tiles", 1, 2, 1, 30, 96, 32, 32, "striped", None),
]


def _mods(mask, mod, bsz, hq, lq, lkv):
    seg = _segments(bsz, max(lq, lkv), min(3, max(lq, lkv)))
    mask_mod = {None: None, "causal": masks.causal, "window": masks.sliding_window(7, 3),
                "document": masks.document(seg[:, :lq], seg[:, :lkv]), "prefix": masks.prefix_lm(9),
                # rows < 20 see nothing: fully masked rows must give 0 and lse -inf
                "late": lambda b, h, i, j: (i >= 20) & (j <= i),
                "striped": lambda b, h, i, j: (j // 32) % 2 == 0}[mask]
    rng = np.random.default_rng(7)
    score_mod = {None: None, "alibi": score_mods.alibi(jnp.asarray(rng.uniform(size=hq), jnp.float32)),
                 "softcap": score_mods.softcap(2.0),
                 "relative_bias": score_mods.relative_bias(
                     normal(rng, (hq, 2 * max(lq, lkv) - 1)))}[mod]
    return score_mod, mask_mod


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_reference(case):
    _, bsz, hq, hkv, lq, lkv, d, dv, mask, mod = case
    q, k, v = _inputs(sum(map(ord, case[0])), bsz, hq, hkv, lq, lkv, d, dv)
    score_mod, mask_mod = _mods(mask, mod, bsz, hq, lq, lkv)
    out, lse = _run(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert out.shape == (bsz, hq, lq, dv) and out.dtype == q.dtype and lse.shape == (bsz, hq, lq)
    _check(out, lse, *_reference(q, k, v, score_mod, mask_mod))


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_packed_gqa_matches_reference(mask):
    """One program per KV group (pack_gqa) gives the same results as the per-head grid."""
    q, k, v = _inputs(3, 1, 4, 2, 43, 43, 32)
    score_mod, mask_mod = _mods(mask, "alibi", 1, 4, 43, 43)
    out, lse = _run(q, k, v, config=TINY_PACK, score_mod=score_mod, mask_mod=mask_mod)
    _check(out, lse, *_reference(q, k, v, score_mod, mask_mod))


def test_bfloat16_and_scale():
    q, k, v = _inputs(4, 1, 4, 2, 40, 40, 64, dtype=jnp.bfloat16)
    out, lse = _run(q, k, v, mask_mod=masks.causal, scale=0.3)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    _check(out, lse, *_reference(q, k, v, None, masks.causal, scale=0.3), dtype=jnp.bfloat16)


def test_query_tile_major_launch_order():
    """FlashConfig.q_major (query tiles the fastest grid axis) computes the same attention, with and
    without a block mask, per-head and packed GQA (G = 2), odd lengths."""
    q, k, v = _inputs(6, 2, 4, 2, 53, 70, 32)
    for cfg in (dataclasses.replace(TINY, q_major=True), dataclasses.replace(TINY_PACK, q_major=True)):
        for mask_mod in (masks.causal, None):
            out, lse = _run(q, k, v, config=cfg, mask_mod=mask_mod)
            _check(out, lse, *_reference(q, k, v, None, mask_mod))


@pytest.mark.parametrize("lkv", [93, 96, 128])
@pytest.mark.parametrize("mask", ["causal", "window", "document", "striped"])
def test_kernel_kv_tiles_inside_mask_tiles(mask, lkv):
    """Block-mask KV tiles spanning several kernel KV tiles (64-key mask tiles, 16-key kernel tiles: 4 per
    mask tile): leading runs, listed full tiles (striped) and partial tiles all step through the sub-tiles;
    Lkv 93 / 96 leaves kernel tiles wholly past the end inside the last mask tile (96 is a multiple of the
    kernel tile, so the loads must still be masked), 128 none. GQA, packed and per-head programs."""
    q, k, v = _inputs(11, 2, 4, 2, 77, lkv, 32)
    score_mod, mask_mod = _mods(mask, None, 2, 4, 77, lkv)
    bm = create_block_mask(mask_mod, None if mask != "document" else 2, None, 77, lkv, block_q=16, block_kv=64)
    ref = _reference(q, k, v, None, mask_mod)
    for cfg in (FlashConfig(16, 16, 4, 1), FlashConfig(32, 16, 4, 1, pack_gqa=True)):
        out, lse = _run(q, k, v, config=cfg, mask_mod=mask_mod, block_mask=bm)
        _check(out, lse, *ref)


@pytest.mark.parametrize("scale", [-0.4, 0.0])
def test_nonpositive_scale(scale):
    """The forward folds a positive scale into the exponent's FMA and takes the running max on unscaled
    scores; a negative or zero scale must take the pre-scaled path (the max of -s is not -max s)."""
    q, k, v = _inputs(5, 1, 4, 2, 37, 45, 32)
    out, lse = _run(q, k, v, mask_mod=masks.causal, scale=scale)
    _check(out, lse, *_reference(q, k, v, None, masks.causal, scale=scale))
    out, lse = _run(q, k, v, scale=scale)
    _check(out, lse, *_reference(q, k, v, None, None, scale=scale))


@given(seed=st.integers(0, 2**16), groups=st.sampled_from([1, 2, 3, 4]), lq=st.integers(1, 70),
       lkv=st.integers(1, 70), d=st.sampled_from([16, 32, 48]),
       mask=st.sampled_from([None, "causal", "window", "document", "prefix"]))
def test_forward_property(seed, groups, lq, lkv, d, mask):
    q, k, v = _inputs(seed, 1, groups, 1, lq, lkv, d)
    score_mod, mask_mod = _mods(mask, None, 1, groups, lq, lkv)
    out, lse = _run(q, k, v, mask_mod=mask_mod)
    _check(out, lse, *_reference(q, k, v, None, mask_mod))


# ----------------------------------------------------------------------------------------------------
# Block masks given by the caller
# ----------------------------------------------------------------------------------------------------

def test_given_block_mask_tiles_become_kernel_tiles():
    q, k, v = _inputs(5, 1, 2, 1, 40, 40, 32)
    bm = create_block_mask(masks.causal, None, None, 40, 40, block_q=32, block_kv=16)
    out, lse = _run(q, k, v, block_mask=bm)          # mask_mod comes from the block mask
    _check(out, lse, *_reference(q, k, v, None, masks.causal))


def test_given_block_mask_with_odd_tiles_is_rebuilt_or_rejected():
    q, k, v = _inputs(6, 1, 2, 1, 40, 40, 32)
    bm = create_block_mask(masks.causal, None, None, 40, 40, block_q=24, block_kv=24)
    out, lse = _run(q, k, v, block_mask=bm)          # rebuilt from its mask_mod
    _check(out, lse, *_reference(q, k, v, None, masks.causal))
    bare = masks.block_mask_from_kinds(bm.tile_kinds, 40, 40, 24, 24)   # no mask_mod to rebuild with
    with pytest.raises(ValueError, match="block_mask"):
        _run(q, k, v, block_mask=bare)


def test_block_mask_shape_mismatch_raises():
    q, k, v = _inputs(6, 1, 2, 1, 40, 40, 32)
    bm = create_block_mask(masks.causal, None, None, 48, 40, block_q=16, block_kv=32)
    with pytest.raises(ValueError, match="block_mask"):
        _run(q, k, v, block_mask=bm)


# ----------------------------------------------------------------------------------------------------
# Gradients through the custom_vjp (q, k, v and a captured bias table)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("return_lse", [False, True])
def test_gradients_including_captured_table(return_lse):
    q, k, v = _inputs(8, 1, 4, 2, 33, 33, 32)
    table = normal(9, (4, 2 * 33 - 1))
    w = normal(10, q.shape)

    def loss(fn, q, k, v, table):
        out = fn(q, k, v, table)
        o, l = out if isinstance(out, tuple) else (out, None)
        extra = 0.0 if l is None else jnp.where(jnp.isfinite(l), l, 0.0).sum()
        return (o * w).sum() + extra

    def kernel(q, k, v, table):
        return flex_attention_pallas(q, k, v, score_mod=score_mods.relative_bias(table), mask_mod=masks.causal,
                                     return_lse=return_lse, interpret=True, config=TINY)

    def reference(q, k, v, table):
        o, l = attention_reference(q, k, v, score_mod=score_mods.relative_bias(table), mask_mod=masks.causal)
        return (o, l) if return_lse else o

    grads = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3))(q, k, v, table)
    with jax.enable_x64():
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        ref = jax.jit(jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3)))(f64(q), f64(k), f64(v),
                                                                                       f64(table))
    for g, r in zip(grads, ref):
        assert rel_err(g, r) < 1e-4


# ----------------------------------------------------------------------------------------------------
# Mods, transformations, errors
# ----------------------------------------------------------------------------------------------------

def test_tile_mod_point_reads_match_mod_on_arrays():
    """TileMod evaluates a scalar-traced mod on tiles, reading captured arrays by index."""
    seg = _segments(2, 40, 3)
    mod = masks.document(seg)
    tm = _tiles.TileMod.make(mod, "mask")
    assert len(tm.captured) == 1
    qi, ki = _tiles.tile_positions(jnp.int32(16), jnp.int32(8), 16, 32)
    got = tm(tm.captured, jnp.int32(1), jnp.int32(0), qi, ki)
    want = jnp.broadcast_to(mod(jnp.int32(1), jnp.int32(0), qi, ki), (16, 32))
    np.testing.assert_array_equal(got, want)


def test_tile_reads_counts_tile_shaped_gathers():
    """Only reads indexed by both q_idx and kv_idx are [BQ, BKV] gathers (they cost shared memory)."""
    make = _tiles.TileMod.make
    assert make(score_mods.relative_bias(jnp.ones((2, 31))), "score").tile_reads == 1
    assert make(score_mods.alibi(jnp.ones((2,))), "score").tile_reads == 0
    assert make(masks.document(_segments(1, 20, 2)), "mask").tile_reads == 0
    assert make(masks.causal, "mask").tile_reads == 0


def test_unsupported_captured_slice_falls_back_to_xla():
    """A mod that reduces a captured array (not a point read) runs on the XLA path, with equal results."""
    table = normal(11, (2, 40))

    def row_bias(score, b, h, q_idx, kv_idx):
        return score + jnp.max(table) * (kv_idx - q_idx).astype(score.dtype) * 0.1

    with pytest.raises(_tiles.UnsupportedModError):
        _tiles.TileMod.make(row_bias, "score")
    q, k, v = _inputs(12, 1, 2, 1, 30, 40, 32)
    out, lse = _run(q, k, v, score_mod=row_bias)
    _check(out, lse, *_reference(q, k, v, row_bias, None))


def test_jit_and_vmap():
    q, k, v = _inputs(13, 1, 2, 1, 24, 24, 32)
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    f = jax.jit(jax.vmap(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=masks.causal, interpret=True,
                                                                config=TINY)))
    out = f(qs, ks, vs)
    for i in range(2):
        ref, _ = _reference(qs[i], ks[i], vs[i], None, masks.causal)
        assert rel_err(out[i], ref) < TOLERANCES["float32"]


def test_bad_inputs_raise_value_error():
    q, k, v = _inputs(14, 1, 3, 2, 16, 16, 32)
    with pytest.raises(ValueError, match=r"\(1, 3, 16, 32\)"):
        flex_attention_pallas(q, k, v, interpret=True)           # Hq % Hkv != 0
    q, k, v = _inputs(14, 1, 2, 1, 16, 16, 32)
    with pytest.raises(ValueError, match="dtype"):
        flex_attention_pallas(q, k.astype(jnp.bfloat16), v, interpret=True)
    with pytest.raises(ValueError, match="shared memory"):
        flex_attention_pallas(q, k, v, interpret=True, config=FlashConfig(256, 256, 8, 4))


# ----------------------------------------------------------------------------------------------------
# Real GPU (pytest -m gpu)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("mask", ["causal", "document", None])
def test_gpu_realistic_shapes(dtype, mask):
    assert on_gpu()
    bsz, hq, hkv, length, d = 2, 8, 2, 1000, 128
    q, k, v = _inputs(20, bsz, hq, hkv, length, length, d, dtype=dtype)
    score_mod, mask_mod = _mods(mask, None, bsz, hq, length, length)
    out, lse = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=mask_mod, return_lse=True))(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_lse = attention_reference(f32(q), f32(k), f32(v), mask_mod=mask_mod)
    assert rel_err(out, ref_out) < TOLERANCES[jnp.dtype(dtype).name]     # float32: 1e-5 rules out tf32
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "document"])
def test_gpu_default_block_mask(mask):
    """A default (128 x 128) BlockMask passed in, H200 D128 bf16 (the benchmark's way of calling): the
    kernel steps two 64-key tiles per mask tile; Lkv 960 is a multiple of 64 but not of 128, so the second
    half of the last mask tile lies past the end."""
    assert on_gpu()
    bsz, hq, hkv, length, d = 2, 8, 2, 960, 128
    q, k, v = _inputs(22, bsz, hq, hkv, length, length, d, dtype=jnp.bfloat16)
    _, mask_mod = _mods(mask, None, bsz, hq, length, length)
    bm = create_block_mask(mask_mod, bsz if mask == "document" else None, None, length, length)
    out, lse = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, block_mask=bm, return_lse=True))(q, k, v)
    ref_out, ref_lse = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), mask_mod=mask_mod)
    assert rel_err(out, ref_out) < TOLERANCES["bfloat16"]
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_deterministic_and_mods():
    assert on_gpu()
    q, k, v = _inputs(21, 1, 8, 2, 777, 777, 96, dtype=jnp.bfloat16)
    score_mod, mask_mod = _mods("causal", "relative_bias", 1, 8, 777, 777)
    f = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, score_mod=score_mod, mask_mod=mask_mod))
    a, b = np.asarray(f(q, k, v), np.float32), np.asarray(f(q, k, v), np.float32)
    np.testing.assert_array_equal(a, b)
    ref, _ = attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                 score_mod=score_mod, mask_mod=mask_mod)
    assert rel_err(a, ref) < TOLERANCES["bfloat16"]


@pytest.mark.parametrize("q_major,mask_mod,length", [(False, masks.causal, 300), (True, masks.causal, 300),
                                                     (False, None, 300), (False, None, 4200)])
def test_forward_lowers_to_triton(q_major, mask_mod, length):
    """The forward kernel (inline-PTX FMA + ex2, both launch orders, an implicit causal mask built while
    tracing for another platform, with 64-key kernel tiles inside its 128-key mask tiles, the unmasked dense
    loop) goes through the Pallas Triton lowering for an abstract H200, with the D128 configs the entry point
    picks itself (128/64 w4 s2; unmasked over 4096 keys 128/128 w8 s3) and the query-tile-major order on a
    masked one."""
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731

    def f(q, k, v):
        cfg = dataclasses.replace(flash_config(128, 128, jnp.bfloat16, "NVIDIA H200"), q_major=True) \
            if q_major else None
        return flex_attention_pallas(q, k, v, mask_mod=mask_mod, config=cfg, device_kind="NVIDIA H200")

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(sd(1, 4, length, 128), sd(1, 2, length, 128), sd(1, 2, length, 128)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "flex_attention_fwd" in text
