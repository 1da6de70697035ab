"""Softmax attention in pure XLA: blockwise online softmax (flash attention written in XLA) and the
K/V-repeat baseline.

``flex_attention_xla`` works on tiles: ``block_q`` query rows of all ``G = Hq // Hkv`` query heads of a KV
group are folded into one ``[G * block_q, D]`` matrix, so each matmul against a ``[block_kv, D]`` K/V tile
is large and K/V are never repeated. For each query tile a loop visits only the non-empty kv tiles (from
the tile classification of the mask) and evaluates ``mask_mod`` only on partial ones. Memory is linear in
the sequence length. The backward pass (FlashAttention-2) recomputes probabilities tile by tile from the
saved log-sum-exp and accumulates dK/dV in place.

Ragged lengths are handled without padding: all tiles have the same shape and the last tile of each
axis is shifted back to end at the sequence end (``start = min(t * block, L - block)``). Columns that
the last kv tile shares with the previous one are masked out; rows that the last query tile shares with
the previous one are recomputed (identical values) and dropped when the tiles are assembled. Fixed tile
shapes also mean each mod is traced once, so its captured arrays can be hoisted into explicit
arguments of the custom_vjp (gradients flow to a bias table captured by ``score_mod``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashlax import _mods
from flashlax import masks as masks_lib
from flashlax._precision import xla_precision
from flashlax.parallel.vma import cotangent_like, match_vma

F32 = jnp.float32
NEG_INF = -jnp.inf

# CPU-friendly tile sizes (measured on a 2-core AVX-512 Xeon, docs/PERF_NOTES.md): G * block_q ~ 512
# query rows against 512 keys keep each matmul large; with a mask, 128-key tiles skip more of it.
DEFAULT_ROWS = 512  # target G * block_q
DEFAULT_BLOCK_KV = 512
DEFAULT_BLOCK_KV_MASKED = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_size(length: int, preferred: int, multiple: int = 8) -> int:
    """Tile size <= preferred that covers ``length`` with as few, evenly sized tiles as possible."""
    n = _cdiv(length, max(1, preferred))
    size = _cdiv(_cdiv(length, n), multiple) * multiple
    return max(1, min(size, length))


def tile_bounds(length: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lows) int32 [n]: tile t covers [starts[t], starts[t] + size); rows below lows[t] belong
    to the previous tile (only the last tile is shifted back, so that no tile runs past ``length``)."""
    n = _cdiv(length, size)
    lows = np.arange(n, dtype=np.int64) * size
    starts = np.minimum(lows, length - size)
    return starts.astype(np.int32), lows.astype(np.int32)


# float32 (and float64) inputs in full precision, one tf32 pass for float32 only when the caller's
# jax.default_matmul_precision asks for it (flashlax/_precision.py)
precision_for = xla_precision


def acc_dtype(dtype):
    """Accumulation and statistics dtype: float32, or float64 for float64 inputs (jax_enable_x64), so a
    float64 caller loses no precision."""
    return jnp.promote_types(dtype, jnp.float32)


# ----------------------------------------------------------------------------------------------------
# Mods: traced once at the tile shape, captured arrays become explicit arguments
# ----------------------------------------------------------------------------------------------------

def convert_mod(mod: Callable | None, *example_args) -> tuple[Callable | None, tuple]:
    """``(fn(consts, *args), consts)``: ``mod`` applied with scalar semantics
    (:func:`flashlax._mods.apply_mod`) reading ``consts`` in place of every array it captured (concrete
    or traced), found by a trace at the example shapes; ``fn`` takes arguments of those shapes."""
    if mod is None:
        return None, ()
    apply = lambda *args: _mods.apply_mod(mod, *args)
    captured = _mods.captured_arrays(apply, *example_args)

    def converted(consts, *args):
        return _mods.with_captured(apply, captured, consts)(*args)

    return converted, captured


def finite_lse(lse):
    """lse with the -inf of fully masked rows replaced by 0, as saved for the backward: every score of such
    a row is -inf, so exp(s - 0) is still 0, and no residual holds an inf (``jax.debug_infs`` checks the
    residuals of a differentiated jit)."""
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_cotangent(x):
    """Cotangent for an argument that gets no gradient: zeros, float0 for integer/bool arrays."""
    x = jnp.asarray(x) if not hasattr(x, "dtype") else x
    if is_float(x):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def mask_extent(mask_mod: Callable, batch: int, heads: int) -> tuple[int | None, int | None]:
    """(B or None, H or None): whether ``mask_mod`` reads b / h (from its jaxpr)."""
    reads_b, reads_h = _mods.reads_batch_head(mask_mod)
    return (batch if reads_b else None), (heads if reads_h else None)


def mask_mod_from_kinds(block_mask: masks_lib.BlockMask) -> Callable:
    """A mask_mod for a BlockMask without one: allowed exactly where the tile is FULL (as to_dense)."""
    kinds = block_mask.tile_kinds
    bm, hm = kinds.shape[:2]

    def mask_mod(b, h, q_idx, kv_idx):
        return kinds[b if bm > 1 else 0, h if hm > 1 else 0,
                     q_idx // block_mask.block_q, kv_idx // block_mask.block_kv] == masks_lib.FULL

    return mask_mod


# ----------------------------------------------------------------------------------------------------
# Tile schedule: which kv tiles each query tile visits, and which of them need the mask
# ----------------------------------------------------------------------------------------------------

def _coverage(length: int, size: int, grid: int, dedupe: bool) -> np.ndarray:
    """float32 [n_tiles, n_grid]: 1 where our tile overlaps a grid tile of the block mask."""
    starts, lows = tile_bounds(length, size)
    first = lows if dedupe else starts
    ends = np.minimum(starts + size, length)
    n_grid = _cdiv(length, grid)
    g_lo = np.arange(n_grid) * grid
    g_hi = np.minimum(g_lo + grid, length)
    return ((first[:, None] < g_hi[None, :]) & (g_lo[None, :] < ends[:, None])).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per query tile: ``count`` kv tiles to visit, their indices ``kv_tiles`` (ascending, then padding)
    and ``masked[i, j]`` (evaluate the mask on tile (i, j)). int32/bool arrays, possibly traced."""

    count: jax.Array
    kv_tiles: jax.Array
    masked: jax.Array


def build_schedule(block_mask: masks_lib.BlockMask | None, lq: int, lkv: int, block_q: int,
                   block_kv: int) -> Schedule:
    nq, nkv = _cdiv(lq, block_q), _cdiv(lkv, block_kv)
    ragged_col = np.zeros((nq, nkv), bool)
    if lkv % block_kv:
        ragged_col[:, -1] = True  # the shifted last kv tile masks the columns it shares
    if block_mask is None:
        return Schedule(jnp.full((nq,), nkv, jnp.int32),
                        jnp.broadcast_to(jnp.arange(nkv, dtype=jnp.int32), (nq, nkv)),
                        jnp.asarray(ragged_col))
    kinds = block_mask.tile_kinds
    not_empty = (kinds != masks_lib.EMPTY).any((0, 1)).astype(F32)  # over batch and heads
    not_full = (kinds != masks_lib.FULL).any((0, 1)).astype(F32)
    cq = jnp.asarray(_coverage(lq, block_q, block_mask.block_q, dedupe=False))
    ck = jnp.asarray(_coverage(lkv, block_kv, block_mask.block_kv, dedupe=True))
    hp = lax.Precision.HIGHEST
    visit = jnp.matmul(jnp.matmul(cq, not_empty, precision=hp), ck.T, precision=hp) > 0
    partial = jnp.matmul(jnp.matmul(cq, not_full, precision=hp), ck.T, precision=hp) > 0
    count, order = masks_lib._indices_of(visit)
    return Schedule(count, order, partial | jnp.asarray(ragged_col))


# ----------------------------------------------------------------------------------------------------
# Blockwise attention with a custom_vjp
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Spec:
    batch: int
    kv_heads: int
    groups: int
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    scale: float
    precision: lax.Precision
    acc: Any                    # accumulation dtype (acc_dtype of the inputs)
    score_fn: Callable | None
    mask_fn: Callable | None
    may_mask: bool  # some tile needs masking (static): otherwise skip the lax.cond

    @property
    def rows(self) -> int:
        return self.groups * self.block_q


def _tile_indices(spec: _Spec, q_start, kv_start):
    """b, h (query head), q_idx, kv_idx broadcastable to the [B, Hkv, G, block_q, block_kv] tile."""
    i32 = jnp.int32
    b = jnp.arange(spec.batch, dtype=i32).reshape(-1, 1, 1, 1, 1)
    h = jnp.arange(spec.kv_heads * spec.groups, dtype=i32).reshape(1, spec.kv_heads, spec.groups, 1, 1)
    q_idx = (q_start + jnp.arange(spec.block_q, dtype=i32)).reshape(1, 1, 1, -1, 1)
    kv_idx = (kv_start + jnp.arange(spec.block_kv, dtype=i32)).reshape(1, 1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def _tile_shape(spec: _Spec) -> tuple[int, ...]:
    return (spec.batch, spec.kv_heads, spec.groups, spec.block_q, spec.block_kv)


def _raw_scores(spec: _Spec, q_t, k_t):
    """scale * q.k for one tile: [B, Hkv, G*bq, D] x [B, Hkv, bk, D] -> [B, Hkv, G*bq, bk] in spec.acc."""
    if q_t.dtype == spec.acc:  # fold the scale into the [G*bq, D] query tile instead of the [G*bq, bk] scores
        return jnp.einsum("bhmd,bhkd->bhmk", q_t * spec.scale, k_t, precision=spec.precision)
    s = jnp.einsum("bhmd,bhkd->bhmk", q_t, k_t, precision=spec.precision, preferred_element_type=spec.acc)
    return s * spec.scale


def _apply_score_mod(spec: _Spec, s, score_consts, idx):
    if spec.score_fn is None:
        return s
    s5 = s.reshape(_tile_shape(spec))
    out = spec.score_fn(score_consts, s5, *idx)
    return jnp.broadcast_to(out, s5.shape).astype(spec.acc).reshape(s.shape)


def _allowed(spec: _Spec, mask_consts, idx, kv_low, shape):
    """bool ``shape``: where the mask (and the shared-column rule of the shifted last kv tile) allows."""
    b, h, q_idx, kv_idx = idx
    allowed = kv_idx >= kv_low
    if spec.mask_fn is not None:
        allowed = allowed & spec.mask_fn(mask_consts, b, h, q_idx, kv_idx)
    return jnp.broadcast_to(allowed, _tile_shape(spec)).reshape(shape)


def _q_tile(spec: _Spec, x, start, width):
    """[B, Hkv, G, L, W] -> rows start..start+bq folded to [B, Hkv, G*bq, W]."""
    t = lax.dynamic_slice_in_dim(x, start, spec.block_q, axis=3)
    return t.reshape(spec.batch, spec.kv_heads, spec.rows, width)


def _assemble(tiles, length: int, block: int):
    """[n, B, Hkv, G, block, ...] per-tile results -> [B, Hkv, G, length, ...] (shifted last tile)."""
    n = tiles.shape[0]
    moved = jnp.moveaxis(tiles, 0, 3)  # [B, Hkv, G, n, block, ...]
    head = moved[:, :, :, : n - 1].reshape(moved.shape[:3] + ((n - 1) * block,) + moved.shape[5:])
    if length == n * block:
        return moved.reshape(moved.shape[:3] + (length,) + moved.shape[5:])
    tail = moved[:, :, :, n - 1, block - (length - (n - 1) * block):]
    return jnp.concatenate([head, tail], axis=3)


def _kv_tile(spec: _Spec, sched: Schedule, k, v, kv_starts, q_start, i, t):
    """The t-th visited kv tile of query tile i: (tile index j, its first key, K tile, V tile, positions)."""
    j = sched.kv_tiles[i, t]
    kv_start = kv_starts[j]
    k_t = lax.dynamic_slice_in_dim(k, kv_start, spec.block_kv, axis=2)
    v_t = lax.dynamic_slice_in_dim(v, kv_start, spec.block_kv, axis=2)
    return j, kv_start, k_t, v_t, _tile_indices(spec, q_start, kv_start)


def _forward(spec: _Spec, q, k, v, score_consts, mask_consts, sched: Schedule):
    """q [B, Hkv, G, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv] -> out [B, Hkv, G, Lq, Dv], lse and the
    row maximum of the (modded, masked) scores, both [B, Hkv, G, Lq] in spec.acc (-inf: fully masked)."""
    bsz, hkv, m_rows, dv = spec.batch, spec.kv_heads, spec.rows, v.shape[-1]
    q_starts, _ = tile_bounds(spec.q_len, spec.block_q)
    kv_starts, kv_lows = tile_bounds(spec.kv_len, spec.block_kv)
    q_starts, kv_starts, kv_lows = map(jnp.asarray, (q_starts, kv_starts, kv_lows))

    def q_tile(i):
        q_start = q_starts[i]
        q_t = _q_tile(spec, q, q_start, q.shape[-1])

        def kv_step(t, carry):
            m, l, acc = carry
            j, _, k_t, v_t, idx = _kv_tile(spec, sched, k, v, kv_starts, q_start, i, t)

            def update(masked: bool):
                s = _apply_score_mod(spec, _raw_scores(spec, q_t, k_t), score_consts, idx)
                if masked:
                    s = jnp.where(_allowed(spec, mask_consts, idx, kv_lows[j], s.shape), s, NEG_INF)
                m_new = jnp.maximum(m, s.max(-1))
                # A row with nothing allowed yet keeps m = -inf; subtracting 0 instead keeps exp() at 0.
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("bhmk,bhkd->bhmd", p.astype(v.dtype), v_t, precision=spec.precision,
                                preferred_element_type=spec.acc)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

            if not spec.may_mask:
                return update(False)
            return lax.cond(sched.masked[i, j], lambda: update(True), lambda: update(False))

        init = (jnp.full((bsz, hkv, m_rows), NEG_INF, spec.acc), jnp.zeros((bsz, hkv, m_rows), spec.acc),
                jnp.zeros((bsz, hkv, m_rows, dv), spec.acc))
        init = match_vma(init, q, k, v, score_consts, mask_consts, sched)
        m, l, acc = lax.fori_loop(0, sched.count[i], kv_step, init)
        has_any = l > 0
        out = acc / jnp.where(has_any, l, 1.0)[..., None]  # fully masked rows: 0
        lse = jnp.where(has_any, m + jnp.log(jnp.where(has_any, l, 1.0)), NEG_INF)
        shape = (bsz, hkv, spec.groups, spec.block_q)
        return out.astype(q.dtype).reshape(shape + (dv,)), lse.reshape(shape), m.reshape(shape)

    tiles = lax.map(q_tile, jnp.arange(len(q_starts), dtype=jnp.int32))
    return tuple(_assemble(t, spec.q_len, spec.block_q) for t in tiles)


def _backward(spec: _Spec, q, k, v, out, lse, dout, dlse, score_consts, mask_consts, sched: Schedule):
    """FlashAttention-2 backward: dS = P * (dP - delta), delta = rowsum(dO * O) - dlse."""
    bsz, hkv, m_rows = spec.batch, spec.kv_heads, spec.rows
    d, dv = q.shape[-1], v.shape[-1]
    q_starts, q_lows = tile_bounds(spec.q_len, spec.block_q)
    kv_starts, kv_lows = tile_bounds(spec.kv_len, spec.block_kv)
    q_starts, q_lows, kv_starts, kv_lows = map(jnp.asarray, (q_starts, q_lows, kv_starts, kv_lows))
    delta = jnp.sum(dout.astype(spec.acc) * out.astype(spec.acc), -1) - dlse
    lse_safe = finite_lse(lse)
    float_pos = [n for n, c in enumerate(score_consts) if is_float(c)]
    operands = (q, k, v, out, lse, dout, dlse, score_consts, mask_consts, sched)
    # Inside shard_map the captured float arrays enter the tile loops varying like the operands: their
    # cotangents accumulate per device and are summed over the devices once, after the loops (the
    # invariant arrays themselves would be summed by autodiff at every tile, inside loops whose trip
    # counts differ between devices).
    primal_consts = score_consts
    score_consts = tuple(match_vma(c, *operands) if is_float(c) else c for c in score_consts)

    def with_float(fconsts):
        merged = list(score_consts)
        for n, c in zip(float_pos, fconsts):
            merged[n] = c
        return tuple(merged)

    def q_tile(carry, i):
        dk_acc, dv_acc, dc_acc = carry
        q_start = q_starts[i]
        # Rows shared with the previous tile get dO = 0, so they add nothing to dK, dV, dbias.
        row_ok = (q_start + jnp.arange(spec.block_q) >= q_lows[i]).reshape(1, 1, 1, -1, 1)
        q_t = _q_tile(spec, q, q_start, d)
        do5 = lax.dynamic_slice_in_dim(dout, q_start, spec.block_q, axis=3)
        do_t = jnp.where(row_ok, do5, 0).reshape(bsz, hkv, m_rows, dv)
        lse_t = _q_tile(spec, lse_safe[..., None], q_start, 1)[..., 0]
        delta_t = jnp.where(row_ok[..., 0], lax.dynamic_slice_in_dim(delta, q_start, spec.block_q, axis=3),
                            0.0).reshape(bsz, hkv, m_rows)

        def kv_step(t, c):
            dq_t, dk_acc, dv_acc, dc = c
            j, kv_start, k_t, v_t, idx = _kv_tile(spec, sched, k, v, kv_starts, q_start, i, t)

            def grads(masked: bool):
                s_raw = _raw_scores(spec, q_t, k_t)
                fconsts = tuple(score_consts[n] for n in float_pos)
                if spec.score_fn is not None:
                    s, mod_vjp = jax.vjp(lambda s_, fc: _apply_score_mod(spec, s_, with_float(fc), idx),
                                         s_raw, fconsts)
                else:
                    s = s_raw
                if masked:
                    allowed = _allowed(spec, mask_consts, idx, kv_lows[j], s.shape)
                    s = jnp.where(allowed, s, NEG_INF)
                p = jnp.exp(s - lse_t[..., None])
                dv_c = jnp.einsum("bhmk,bhmd->bhkd", p.astype(dout.dtype), do_t, precision=spec.precision,
                                  preferred_element_type=spec.acc)
                dp = jnp.einsum("bhmd,bhkd->bhmk", do_t, v_t, precision=spec.precision,
                                preferred_element_type=spec.acc)
                ds = p * (dp - delta_t[..., None])  # 0 wherever p is 0 (masked), so the mask needs no vjp
                if spec.score_fn is not None:
                    ds, dfc = mod_vjp(ds)
                    if masked:
                        # The mod's derivative may be NaN/inf where the mask forbids (sqrt of a negative
                        # offset): 0 * NaN must not reach dq/dk.
                        ds = jnp.where(allowed, ds, 0.0)
                else:
                    dfc = ()
                ds = ds * spec.scale
                dq_c = jnp.einsum("bhmk,bhkd->bhmd", ds.astype(k.dtype), k_t, precision=spec.precision,
                                  preferred_element_type=spec.acc)
                dk_c = jnp.einsum("bhmk,bhmd->bhkd", ds.astype(q.dtype), q_t, precision=spec.precision,
                                  preferred_element_type=spec.acc)
                return dq_c, dk_c, dv_c, tuple(g.astype(spec.acc) for g in dfc)

            if not spec.may_mask:
                dq_c, dk_c, dv_c, dfc = grads(False)
            else:
                dq_c, dk_c, dv_c, dfc = lax.cond(sched.masked[i, j], lambda: grads(True), lambda: grads(False))

            def add_at(acc, upd):
                cur = lax.dynamic_slice_in_dim(acc, kv_start, spec.block_kv, axis=2)
                return lax.dynamic_update_slice_in_dim(acc, cur + upd, kv_start, axis=2)

            return (dq_t + dq_c, add_at(dk_acc, dk_c), add_at(dv_acc, dv_c),
                    tuple(a + g for a, g in zip(dc, dfc)))

        init = (match_vma(jnp.zeros((bsz, hkv, m_rows, d), spec.acc), *operands), dk_acc, dv_acc, dc_acc)
        dq_t, dk_acc, dv_acc, dc_acc = lax.fori_loop(0, sched.count[i], kv_step, init)
        return (dk_acc, dv_acc, dc_acc), dq_t.reshape(bsz, hkv, spec.groups, spec.block_q, d)

    dc0 = tuple(jnp.zeros(score_consts[n].shape, spec.acc) for n in float_pos)
    init = match_vma((jnp.zeros(k.shape, spec.acc), jnp.zeros(v.shape, spec.acc), dc0), *operands)
    (dk, dv_, dc), dq_tiles = lax.scan(q_tile, init, jnp.arange(len(q_starts), dtype=jnp.int32))
    dq = _assemble(dq_tiles, spec.q_len, spec.block_q)
    d_score = [zero_cotangent(c) for c in primal_consts]
    for n, g in zip(float_pos, dc):
        d_score[n] = cotangent_like(g, primal_consts[n])
    return cotangent_like(dq, q), cotangent_like(dk, k), cotangent_like(dv_, v), tuple(d_score)


def _blockwise_attention(spec: _Spec, q, k, v, score_consts, mask_consts, sched: Schedule):
    @jax.custom_vjp
    def attend(q, k, v, score_consts, mask_consts, sched_arrays):
        return _forward(spec, q, k, v, score_consts, mask_consts, Schedule(*sched_arrays))

    def fwd(q, k, v, score_consts, mask_consts, sched_arrays):
        out, lse, row_max = attend(q, k, v, score_consts, mask_consts, sched_arrays)
        return (out, lse, row_max), (q, k, v, out, finite_lse(lse), score_consts, mask_consts, sched_arrays)

    def bwd(res, cotangents):
        q, k, v, out, lse, score_consts, mask_consts, sched_arrays = res
        dout, dlse, _ = cotangents       # the row maximum carries no gradient
        dq, dk, dv, d_score = _backward(spec, q, k, v, out, lse, dout, dlse.astype(spec.acc), score_consts,
                                        mask_consts, Schedule(*sched_arrays))
        return (dq, dk, dv, d_score, tuple(map(zero_cotangent, mask_consts)),
                tuple(map(zero_cotangent, sched_arrays)))

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, tuple(score_consts), tuple(mask_consts),
                  (sched.count, sched.kv_tiles, sched.masked))


def _setup(q, k, v, score_mod, mask_mod, block_mask, scale, block_q, block_kv):
    """Tiles, schedule and converted mods of one call: (spec, q5 [B, Hkv, G, Lq, D], k, v (batch
    broadcast), score_consts, mask_consts, schedule)."""
    k, v = broadcast_kv_batch(q, k, v)
    bsz, hq, lq, d = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    masked = mask_mod is not None or block_mask is not None
    block_q = tile_size(lq, block_q or max(16, DEFAULT_ROWS // groups))
    block_kv = tile_size(lkv, block_kv or (DEFAULT_BLOCK_KV_MASKED if masked else DEFAULT_BLOCK_KV))
    if mask_mod is None and block_mask is not None and block_mask.mask_mod is None:
        mask_mod = mask_mod_from_kinds(block_mask)
    if mask_mod is not None and block_mask is None:
        bm, hm = mask_extent(mask_mod, bsz, hq)
        block_mask = masks_lib.create_block_mask(mask_mod, bm, hm, lq, lkv, block_q=block_q, block_kv=block_kv)
    sched = build_schedule(block_mask if mask_mod is not None else None, lq, lkv, block_q, block_kv)

    tile5 = (bsz, hkv, groups, block_q, block_kv)
    i32 = jnp.int32
    example_idx = (jnp.zeros((bsz, 1, 1, 1, 1), i32), jnp.zeros((1, hkv, groups, 1, 1), i32),
                   jnp.zeros((1, 1, 1, block_q, 1), i32), jnp.zeros((1, 1, 1, 1, block_kv), i32))
    acc = acc_dtype(q.dtype)
    score_fn, score_consts = convert_mod(score_mod, jnp.zeros(tile5, acc), *example_idx)
    mask_fn, mask_consts = convert_mod(mask_mod, *example_idx)
    spec = _Spec(bsz, hkv, groups, lq, lkv, block_q, block_kv, float(scale), precision_for(q.dtype), acc,
                 score_fn, mask_fn, may_mask=mask_fn is not None or lkv % block_kv != 0)
    q5 = q.reshape(bsz, hkv, groups, lq, d)
    return spec, q5, k, v, score_consts, mask_consts, sched


def flex_attention_xla(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale, return_lse=False,
                       return_max=False, interpret=False, block_q: int | None = None, block_kv: int | None = None):
    """Blockwise online-softmax attention in XLA (GQA native, memory linear in sequence length).

    q: [B, Hq, Lq, D], k: [B or 1, Hkv, Lkv, D], v: [B or 1, Hkv, Lkv, Dv] -> out [B, Hq, Lq, Dv]
    (and lse [B, Hq, Lq] float32, float64 for float64 inputs, when ``return_lse``; ``return_max``:
    (out, lse, max) with the row maximum of the modded, masked scores, -inf for fully masked rows, no
    gradient). ``interpret`` is ignored. ``block_q`` is the number of rows per query head in a tile
    (G * block_q rows are processed together).
    """
    del interpret
    spec, q5, k, v, score_consts, mask_consts, sched = _setup(q, k, v, score_mod, mask_mod, block_mask, scale,
                                                              block_q, block_kv)
    out, lse, row_max = _blockwise_attention(spec, q5, k, v, score_consts, mask_consts, sched)
    bsz, hq, lq, _ = q.shape
    out = out.reshape(bsz, hq, lq, v.shape[-1])
    if return_max:
        return out, lse.reshape(bsz, hq, lq), lax.stop_gradient(row_max.reshape(bsz, hq, lq))
    return (out, lse.reshape(bsz, hq, lq)) if return_lse else out


def blockwise_passes(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale):
    """The blockwise path of one call as two passes, without its custom_vjp: ``(forward, backward,
    score_consts)``. ``forward() -> (out [B, Hq, Lq, Dv], lse [B, Hq, Lq])``; ``backward(out, lse, dout, dlse)
    -> (dq, dk, dv, d_score_consts)`` with ``out`` / ``lse`` any normalisation of the scores (ring attention,
    :mod:`flashlax.parallel.ring`, passes the ones merged over all K/V blocks, so each block's backward
    gives its exact share of the gradient); ``d_score_consts`` matches ``score_consts``, the arrays the
    score_mod captured."""
    spec, q5, kb, vb, score_consts, mask_consts, sched = _setup(q, k, v, score_mod, mask_mod, block_mask, scale,
                                                                None, None)
    shape5 = q5.shape[:4]

    def forward():
        out, lse, _ = _forward(spec, q5, kb, vb, score_consts, mask_consts, sched)
        return out.reshape(q.shape[:3] + (v.shape[-1],)), lse.reshape(q.shape[:3])

    def backward(out, lse, dout, dlse):
        dq, dk, dv, d_score = _backward(spec, q5, kb, vb, out.reshape(shape5 + (-1,)), lse.reshape(shape5),
                                        dout.reshape(shape5 + (-1,)), dlse.reshape(shape5).astype(spec.acc),
                                        score_consts, mask_consts, sched)
        if k.shape[0] != kb.shape[0]:    # K/V of batch 1 broadcast over the batch
            dk, dv = dk.sum(0, keepdims=True), dv.sum(0, keepdims=True)
        return dq.reshape(q.shape), dk, dv, d_score

    return forward, backward, score_consts


def broadcast_kv_batch(q, k, v):
    """K/V given with batch 1 against q with batch B (FlexAttention broadcasts them): broadcast to B.
    Under differentiation the cotangents of the broadcast sum back over the batch."""
    bsz = q.shape[0]
    if k.shape[0] != bsz:
        k = jnp.broadcast_to(k, (bsz,) + k.shape[1:])
        v = jnp.broadcast_to(v, (bsz,) + v.shape[1:])
    return k, v


def masked_score_mod(score_mod, s, allowed, *idx):
    """``score_mod`` on the scores ``s`` with the mask applied after it (-inf where not ``allowed``).

    Where the mask forbids, the mod sees a stop_gradient copy of the score: autodiff then drops whatever
    the mod's derivative is there (NaN from ``sqrt`` of a negative offset, say) instead of multiplying it
    by a zero cotangent."""
    if score_mod is not None:
        if allowed is not None:
            s = jnp.where(allowed, s, lax.stop_gradient(s))
        s = _mods.apply_mod(score_mod, s, *idx).astype(s.dtype)
    return s if allowed is None else jnp.where(allowed, s, NEG_INF)


# ----------------------------------------------------------------------------------------------------
# The K/V-repeat baseline
# ----------------------------------------------------------------------------------------------------

def dense_attention(q, k, v, *, score_mod=None, mask_mod=None, scale, precision=None, return_max=False):
    """Materialised attention with the K/V heads given per query head: q, k, v [B, H, L*, D*].

    Returns (out in q's dtype, lse f32, or f64 for f64 inputs), and with ``return_max`` the row maximum of
    the modded, masked scores (no gradient). Fully masked rows: out 0, lse and max -inf, finite gradients.
    """
    precision = precision or precision_for(q.dtype)
    acc = acc_dtype(q.dtype)
    bsz, heads, lq, _ = q.shape
    lkv = k.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=precision, preferred_element_type=acc) * scale
    i32 = jnp.int32
    b = jnp.arange(bsz, dtype=i32)[:, None, None, None]
    h = jnp.arange(heads, dtype=i32)[None, :, None, None]
    q_idx = jnp.arange(lq, dtype=i32)[None, None, :, None]
    kv_idx = jnp.arange(lkv, dtype=i32)[None, None, None, :]
    allowed = None if mask_mod is None else jnp.broadcast_to(_mods.apply_mod(mask_mod, b, h, q_idx, kv_idx),
                                                             s.shape)
    s = masked_score_mod(score_mod, s, allowed, b, h, q_idx, kv_idx)
    row_max = lax.stop_gradient(s.max(-1))
    m = row_max[..., None]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    l = e.sum(-1)
    has_any = l > 0
    l_safe = jnp.where(has_any, l, 1.0)
    pv = jnp.einsum("bhqk,bhkd->bhqd", e.astype(v.dtype), v, precision=precision, preferred_element_type=acc)
    out = pv / l_safe[..., None]
    lse = jnp.where(has_any, m[..., 0] + jnp.log(l_safe), NEG_INF)
    return (out.astype(q.dtype), lse, row_max) if return_max else (out.astype(q.dtype), lse)


def flex_attention_repeat(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale, return_lse=False,
                          return_max=False, interpret=False):
    """The old baseline: K/V repeated to Hq heads (jnp.repeat), then materialised attention.

    q: [B, Hq, Lq, D], k: [B, Hkv, Lkv, D], v: [B, Hkv, Lkv, Dv]. Memory is quadratic in length.
    ``return_max``: (out, lse, row max) as flex_attention_xla.
    """
    del interpret
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod or mask_mod_from_kinds(block_mask)
    k, v = broadcast_kv_batch(q, k, v)
    groups = q.shape[1] // k.shape[1]
    k_rep = jnp.repeat(k, groups, axis=1)
    v_rep = jnp.repeat(v, groups, axis=1)
    res = dense_attention(q, k_rep, v_rep, score_mod=score_mod, mask_mod=mask_mod, scale=scale,
                          return_max=return_max)
    return res if return_lse or return_max else res[0]
