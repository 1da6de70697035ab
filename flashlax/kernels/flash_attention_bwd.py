"""FlashAttention-2 backward for flex_attention: Pallas kernels (Triton lowering).

Three launches, no atomics, so the result is bit-for-bit deterministic:
  1. delta pre-pass     delta[b, h, i] = sum_d dout[b, h, i, d] * out[b, h, i, d]      (float32)
  2. dK/dV pass         grid (B, Hkv, kv tiles): for its KV tile, a program loops over the G query heads
                        of the group and over the query tiles of the transposed block mask (q_* lists),
                        accumulating dK and dV in registers: GQA without expanding K/V and without atomics.
  3. dQ pass            grid (B, Hq, q tiles): loops over the KV tiles of the row lists (kv_* lists).
Without a mask (block_mask=None) both passes loop over every tile with static trip counts and read no
index arrays (H200 B2 T4096 D128: 3.77 -> 3.64 ms against an all-full block mask), with their own config
(``BWD_DENSE_CONFIGS``).
Both passes recompute P = exp(mod(scale * q.k) - lse) and use
  dS = P * (dP - delta) * dmod/dscore * scale,   dP = dout . v^T,
where dmod/dscore comes from ``jax.jvp`` of the traced ``score_mod`` inside the kernel (the mod is
elementwise in the score, so a unit tangent gives its derivative). Full tiles skip ``mask_mod``.

Gradients of arrays captured by ``score_mod`` (ALiBi slopes, a relative-bias table) are reductions of dS
over the whole [Lq, Lkv] plane into a small array (a scatter-add for a table): that needs atomics or a
second pass in a kernel, so it is computed by an XLA pass over query tiles (memory O(block_q * Lkv) per
step) that recomputes dS and pulls it back through the mod with ``jax.vjp``. It runs only when the
score_mod captures floating-point arrays.

What runs where: every elementwise score_mod and every mask_mod runs in the kernels, including mods that
read captured arrays by point reads (``_tiles.TileMod``: slopes[h], table[h, offset], seg[b, q_idx]).
Mods that use a captured array otherwise are routed by the forward (``flex_attention_pallas``) to the
XLA path, forward and backward; so is ``return_lse=True`` under differentiation (lse cotangents).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax import _mods
from flashlax._precision import xla_precision
from flashlax import masks as masks_lib
from flashlax.kernels import _tiles
from flashlax.kernels._tiles import LOG2E, dot_nn, dot_nt, dot_precision, dot_tn, exp2_fma, fma, leading_run, pow2
from flashlax.kernels.configs import SMEM_LIMITS, device_family
from flashlax.masks import BlockMask
from flashlax.parallel.vma import out_struct


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Backward tile sizes, warps and pipeline stages.

    block_q_dkv x block_kv_dkv: the dK/dV pass (a program owns block_kv_dkv keys, steps block_q_dkv queries).
    block_q_dq x block_kv_dq: the dQ pass (a program owns block_q_dq queries, steps block_kv_dq keys).
    Tiles are clipped to divisors of the block mask's tiles (see ``_sub_tile``), so one backward tile
    always lies inside one block-mask tile and inherits its kind (empty / partial / full).
    """

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_warps_dkv: int = 4
    num_warps_dq: int = 4
    num_stages_dkv: int = 2
    num_stages_dq: int = 2
    block_delta: int = 64

    def __post_init__(self):
        for name in ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq", "block_delta"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"BwdConfig: {name} must be a power of two >= 16, got {val!r}")
        for name in ("num_warps_dkv", "num_warps_dq"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"BwdConfig: {name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)!r}")
        for name in ("num_stages_dkv", "num_stages_dq"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"BwdConfig: {name} must be a positive int, got {getattr(self, name)!r}")

    def smem_bytes(self, head_dim: int, head_dim_v: int, itemsize: int) -> int:
        """Static estimate of the shared memory each backward kernel needs; returns the larger.

        Triton keeps the tiles it streams through the loop in shared memory, one copy per pipeline stage
        (q and dout in the dK/dV pass; k and v in the dQ pass), stages the resident operands of the
        matmuls once (k, v or q, dout), and round-trips the two [block_q, block_kv] operands that feed
        a second matmul (P^T and dS^T, or dS) through shared memory for the layout change.
        """
        d, dv = pow2(head_dim), pow2(head_dim_v)
        dkv = (self.num_stages_dkv * self.block_q_dkv * (d + dv) * itemsize
               + self.block_kv_dkv * (d + dv) * itemsize
               + 2 * self.block_q_dkv * self.block_kv_dkv * itemsize
               + self.num_stages_dkv * self.block_q_dkv * 8)          # lse, delta rows (f32)
        dq = (self.num_stages_dq * self.block_kv_dq * (d + dv) * itemsize
              + self.block_q_dq * (d + dv) * itemsize
              + self.block_q_dq * self.block_kv_dq * itemsize)
        return max(dkv, dq)

    def check_smem(self, head_dim: int, head_dim_v: int, itemsize: int, limit: int) -> None:
        need = self.smem_bytes(head_dim, head_dim_v, itemsize)
        if need > limit:
            raise ValueError(f"flash_attention_bwd: config {self} needs about {need} bytes of shared memory "
                             f"for head dims ({head_dim}, {head_dim_v}) and itemsize {itemsize}, over the "
                             f"device limit of {limit} bytes")


# Configs: family -> {(max padded head dim, dtype class "16" or "32"): config}, as the forward's table.
# Every entry fits its family's shared-memory budget at its head dim (tests/test_flash_kernel_bwd.py).
BWD_CONFIGS: dict[str, dict[tuple[int, str], BwdConfig]] = {
    # H200 bf16 D128, B2 Hq32 Hkv8 T4096 causal (docs/PERF_NOTES.md): backward
    # 64/64 64/64 w4 s2 2.19 ms; 32/64 64/32 w4 s3 3.08; 32/128 w8 3.19; 32/128 w4 17.5 (two f32
    # [128, 128] accumulators on 4 warps spill registers). Entries other than (128, "16") follow the same
    # rule (accumulator floats per thread <= ~128) but were not timed.
    "h200": {
        (64, "16"): BwdConfig(64, 64, 64, 64, 4, 4, 2, 2),
        # D128: dK/dV 64/128 w8 s3, dQ 128/128 w8 s2 (session 3 A/B, bwd alone): B2 T4096 causal 2.08 ->
        # 2.02 ms, full 3.87 -> 3.76, B1 T16384 causal 15.1 -> 14.7, full 29.5 -> 29.0 vs 64/64 64/64 w4 s2.
        (128, "16"): BwdConfig(64, 128, 128, 128, 8, 8, 3, 2),
        # D256: 64/32 32/64 w4 s2 7.24 ms vs 32/64 64/32 w8 s2 10.7, 64/64 w8 8.04 (B2 T4096 causal bwd)
        (256, "16"): BwdConfig(64, 32, 32, 64, 4, 4, 2, 2),
        # float32 matmuls run on the CUDA cores (IEEE, no tf32): small tiles, as the forward's.
        (64, "32"): BwdConfig(16, 32, 32, 16, 4, 4, 2, 2),
        (128, "32"): BwdConfig(16, 32, 32, 16, 4, 4, 2, 2),
        (256, "32"): BwdConfig(16, 32, 32, 16, 8, 8, 1, 1),
    },
    "rtx3090": {
        (64, "16"): BwdConfig(32, 64, 64, 32, 4, 4, 2, 2),
        (128, "16"): BwdConfig(16, 64, 64, 16, 4, 4, 2, 2),
        (256, "16"): BwdConfig(16, 32, 32, 16, 4, 4, 2, 2),
        (64, "32"): BwdConfig(16, 64, 64, 16, 4, 4, 2, 2),
        (128, "32"): BwdConfig(16, 32, 32, 16, 4, 4, 2, 2),
        (256, "32"): BwdConfig(16, 16, 16, 16, 4, 4, 1, 1),
    },
}
BWD_CONFIGS["default"] = BWD_CONFIGS["rtx3090"]

# Unmasked calls (block_mask=None: the dense loops), where they differ from the table above. H200 D128:
# dQ 128/64 s3 instead of 128/128 s2, backward alone (session 4, scripts/gpu_ab.py, three interleaved
# rounds): B2 T4096 full 3.64 -> 3.52 ms, B1 T16384 full 28.2 -> 27.7; on causal it lost (2.00 -> 2.09).
BWD_DENSE_CONFIGS: dict[str, dict[tuple[int, str], BwdConfig]] = {
    "h200": {(128, "16"): BwdConfig(64, 128, 128, 64, 8, 8, 3, 3)},
    "rtx3090": {},
    "default": {},
}


def default_bwd_config(head_dim: int, head_dim_v: int | None = None, dtype=jnp.bfloat16,
                       device_kind: str | None = None, dense: bool = False) -> BwdConfig:
    """The backward config for this device kind (see ``configs.device_family``), head dims and dtype;
    ``dense``: for an unmasked call (block_mask None)."""
    d = max(pow2(head_dim), pow2(head_dim if head_dim_v is None else head_dim_v))
    cls = "32" if jnp.dtype(dtype).itemsize >= 4 else "16"
    family = device_family(device_kind)
    table = BWD_CONFIGS[family]
    if dense:
        table = {**table, **BWD_DENSE_CONFIGS[family]}
    for max_d in (64, 128, 256):
        if d <= max_d:
            return table[(max_d, cls)]
    raise ValueError(f"flash_attention_bwd: head dims up to 256 are supported, got ({head_dim}, {head_dim_v})")


def _sub_tile(want: int, mask_block: int) -> int:
    """Largest power of two <= want that divides the block-mask tile ``mask_block``."""
    t = 1
    while t * 2 <= want and mask_block % (t * 2) == 0:
        t *= 2
    return t


# ----------------------------------------------------------------------------------------------------
# In-kernel helpers
# ----------------------------------------------------------------------------------------------------

def _edge_mask(start, rows: int, n_rows: int, cols: int | None = None, n_cols: int | None = None,
               rows_exact: bool = False):
    """In-bounds mask of a [rows(, cols)] tile at row ``start``, or None when every element is in bounds
    (rows_exact: the caller knows n_rows is a multiple of the tile, so no load needs a mask)."""
    row_ok = None if rows_exact else (start + jnp.arange(rows, dtype=jnp.int32)) < n_rows
    if cols is None:
        return row_ok
    col_ok = None if cols == n_cols else (jnp.arange(cols, dtype=jnp.int32) < n_cols)[None, :]
    if row_ok is None:
        return None if col_ok is None else jnp.broadcast_to(col_ok, (rows, cols))
    row_ok = jnp.broadcast_to(row_ok[:, None], (rows, cols))
    return row_ok if col_ok is None else row_ok & col_ok


def _load_rows(ref, start, rows: int, n_rows: int, cols: int, n_cols: int, rows_exact: bool = False,
               lead=None):
    """[rows, cols] tile of a [n_rows, n_cols] ref from row ``start``; zeros outside the array (cols is
    n_cols rounded up to a power of two, as Triton tiles must be). ``lead``: an index into a leading
    axis, folded into the same indexer (the Triton lowering takes one indexer per load)."""
    mask = _edge_mask(start, rows, n_rows, cols, n_cols, rows_exact)
    idx = (_tiles.ds(start, rows), _tiles.ds(0, cols))
    view = ref.at[idx if lead is None else (lead, *idx)]
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0.0)


def _load_vec(ref, start, rows: int, n_rows: int, rows_exact: bool = False, lead=None):
    view = ref.at[_tiles.ds(start, rows)] if lead is None else ref.at[lead, _tiles.ds(start, rows)]
    if rows_exact:
        return plgpu.load(view)
    return plgpu.load(view, mask=_edge_mask(start, rows, n_rows), other=0.0)


def _store_rows(ref, start, val, n_rows: int, n_cols: int, rows_exact: bool = False):
    rows, cols = val.shape
    mask = _edge_mask(start, rows, n_rows, cols, n_cols, rows_exact)
    plgpu.store(ref.at[_tiles.ds(start, rows), _tiles.ds(0, cols)], val.astype(ref.dtype), mask=mask)


def _ds_tile(q, k, v, do, lse, delta, *, b, h, q_start, kv_start, lq, lkv, scale, partial,
             score_mod, mask_mod, captured, q_exact, kv_exact, interpret):
    """Recomputes P for one [bq, bkv] tile and returns (P, dS) in float32, dS w.r.t. q.k (scale included).

    lse = -inf (fully masked row) -> P = 0 exactly: the lse is replaced by +inf so exp(s - lse) = 0
    without forming inf - inf.
    """
    bq, bkv = q.shape[0], k.shape[0]
    # [bq, 1] and [1, bkv] (the TileMod convention): a mod reading only q_idx (q_seg[b, q_idx]) loads bq
    # values, not bq * bkv.
    q_idx = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
    valid = None                                 # None: every element of the tile counts
    if not q_exact:
        valid = q_idx < lq
    if not kv_exact:
        valid = _and(valid, kv_idx < lkv)
    if partial and mask_mod is not None:
        valid = _and(valid, _call_mod(mask_mod, captured, b, h, q_idx, kv_idx))
    if valid is not None:
        valid = jnp.broadcast_to(valid, (bq, bkv))
    lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse)[:, None]
    prec = dot_precision(q.dtype)
    qk = dot_nt(q, k, prec)
    if score_mod is None:
        p = exp2_fma(qk, scale * LOG2E, -LOG2E * lse_safe, interpret)    # one FMA + MUFU ex2 on the GPU
        dmod = None
    else:
        s = qk * scale
        s_mod, dmod = jax.jvp(lambda x: _call_score_mod(score_mod, captured, x, b, h, q_idx, kv_idx),
                              (s,), (jnp.ones_like(s),))
        p = jnp.exp(s_mod - lse_safe)
    if valid is not None:
        p = jnp.where(valid, p, 0.0)
    dp = dot_nt(do, v, prec)
    if dmod is None:       # dS = P (dP - delta) scale with the scale folded into one FMA
        return p, p * fma(dp, scale, -scale * delta[:, None], interpret)
    ds = p * (dp - delta[:, None]) * (dmod if valid is None else jnp.where(valid, dmod, 0.0))
    return p, ds * scale


def _pt_dst_tile(q, k, v, do, lse, delta, *, b, h, q_start, kv_start, lq, lkv, scale, partial, mask_mod,
                 captured, q_exact, kv_exact, interpret):
    """(P^T, dS^T) [bkv, bq] float32 of one tile, for the dK/dV pass without a score_mod.

    Computed transposed (K Q^T, V dO^T) so both land in the accumulator layout of the next matmuls
    (dV += P^T dO, dK += dS^T Q): the transposed operands are Q and dO, which sit in shared memory and
    transpose for free, instead of P and dS, which would take a round trip through shared memory each.
    A mask_mod is evaluated in the [bq, bkv] convention of the mods and its tile transposed.
    """
    bq, bkv = q.shape[0], k.shape[0]
    valid = None
    if not q_exact:
        valid = (q_start + lax.broadcasted_iota(jnp.int32, (1, bq), 1)) < lq
    if not kv_exact:
        valid = _and(valid, (kv_start + lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)) < lkv)
    if partial and mask_mod is not None:
        q_idx = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
        valid = _and(valid, _call_mod(mask_mod, captured, b, h, q_idx, kv_idx).T)
    lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse)[None, :]
    prec = dot_precision(q.dtype)
    pt = exp2_fma(dot_nt(k, q, prec), scale * LOG2E, -LOG2E * lse_safe, interpret)
    if valid is not None:
        pt = jnp.where(jnp.broadcast_to(valid, (bkv, bq)), pt, 0.0)
    dpt = dot_nt(v, do, prec)
    return pt, pt * fma(dpt, scale, -scale * delta[None, :], interpret)


def _and(a, b):
    return b if a is None else a & b


def _call_mod(mask_mod, captured, b, h, q_idx, kv_idx):
    return jnp.broadcast_to(mask_mod(*captured["mask"], b, h, q_idx, kv_idx),
                            (q_idx.shape[0], kv_idx.shape[1]))


def _call_score_mod(score_mod, captured, s, b, h, q_idx, kv_idx):
    return jnp.broadcast_to(score_mod(*captured["score"], s, b, h, q_idx, kv_idx), s.shape).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------

def _delta_kernel(o_ref, do_ref, delta_ref, *, block: int, lq: int, dv: int):
    start = pl.program_id(2) * block
    dvp = pow2(dv)
    o = _load_rows(o_ref, start, block, lq, dvp, dv).astype(jnp.float32)
    do = _load_rows(do_ref, start, block, lq, dvp, dv).astype(jnp.float32)
    row_ok = (start + jnp.arange(block, dtype=jnp.int32)) < lq
    plgpu.store(delta_ref.at[_tiles.ds(start, block)], jnp.sum(o * do, axis=1), mask=row_ok)


def _mask_loop(num_ref, idx_ref, bm, hm, mt, sub: int, body, carry, first_ref=None, run_ref=None):
    """Runs body(tile, carry) over the backward tiles inside the listed block-mask tiles of row/column mt.

    A block-mask tile holds ``sub`` backward tiles; tile indices come from the int32 index list, so the
    trip count is data dependent (empty tiles are never visited). With first_ref/run_ref, the leading run
    of consecutive listed tiles (all full tiles of causal, sliding-window and document masks) is stepped
    by address arithmetic, which Triton software-pipelines like a dense loop (no index load per step);
    the forward measured 9-14% from this on the H200.
    """
    start = 0
    if first_ref is not None:
        first, run = first_ref[bm, hm, mt] * sub, run_ref[bm, hm, mt] * sub
        carry = lax.fori_loop(0, run, lambda j, c: body(first + j, c), carry)
        start = run
    if sub == 1:
        return lax.fori_loop(start, num_ref[bm, hm, mt], lambda i, c: body(idx_ref[bm, hm, mt, i], c), carry)
    n = num_ref[bm, hm, mt] * sub
    sub_ = jnp.int32(sub)

    def step(i, c):
        tile = idx_ref[bm, hm, mt, lax.div(i, sub_)] * sub_ + lax.rem(i, sub_)
        return body(tile, c)

    return lax.fori_loop(start, n, step, carry)


def _dkdv_kernel(*refs, n_cap, groups, bq, bkv, mask_bq, mask_bkv, lq, lkv, d, dv, scale,
                 bm_dep, hm_dep, score_mod, mask_mod, cap_split, interpret, dense):
    # dense: None, or the static number of query tiles when there is no mask (mask refs unused).
    # Query tiles are visited as sub-tiles of block-mask tiles, which may stick out past Lq even when
    # Lq is a multiple of bq: loads need no mask only when Lq is a multiple of the mask tile.
    q_exact, kv_exact = lq % mask_bq == 0, lkv % bkv == 0
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
     qn_ref, qi_ref, fqn_ref, fqi_ref, ffirst_ref, frun_ref) = refs[:12]
    cap_refs = refs[12:12 + n_cap]
    dk_ref, dv_ref = refs[12 + n_cap:]
    b, hkv, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp_, dvp = pow2(d), pow2(dv)
    kv_start = t * bkv
    k = _load_rows(k_ref, kv_start, bkv, lkv, dp_, d, kv_exact)
    v = _load_rows(v_ref, kv_start, bkv, lkv, dvp, dv, kv_exact)
    mt = (t * bkv) // mask_bkv                     # block-mask kv tile holding this backward tile
    sub = mask_bq // bq
    captured = _split_captured(cap_refs, cap_split)      # refs: the mods read them with point loads
    bm = b if bm_dep else 0

    def head(g, carry):
        h = hkv * groups + g
        hm = h if hm_dep else 0

        def tile_body(partial):
            def body(qt, c):
                dk_acc, dv_acc = c
                q_start = pl.multiple_of(qt * bq, bq)
                q = _load_rows(q_ref, q_start, bq, lq, dp_, d, q_exact, lead=g)
                do = _load_rows(do_ref, q_start, bq, lq, dvp, dv, q_exact, lead=g)
                lse = _load_vec(lse_ref, q_start, bq, lq, q_exact, lead=g)
                delta = _load_vec(delta_ref, q_start, bq, lq, q_exact, lead=g)
                prec = dot_precision(q.dtype)
                if score_mod is None:      # P^T, dS^T directly (see _pt_dst_tile)
                    pt, dst = _pt_dst_tile(q, k, v, do, lse, delta, b=b, h=h, q_start=q_start,
                                           kv_start=kv_start, lq=lq, lkv=lkv, scale=scale, partial=partial,
                                           mask_mod=mask_mod, captured=captured, q_exact=q_exact,
                                           kv_exact=kv_exact, interpret=interpret)
                    dv_acc = dv_acc + dot_nn(pt.astype(do.dtype), do, prec)
                    dk_acc = dk_acc + dot_nn(dst.astype(q.dtype), q, prec)
                    return dk_acc, dv_acc
                p, ds = _ds_tile(q, k, v, do, lse, delta, b=b, h=h, q_start=q_start, kv_start=kv_start,
                                 lq=lq, lkv=lkv, scale=scale, partial=partial, score_mod=score_mod,
                                 mask_mod=mask_mod, captured=captured, q_exact=q_exact, kv_exact=kv_exact,
                                 interpret=interpret)
                dv_acc = dv_acc + dot_tn(p.astype(do.dtype), do, prec)
                dk_acc = dk_acc + dot_tn(ds.astype(q.dtype), q, prec)
                return dk_acc, dv_acc
            return body

        if dense is not None:
            return lax.fori_loop(0, dense, tile_body(False), carry)
        carry = _mask_loop(fqn_ref, fqi_ref, bm, hm, mt, sub, tile_body(False), carry, ffirst_ref, frun_ref)
        carry = _mask_loop(qn_ref, qi_ref, bm, hm, mt, sub, tile_body(True), carry)
        return carry

    zeros = (jnp.zeros((bkv, dp_), jnp.float32), jnp.zeros((bkv, dvp), jnp.float32))
    dk_acc, dv_acc = lax.fori_loop(0, groups, head, zeros)
    _store_rows(dk_ref, kv_start, dk_acc, lkv, d, kv_exact)
    _store_rows(dv_ref, kv_start, dv_acc, lkv, dv, kv_exact)


def _dq_kernel(*refs, n_cap, groups, bq, bkv, mask_bq, mask_bkv, lq, lkv, d, dv, scale,
               bm_dep, hm_dep, score_mod, mask_mod, cap_split, interpret, dense):
    q_exact, kv_exact = lq % bq == 0, lkv % mask_bkv == 0      # as in _dkdv_kernel, with q and kv swapped
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
     kn_ref, ki_ref, fkn_ref, fki_ref, ffirst_ref, frun_ref) = refs[:12]
    cap_refs = refs[12:12 + n_cap]
    (dq_ref,) = refs[12 + n_cap:]
    b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp_, dvp = pow2(d), pow2(dv)
    q_start = t * bq
    q = _load_rows(q_ref, q_start, bq, lq, dp_, d, q_exact)
    do = _load_rows(do_ref, q_start, bq, lq, dvp, dv, q_exact)
    lse = _load_vec(lse_ref, q_start, bq, lq, q_exact)
    delta = _load_vec(delta_ref, q_start, bq, lq, q_exact)
    mt = (t * bq) // mask_bq
    sub = mask_bkv // bkv
    captured = _split_captured(cap_refs, cap_split)
    bm = b if bm_dep else 0
    hm = h if hm_dep else 0

    def tile_body(partial):
        def body(kt, dq_acc):
            kv_start = pl.multiple_of(kt * bkv, bkv)
            k = _load_rows(k_ref, kv_start, bkv, lkv, dp_, d, kv_exact)
            v = _load_rows(v_ref, kv_start, bkv, lkv, dvp, dv, kv_exact)
            _, ds = _ds_tile(q, k, v, do, lse, delta, b=b, h=h, q_start=q_start, kv_start=kv_start,
                             lq=lq, lkv=lkv, scale=scale, partial=partial, score_mod=score_mod,
                             mask_mod=mask_mod, captured=captured, q_exact=q_exact, kv_exact=kv_exact,
                             interpret=interpret)
            return dq_acc + dot_nn(ds.astype(k.dtype), k, dot_precision(k.dtype))
        return body

    dq_acc = jnp.zeros((bq, dp_), jnp.float32)
    if dense is not None:
        dq_acc = lax.fori_loop(0, dense, tile_body(False), dq_acc)
    else:
        dq_acc = _mask_loop(fkn_ref, fki_ref, bm, hm, mt, sub, tile_body(False), dq_acc, ffirst_ref, frun_ref)
        dq_acc = _mask_loop(kn_ref, ki_ref, bm, hm, mt, sub, tile_body(True), dq_acc)
    _store_rows(dq_ref, q_start, dq_acc, lq, d, q_exact)


def _split_captured(values, split):
    n_score = split
    return {"score": tuple(values[:n_score]), "mask": tuple(values[n_score:])}


# ----------------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------------

def _full_spec(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def flash_attention_bwd(q, k, v, out, lse, dout, *, block_mask: BlockMask | None, score_mod=None, mask_mod=None,
                        captured: Sequence[jax.Array] | dict = (), scale: float, config: Any = None,
                        interpret: bool = False):
    """Backward of flex_attention. Returns (dq, dk, dv, dcaptured).

    q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv], out/dout [B, Hq, Lq, Dv],
    lse [B, Hq, Lq] float32 natural log (-inf on fully masked rows).
    score_mod(*score_captured, score, b, h, q_idx, kv_idx) and mask_mod(*mask_captured, b, h, q_idx, kv_idx)
    take their captured arrays first (closure-converted); ``captured`` is
    {"score": (...), "mask": (...)} or a plain tuple for the score_mod alone.
    dcaptured mirrors ``captured``: cotangents of float arrays of the score_mod, zeros otherwise.
    """
    bsz, hq, lq, d = q.shape
    _, hkv, lkv, dv = v.shape
    groups = hq // hkv
    cap = _normalize_captured(captured)
    if isinstance(config, BwdConfig):
        bwd = config
    else:
        kind = None if not interpret else "cpu-interpret"
        bwd = default_bwd_config(d, dv, q.dtype, kind, dense=block_mask is None)
        bwd.check_smem(d, dv, q.dtype.itemsize, SMEM_LIMITS[device_family(kind)])
        # Tiles no longer than the (power-of-two padded) sequences: tiny inputs launch tiny tiles.
        cq, ckv = max(16, pow2(lq)), max(16, pow2(lkv))
        bwd = dataclasses.replace(bwd, block_q_dkv=min(bwd.block_q_dkv, cq), block_q_dq=min(bwd.block_q_dq, cq),
                                  block_kv_dkv=min(bwd.block_kv_dkv, ckv), block_kv_dq=min(bwd.block_kv_dq, ckv))
    if mask_mod is None and block_mask is not None and block_mask.mask_mod is not None:
        # The block mask's own mod (no converted captures): partial tiles still need it.
        mask_mod, cap["mask"] = block_mask.mask_mod, ()
    dense = block_mask is None
    if dense:
        # No mask: every tile is full. The kernels step through all tiles with static trip counts and
        # get placeholder mask refs they never read (no index arrays to build or load).
        mask_bq, mask_bkv = _preferred_tiles(bwd)
        bm_dep = hm_dep = False
        mask_mod = None          # block_mask=None means no mask, whatever mask_mod says
        num0, idx0 = jnp.zeros((1, 1, 1), jnp.int32), jnp.zeros((1, 1, 1, 1), jnp.int32)
        t_mask = r_mask = (num0, idx0, num0, idx0, num0, num0)
    else:
        block_mask = _fit_block_mask(block_mask, mask_mod, cap, bsz, hq, lq, lkv, bwd)
        mask_bq, mask_bkv = block_mask.block_q, block_mask.block_kv
        bm_dep = block_mask.kv_num_blocks.shape[0] > 1
        hm_dep = block_mask.kv_num_blocks.shape[1] > 1
        bmk = block_mask
        t_mask = (bmk.q_num_blocks, bmk.q_indices, bmk.full_q_num_blocks, bmk.full_q_indices,
                  *leading_run(bmk.full_q_num_blocks, bmk.full_q_indices))
        r_mask = (bmk.kv_num_blocks, bmk.kv_indices, bmk.full_kv_num_blocks, bmk.full_kv_indices,
                  *leading_run(bmk.full_kv_num_blocks, bmk.full_kv_indices))
    dp_, dvp = pow2(d), pow2(dv)

    # 1. delta = rowsum(dout * out), float32.
    blk = min(bwd.block_delta, pow2(lq))
    o_spec = pl.BlockSpec((None, None, lq, dv), lambda b, h, t: (b, h, 0, 0))
    delta = pl.pallas_call(
        functools.partial(_delta_kernel, block=blk, lq=lq, dv=dv),
        grid=(bsz, hq, pl.cdiv(lq, blk)),
        in_specs=[o_spec, o_spec],
        out_specs=pl.BlockSpec((None, None, lq), lambda b, h, t: (b, h, 0)),
        out_shape=out_struct((bsz, hq, lq), jnp.float32, out, dout),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="flex_bwd_delta",
    )(out, dout)

    cap_values = cap["score"] + cap["mask"]
    operands = (q, k, v, dout, lse, delta, *cap_values)
    cap_split = len(cap["score"])
    common = dict(n_cap=len(cap_values), groups=groups, mask_bq=mask_bq, mask_bkv=mask_bkv, lq=lq, lkv=lkv,
                  d=d, dv=dv, scale=float(scale), bm_dep=bm_dep, hm_dep=hm_dep, score_mod=score_mod,
                  mask_mod=mask_mod, cap_split=cap_split, interpret=interpret)
    cap_specs = [_full_spec(c) for c in cap_values]

    # 2. dK/dV: one program per (b, kv head, kv tile); the G query heads of the group come in as one block.
    bq, bkv = _sub_tile(bwd.block_q_dkv, mask_bq), _sub_tile(bwd.block_kv_dkv, mask_bkv)
    grp = lambda last: pl.BlockSpec((None, groups, lq, last), lambda b, j, t: (b, j, 0, 0))
    kv_spec = lambda last: pl.BlockSpec((None, None, lkv, last), lambda b, j, t: (b, j, 0, 0))
    dk, dv_out = pl.pallas_call(
        functools.partial(_dkdv_kernel, bq=bq, bkv=bkv, **common,
                          dense=pl.cdiv(lq, mask_bq) * (mask_bq // bq) if dense else None),
        grid=(bsz, hkv, pl.cdiv(lkv, bkv)),
        in_specs=[grp(d), kv_spec(d), kv_spec(dv), grp(dv),
                  pl.BlockSpec((None, groups, lq), lambda b, j, t: (b, j, 0)),
                  pl.BlockSpec((None, groups, lq), lambda b, j, t: (b, j, 0)),
                  *[_full_spec(x) for x in t_mask], *cap_specs],
        out_specs=[kv_spec(d), kv_spec(dv)],
        out_shape=[out_struct(k.shape, k.dtype, *operands), out_struct(v.shape, v.dtype, *operands)],
        compiler_params=plgpu.CompilerParams(num_warps=bwd.num_warps_dkv, num_stages=bwd.num_stages_dkv),
        interpret=interpret, name="flex_bwd_dkdv",
    )(q, k, v, dout, lse, delta, *t_mask, *cap_values)

    # 3. dQ: one program per (b, q head, q tile), reading KV head h // G.
    bq, bkv = _sub_tile(bwd.block_q_dq, mask_bq), _sub_tile(bwd.block_kv_dq, mask_bkv)
    q_spec = lambda last: pl.BlockSpec((None, None, lq, last), lambda b, h, t: (b, h, 0, 0))
    kvh_spec = lambda last: pl.BlockSpec((None, None, lkv, last), lambda b, h, t: (b, h // groups, 0, 0))
    row_spec = pl.BlockSpec((None, None, lq), lambda b, h, t: (b, h, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bkv=bkv, **common,
                          dense=pl.cdiv(lkv, mask_bkv) * (mask_bkv // bkv) if dense else None),
        grid=(bsz, hq, pl.cdiv(lq, bq)),
        in_specs=[q_spec(d), kvh_spec(d), kvh_spec(dv), q_spec(dv), row_spec, row_spec,
                  *[_full_spec(x) for x in r_mask], *cap_specs],
        out_specs=q_spec(d),
        out_shape=out_struct(q.shape, q.dtype, *operands),
        compiler_params=plgpu.CompilerParams(num_warps=bwd.num_warps_dq, num_stages=bwd.num_stages_dq),
        interpret=interpret, name="flex_bwd_dq",
    )(q, k, v, dout, lse, delta, *r_mask, *cap_values)

    dcap = _dcaptured_xla(q, k, v, dout, lse, delta, block_mask=block_mask, score_mod=score_mod,
                          mask_mod=mask_mod, cap=cap, scale=scale)
    if not isinstance(captured, dict):
        dcap = dcap["score"]
    return dq, dk, dv_out, dcap


def _preferred_tiles(bwd: BwdConfig) -> tuple[int, int]:
    """(query, key) tile of the block mask the backward prefers: the larger tile of its two passes on each
    axis, so both passes' tiles divide it."""
    return max(bwd.block_q_dkv, bwd.block_q_dq), max(bwd.block_kv_dkv, bwd.block_kv_dq)


def _fit_block_mask(block_mask, mask_mod, cap, bsz, hq, lq, lkv, bwd: BwdConfig) -> BlockMask:
    """A block mask whose tiles the backward tiles divide.

    The kernels visit backward tiles as sub-tiles of block-mask tiles. When the forward's mask tiles are
    smaller than (or not a multiple of) the backward's preferred tiles, the mask is rebuilt from its
    mask_mod with tiles (max block_q, max block_kv) of the config (one XLA pass over the mask plane);
    without a mask_mod the given tiles are kept and the kernels use the largest dividing sub-tiles.
    (``block_mask=None``, no mask, never gets here: the wrapper runs the dense loops.)
    """
    tq, tkv = _preferred_tiles(bwd)
    if (block_mask.block_q % tq == 0 and block_mask.block_kv % tkv == 0) or mask_mod is None:
        return block_mask
    bm_b, bm_h = block_mask.kv_num_blocks.shape[:2]
    mask_caps = cap["mask"]

    def plain(b, h, q_idx, kv_idx):
        return mask_mod(*mask_caps, b, h, q_idx, kv_idx)

    reads_b, reads_h = _mods.reads_batch_head(plain)
    return masks_lib.create_block_mask(plain, bsz if bm_b > 1 or reads_b else None,
                                       hq if bm_h > 1 or reads_h else None, lq, lkv, block_q=tq, block_kv=tkv)


def _normalize_captured(captured) -> dict:
    if isinstance(captured, dict):
        return {"score": tuple(captured.get("score", ())), "mask": tuple(captured.get("mask", ()))}
    return {"score": tuple(captured or ()), "mask": ()}


def _dcaptured_xla(q, k, v, dout, lse, delta, *, block_mask, score_mod, mask_mod, cap, scale,
                   block_q: int = 64):
    """Cotangents of the score_mod's captured arrays, by an XLA loop over query tiles.

    Each step recomputes dS for block_q query rows against all keys ([B, Hq, block_q, Lkv] in float32)
    and pulls it back through the mod with jax.vjp, so memory stays O(block_q * Lkv).
    """
    score_caps = cap["score"]
    zeros = {"score": tuple(jnp.zeros_like(c) for c in score_caps),
             "mask": tuple(jnp.zeros_like(c) for c in cap["mask"])}
    diff = [jnp.issubdtype(c.dtype, jnp.floating) for c in score_caps]
    if score_mod is None or not any(diff):
        return zeros
    bsz, hq, lq, d = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    block_q = min(block_q, lq)
    n_tiles = -(-lq // block_q)
    pad = n_tiles * block_q - lq
    f32 = jnp.float32
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    dop = jnp.pad(dout, ((0, 0), (0, 0), (0, pad), (0, 0)))
    lsep = jnp.pad(lse, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    deltap = jnp.pad(delta, ((0, 0), (0, 0), (0, pad)))
    kr = k.reshape(bsz, hkv, 1, lkv, d)
    vr = v.reshape(bsz, hkv, 1, lkv, v.shape[-1])
    b_idx = jnp.arange(bsz, dtype=jnp.int32)[:, None, None, None]
    h_idx = jnp.arange(hq, dtype=jnp.int32)[None, :, None, None]
    kv_idx = jnp.arange(lkv, dtype=jnp.int32)[None, None, None, :]
    hi = xla_precision(q.dtype)

    def step(acc, i):
        start = i * block_q
        sl = lambda x: lax.dynamic_slice_in_dim(x, start, block_q, axis=2)
        qt = sl(qp).reshape(bsz, hkv, groups, block_q, d)
        dot = sl(dop).reshape(bsz, hkv, groups, block_q, -1)
        lse_t, delta_t = sl(lsep), sl(deltap)
        q_idx = (start + jnp.arange(block_q, dtype=jnp.int32))[None, None, :, None]
        s = jnp.einsum("bkgqd,bkxld->bkgql", qt, kr, preferred_element_type=f32, precision=hi)
        s = s.reshape(bsz, hq, block_q, lkv) * scale
        valid = (q_idx < lq) & (kv_idx < lkv)
        if mask_mod is not None:
            valid = valid & mask_mod(*cap["mask"], b_idx, h_idx, q_idx, kv_idx)
        valid = jnp.broadcast_to(valid, s.shape)

        def mod_of(caps):
            return jnp.broadcast_to(score_mod(*caps, s, b_idx, h_idx, q_idx, kv_idx), s.shape).astype(f32)

        s_mod, pullback = jax.vjp(mod_of, score_caps)
        lse_safe = jnp.where(lse_t == -jnp.inf, jnp.inf, lse_t)[..., None]
        p = jnp.where(valid, jnp.exp(s_mod - lse_safe), 0.0)
        dp = jnp.einsum("bkgqd,bkxld->bkgql", dot, vr, preferred_element_type=f32, precision=hi)
        ds = p * (dp.reshape(bsz, hq, block_q, lkv) - delta_t[..., None])
        (dcaps,) = pullback(ds)
        acc = tuple(a + (dc.astype(f32) if ok else 0.0) for a, dc, ok in zip(acc, dcaps, diff))
        return acc, None

    init = tuple(jnp.zeros(c.shape, f32) for c in score_caps)
    acc, _ = lax.scan(step, init, jnp.arange(n_tiles))
    zeros["score"] = tuple(a.astype(c.dtype) if ok else jnp.zeros_like(c)
                           for a, c, ok in zip(acc, score_caps, diff))
    return zeros
