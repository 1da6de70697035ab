"""Flash decoding for decode_attention: a split-KV Pallas kernel (Triton lowering), the log-sum-exp merge of
the splits, and the entry point :func:`decode_attention_pallas`.

Grid (splits, KV heads x row blocks, batch). One program reads one split of one (batch, KV head) cache
slice once and serves every query row of the group: the G query heads x Lq new tokens (row ``g * Lq + i``
is new token i of query head ``hkv * G + g``), padded in registers to a power of two >= 16 (the smallest
Triton dot), never in memory. Groups with more than ``block_rows`` rows are cut into row blocks that run as
neighbouring programs, so the second read of a K/V tile comes from L2.

``kv_lens`` is an int32 ref read inside the kernel: a split's tile range is clipped to the sequence, so
splits past its end do no loads, and changing the values never recompiles. A split visits first the tiles
every new token sees whole (plain loads, no mask), then the last one or two tiles (loads masked by
kv_lens, so rows past it are never read and NaN there cannot leak; new token i sees positions
<= kv_lens - Lq + i). The rows read are clamped into [0, Lmax), so traced out-of-range values stay memory
safe (the new tokens' positions use kv_lens as given). With ``nan_outside_lens`` (the front end's guard for
traced lengths) the store of the final output writes NaN rows for a length outside [Lq, Lmax], so a serving
step runs no XLA op after the kernel.

Each split writes a float32 partial output normalised by its own sum, and its log-sum-exp. The splits are
merged in float32 in the same launch when one program's partials are small (``DecodeConfig.merge_in_kernel_kb``,
128 KB: Lq 1 to 4 at the decode shapes): each program bumps its group's arrival counter (an acquire-release
atomic; the counters are a fresh zero buffer per call) and the one that arrives last reads the group's
partials back from L2 in split order and writes the final output in q's dtype (deterministic: the same sums
whichever program merges). Larger merges (Lq 16: 1 MB per group) run as one fused XLA step
(:func:`merge_splits`), spread over the chip, or, with ``DecodeConfig.merge_kernel_rows``, as a second Pallas
launch (:func:`_merge_call`: one program per few rows of a group, every split; one launch where XLA's merge
takes several). A split that saw nothing has lse -inf and weight 0. With one split the
kernel writes the final output itself.

score_mod / mask_mod run in the kernel through ``_tiles.TileMod`` (scalar semantics, captured arrays passed
as refs); q_idx is the new token's absolute position. A mod that TileMod cannot evaluate in a kernel
(``UnsupportedModError``) runs the XLA path instead.

Paged caches (``block_table``, see ``flashlax.paged``): the K/V refs are the pool's pages of the program's KV
head ([num_pages, page_size, D]) and the sequence's block-table row is an int32 ref read in the kernel. A
logical tile is loaded from its page (``_tiles.kv_tile_view``): one table read per tile when the page size
is a multiple of the tile (the tile is one block of one page), a per-row page lookup otherwise (pages of 16
under 64-key tiles). The next tile's pages are read one loop step ahead (``DecodeConfig.page_prefetch``):
read in the same step, the table read delays the K/V loads it feeds (Triton's pipeliner gives them half
the lead, or waits on a scalar read). Nothing is gathered in memory; the rest of the kernel does not change.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax import paged
from flashlax.kernels import _tiles
from flashlax.kernels._tiles import TileMod, pow2
from flashlax.kernels.configs import (DecodeConfig, check_decode_config, decode_config, decode_shrink_to_fit,
                                      num_sms)
from flashlax.parallel.vma import match_vma, out_struct

MIN_ROWS = 16  # the smallest Triton dot operand


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _padded(dim: int) -> int:
    """A head dim padded in registers: the next power of two, at least 16 (the smallest Triton dot side)."""
    return max(MIN_ROWS, pow2(dim))


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """Everything about one call that is not an array."""

    config: DecodeConfig
    block_rows: int          # query rows per program (power of two >= 16)
    row_blocks: int          # programs per KV group along the rows
    splits: int
    tiles_per_split: int
    scale: float
    score_mod: TileMod | None
    mask_mod: TileMod | None
    interpret: bool
    merge_in_kernel: bool = False   # splits > 1 merged by the last split of each group (merge_rows rows)
    merge_rows: int = 0
    page_size: int = 0        # > 0: paged K/V (num_pages, max_pages below)
    num_pages: int = 0
    max_pages: int = 0
    nan_guard: bool = False   # the final store writes NaN rows where kv_lens lies outside [Lq, Lmax]
    merge_launch_rows: int = 0   # > 0: splits > 1 merged by a second launch (_merge_kernel), this many rows each
    # (the config's merge_kernel_rows, at most the group's rows rounded up to a power of two)


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------

def _kv_tile_start(tile, block_kv: int):
    """First logical cache row of KV tile ``tile``."""
    return pl.multiple_of(tile * block_kv, block_kv)


def _load_kv(ref, start, block_kv: int, cols: int, n_cols: int, kv_len=None, pages: _tiles.Pages | None = None,
             page=None):
    """[block_kv, cols] tile of a [Lmax, >= n_cols] cache ref (or paged: ``pages``, the tile's ``page``
    ids when read already) from logical row ``start``. ``kv_len`` given: rows at or past it read as 0 (never
    loaded); columns >= n_cols (head-dim padding) read as 0."""
    mask = None
    if kv_len is not None:
        mask = jnp.broadcast_to(_tiles.row_mask(start, block_kv, kv_len)[:, None], (block_kv, cols))
    if cols != n_cols:
        col_ok = jnp.broadcast_to((jnp.arange(cols, dtype=jnp.int32) < n_cols)[None, :], (block_kv, cols))
        mask = col_ok if mask is None else mask & col_ok
    block = _tiles.kv_tile_view(ref, start, block_kv, cols, pages, page)
    return plgpu.load(block) if mask is None else plgpu.load(block, mask=mask, other=0.0)


def _decode_kernel(kv_lens_ref, *refs, st: _Static, n_score_cap: int, groups: int,
                   q_len: int, q_heads: int, max_len: int, d: int, dv: int):
    pages = None
    if st.page_size:
        pages = _tiles.Pages(refs[0], st.page_size, st.num_pages, st.max_pages, st.config.page_lookup)
        refs = refs[1:]
    ahead = st.config.page_prefetch if pages is not None else 0   # tiles whose pages are read ahead
    q_ref, k_ref, v_ref, *refs = refs
    fused = st.merge_in_kernel
    if fused:   # inputs ..., captured, counter (aliased to the last output); outputs out, lse, partials, counter
        *refs, _, o_ref, lse_ref, o_part_ref, lse_part_ref, count_ref = refs
        cap_refs = refs
    else:
        n_cap = len(refs) - 2
        cap_refs, (o_ref, lse_ref) = refs[:n_cap], refs[n_cap:]
    score_caps, mask_caps = cap_refs[:n_score_cap], cap_refs[n_score_cap:]
    cfg = st.config
    bk, br = cfg.block_kv, st.block_rows
    dp, dvp = _padded(d), _padded(dv)
    rows = groups * q_len

    i32 = jnp.int32   # lax.div / lax.rem take no Python ints (int64 under x64): all index math is int32
    split, group_pid, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if st.row_blocks == 1:
        kv_head, row0 = group_pid, 0
    else:
        kv_head = lax.div(group_pid, i32(st.row_blocks))
        row0 = pl.multiple_of(lax.rem(group_pid, i32(st.row_blocks)) * br, br)
    # Rows read stay in [0, Lmax) (traced out-of-range values stay memory safe); the new tokens' positions
    # come from the length as given: a shard of a sequence-split cache (flashlax.parallel.sequence) gets
    # lengths past its Lmax (every row visible) or below Lq (the tokens lie beyond its rows).
    kv_len = jnp.clip(kv_lens_ref[0], 0, max_len)

    # Row r of the group is new token r % Lq of query head hkv * G + r // Lq (padding rows: clamped head).
    row = row0 + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    h = jnp.minimum(kv_head * groups + lax.div(row, i32(q_len)), q_heads - 1)
    q_idx = kv_lens_ref[0] - q_len + lax.rem(row, i32(q_len))  # absolute position of the new token
    q = _tiles.load_tile(q_ref, row0, br, rows, dp, d)
    precision = _tiles.dot_precision(q.dtype)
    # Base-2 factor of the scores, folded into the exponent's FMA (_tiles.softmax_update).
    mult = _tiles.exponent_factor(st.scale, st.score_mod is not None)

    def visit(tile, carry, edge: bool):
        m_prev, l_prev, acc_prev, *queued = carry
        kv_start = _kv_tile_start(tile, bk)
        limit = kv_len if edge else None
        page, queue = None, ()
        if pages is not None:   # this tile's pages (read `ahead` steps before), then those of tile + ahead
            page = queued[0] if ahead else _tiles.page_ids(pages, kv_start, bk)
            if ahead:
                queue = (*queued[1:], _tiles.page_ids(pages, _kv_tile_start(tile + ahead, bk), bk))
        k = _load_kv(k_ref, kv_start, bk, dp, d, limit, pages, page)
        v = _load_kv(v_ref, kv_start, bk, dvp, dv, limit, pages, page)
        qk = _tiles.dot_nt(q, k, precision)
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        s = _tiles.kernel_scores(qk, st.scale, st.score_mod, score_caps, b, h, q_idx, kv_idx)
        if edge:   # new token i sees positions <= kv_len - Lq + i (< kv_len: rows past it are 0, unread)
            s = jnp.where(kv_idx <= q_idx, s, -jnp.inf)
        if st.mask_mod is not None:
            s = jnp.where(st.mask_mod(mask_caps, b, h, q_idx, kv_idx), s, -jnp.inf)
        p, alpha, m_new, l_new = _tiles.softmax_update(s, m_prev, l_prev, mult, st.interpret)
        acc = acc_prev * alpha[:, None] + _tiles.dot_nn(p.astype(v.dtype), v, precision)
        return (m_new, l_new, acc, *queue)

    # This split's tiles [lo, hi), clipped to the sequence; tiles below `whole` are seen whole by every
    # new token (they end at or before kv_len - Lq + 1), the rest (at most two) need the edge mask.
    lo = split * st.tiles_per_split
    hi = jnp.maximum(jnp.minimum(lo + st.tiles_per_split, lax.div(kv_len + (bk - 1), i32(bk))), lo)
    whole = lax.div(jnp.maximum(kv_len - q_len + 1, 0), i32(bk))
    mid = jnp.clip(whole, lo, hi)
    carry = (jnp.full((br,), -jnp.inf, jnp.float32), jnp.zeros((br,), jnp.float32),
             jnp.zeros((br, dvp), jnp.float32))
    carry += tuple(_tiles.page_ids(pages, _kv_tile_start(lo + i, bk), bk) for i in range(ahead))
    carry = lax.fori_loop(lo, mid, lambda j, c: visit(j, c, edge=False), carry)
    carry = lax.fori_loop(mid, hi, lambda j, c: visit(j, c, edge=True), carry)

    m, l, acc = carry[:3]
    out, lse = _tiles.softmax_finalize(acc, m, l, mult)
    # A length outside [Lq, Lmax] (traced, so unchecked) gives NaN rows in the final output, never plausible
    # numbers; the value as given (int32 holds every int32 length exactly; the front end clips wider ones to
    # [-1, Lmax + 1] first).
    bad = _outside_lens(kv_lens_ref, q_len, max_len) if st.nan_guard else None
    if not fused:
        if bad is not None:   # one split: this store is the final output
            out, lse = _nan_if(bad, out, lse)
        _tiles.store_tile(o_ref, row0, out, rows, dv)     # q's dtype with one split, else float32 partials
        _tiles.store_vec(lse_ref, row0, lse, rows)
        return
    # One index expression per store (the interpreter mishandles a store through two chained .at views), its
    # indices all int32 (with split, a program id; Python ints would be int64 under x64).
    row0_32, zero = jnp.asarray(row0, i32), i32(0)
    plgpu.store(o_part_ref.at[split, pl.ds(row0_32, br), pl.ds(zero, dvp)], out,
                mask=_tiles.tile_mask(row0, br, rows, dvp, dv, False))
    plgpu.store(lse_part_ref.at[split, pl.ds(row0_32, br)], lse, mask=_tiles.row_mask(row0, br, rows))
    # Every thread's partial stores, then one acquire-release increment of the group's counter (GPU scope):
    # the program that sees splits - 1 arrived last, every other split's partials are visible to it, and it
    # merges them in split order (the same sums whichever program it is: deterministic).
    if not st.interpret:
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(count_ref, split * 0, jnp.int32(1))   # a traced index: the interpreter's rule needs one

    @pl.when(arrived == st.splits - 1)
    def _merge():
        _merge_partials(o_part_ref, lse_part_ref, o_ref, lse_ref, row0, st.splits, st.merge_rows, rows, dvp, dv,
                        bad)


def _outside_lens(kv_lens_ref, q_len: int, max_len: int):
    """Scalar bool: the program's kv_lens entry lies outside [Lq, Lmax] (NaN rows in the final store)."""
    return (kv_lens_ref[0] < q_len) | (kv_lens_ref[0] > max_len)


def _nan_if(bad, out, lse):
    """out [rows, dv] and lse [rows] replaced by NaN where the scalar ``bad`` holds."""
    return jnp.where(bad, jnp.nan, out), jnp.where(bad, jnp.nan, lse)


def _merge_chunk(splits: int, merge_rows: int, dvp: int) -> int:
    """Splits per step of the in-kernel merge: [sc, merge_rows, dvp] float32, about 64 registers per thread
    at 4 warps."""
    return min(pow2(splits), max(1, 8192 // (merge_rows * dvp)))


def _merge_partials(o_part_ref, lse_part_ref, o_ref, lse_ref, row0, splits: int, rp: int, rows: int,
                    dvp: int, dv: int, bad=None):
    """The log-sum-exp merge of :func:`merge_splits` inside the kernel, for the ``rp`` rows from row0 of one
    group (rp: the rows of the program's block, a power of two, not padded to 16: no dot here). The splits
    in chunks of ``sc`` ([sc, rp, dvp] float32 partials, read back from L2, which holds them), unrolled so
    every chunk's loads are in flight together, in split order with an online max. Rows no split saw give
    0 and lse -inf. Plain loads: this program never read these addresses before, so its L1 holds no stale
    copy, and they come after the counter's acquire. ``bad``: a scalar bool, NaN rows where it holds."""
    sc = _merge_chunk(splits, rp, dvp)
    i32 = jnp.int32   # every index of one load the same integer type (Python ints are int64 under x64)
    row0, zero = jnp.asarray(row0, i32), i32(0)
    row_ok = (row0 + lax.broadcasted_iota(jnp.int32, (1, rp), 1)) < rows
    col_ok = lax.broadcasted_iota(jnp.int32, (1, 1, dvp), 2) < dv
    m = jnp.full((rp,), -jnp.inf, jnp.float32)
    tot = jnp.zeros((rp,), jnp.float32)
    acc = jnp.zeros((rp, dvp), jnp.float32)
    for s0 in range(0, splits, sc):
        ok = ((s0 + lax.broadcasted_iota(jnp.int32, (sc, 1), 0)) < splits) & row_ok      # [sc, rp]
        lse = plgpu.load(lse_part_ref.at[pl.ds(i32(s0), sc), pl.ds(row0, rp)], mask=ok, other=-jnp.inf)
        part = plgpu.load(o_part_ref.at[pl.ds(i32(s0), sc), pl.ds(row0, rp), pl.ds(zero, dvp)],
                          mask=ok[:, :, None] & col_ok, other=0.0)
        m_new = jnp.maximum(m, jnp.max(lse, axis=0))                 # [rp]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)            # nothing seen yet: exp(-inf - 0) = 0
        alpha = jnp.exp(m - m_safe)
        w = jnp.exp(lse - m_safe[None, :])                           # [sc, rp]
        tot = tot * alpha + jnp.sum(w, axis=0)
        acc = acc * alpha[:, None] + jnp.sum(part * w[:, :, None], axis=0)
        m = m_new
    out, lse = _merged(acc, tot, m)
    if bad is not None:
        out, lse = _nan_if(bad, out, lse)
    _tiles.store_tile(o_ref, row0, out, rows, dv)
    _tiles.store_vec(lse_ref, row0, lse, rows)


def _decode_call(st: _Static, q, k_cache, v_cache, kv_lens, captured, n_score_cap: int, block_table=None):
    """pallas_call of the kernel. Returns (out, lse): out [B, Hkv, rows, Dv] in q's dtype and lse
    [B, Hkv, rows] with one split; float32 partials [B, Hkv, S, rows, Dv] and [B, Hkv, S, rows] otherwise
    (rows = G * Lq; lse natural log). Paged (``block_table`` int32 [B, max_pages]): the caches are pages
    [num_pages, Hkv, page_size, D]."""
    batch, q_heads, q_len, d = q.shape
    _, kv_heads, max_len, dv = v_cache.shape
    if block_table is not None:
        max_len = block_table.shape[1] * st.page_size
    groups = q_heads // kv_heads
    rows = groups * q_len
    dp, dvp = _padded(d), _padded(dv)
    nr, splits = st.row_blocks, st.splits
    final = splits == 1
    fused = st.merge_in_kernel
    kv_head = (lambda g: g) if nr == 1 else (lambda g: g // nr)
    q_rows = q.reshape(batch, kv_heads, rows, d)          # row g * Lq + i: head hkv * G + g, token i

    in_specs = [pl.BlockSpec((1,), lambda s, g, b: (b,))]
    paging = ()
    if block_table is None:
        cache_spec = lambda cols: pl.BlockSpec((None, None, max_len, cols), lambda s, g, b: (b, kv_head(g), 0, 0))  # noqa: E731
    else:   # the whole pool of the program's KV head, and the sequence's row of the block table
        in_specs.append(pl.BlockSpec((None, block_table.shape[1]), lambda s, g, b: (b, 0)))
        paging = (block_table,)
        cache_spec = lambda cols: pl.BlockSpec((st.num_pages, None, st.page_size, cols),  # noqa: E731
                                               lambda s, g, b: (0, kv_head(g), 0, 0))
    in_specs += [pl.BlockSpec((None, None, rows, dp), lambda s, g, b: (b, kv_head(g), 0, 0)),
                 cache_spec(dp), cache_spec(dvp)] + _tiles.captured_specs(captured)
    operands = (kv_lens, *paging, q_rows, k_cache, v_cache, *captured)
    aliases = {}
    if final or fused:
        out_specs = [pl.BlockSpec((None, None, rows, dvp), lambda s, g, b: (b, kv_head(g), 0, 0)),
                     pl.BlockSpec((None, None, rows), lambda s, g, b: (b, kv_head(g), 0))]
        out_shape = [out_struct((batch, kv_heads, rows, dv), q.dtype, *operands),
                     out_struct((batch, kv_heads, rows), jnp.float32, *operands)]
    if fused:   # every split's partials visible to the program that merges: blocks over all splits (the
        # split axis padded to whole merge steps; the padding is never written and never read)
        sc = _merge_chunk(splits, st.merge_rows, dvp)
        sp = _cdiv(splits, sc) * sc
        out_specs += [pl.BlockSpec((None, None, sp, rows, dvp), lambda s, g, b: (b, kv_head(g), 0, 0, 0)),
                      pl.BlockSpec((None, None, sp, rows), lambda s, g, b: (b, kv_head(g), 0, 0)),
                      pl.BlockSpec((None, 1), lambda s, g, b: (b, g))]
        out_shape += [out_struct((batch, kv_heads, sp, rows, dv), jnp.float32, *operands),
                      out_struct((batch, kv_heads, sp, rows), jnp.float32, *operands),
                      out_struct((batch, kv_heads * nr), jnp.int32, *operands)]
        # The arrival counters, one per (sequence, group, row block), zeros in a fresh buffer per call.
        counter = match_vma(jnp.zeros((batch, kv_heads * nr), jnp.int32), *operands)
        in_specs.append(pl.BlockSpec((None, 1), lambda s, g, b: (b, g)))
        aliases = {len(operands): 4}
        operands = (*operands, counter)
    elif not final:   # partials; for the merge launch the split axis padded to whole merge steps (never written)
        sp = splits
        if st.merge_launch_rows:
            sc = _merge_chunk(splits, st.merge_launch_rows, dvp)
            sp = _cdiv(splits, sc) * sc
        out_specs = [pl.BlockSpec((None, None, None, rows, dvp), lambda s, g, b: (b, kv_head(g), s, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda s, g, b: (b, kv_head(g), s, 0))]
        out_shape = [out_struct((batch, kv_heads, sp, rows, dv), jnp.float32, *operands),
                     out_struct((batch, kv_heads, sp, rows), jnp.float32, *operands)]
    kernel = functools.partial(_decode_kernel, st=st, n_score_cap=n_score_cap, groups=groups, q_len=q_len,
                               q_heads=q_heads, max_len=max_len, d=d, dv=dv)
    results = pl.pallas_call(
        kernel,
        grid=(splits, kv_heads * nr, batch),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=st.config.num_warps, num_stages=st.config.num_stages),
        interpret=st.interpret,
        name="decode_attention",
    )(*operands)
    if st.merge_launch_rows and not (final or fused):
        return _merge_call(st, kv_lens, *results[:2], splits=splits, rows=rows, dv=dv, dtype=q.dtype,
                           q_len=q_len, max_len=max_len)
    return results[:2]


def _merge_kernel(kv_lens_ref, o_part_ref, lse_part_ref, o_ref, lse_ref, *, splits: int, rp: int, rows: int,
                  dvp: int, dv: int, nan_guard: bool, q_len: int, max_len: int):
    """One program of the merge launch: ``rp`` rows of one group, every split (:func:`_merge_partials`)."""
    row0 = pl.multiple_of(pl.program_id(0) * rp, rp)
    bad = _outside_lens(kv_lens_ref, q_len, max_len) if nan_guard else None
    _merge_partials(o_part_ref, lse_part_ref, o_ref, lse_ref, row0, splits, rp, rows, dvp, dv, bad)


def _merge_call(st: _Static, kv_lens, o_parts, lse_parts, *, splits: int, rows: int, dv: int, dtype, q_len: int,
                max_len: int):
    """The splits' partials [B, Hkv, S', rows, Dv] / [B, Hkv, S', rows] (S' >= splits: padded to whole merge
    steps) merged by a second launch, grid (row blocks of ``st.merge_launch_rows``, Hkv, B): one launch where
    the fused XLA merge takes several. Returns out [B, Hkv, rows, Dv] in ``dtype`` and lse [B, Hkv, rows]."""
    batch, kv_heads, sp = o_parts.shape[:3]
    dvp = _padded(dv)
    rp = st.merge_launch_rows
    kernel = functools.partial(_merge_kernel, splits=splits, rp=rp, rows=rows, dvp=dvp, dv=dv,
                               nan_guard=st.nan_guard, q_len=q_len, max_len=max_len)
    operands = (kv_lens, o_parts, lse_parts)
    return pl.pallas_call(
        kernel,
        grid=(_cdiv(rows, rp), kv_heads, batch),
        in_specs=[pl.BlockSpec((1,), lambda r, h, b: (b,)),
                  pl.BlockSpec((None, None, sp, rows, dvp), lambda r, h, b: (b, h, 0, 0, 0)),
                  pl.BlockSpec((None, None, sp, rows), lambda r, h, b: (b, h, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, rows, dvp), lambda r, h, b: (b, h, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda r, h, b: (b, h, 0))],
        out_shape=[out_struct((batch, kv_heads, rows, dv), dtype, *operands),
                   out_struct((batch, kv_heads, rows), jnp.float32, *operands)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=st.interpret,
        name="decode_merge",
    )(*operands)


def merge_splits(out_parts, lse_parts):
    """Log-sum-exp merge of split partials, float32: out_parts [..., S, rows, Dv] (each normalised by its
    own sum), lse_parts [..., S, rows] natural log -> (out [..., rows, Dv], lse [..., rows]). Splits with
    lse -inf (nothing seen) weigh 0; rows no split saw give out 0 and lse -inf."""
    lse_max = jnp.max(lse_parts, axis=-2, keepdims=True)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)   # no finite split: exp(-inf - 0) = 0
    weight = jnp.exp(lse_parts - lse_max)                     # [..., S, rows], each <= 1
    return _merged(jnp.sum(out_parts * weight[..., None], axis=-3), jnp.sum(weight, axis=-2),
                   jnp.squeeze(lse_max, -2))


def _merged(acc, total, lse_max):
    """The end of a log-sum-exp merge (:func:`merge_splits`, and the kernel's :func:`_merge_partials`):
    acc [..., rows, Dv] and total [..., rows], the partials and their weights summed with weights
    exp(lse - lse_max) -> (out, lse). Rows with total 0 (no split saw them) give 0 and -inf."""
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    return acc / total_safe[..., None], jnp.where(seen, jnp.log(total_safe) + lse_max, -jnp.inf)


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------

def choose_num_splits(batch: int, kv_heads: int, max_len: int, *, config: DecodeConfig | None = None,
                      row_blocks: int = 1, device_kind: str | None = None, multiprocessors: int | None = None) -> int:
    """Splits for the shape and device: the most that keep every program of the call resident at once
    (``config.programs_per_sm`` per multiprocessor; small batches need many splits, large batches one),
    each split at least ``config.min_split_tiles`` tiles long; the count is then trimmed so the splits
    cover the tiles evenly."""
    cfg = config or decode_config(128, 128, jnp.bfloat16, device_kind)
    sms = multiprocessors or num_sms(device_kind)
    tiles = _cdiv(max_len, cfg.block_kv)
    # One wave: as many splits as fit next to the other groups' programs (rounding down; H200 at two programs
    # per SM: 32 splits of a B1 Hkv8 cache took 0.075 ms at L65536, 64 splits 0.080, 128 splits 0.079; B32
    # L4096 1 split 0.131, 2 splits 0.148; docs/PERF_NOTES.md).
    want = max(1, cfg.programs_per_sm * sms // (batch * kv_heads * row_blocks))
    tiles_per_split = max(cfg.min_split_tiles, _cdiv(tiles, want))
    return _cdiv(tiles, tiles_per_split)


def _check_inputs(q, k_cache, v_cache, block_table=None):
    """Shapes and dtypes; with ``block_table`` the caches are pages [num_pages, Hkv, page_size, D] and the
    cache length is max_pages * page_size. Returns the block table as int32 (or None)."""
    shapes = f"q {jnp.shape(q)}, k_cache {jnp.shape(k_cache)}, v_cache {jnp.shape(v_cache)}"
    if not (jnp.ndim(q) == jnp.ndim(k_cache) == jnp.ndim(v_cache) == 4):
        raise ValueError(f"decode_attention_pallas: q, k_cache, v_cache must be 4-D [B, H, L, D], got {shapes}")
    (batch, q_heads, q_len, d), (bk, kv_heads, max_len, dk) = q.shape, k_cache.shape
    if block_table is not None:
        block_table = paged.check_block_table("decode_attention_pallas", block_table, k_cache, v_cache, batch)
        bk, max_len = batch, block_table.shape[1] * k_cache.shape[2]
        v_cache = jax.ShapeDtypeStruct((batch, kv_heads, max_len, v_cache.shape[3]), v_cache.dtype)
    if (bk, kv_heads, max_len) != v_cache.shape[:3] or bk != batch or dk != d or kv_heads == 0 \
            or q_heads % kv_heads or not 1 <= q_len <= max_len:
        raise ValueError(f"decode_attention_pallas: incompatible shapes {shapes} (need q [B, Hq, Lq, D], caches "
                         "[B, Hkv, Lmax, D] and [B, Hkv, Lmax, Dv], Hq % Hkv == 0, 1 <= Lq <= Lmax)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"decode_attention_pallas: q and the caches must share one dtype of float32/bfloat16/"
                         f"float16, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype} ({shapes})")
    if max(d, v_cache.shape[-1]) > 256:
        raise ValueError(f"decode_attention_pallas: head dims up to 256 are supported, got {shapes}")
    return block_table


def decode_attention_pallas(q, k_cache, v_cache, *, kv_lens=None, block_table=None, scale=None,
                            num_splits: int | None = None, score_mod=None, mask_mod=None, return_lse: bool = False,
                            interpret: bool = False, config: DecodeConfig | None = None,
                            device_kind: str | None = None, nan_outside_lens: bool = False):
    """Split-KV flash decoding, Pallas/Triton kernel.

    q: [B, Hq, Lq, D] (1 <= Lq <= 16 in the contract), k_cache: [B, Hkv, Lmax, D], v_cache:
    [B, Hkv, Lmax, Dv], kv_lens: int [B] valid cache lengths including the new tokens (default Lmax; cast
    to int32). New token i sits at position kv_lens - Lq + i and sees the cache up to itself; mods get that
    position as q_idx. block_table: int [B, max_pages] for a paged cache (``flashlax.paged``): k_cache,
    v_cache are then pages [num_pages, Hkv, page_size, D / Dv] and Lmax = max_pages * page_size; pages are
    read in the kernel. num_splits: None (chosen from B * Hkv, Lmax and the multiprocessor count) or any
    positive int (splits past the cache are empty). Returns out [B, Hq, Lq, Dv] in q's dtype (and lse
    [B, Hq, Lq] float32, natural log). ``config``: a DecodeConfig (default: :func:`decode_config`).
    ``nan_outside_lens``: batch elements whose kv_lens lie outside [Lq, Lmax] get NaN rows (output and lse),
    written by the kernel's final store where it has one (the front end's guard for traced lengths, which it
    cannot check; kv_lens must then fit int32, the front end clips wider ones to [-1, Lmax + 1]).
    """
    block_table = _check_inputs(q, k_cache, v_cache, block_table)
    batch, q_heads, q_len, d = q.shape
    dv = v_cache.shape[3]
    max_len = v_cache.shape[2] if block_table is None else block_table.shape[1] * v_cache.shape[2]
    scale = float(d ** -0.5 if scale is None else scale)
    kv_lens = (jnp.full((batch,), max_len, jnp.int32) if kv_lens is None
               else jnp.asarray(kv_lens).astype(jnp.int32))
    tile_mods = _tiles.make_tile_mods(score_mod, mask_mod)
    if tile_mods is None:       # a mod the kernel cannot evaluate on tiles: the XLA split-KV path
        from flashlax.fallbacks.decode import decode_attention_xla, nan_rows
        if block_table is not None:
            k_cache, v_cache = (paged.gather_pages(c, block_table) for c in (k_cache, v_cache))
        result = decode_attention_xla(q, k_cache, v_cache, kv_lens=kv_lens, scale=scale, num_splits=num_splits,
                                      score_mod=score_mod, mask_mod=mask_mod, return_lse=return_lse)
        return nan_rows(result, kv_lens, q_len, max_len) if nan_outside_lens else result
    score_tm, mask_tm = tile_mods
    out, lse, partials = kernel_outputs(q, k_cache, v_cache, kv_lens, scale=scale, num_splits=num_splits,
                                        score_tm=score_tm, mask_tm=mask_tm, interpret=interpret, config=config,
                                        device_kind=device_kind, block_table=block_table,
                                        nan_outside_lens=nan_outside_lens)
    if partials:
        out, lse = merge_splits(out, lse)
    out = out.astype(q.dtype).reshape(batch, q_heads, q_len, dv)
    result = (out, lse.reshape(batch, q_heads, q_len)) if return_lse else out
    if partials and nan_outside_lens:   # merged in XLA: the guard is an XLA step after the merge
        from flashlax.fallbacks.decode import nan_rows
        return nan_rows(result, kv_lens, q_len, max_len)
    return result


def _smem_view(cfg: DecodeConfig, page_size: int) -> DecodeConfig:
    """``cfg`` as its shared memory is counted. A paged launch that reads the block table as a vector in the
    same loop step as the K/V loads it feeds (no read-ahead) gets (num_stages - 1) // 2 steps of lead for
    them from Triton's pipeliner (its AssignLatencies pass: latency = (stages - 1) / (indirection + 1)), so
    they hold that many + 1 buffers, as a launch of that many + 1 stages would. The H200 D128 16-bit entry's
    paged override reads the table in the step (``page_prefetch=0``, 7 stages: 4 K/V buffers)."""
    if page_size and cfg.page_prefetch == 0 and _tiles.page_read(cfg.page_lookup, page_size, cfg.block_kv) == "rows":
        return dataclasses.replace(cfg, num_stages=(cfg.num_stages - 1) // 2 + 1)
    return cfg


def launch_config(config: DecodeConfig | None, d: int, dv: int, dtype, device_kind: str, *, rows: int,
                  max_len: int, page_size: int = 0, tile_reads: int = 0) -> tuple[DecodeConfig, int]:
    """(config, block_rows) a launch runs: ``config`` (None: the device's entry) with its paged overrides
    when ``page_size`` is set (:meth:`DecodeConfig.for_paged`), its shared memory counted as the launch
    holds it (:func:`_smem_view`). An explicit config that does not fit raises; the default one is stepped
    down only when its launch does not fit (a paged 7-stage launch holds 4 K/V buffers, not 7)."""
    staged = (lambda c: c.for_paged(page_size)) if page_size else (lambda c: c)  # noqa: E731
    if config is None:
        cfg = staged(decode_config(d, dv, dtype, device_kind))
        block_rows = min(cfg.block_rows, max(MIN_ROWS, pow2(rows)))
        view = _smem_view(cfg, page_size)
        small, block_rows = decode_shrink_to_fit(view, block_rows, d, dv, dtype, device_kind, tile_reads)
        if (small.block_kv, small.num_stages) != (view.block_kv, view.num_stages):
            cfg = small          # stepped down: its stages are counted as plain ones, the safe reading
        # Do not step tiles far longer than the cache (tiny inputs).
        return dataclasses.replace(cfg, block_kv=min(cfg.block_kv, max(16, pow2(max_len)))), block_rows
    cfg = staged(config)
    block_rows = min(cfg.block_rows, max(MIN_ROWS, pow2(rows)))
    check_decode_config(_smem_view(cfg, page_size), block_rows, d, dv, dtype, device_kind, tile_reads)
    return cfg, block_rows


def kernel_outputs(q, k_cache, v_cache, kv_lens, *, scale: float, num_splits, score_tm: TileMod | None = None,
                   mask_tm: TileMod | None = None, interpret: bool = False, config: DecodeConfig | None = None,
                   device_kind: str | None = None, block_table=None, nan_outside_lens: bool = False):
    """The kernel's launch for validated inputs (kv_lens int32 [B], scale a float, mods as TileMods,
    block_table None or int32 [B, max_pages] with paged caches): ``(out, lse, partials)``, with out
    [B, Hkv, G * Lq, Dv] in q's dtype and lse [B, Hkv, G * Lq] when ``partials`` is False (one split, the
    splits merged in the kernel: ``config.merge_in_kernel_kb``, or by the merge launch:
    ``config.merge_kernel_rows``), else the float32 partials
    [B, Hkv, splits, G * Lq, Dv] and [B, Hkv, splits, G * Lq] for :func:`merge_splits`. Picks and checks the
    config and the split count. ``nan_outside_lens``: the final output's rows are NaN for batch elements whose
    kv_lens lie outside [Lq, Lmax] (the partials are not guarded: the caller's merge must do it)."""
    batch, q_heads, q_len, d = q.shape
    _, kv_heads, max_len, dv = v_cache.shape
    paging = {}
    if block_table is not None:
        paging = dict(page_size=max_len, num_pages=v_cache.shape[0], max_pages=block_table.shape[1])
        max_len = block_table.shape[1] * max_len
    tile_reads = sum(tm.tile_reads for tm in (score_tm, mask_tm) if tm is not None)
    kind = device_kind
    if kind is None:
        kind = jax.devices()[0].device_kind if not interpret else "cpu-interpret"
    groups = q_heads // kv_heads
    rows = groups * q_len
    cfg, block_rows = launch_config(config, d, dv, q.dtype, kind, rows=rows, max_len=max_len,
                                    page_size=paging.get("page_size", 0), tile_reads=tile_reads)
    row_blocks = _cdiv(rows, block_rows)
    tiles = _cdiv(max_len, cfg.block_kv)
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_len, config=cfg, row_blocks=row_blocks,
                                       device_kind=None if interpret else kind)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
        raise ValueError(f"decode_attention_pallas: num_splits must be None or a positive int, got {num_splits!r}")
    num_splits = int(num_splits)
    # Splits beyond one per tile would be empty: the same result with fewer programs.
    tiles_per_split = _cdiv(tiles, min(num_splits, tiles))
    splits = _cdiv(tiles, tiles_per_split)
    # The last split of a group merges its partials in the kernel when they are small enough for one program
    # to read back quickly (H200: docs/PERF_NOTES.md, decode "merge"); else the fused XLA merge_splits.
    merge_rows = min(block_rows, pow2(rows))
    fused = splits > 1 and splits * merge_rows * _padded(dv) * 4 <= cfg.merge_in_kernel_kb * 1024
    launch_rows = min(cfg.merge_kernel_rows, pow2(rows)) if splits > 1 and not fused else 0   # second launch merges
    st = _Static(config=cfg, block_rows=block_rows, row_blocks=row_blocks, splits=splits,
                 tiles_per_split=tiles_per_split, scale=scale, score_mod=score_tm, mask_mod=mask_tm,
                 interpret=bool(interpret), merge_in_kernel=fused, merge_rows=merge_rows,
                 nan_guard=bool(nan_outside_lens) and (fused or splits == 1 or launch_rows > 0),
                 merge_launch_rows=launch_rows, **paging)
    captured = tuple(jnp.asarray(c) for tm in (score_tm, mask_tm) if tm is not None for c in tm.captured)
    n_score_cap = score_tm.num_captured if score_tm is not None else 0
    out, lse = _decode_call(st, q, k_cache, v_cache, kv_lens, captured, n_score_cap, block_table)
    return out, lse, splits > 1 and not fused and not launch_rows
