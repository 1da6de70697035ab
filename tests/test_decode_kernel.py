"""Tests of the Pallas flash-decoding kernel (flashlax/kernels/decode.py) and its configs.

On CPU the kernel runs in the Pallas interpreter (interpret=True) at tiny shapes, against the float64
decode reference and the XLA split-KV path. The interpreter fills output buffers with NaN before the kernel
runs and every cache row past kv_lens holds NaN here, so the finite-output checks also prove that every
output element was written and that no row past kv_lens was read. ``gpu``-marked tests run the compiled
kernel at the benchmark's sizes (pytest -m gpu on the device machine).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from conftest import TOLERANCES, normal, on_gpu, rel_err
from flashlax import masks, score_mods
from flashlax.fallbacks.decode import decode_attention_xla
from flashlax.kernels import configs
from flashlax.kernels.configs import (DECODE_CONFIGS, DecodeConfig, check_decode_config, decode_config,
                                      decode_smem_bytes)
from flashlax.kernels.decode import (_smem_view, choose_num_splits, decode_attention_pallas, kernel_outputs,
                                     launch_config, merge_splits)
from flashlax.reference import decode_reference

KINDS = {"h200": "NVIDIA H200", "rtx3090": "NVIDIA GeForce RTX 3090", "default": "Some Future GPU"}


def _inputs(seed, batch, q_heads, kv_heads, q_len, max_len, head_dim, dtype=jnp.float32, head_dim_v=None,
            kv_lens=None):
    """Fresh random q, caches and kv_lens (given, or random in [Lq, Lmax] with the first = Lmax); every
    cache row at or past kv_lens is NaN."""
    rng = np.random.default_rng(seed)
    q = normal(rng, (batch, q_heads, q_len, head_dim), dtype)
    k = normal(rng, (batch, kv_heads, max_len, head_dim), dtype)
    v = normal(rng, (batch, kv_heads, max_len, head_dim_v or head_dim), dtype)
    if kv_lens is None:
        lens = rng.integers(q_len, max_len + 1, (batch,))
        lens[0] = max_len                                # one full cache: the last, ragged tile
        lens = jnp.asarray(lens, jnp.int32)
    else:
        lens = jnp.asarray(kv_lens, jnp.int32)
    return q, _poison(k, lens), _poison(v, lens), lens


def _poison(cache, kv_lens):
    rows = jnp.arange(cache.shape[2], dtype=jnp.int32)[None, None, :, None] < kv_lens[:, None, None, None]
    return jnp.where(rows, cache, jnp.nan)


def _reference(q, k, v, kv_lens, scale=None, **mods):
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        out, lse = jax.jit(lambda q, k, v, kv_lens: decode_reference(q, k, v, kv_lens=kv_lens, scale=scale, **mods))(
            f64(q), f64(k), f64(v), jnp.asarray(kv_lens))
        return np.asarray(out), np.asarray(lse)


def _xla(q, k, v, kv_lens, scale, **kw):
    return decode_attention_xla(q, k, v, kv_lens=kv_lens, scale=scale, return_lse=True, **kw)


def _pallas(q, k, v, kv_lens, scale=None, **kw):
    return decode_attention_pallas(q, k, v, kv_lens=kv_lens, scale=scale, return_lse=True, interpret=True, **kw)


def _check(out, lse, ref_out, ref_lse, dtype):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "unwritten or leaked NaN"
    tol = TOLERANCES[jnp.dtype(dtype).name]
    assert rel_err(out, ref_out) <= tol
    empty = ~np.isfinite(ref_lse)
    np.testing.assert_array_equal(lse[empty], -np.inf)
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------------
# Against the float64 reference and the XLA path (interpreted)
# ----------------------------------------------------------------------------------------------------

CASES = [
    # (id, B, Hq, Hkv, Lq, Lmax, D, dtype, num_splits)
    ("g1_lq1_odd_len", 2, 2, 2, 1, 37, 64, "float32", None),
    ("g3_lq5_d96", 2, 6, 2, 5, 77, 96, "float32", 3),
    # 8 x 16 = 128 rows: four 32-row blocks per KV group with the f32 D128 config
    ("g8_lq16_row_blocks", 1, 8, 1, 16, 45, 64, "float32", 2),
    ("g8_lq2_splits_past_cache", 2, 8, 1, 2, 50, 64, "float32", 40),
    ("g5_lq3_d256", 1, 5, 1, 3, 21, 256, "float32", 2),
    ("g4_lq4_bf16", 2, 8, 2, 4, 70, 128, "bfloat16", None),
    ("g6_lq1_fp16", 1, 6, 1, 1, 65, 64, "float16", 3),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_xla(case):
    """GQA groups 1, 3, 4, 5, 6, 8; Lq 1, 2, 3, 4, 5, 16; odd cache lengths; ragged kv_lens with NaN past
    them; explicit and chosen num_splits, also more than the cache has tiles; head dims 64..256; float32,
    bf16, fp16."""
    name, batch, hq, hkv, lq, max_len, d, dtype, splits = case
    q, k, v, lens = _inputs(sum(map(ord, name)), batch, hq, hkv, lq, max_len, d, jnp.dtype(dtype))
    out, lse = _pallas(q, k, v, lens, num_splits=splits)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    _check(out, lse, *_reference(q, k, v, lens), q.dtype)
    xla_out, xla_lse = _xla(q, k, v, lens, d ** -0.5, num_splits=splits)
    assert rel_err(np.asarray(out, np.float64), np.asarray(xla_out, np.float64)) <= TOLERANCES[dtype]


MERGE_CASES = [
    # (id, B, Hq, Hkv, Lq, Lmax, D, num_splits, block_rows): 16-key tiles so the cache has many of them
    ("g8_lq2_13_splits", 2, 8, 1, 2, 200, 64, 40, 16),      # 13 splits in 4 merge steps, ragged lengths
    ("g8_lq16_row_blocks", 1, 8, 1, 16, 100, 64, 5, 32),    # 4 row blocks, each its own counter; 4 splits
    ("g3_lq5_d96", 2, 6, 2, 5, 77, 96, 3, 16),              # head dim padded 96 -> 128
    ("g4_lq1_44_splits", 1, 4, 1, 1, 1400, 128, 80, 16),    # 4 rows (not padded to 16), 3 merge steps
]


@pytest.mark.parametrize("case", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merges_of_the_splits(case):
    """The three merges of the splits (the last split of a group merging in the kernel, the default; a fused
    XLA step; a second Pallas launch, ``merge_kernel_rows`` rows per program, the last row block ragged where
    the group's rows are not a multiple, or one program for all of them) against the reference and each
    other: several merge steps, row blocks (each its own arrival counter), splits past a sequence's end
    (partials with lse -inf), ragged kv_lens with NaN past them."""
    name, batch, hq, hkv, lq, max_len, d, splits, block_rows = case
    lens = [max_len, lq + 20][:batch]      # most of the second sequence's splits see nothing
    q, k, v, lens = _inputs(sum(map(ord, name)), batch, hq, hkv, lq, max_len, d, kv_lens=lens)
    base = decode_config(d, d, q.dtype, "cpu-interpret")
    assert base.merge_in_kernel_kb > 0
    results = {}
    for mode, fields in (("kernel", {}), ("xla", dict(merge_in_kernel_kb=0)),
                         ("launch", dict(merge_in_kernel_kb=0, merge_kernel_rows=2 if hq * lq // hkv % 4 else 4)),
                         ("launch_wide", dict(merge_in_kernel_kb=0, merge_kernel_rows=256))):   # over the rows
        cfg = dataclasses.replace(base, block_kv=16, block_rows=block_rows, **fields)
        _, _, partials = kernel_outputs(q, k, v, lens, scale=0.1, num_splits=splits, config=cfg, interpret=True)
        assert partials == (mode == "xla")    # the kernel or the second launch merged, or XLA merges the partials
        if mode == "kernel":                  # partials over the size limit: the XLA merge
            small = dataclasses.replace(cfg, merge_in_kernel_kb=1)
            assert kernel_outputs(q, k, v, lens, scale=0.1, num_splits=splits, config=small, interpret=True)[2]
        results[mode] = _pallas(q, k, v, lens, num_splits=splits, config=cfg)
        _check(*results[mode], *_reference(q, k, v, lens), q.dtype)
    for mode in ("xla", "launch", "launch_wide"):
        np.testing.assert_allclose(np.asarray(results[mode][0]), np.asarray(results["kernel"][0]), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(np.asarray(results[mode][1]), np.asarray(results["kernel"][1]), rtol=1e-5,
                                   atol=1e-6)
    if name == MERGE_CASES[0][0]:   # vmap adds a grid axis: each mapped call gets its own counters
        cfg = dataclasses.replace(base, block_kv=16, block_rows=block_rows)
        one = lambda q, c=cfg: _pallas(q, k, v, lens, num_splits=splits, config=c)[0]  # noqa: E731
        stacked = jax.vmap(one)(jnp.stack([q, -0.5 * q]))
        np.testing.assert_allclose(np.asarray(stacked[0]), np.asarray(results["kernel"][0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(stacked[1]), np.asarray(one(-0.5 * q)), rtol=1e-6, atol=1e-6)
        # the merge launch mapped: both launches get the mapped axis, each call's partials its own
        launch = dataclasses.replace(cfg, merge_in_kernel_kb=0, merge_kernel_rows=4)
        mapped = jax.vmap(lambda q: one(q, launch))(jnp.stack([-0.5 * q, q]))
        np.testing.assert_allclose(np.asarray(mapped[0]), np.asarray(stacked[1]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(mapped[1]), np.asarray(results["kernel"][0]), rtol=1e-5, atol=1e-6)
        with jax.enable_x64(True):   # int64 kv_lens; the counters and index arithmetic stay int32
            x64 = jax.jit(lambda q, lens: _pallas(q, k, v, lens, num_splits=splits, config=cfg))(q, lens.astype(jnp.int64))
        _check(*x64, *_reference(q, k, v, lens), q.dtype)


def test_value_head_dim_and_scale():
    """Dv != D, an explicit (negative) scale, kv_lens == Lq (the new tokens are the whole cache)."""
    q, k, v, lens = _inputs(2, 2, 4, 2, 3, 40, 64, head_dim_v=32, kv_lens=[3, 40])
    out, lse = _pallas(q, k, v, lens, scale=-0.2, num_splits=2)
    assert out.shape == (2, 4, 3, 32)
    _check(out, lse, *_reference(q, k, v, lens, scale=-0.2), q.dtype)


_KEEP = jnp.asarray(np.random.default_rng(5).random((2, 90)) < 0.6)
_BIAS = jnp.linspace(-0.5, 0.5, 4)
MODS = {
    "window": dict(mask_mod=masks.sliding_window(11)),
    "softcap": dict(score_mod=score_mods.softcap(1.5)),
    "alibi+window": dict(score_mod=score_mods.alibi(jnp.linspace(0.1, 0.8, 6)), mask_mod=masks.sliding_window(17)),
    # a captured array read at (b, kv_idx): which cache rows each sequence may see
    "captured_mask": dict(mask_mod=lambda b, h, q_idx, kv_idx: _KEEP[b, kv_idx]),
    # a captured [2L-1] table read at q_idx - kv_idx: a [rows, block_kv] gather per tile
    "relative_bias": dict(score_mod=score_mods.relative_bias(jnp.linspace(-1.0, 1.0, 179))),
    # heads 0 and 4 see nothing: output 0, lse -inf
    "empty_heads": dict(mask_mod=lambda b, h, q_idx, kv_idx: (h % 4) != 0),
}


@pytest.mark.parametrize("name", list(MODS))
def test_mods(name):
    """Mods run in the kernel with scalar semantics; q_idx is the new token's absolute position."""
    kw = MODS[name]
    q, k, v, lens = _inputs(3, 2, 6, 2, 3, 90, 64)
    out, lse = _pallas(q, k, v, lens, num_splits=3, **kw)
    _check(out, lse, *_reference(q, k, v, lens, **kw), q.dtype)
    xla_out, _ = _xla(q, k, v, lens, 64 ** -0.5, num_splits=3, **kw)
    assert rel_err(np.asarray(out, np.float64), np.asarray(xla_out, np.float64)) <= TOLERANCES["float32"]


def test_unsupported_mod_runs_on_xla():
    """A mod that reduces a captured array (not a point read) cannot be evaluated on kernel tiles: the call
    runs the XLA path and is still right."""
    score_mod = lambda s, b, h, q_idx, kv_idx: s + jnp.sum(_BIAS) + _BIAS[h % 4]  # noqa: E731
    q, k, v, lens = _inputs(4, 1, 4, 2, 2, 30, 64)
    out, lse = _pallas(q, k, v, lens, score_mod=score_mod)
    _check(out, lse, *_reference(q, k, v, lens, score_mod=score_mod), q.dtype)


def test_kv_lens_never_recompile_and_stay_in_bounds():
    """kv_lens are read in the kernel: new values reuse the compiled call; traced values outside [Lq, Lmax]
    (the front end turns those rows into NaN) are clamped in the kernel, never read out of bounds."""
    f = jax.jit(lambda q, k, v, lens: _pallas(q, k, v, lens, num_splits=3))
    for lens in ([4, 64], [30, 9], [64, 64], [5, 33]):
        q, k, v, lens = _inputs(6, 2, 4, 2, 4, 64, 64, kv_lens=lens)
        _check(*f(q, k, v, lens), *_reference(q, k, v, lens), q.dtype)
    out, _ = f(q, k, v, jnp.asarray([1000, -7], jnp.int32))
    assert out.shape == q.shape
    assert f._cache_size() == 1


@pytest.mark.parametrize("path", ["one_split", "merge_in_kernel", "xla_merge", "merge_launch", "paged", "xla_mod"])
def test_nan_outside_lens_in_every_final_store(path):
    """``nan_outside_lens`` (the front end's guard for traced kv_lens): every store that writes the final
    output (one split, the in-kernel merge, the XLA merge, the merge launch, paged, the XLA path for a mod
    the kernel cannot run) gives NaN rows for lengths outside [Lq, Lmax], int32 extremes included, and leaves the other batch
    elements exactly as the unguarded call writes them, right against the reference."""
    batch, lq, max_len, page = 6, 3, 48, 16
    q, k, v, _ = _inputs(21, batch, 4, 2, lq, max_len, 64, kv_lens=[max_len] * batch)
    lens = jnp.asarray([max_len, lq - 1, 20, max_len + 1, 2 ** 31 - 1, -2 ** 31], jnp.int32)
    good = np.asarray([True, False, True, False, False, False])
    cfg = dataclasses.replace(decode_config(64, 64, q.dtype, "cpu-interpret"), block_kv=16)
    splits, kk, vv, kw, mods = 3, k, v, {}, {}
    if path == "one_split":
        splits = 1
    elif path == "xla_merge":
        cfg = dataclasses.replace(cfg, merge_in_kernel_kb=0)
    elif path == "merge_launch":
        cfg = dataclasses.replace(cfg, merge_in_kernel_kb=0, merge_kernel_rows=4)
    elif path == "paged":   # sequence b's pages in pool order b * pages + p
        pages = max_len // page
        kk, vv = (c.reshape(batch, 2, pages, page, 64).transpose(0, 2, 1, 3, 4).reshape(batch * pages, 2, page, 64)
                  for c in (k, v))
        kw = dict(block_table=jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages))
    elif path == "xla_mod":
        mods = dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + jnp.sum(_BIAS) + _BIAS[h % 4])
    if path != "xla_mod":   # the store path the config takes
        partials = kernel_outputs(q, kk, vv, lens, scale=0.125, num_splits=splits, config=cfg, interpret=True,
                                  **kw)[2]
        assert partials == (path == "xla_merge")
    call = jax.jit(lambda lens, guard: _pallas(q, kk, vv, lens, scale=0.125, num_splits=splits, config=cfg,
                                               nan_outside_lens=guard, **kw, **mods), static_argnums=1)
    out, lse = (np.asarray(x) for x in call(lens, True))
    plain_out, plain_lse = (np.asarray(x) for x in call(lens, False))
    assert np.isnan(out[~good]).all() and np.isnan(lse[~good]).all()
    np.testing.assert_array_equal(out[good], plain_out[good])
    np.testing.assert_array_equal(lse[good], plain_lse[good])
    _check(out[good], lse[good], *_reference(q[good], k[good], v[good], lens[good], scale=0.125, **mods), q.dtype)


def test_merge_splits():
    """The log-sum-exp merge: splits that saw nothing weigh 0, rows no split saw give 0 and -inf."""
    parts = jnp.array([[[1.0], [5.0]], [[3.0], [7.0]]])        # [S=2, rows=2, Dv=1]
    lse = jnp.array([[0.0, -jnp.inf], [jnp.log(3.0), -jnp.inf]])  # [S=2, rows=2]
    out, total = merge_splits(parts, lse)
    np.testing.assert_allclose(out[:, 0], [(1 * 1 + 3 * 3) / 4, 0.0], rtol=1e-6)
    np.testing.assert_allclose(total, [np.log(4.0), -np.inf], rtol=1e-6)


def test_x64():
    """jax_enable_x64 on: int64 kv_lens, index arithmetic stays int32 in the kernel."""
    q, k, v, lens = _inputs(7, 2, 6, 2, 3, 50, 64)
    with jax.enable_x64(True):
        out, lse = jax.jit(lambda q, k, v, lens: _pallas(q, k, v, lens, num_splits=2))(q, k, v, lens.astype(jnp.int64))
    _check(out, lse, *_reference(q, k, v, lens), q.dtype)


def test_deterministic():
    q, k, v, lens = _inputs(8, 2, 4, 2, 4, 50, 64, jnp.bfloat16)
    f = jax.jit(lambda q, k, v, lens: _pallas(q, k, v, lens, num_splits=2)[0])
    np.testing.assert_array_equal(np.asarray(f(q, k, v, lens), np.float32), np.asarray(f(q, k, v, lens), np.float32))


# ----------------------------------------------------------------------------------------------------
# Lowering for the GPU, configs, split choice (no execution)
# ----------------------------------------------------------------------------------------------------

LOWERINGS = [
    # (q_heads, kv_heads, Lq, Lmax, D, dtype, mods)
    (32, 8, 1, 4100, 128, jnp.bfloat16, None),                 # Lq 1, ragged cache, many splits
    (32, 8, 16, 4096, 128, jnp.bfloat16, None),                # 64 rows in one program
    (48, 4, 16, 1000, 96, jnp.float16, "alibi+window"),        # 192 rows: row blocks, D96 padded, mods
    (8, 8, 2, 777, 256, jnp.float32, "relative_bias"),         # float32 IEEE dots, D256, a tile gather
]


@pytest.mark.parametrize("merge", ["default", "launch"])
@pytest.mark.parametrize("guard", [False, True], ids=["plain", "nan_guard"])
@pytest.mark.parametrize("case", LOWERINGS, ids=[f"g{c[0] // c[1]}_lq{c[2]}_d{c[4]}_{c[6]}" for c in LOWERINGS])
def test_lowers_to_triton(case, guard, merge):
    """The kernel (inline-PTX FMA + ex2, both loops, masked loads, row blocks, mods, the traced-lengths NaN
    guard in its final store) goes through the Pallas Triton lowering for an abstract H200 with the configs
    the entry point picks; ``launch``: with the large merges (Lq 16) in a second Pallas launch."""
    hq, hkv, lq, max_len, d, dtype, mods = case
    config = None
    if merge == "launch":
        config = dataclasses.replace(decode_config(d, d, dtype, "NVIDIA H200"), merge_kernel_rows=4)
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)
    kw = {"alibi+window": dict(score_mod=score_mods.alibi(jnp.linspace(0.1, 0.8, hq)),
                               mask_mod=masks.sliding_window(100)),
          "relative_bias": dict(score_mod=score_mods.relative_bias(jnp.linspace(-1.0, 1.0, 2 * max_len - 1))),
          None: {}}[mods]

    def f(q, k, v, lens):
        return decode_attention_pallas(q, k, v, kv_lens=lens, device_kind="NVIDIA H200", nan_outside_lens=guard,
                                       config=config, **kw)

    sd = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(sd(2, hq, lq, d), sd(2, hkv, max_len, d), sd(2, hkv, max_len, d),
                                jax.ShapeDtypeStruct((2,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "decode_attention" in text
    if merge == "launch" and (hq // hkv, lq) == (4, 16):   # 16 splits x 64 rows: over the in-kernel limit
        assert "decode_merge" in text


def test_rtx3090_decode_configs_fit_99kb():
    """Every RTX 3090 entry fits 99 KB of shared memory per block at its largest head dim, with its full
    block_rows of query rows, for bf16 and fp16 alike (P @ V operand counted in shared memory on sm_86)."""
    assert configs.SMEM_LIMITS["rtx3090"] == 101376
    for (max_d, cls), cfg in DECODE_CONFIGS["rtx3090"].items():
        for dtype in ((jnp.float32,) if cls == "32" else (jnp.bfloat16, jnp.float16)):
            need = decode_smem_bytes(cfg, cfg.block_rows, max_d, max_d, dtype, p_in_smem=True)
            assert need <= 101376, (max_d, dtype, cfg, need)
            check_decode_config(cfg, cfg.block_rows, max_d, max_d, dtype, KINDS["rtx3090"])


@pytest.mark.parametrize("family", ["h200", "default"])
def test_other_decode_configs_fit(family):
    for (max_d, cls), cfg in DECODE_CONFIGS[family].items():
        dtype = jnp.float32 if cls == "32" else jnp.bfloat16
        check_decode_config(cfg, cfg.block_rows, max_d, max_d, dtype, KINDS[family])
        for page_size in (8, 16, 32, 48):  # tiles spanning pages: the paged overrides, counted as launched
            check_decode_config(_smem_view(cfg.for_paged(page_size), page_size), cfg.block_rows, max_d, max_d,
                                dtype, KINDS[family])


@pytest.mark.parametrize("family", ["h200", "rtx3090", "default"])
def test_default_launch_runs_the_shipped_config(family):
    """With config=None a launch runs the device's entry (with its paged overrides on pages smaller than a
    tile) unchanged: the fit check counts a paged launch's buffers as the launch holds them, so the H200's
    7-stage paged override is not stepped down to 32-key tiles (the bench's p16 rows ran that until
    session 20, 16% behind contiguous)."""
    for (max_d, cls), cfg in DECODE_CONFIGS[family].items():
        for dtype in ((jnp.float32,) if cls == "32" else (jnp.bfloat16, jnp.float16)):
            for page_size in (0, 8, 16, 32, 64, 256):
                want = cfg.for_paged(page_size) if page_size else cfg
                got, rows = launch_config(None, max_d, max_d, dtype, KINDS[family], rows=cfg.block_rows,
                                          max_len=1 << 16, page_size=page_size)
                assert (got, rows) == (want, cfg.block_rows), (family, max_d, dtype, page_size)


def test_oversized_decode_config_is_rejected_and_shrunk():
    big = DecodeConfig(block_kv=128, num_warps=4, num_stages=4, block_rows=64)
    with pytest.raises(ValueError, match="101376"):
        check_decode_config(big, 64, 256, 256, jnp.bfloat16, KINDS["rtx3090"])
    cfg, rows = configs.decode_shrink_to_fit(big, 64, 256, 256, jnp.bfloat16, KINDS["rtx3090"], tile_reads=1)
    check_decode_config(cfg, rows, 256, 256, jnp.bfloat16, KINDS["rtx3090"], tile_reads=1)
    with pytest.raises(ValueError):
        DecodeConfig(block_kv=48)


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_decode_config_merge_in_kernel_kb_validated(bad):
    with pytest.raises(ValueError, match="merge_in_kernel_kb"):
        DecodeConfig(merge_in_kernel_kb=bad)


@pytest.mark.parametrize("bad", [-1, True, 3, 1.0])
def test_decode_config_merge_kernel_rows_validated(bad):
    with pytest.raises(ValueError, match="merge_kernel_rows"):
        DecodeConfig(merge_kernel_rows=bad)


def test_num_splits_choice():
    """One wave of programs (programs_per_sm per SM): the split counts measured fastest on the H200 for the
    issue-14 shapes (one program per SM there since session 15; two per SM before); never fewer than
    min_split_tiles tiles per split, never fewer than one split."""
    shapes = ((1, 65536), (1, 16384), (8, 16384), (32, 4096), (4, 32768), (64, 4096))
    cfg = DECODE_CONFIGS["h200"][(128, "16")]
    assert cfg.programs_per_sm == 1
    chosen = {(b, lkv): choose_num_splits(b, 8, lkv, config=cfg, multiprocessors=132) for b, lkv in shapes}
    assert chosen == {(1, 65536): 16, (1, 16384): 16, (8, 16384): 2, (32, 4096): 1, (4, 32768): 4, (64, 4096): 1}
    two = dataclasses.replace(cfg, programs_per_sm=2, num_stages=3)
    chosen = {(b, lkv): choose_num_splits(b, 8, lkv, config=two, multiprocessors=132) for b, lkv in shapes}
    assert chosen == {(1, 65536): 32, (1, 16384): 32, (8, 16384): 4, (32, 4096): 1, (4, 32768): 8, (64, 4096): 1}
    assert choose_num_splits(1, 1, 100, config=cfg, multiprocessors=132) == 1       # 2 tiles < min_split_tiles
    assert choose_num_splits(1, 8, 65536, config=two, multiprocessors=132, row_blocks=4) == 8
    assert choose_num_splits(1, 8, 65536, config=cfg, multiprocessors=132, row_blocks=4) == 4


# ----------------------------------------------------------------------------------------------------
# Real GPU (pytest -m gpu)
# ----------------------------------------------------------------------------------------------------

GPU_CASES = [
    # (B, Hq, Hkv, Lq, Lmax, D, dtype, mods)
    (1, 32, 8, 1, 65536, 128, "bfloat16", None),
    (8, 32, 8, 1, 16384, 128, "bfloat16", None),
    (32, 32, 8, 1, 4096, 128, "bfloat16", None),
    (1, 32, 8, 16, 65536, 128, "bfloat16", None),
    (4, 24, 8, 4, 32768 + 77, 96, "float16", "alibi+window"),
    (2, 40, 8, 16, 5000, 64, "float32", "softcap"),
    (2, 16, 1, 16, 3000, 256, "bfloat16", "captured"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"b{c[0]}_g{c[1] // c[2]}_lq{c[3]}_l{c[4]}_d{c[5]}_{c[6]}_{c[7]}"
                                                 for c in GPU_CASES])
def test_gpu_matches_xla(case):
    """Compiled kernel at real sizes, ragged kv_lens with NaN past them, against the XLA path and a float32
    reference on the GPU."""
    batch, hq, hkv, lq, max_len, d, dtype, mods = case
    q, k, v, lens = _inputs(11, batch, hq, hkv, lq, max_len, d, jnp.dtype(dtype))
    keep = jnp.asarray(np.random.default_rng(2).random((batch, max_len)) < 0.5)
    kw = {None: {}, "alibi+window": dict(score_mod=score_mods.alibi(jnp.linspace(0.01, 0.1, hq)),
                                         mask_mod=masks.sliding_window(3000)),
          "softcap": dict(score_mod=score_mods.softcap(3.0)),
          "captured": dict(mask_mod=lambda b, h, q_idx, kv_idx: keep[b, kv_idx] | (kv_idx == q_idx))}[mods]
    out, lse = jax.jit(lambda q, k, v, lens: decode_attention_pallas(q, k, v, kv_lens=lens, return_lse=True,
                                                                     **kw))(q, k, v, lens)
    xla_out, _ = _xla(q, k, v, lens, d ** -0.5, **kw)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_lse = decode_reference(f32(q), f32(k), f32(v), kv_lens=lens, **kw)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = TOLERANCES[dtype]
    assert rel_err(np.asarray(out, np.float64), np.asarray(ref_out, np.float64)) <= tol
    assert rel_err(np.asarray(out, np.float64), np.asarray(xla_out, np.float64)) <= tol
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 32, 8, 16, 65536, 128, "bfloat16"), (2, 40, 8, 16, 5000, 64, "float32"),
                                  (3, 24, 8, 5, 20000 + 3, 96, "float16")])
def test_gpu_merge_launch(case):
    """The merge as a second Pallas launch (``merge_kernel_rows``) at real sizes, ragged kv_lens with NaN past
    them: against the XLA merge of the same partials (float32 sums in another order) and a float32
    reference."""
    batch, hq, hkv, lq, max_len, d, dtype = case
    q, k, v, lens = _inputs(13, batch, hq, hkv, lq, max_len, d, jnp.dtype(dtype))
    base = dataclasses.replace(decode_config(d, d, q.dtype, jax.devices()[0].device_kind), merge_in_kernel_kb=0)
    run = lambda cfg: jax.jit(lambda q, k, v, lens: decode_attention_pallas(  # noqa: E731
        q, k, v, kv_lens=lens, return_lse=True, config=cfg))(q, k, v, lens)
    out, lse = run(dataclasses.replace(base, merge_kernel_rows=4))
    xla_out, xla_lse = run(base)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_lse = decode_reference(f32(q), f32(k), f32(v), kv_lens=lens)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(lse), np.asarray(xla_lse), rtol=1e-5, atol=1e-5)
    assert rel_err(np.asarray(out, np.float64), np.asarray(xla_out, np.float64)) <= tol
    assert rel_err(np.asarray(out, np.float64), np.asarray(ref_out, np.float64)) <= tol
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("lq,num_splits", [(1, None), (16, None), (4, 1)])
def test_gpu_traced_lens_nan_rows(lq, num_splits):
    """The serving call on the GPU (kv_lens a traced argument): lengths outside [Lq, Lmax], int32 extremes
    included, give NaN rows from the kernel's final store (the merge in the kernel at Lq 1, one split) or
    the XLA merge (Lq 16); the other sequences match the XLA path."""
    q, k, v, _ = _inputs(12, 4, 32, 8, lq, 16384, 128, jnp.bfloat16, kv_lens=[16384] * 4)
    lens = jnp.asarray([16384, lq - 1, 9000, 2 ** 31 - 1], jnp.int32)
    out, lse = jax.jit(lambda lens: flashlax.decode_attention(q, k, v, kv_lens=lens, return_lse=True, impl="pallas",
                                                              num_splits=num_splits))(lens)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isnan(out[1::2]).all() and np.isnan(lse[1::2]).all()
    good = jnp.asarray([0, 2])
    xla_out, xla_lse = _xla(q[good], k[good], v[good], lens[good], 128 ** -0.5)
    tol = TOLERANCES["bfloat16"]
    assert rel_err(out[::2].astype(np.float64), np.asarray(xla_out, np.float64)) <= tol
    np.testing.assert_allclose(lse[::2], np.asarray(xla_lse), rtol=tol, atol=tol)


def test_x64_in_a_fresh_process():
    """x64 switched on before anything is traced (as a script does), through the front end."""
    code = ("import jax; jax.config.update('jax_enable_x64', True);"
            "jax.config.update('jax_numpy_rank_promotion', 'raise');"
            "import jax.numpy as jnp; from flashlax.kernels.decode import decode_attention_pallas as f;"
            "q = jnp.ones((1, 4, 2, 64), jnp.float32); k = jnp.ones((1, 2, 40, 64), jnp.float32);"
            "o = jax.jit(lambda q, k, l: f(q, k, k, kv_lens=l, interpret=True))(q, k, jnp.array([33]));"
            "assert o.dtype == jnp.float32 and bool(jnp.isfinite(o).all()); print('ok')")
    env = dict(os.environ, JAX_PLATFORMS="cpu" if not on_gpu() else os.environ.get("JAX_PLATFORMS", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
