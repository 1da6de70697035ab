"""Flash-attention forward for flex_attention: a Pallas kernel (Triton lowering), its pallas_call wrapper,
the custom_vjp and the entry point :func:`flex_attention_pallas`.

One program per (query head h, query tile, batch b) owns ``block_q`` query rows and runs the online softmax
over the KV tiles its block-mask row lists: first the full tiles (no mask_mod), then the partial ones
(mask_mod evaluated on the tile); empty tiles are never visited. The tile lists are int32 refs read inside
the kernel, so the trip counts are data dependent and K/V are sliced with
``_tiles.ds(pl.multiple_of(idx * block_kv, block_kv), block_kv)``. The leading run of consecutive full tiles
(all of them for causal, sliding-window and document masks) is stepped by address arithmetic instead of
index loads, so Triton pipelines it like a dense loop (index loads cost 25% on the H200).

GQA is native: query head h reads KV head h // G through the BlockSpec index map, so K/V are never
repeated in memory. Heads are the fastest grid axis, so the G programs that share a KV head run side by
side and read each K/V tile from L2.

Statistics are float32; p = exp2(s * scale * log2 e - m) is one FMA and one ex2; lse is returned in
natural log for the backward. Fully masked rows give output 0 and lse -inf (see ``_tiles.softmax_update``).
Head dims are padded to the next power of two inside the kernel (masked loads, masked stores) and
sequence edges are masked, so any Lq, Lkv and head dims 16..256 work without padding in memory.

Paged K/V (``block_table``, see ``flashlax.paged``): the K/V refs are the pool's pages of the program's KV
head and the sequence's block-table row is an int32 ref; each KV tile is loaded from its page
(``_tiles.kv_tile_view``), nothing is gathered in memory. ``kv_lens`` (per-sequence key counts) bounds the
K/V loads, so rows past a sequence's end are never read. The backward of a paged call gathers the pages
into contiguous K/V (XLA), runs the backward kernels and scatter-adds dK/dV into the pool (a page shared by
several sequences gets the sum).

``return_max``: a third output, the row maximum of the modded, masked scores (natural units, -inf for
fully masked rows), from the online softmax's running max; it carries no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax import masks as masks_lib
from flashlax import paged
from flashlax.fallbacks.attention import broadcast_kv_batch, mask_extent
from flashlax.kernels import _tiles
from flashlax.kernels._tiles import TileMod, pow2
from flashlax.kernels.configs import (FlashConfig, check_config, flash_config, parse_kernel_options,
                                     shrink_to_fit, smem_limit)
from flashlax.parallel.vma import cotangent_like, out_struct

_SUPPORTED_TILES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """Everything about one call that is not an array (a custom_vjp nondiff argument)."""

    config: FlashConfig
    scale: float
    score_mod: TileMod | None
    mask_mod: TileMod | None
    n_score_cap: int
    has_block_mask: bool
    return_lse: bool
    interpret: bool
    reverse_q: bool
    pack: int = 1          # query heads per program: 1 (grid over Hq) or G (a KV group shares K/V loads)
    kv_sub: int = 1        # kernel KV tiles per block-mask KV tile (block_mask.block_kv // config.block_kv)
    return_max: bool = False
    page_size: int = 0     # > 0: paged K/V [num_pages, Hkv, page_size, D] read through the block table
    num_pages: int = 0
    max_pages: int = 0
    has_kv_lens: bool = False
    bwd_config: Any = None  # a BwdConfig from kernel_options, or None (the backward's default)


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, st: _Static, n_cap: int, lq: int, lkv: int, d: int, dv: int, nq: int, nkv: int):
    cfg = st.config
    bq, bkv = cfg.block_q, cfg.block_kv
    q_ref, k_ref, v_ref = refs[:3]
    pos = 3
    pages = kv_limit = None
    if st.page_size:
        pages = _tiles.Pages(refs[pos], st.page_size, st.num_pages, st.max_pages)
        pos += 1
    if st.has_kv_lens:
        kv_limit = jnp.clip(refs[pos][0], 0, lkv)       # this sequence's keys: loads stop there
        pos += 1
    if st.has_block_mask:
        kv_num_ref, kv_idx_ref, full_num_ref, full_idx_ref, full_first_ref, full_run_ref = refs[pos:pos + 6]
        pos += 6
    cap_refs = refs[pos:pos + n_cap]
    o_ref, lse_ref, *max_ref = refs[pos + n_cap:]
    score_caps, mask_caps = cap_refs[:st.n_score_cap], cap_refs[st.n_score_cap:]

    gp = st.pack                          # query heads per program (1: one head, G: a whole KV group)
    bqh = bq // gp                        # query rows per head
    # grid (heads, query tiles, batch), or (query tiles, heads, batch) with cfg.q_major
    h_pid, iq = (pl.program_id(1), pl.program_id(0)) if cfg.q_major else (pl.program_id(0), pl.program_id(1))
    if st.reverse_q:                       # heaviest (causal: longest) rows first
        iq = nq - 1 - iq
    b = pl.program_id(2)
    dp, dvp = pow2(d), pow2(dv)
    q_start = pl.multiple_of(iq * bqh, bqh)
    if gp == 1:
        h = h_pid
        q = _tiles.load_tile(q_ref, q_start, bq, lq, dp, d, aligned=True)
        q_idx = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    else:
        # Rows g * bqh + i hold query i of head hkv * G + g: one K/V tile load serves the whole group.
        row = lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        h = h_pid * gp + row // bqh
        q_idx = q_start + row % bqh
        q = plgpu.load(q_ref.at[:, _tiles.ds(q_start, bqh), _tiles.ds(0, dp)], mask=_mask3(gp, q_start, bqh, lq, dp, d),
                       other=0.0).reshape(bq, dp)
    precision = _tiles.dot_precision(q.dtype)
    # A block-mask tile spans `sub` kernel KV tiles. When Lkv is not a multiple of the mask tile, the last
    # mask tile's sub-tiles may lie wholly past Lkv: they load masked and their columns get -inf.
    sub = st.kv_sub
    kv_ragged = lkv % (bkv * sub) != 0
    kv_aligned = sub == 1 or not kv_ragged
    # Base-2 factor of the scores, folded into the exponent's FMA (_tiles.softmax_update).
    mult = _tiles.exponent_factor(st.scale, st.score_mod is not None)

    def visit(kv_tile, carry, masked: bool):
        m_prev, l_prev, acc_prev = carry
        kv_start = pl.multiple_of(kv_tile * bkv, bkv)
        n_rows, aligned = (lkv, kv_aligned) if kv_limit is None else (kv_limit, False)
        k = _tiles.load_tile(k_ref, kv_start, bkv, n_rows, dp, d, aligned=aligned, pages=pages)
        v = _tiles.load_tile(v_ref, kv_start, bkv, n_rows, dvp, dv, aligned=aligned, pages=pages)
        qk = _tiles.dot_nt(q, k, precision)
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
        # s: scores in units that `mult` turns into base-2 exponents (raw q.k when scale > 0).
        s = _tiles.kernel_scores(qk, st.scale, st.score_mod, score_caps, b, h, q_idx, kv_idx)
        if kv_ragged:
            s = s + _tiles.kv_edge_bias(kv_start, bkv, lkv)
        if masked:
            allowed = st.mask_mod(mask_caps, b, h, q_idx, kv_idx)
            s = jnp.where(allowed, s, -jnp.inf)
        p, alpha, m_new, l_new = _tiles.softmax_update(s, m_prev, l_prev, mult, st.interpret)
        acc = acc_prev * alpha[:, None] + _tiles.dot_nn(p.astype(v.dtype), v, precision)
        return m_new, l_new, acc

    def listed(idx_ref, j):
        # kernel tile j of a list of mask tiles: sub-tile j % sub of mask tile idx_ref[j // sub] (j >= 0, so
        # lax.div / lax.rem: jnp's floor division adds a sign fix-up the Triton lowering rejects)
        return idx_ref[j] if sub == 1 else idx_ref[lax.div(j, sub)] * sub + lax.rem(j, sub)

    carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
             jnp.zeros((bq, dvp), jnp.float32))
    if st.has_block_mask:
        # Full tiles: the leading run of consecutive tile indices (all of them for causal, sliding-window
        # and document masks) is visited by address arithmetic, which Triton software-pipelines like a
        # dense loop; only the rest of the list, if any, is read through the index ref.
        first, run = full_first_ref[0] * sub, full_run_ref[0] * sub
        carry = lax.fori_loop(0, run, lambda j, c: visit(first + j, c, masked=False), carry)
        carry = lax.fori_loop(run, full_num_ref[0] * sub,
                              lambda j, c: visit(listed(full_idx_ref, j), c, masked=False), carry)
        if st.mask_mod is not None:
            def partial_body(j, c):
                return visit(listed(kv_idx_ref, j), c, masked=True)

            carry = lax.fori_loop(0, kv_num_ref[0] * sub, partial_body, carry)
    else:
        carry = lax.fori_loop(0, nkv, lambda j, c: visit(j, c, masked=False), carry)

    m, l, acc = carry
    out, lse = _tiles.softmax_finalize(acc, m, l, mult)
    # The running max is in the units `mult` turns into base-2 exponents: natural scores are m * mult * ln 2.
    rows = [(lse_ref, lse)] + [(r, m * (mult * _tiles.LN2)) for r in max_ref]
    if gp == 1:
        _tiles.store_tile(o_ref, q_start, out, lq, dv, aligned=True)
        for ref, val in rows:
            _tiles.store_vec(ref, q_start, val, lq)
    else:
        plgpu.store(o_ref.at[:, _tiles.ds(q_start, bqh), _tiles.ds(0, dvp)], out.reshape(gp, bqh, dvp).astype(o_ref.dtype),
                    mask=_mask3(gp, q_start, bqh, lq, dvp, dv))
        rows_ok = jnp.broadcast_to(_tiles.row_mask(q_start, bqh, lq)[None, :], (gp, bqh))
        for ref, val in rows:
            plgpu.store(ref.at[:, _tiles.ds(q_start, bqh)], val.reshape(gp, bqh), mask=rows_ok)


def _mask3(gp, start, rows, n_rows, cols, n_cols):
    """bool [gp, rows, cols]: in-range rows (start + i < n_rows) and columns (< n_cols) of a head group."""
    ok = _tiles.row_mask(start, rows, n_rows)[None, :, None] & (jnp.arange(cols) < n_cols)[None, None, :]
    return jnp.broadcast_to(ok, (gp, rows, cols))


def _forward_call(st: _Static, q, k, v, bm: masks_lib.BlockMask | None, captured, paging=(None, None)):
    """pallas_call of the forward. Returns (out [B, Hq, Lq, Dv] q.dtype, lse [B, Hq, Lq] float32), and the
    row maximum [B, Hq, Lq] float32 with ``st.return_max``. ``paging``: (block_table int32 [B, max_pages] or
    None, kv_lens int32 [B] or None); with a block table, k and v are pages [num_pages, Hkv, page_size, D]."""
    block_table, kv_lens = paging
    bsz, hq, lq, d = q.shape
    _, hkv, lkv, dv = v.shape
    if block_table is not None:
        lkv = st.max_pages * st.page_size
    groups = hq // hkv
    cfg = st.config
    gp = st.pack
    nq, nkv = pl.cdiv(lq, cfg.block_q // gp), pl.cdiv(lkv, cfg.block_kv)
    dp, dvp = pow2(d), pow2(dv)
    rev = (lambda i: nq - 1 - i) if st.reverse_q else (lambda i: i)
    kv_head = (lambda h: h // groups) if gp == 1 else (lambda h: h)
    qh = None if gp == 1 else gp

    def _spec(block, index_map):
        # index maps are written for grid (h, i, b); cfg.q_major launches (i, h, b)
        return pl.BlockSpec(block, (lambda i, h, b: index_map(h, i, b)) if cfg.q_major else index_map)

    if block_table is None:
        kv_spec = lambda cols: _spec((None, None, lkv, cols), lambda h, i, b: (b, kv_head(h), 0, 0))  # noqa: E731
    else:   # the whole pool of the program's KV head; pages are looked up in the kernel
        kv_spec = lambda cols: _spec((st.num_pages, None, st.page_size, cols),  # noqa: E731
                                     lambda h, i, b: (0, kv_head(h), 0, 0))
    in_specs = [_spec((None, qh, lq, dp), lambda h, i, b: (b, h, 0, 0)), kv_spec(dp), kv_spec(dvp)]
    args = [q, k, v]
    if block_table is not None:
        in_specs.append(_spec((None, st.max_pages), lambda h, i, b: (b, 0)))
        args.append(block_table)
    if kv_lens is not None:
        in_specs.append(_spec((1,), lambda h, i, b: (b,)))
        args.append(kv_lens)
    if st.has_block_mask:
        bm_dep, hm_dep = bm.kv_num_blocks.shape[0] > 1, bm.kv_num_blocks.shape[1] > 1
        sel_b = (lambda b: b) if bm_dep else (lambda b: 0)
        sel_h = (lambda h: h) if hm_dep else (lambda h: 0)
        num_spec = _spec((None, None, 1), lambda h, i, b: (sel_b(b), sel_h(h), rev(i)))
        n_mask_kv = bm.kv_indices.shape[-1]
        idx_spec = _spec((None, None, None, n_mask_kv), lambda h, i, b: (sel_b(b), sel_h(h), rev(i), 0))
        in_specs += [num_spec, idx_spec, num_spec, idx_spec, num_spec, num_spec]
        args += [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                 *_tiles.leading_run(bm.full_kv_num_blocks, bm.full_kv_indices)]
    in_specs += _tiles.captured_specs(captured)
    args += list(captured)

    kernel = functools.partial(_fwd_kernel, st=st, n_cap=len(captured), lq=lq, lkv=lkv, d=d, dv=dv, nq=nq, nkv=nkv)
    n_rows_out = 2 if st.return_max else 1           # lse, and the row max
    outs = pl.pallas_call(
        kernel,
        grid=(nq, hq // gp, bsz) if cfg.q_major else (hq // gp, nq, bsz),
        in_specs=in_specs,
        out_specs=[_spec((None, qh, lq, dvp), lambda h, i, b: (b, h, 0, 0))]
        + [_spec((None, qh, lq), lambda h, i, b: (b, h, 0))] * n_rows_out,
        out_shape=[out_struct((bsz, hq, lq, dv), q.dtype, *args)]
        + [out_struct((bsz, hq, lq), jnp.float32, *args)] * n_rows_out,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=st.interpret,
        name="flex_attention_fwd",
    )(*args)
    return tuple(outs)


# ----------------------------------------------------------------------------------------------------
# custom_vjp
# ----------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, bm, captured, paging):
    return _forward_call(st, q, k, v, bm, captured, paging)


def _flash_fwd(st, q, k, v, bm, captured, paging):
    outs = _forward_call(st, q, k, v, bm, captured, paging)
    return outs, (q, k, v, bm, captured, paging, outs[0], outs[1])


def _flash_bwd(st, res, cts):
    q, k_in, v_in, bm, captured, paging, out, lse = res
    dout, dlse = cts[:2]                       # the row maximum (cts[2]) carries no gradient
    block_table, kv_lens = paging
    k, v, pages_vjp = k_in, v_in, None
    if block_table is not None:
        # Paged K/V: the backward kernels take contiguous K/V, so the pages are gathered here (rows past
        # kv_lens zeroed: whatever they hold cannot reach dQ) and dK/dV go back to the pool by the gather's
        # transpose, a scatter-add (shared pages sum the gradients of their sequences).
        def contiguous(kp, vp):
            kc, vc = paged.gather_pages(kp, block_table), paged.gather_pages(vp, block_table)
            return (kc, vc) if kv_lens is None else (paged.zero_past(kc, kv_lens), paged.zero_past(vc, kv_lens))

        (k, v), pages_vjp = jax.vjp(contiguous, k_in, v_in)
    if st.return_lse or _kernel_bwd() is None:
        # lse cotangents (or no backward kernel module): vjp of the blockwise XLA path, which returns
        # the same (out, lse) and differentiates through lse as well.
        dq, dk, dv, dcap = _xla_vjp(st, q, k, v, bm, captured, dout, dlse)
    else:
        dq, dk, dv, dcap = _kernel_vjp(st, q, k, v, bm, captured, out, lse, dout)
    if pages_vjp is not None:
        dk, dv = pages_vjp((dk, dv))
    dcap = tuple(None if not _is_float(c) else cotangent_like(g, c) for c, g in zip(captured, dcap))
    return cotangent_like(dq, q), cotangent_like(dk, k_in), cotangent_like(dv, v_in), None, dcap, (None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _kernel_bwd():
    try:
        from flashlax.kernels.flash_attention_bwd import flash_attention_bwd
    except ImportError:
        return None
    return flash_attention_bwd


def _split_mods(st: _Static):
    """Closure-converted mods in the backward module's convention: captured arrays first."""
    ns = st.n_score_cap
    score = None if st.score_mod is None else (lambda *a: st.score_mod(a[:ns], *a[ns:]))
    nm = 0 if st.mask_mod is None else st.mask_mod.num_captured
    mask = None if st.mask_mod is None else (lambda *a: st.mask_mod(a[:nm], *a[nm:]))
    return score, mask


def _kernel_vjp(st, q, k, v, bm, captured, out, lse, dout):
    score, mask = _split_mods(st)
    # bm None (no mask): the backward runs its dense loops (static trip counts, no index arrays).
    caps = {"score": tuple(captured[:st.n_score_cap]), "mask": tuple(captured[st.n_score_cap:])}
    dq, dk, dv, dcap = _kernel_bwd()(q, k, v, out, lse, dout, block_mask=bm, score_mod=score,
                                     mask_mod=mask, captured=caps, scale=st.scale, config=st.bwd_config,
                                     interpret=st.interpret)
    return dq, dk, dv, tuple(dcap["score"]) + tuple(dcap["mask"])


def _xla_vjp(st, q, k, v, bm, captured, dout, dlse):
    from flashlax.fallbacks.attention import flex_attention_xla

    def f(q, k, v, caps):
        score, mask = _bound_mods(st, caps)
        return flex_attention_xla(q, k, v, score_mod=score, mask_mod=mask, block_mask=bm if mask else None,
                                  scale=st.scale, return_lse=True)

    _, pullback = jax.vjp(f, q, k, v, tuple(captured))
    dq, dk, dv, dcap = pullback((dout, dlse))
    return dq, dk, dv, dcap


def _bound_mods(st: _Static, caps):
    """Plain mods (b, h, q_idx, kv_idx conventions) reading ``caps`` in place of the captured arrays."""
    ns = st.n_score_cap
    score = None if st.score_mod is None else (
        lambda s, b, h, qi, ki: st.score_mod(caps[:ns], s, b, h, qi, ki))
    mask = None if st.mask_mod is None else (
        lambda b, h, qi, ki: st.mask_mod(caps[ns:], b, h, qi, ki))
    return score, mask


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(f"flex_attention_pallas: {name} must be [B, H, L, D], got shape {jnp.shape(x)} "
                             f"(q {jnp.shape(q)}, k {jnp.shape(k)}, v {jnp.shape(v)})")
    (bsz, hq, _, d), (bk, hkv, lkv, dk), (bv, hv, lv, _) = q.shape, k.shape, v.shape
    if not (bsz == bk == bv and hkv == hv and lkv == lv and d == dk) or hkv == 0 or hq % hkv:
        raise ValueError(f"flex_attention_pallas: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape} "
                         "(need q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv], Hq % Hkv == 0)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"flex_attention_pallas: q, k, v must share one dtype of float32/bfloat16/float16, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype} (shapes {q.shape}, {k.shape}, {v.shape})")
    if max(d, v.shape[-1]) > 256 or min(d, v.shape[-1]) < 1:
        raise ValueError(f"flex_attention_pallas: head dims must be 1..256, got q {q.shape}, v {v.shape}")


def _resolve_block_mask(block_mask, mask_mod, cfg: FlashConfig, pack: int, bsz, hq, lq, lkv, fits: Callable,
                        fixed_tiles: bool = False):
    """Returns (block_mask or None, config, kv_sub): a block mask whose query tiles are the kernel's
    (block_q // pack rows per head) and whose KV tiles each span ``kv_sub`` kernel KV tiles.

    A block mask's KV tiles may be a multiple of the kernel's (the H200 D128 forward steps 64 keys inside
    the default 128-key mask tiles); a mask built here uses KV tiles of at least 128 keys (create_block_mask's
    default, which the backward's tiles are tuned for), fewer only for short sequences. ``fixed_tiles``:
    the config's tiles were chosen by the caller (kernel_options) and a block mask must fit them."""
    def build(b_dim, h_dim):
        mask_kv = max(cfg.block_kv, min(masks_lib.DEFAULT_BLOCK, pow2(lkv)))
        bm = masks_lib.create_block_mask(mask_mod, b_dim, h_dim, lq, lkv, block_q=cfg.block_q // pack,
                                         block_kv=mask_kv)
        return bm, cfg, mask_kv // cfg.block_kv

    if block_mask is None:
        if mask_mod is None:
            return None, cfg, 1
        return build(*mask_extent(mask_mod, bsz, hq))
    tiles = (block_mask.block_q, block_mask.block_kv)
    if fixed_tiles:
        if tiles[0] * pack == cfg.block_q and tiles[1] % cfg.block_kv == 0:
            return block_mask, cfg, tiles[1] // cfg.block_kv
    elif tiles[0] * pack in _SUPPORTED_TILES and tiles[1] in _SUPPORTED_TILES:
        kv = cfg.block_kv if tiles[1] % cfg.block_kv == 0 else tiles[1]
        tuned = dataclasses.replace(cfg, block_q=tiles[0] * pack, block_kv=kv)
        if fits(tuned):
            return block_mask, tuned, tiles[1] // kv
    if mask_mod is None:
        raise ValueError(f"flex_attention_pallas: block_mask tiles {tiles} are not a supported kernel tile "
                         f"(powers of two 16..256 within the shared-memory budget{', or the kernel_options tiles' if fixed_tiles else ''}) "
                         f"and there is no mask_mod to rebuild it with tiles ({cfg.block_q // pack}, {cfg.block_kv})")
    return build(*mask_extent(mask_mod, bsz, hq))


def _kernel_config(d, dv, dtype, kind, lkv, lq, groups, dense: bool, tile_reads: int, config, options):
    """The forward config: ``config`` as given, else the device's default (shrunk to fit, tiles clipped to
    tiny inputs) with ``options`` (parsed kernel_options) applied on top and checked against the device's
    shared memory (ValueError naming kernel_options)."""
    if config is not None:
        check_config(config, d, dv, dtype, kind, tile_reads=tile_reads)
        return config
    cfg = shrink_to_fit(flash_config(d, dv, dtype, kind, lkv if dense else None), d, dv, dtype, kind, tile_reads)
    # Do not launch tiles far longer than the sequence (tiny inputs).
    rows = max(16, pow2(lq) * (groups if cfg.pack_gqa else 1))
    cfg = dataclasses.replace(cfg, block_q=min(cfg.block_q, rows), block_kv=min(cfg.block_kv, max(16, pow2(lkv))))
    if options.fwd:
        cfg = dataclasses.replace(cfg, **options.fwd)
        try:
            check_config(cfg, d, dv, dtype, kind, tile_reads=tile_reads)
        except ValueError as err:
            raise ValueError(f"flex_attention: kernel_options {options.fwd} do not fit this device: {err}") from None
    return cfg


def _bwd_config(d, dv, dtype, kind, dense: bool, options):
    """A BwdConfig from kernel_options (None: the backward's own default), checked against shared memory."""
    if not options.bwd:
        return None
    from flashlax.kernels.flash_attention_bwd import default_bwd_config

    bwd = dataclasses.replace(default_bwd_config(d, dv, dtype, kind, dense=dense), **options.bwd)
    try:
        bwd.check_smem(d, dv, jnp.dtype(dtype).itemsize, smem_limit(kind))
    except ValueError as err:
        raise ValueError(f"flex_attention: kernel_options {options.bwd} (backward) do not fit this device: "
                         f"{err}") from None
    return bwd


def _paging(q, k, v, block_table, kv_lens):
    """(k, v, Lkv, the _Static paging fields, block_table, kv_lens): K/V of batch 1 broadcast, or a paged
    cache's pages checked against its block table; kv_lens int32 clipped to [0, Lkv]."""
    if block_table is None:
        k, v = broadcast_kv_batch(q, k, v)    # K/V of batch 1 (FlexAttention broadcasts them)
        _check_inputs(q, k, v)
        lkv, paging = k.shape[2], {}
    else:
        block_table = paged.check_block_table("flex_attention_pallas", block_table, k, v, q.shape[0], kv_lens)
        lkv = block_table.shape[1] * k.shape[2]
        logical = lambda x: jax.ShapeDtypeStruct((q.shape[0], x.shape[1], lkv, x.shape[3]), x.dtype)  # noqa: E731
        _check_inputs(q, logical(k), logical(v))
        paging = dict(page_size=k.shape[2], num_pages=k.shape[0], max_pages=block_table.shape[1])
    if kv_lens is not None:
        kv_lens = jnp.clip(jnp.asarray(kv_lens), 0, lkv).astype(jnp.int32)
    return k, v, lkv, paging, block_table, kv_lens


def _setup(q, k, v, lkv, paging, score_mod, mask_mod, block_mask, scale, *, return_lse, return_max, has_kv_lens,
           interpret, options, config, device_kind):
    """Config, block mask and traced mods of one call: ``(st, bm, captured)``, or None when a mod needs the
    XLA path (it reads a captured array other than point-wise)."""
    bsz, hq, lq, d = q.shape
    dv = v.shape[-1]
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    tile_mods = _tiles.make_tile_mods(score_mod, mask_mod)    # captured arrays become kernel inputs
    if tile_mods is None:
        return None
    score_tm, mask_tm = tile_mods
    tile_reads = sum(tm.tile_reads for tm in (score_tm, mask_tm) if tm is not None)
    kind = device_kind
    if kind is None:
        kind = jax.devices()[0].device_kind if not interpret else "cpu-interpret"
    groups = hq // k.shape[1]
    dense = block_mask is None and mask_mod is None
    cfg = _kernel_config(d, dv, q.dtype, kind, lkv, lq, groups, dense, tile_reads, config, options)

    def fits(c):
        try:
            check_config(c, d, dv, q.dtype, kind, tile_reads=tile_reads)
            return True
        except ValueError:
            return False

    if block_mask is not None:
        if not isinstance(block_mask, masks_lib.BlockMask):
            raise ValueError(f"flex_attention_pallas: block_mask must be a BlockMask or None, got "
                             f"{type(block_mask).__name__}")
        bm_b, bm_h, bm_q, bm_kv = block_mask.shape
        if bm_q != lq or bm_kv != lkv or bm_b not in (1, bsz) or bm_h not in (1, hq):
            raise ValueError(f"flex_attention_pallas: block_mask of shape {block_mask.shape} does not fit "
                             f"q {q.shape}, k {k.shape} (needs (1 or B, 1 or Hq, Lq, Lkv={lkv}))")
        head_dep = bm_h > 1
    else:
        head_dep = mask_mod is not None and mask_extent(mask_mod, bsz, hq)[1] is not None
    pack = groups if (cfg.pack_gqa and groups > 1 and groups & (groups - 1) == 0
                      and cfg.block_q // groups >= 16 and not head_dep) else 1
    bm, cfg, kv_sub = _resolve_block_mask(block_mask, mask_mod, cfg, pack, bsz, hq, lq, lkv, fits,
                                          fixed_tiles=config is None and options.fixed_tiles)
    if bm is None:
        mask_tm = None          # no block mask means no mask: every tile is full
    captured = tuple(jnp.asarray(c) for c in (score_tm.captured if score_tm else ())) + \
        tuple(jnp.asarray(c) for c in (mask_tm.captured if mask_tm else ()))
    st = _Static(config=cfg, scale=scale, score_mod=score_tm, mask_mod=mask_tm,
                 n_score_cap=score_tm.num_captured if score_tm else 0, has_block_mask=bm is not None,
                 return_lse=bool(return_lse), interpret=bool(interpret),
                 reverse_q=bm is not None, pack=pack, kv_sub=kv_sub, return_max=bool(return_max),
                 has_kv_lens=has_kv_lens, bwd_config=_bwd_config(d, dv, q.dtype, kind, bm is None, options),
                 **paging)
    return st, bm, captured


def flex_attention_pallas(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale=None,
                          return_lse=False, return_max=False, block_table=None, kv_lens=None,
                          interpret=False, kernel_options=None, config: FlashConfig | None = None,
                          device_kind: str | None = None):
    """Flash attention with flex mods, Pallas/Triton kernel.

    q: [B, Hq, Lq, D], k: [B, Hkv, Lkv, D], v: [B, Hkv, Lkv, Dv], Hq % Hkv == 0 (query head h reads KV
    head h // (Hq // Hkv)). score_mod(score, b, h, q_idx, kv_idx), mask_mod(b, h, q_idx, kv_idx);
    block_mask: a BlockMask (its tiles become the kernel's tiles when supported, else it is rebuilt from
    the mask_mod) or None. Returns out [B, Hq, Lq, Dv] in q's dtype, or (out, lse [B, Hq, Lq] float32), or
    with ``return_max`` (out, lse, row max of the scores [B, Hq, Lq] float32, no gradient).
    block_table: int [B, max_pages] for paged K/V (k, v are then pages [num_pages, Hkv, page_size, D];
    Lkv = max_pages * page_size; ``flashlax.paged``). kv_lens: int [B] or None; K/V rows at or past
    kv_lens[b] are never loaded (the mask that hides them is the caller's mask_mod).
    ``kernel_options``: PyTorch FlexAttention's names for the config (configs.KERNEL_OPTIONS), applied on top
    of the default config; ``config``: a whole FlashConfig instead (default: :func:`flash_config` for the
    device kind, head dims and dtype). Differentiable in q, k (or its pages), v and float arrays captured
    by the mods.
    """
    options = parse_kernel_options(kernel_options)
    k, v, lkv, paging, block_table, kv_lens = _paging(q, k, v, block_table, kv_lens)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    prep = _setup(q, k, v, lkv, paging, score_mod, mask_mod, block_mask, scale, return_lse=return_lse,
                  return_max=return_max, has_kv_lens=kv_lens is not None, interpret=interpret, options=options,
                  config=config, device_kind=device_kind)
    if prep is None:            # a mod the kernel cannot evaluate on tiles: the blockwise XLA path
        from flashlax.fallbacks.attention import flex_attention_xla
        if block_table is not None:
            k, v = (paged.gather_pages(x, block_table) for x in (k, v))
        if kv_lens is not None:
            k, v = (paged.zero_past(x, kv_lens) for x in (k, v))
        return flex_attention_xla(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                  scale=scale, return_lse=return_lse, return_max=return_max)
    st, bm, captured = prep
    outs = _flash(st, q, k, v, bm, captured, (block_table, kv_lens))
    if return_max:
        return outs[0], outs[1], lax.stop_gradient(outs[2])
    return (outs[0], outs[1]) if return_lse else outs[0]


def kernel_passes(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale, return_lse=False,
                  interpret=False):
    """The kernels of one call as two passes, without the custom_vjp (what ring attention runs per K/V
    block): ``(forward, backward, score_consts)`` as :func:`flashlax.fallbacks.attention.blockwise_passes`,
    whose passes it returns when a mod needs the XLA path."""
    kb, vb, lkv, paging, _, _ = _paging(q, k, v, None, None)
    prep = _setup(q, kb, vb, lkv, paging, score_mod, mask_mod, block_mask, float(scale), return_lse=return_lse,
                  return_max=False, has_kv_lens=False, interpret=interpret, options=parse_kernel_options(None),
                  config=None, device_kind=None)
    if prep is None:
        from flashlax.fallbacks.attention import blockwise_passes
        return blockwise_passes(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                scale=scale)
    st, bm, captured = prep
    score_consts = captured[:st.n_score_cap]

    def forward():
        return _forward_call(st, q, kb, vb, bm, captured)

    if return_lse or _kernel_bwd() is None:
        # The backward kernels take no lse cotangent: the XLA path's backward, from the same out and lse.
        from flashlax.fallbacks.attention import blockwise_passes
        _, xla_backward, xla_consts = blockwise_passes(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                       block_mask=block_mask, scale=st.scale)

        def backward(out, lse, dout, dlse):
            dq, dk, dv, d_xla = xla_backward(out, lse, dout, dlse)
            return dq, dk, dv, tuple(next((g for x, g in zip(xla_consts, d_xla) if x is c), jnp.zeros_like(c))
                                     for c in score_consts)

        return forward, backward, score_consts

    def backward(out, lse, dout, dlse):
        dq, dk, dv, _, dcap, _ = _flash_bwd(st, (q, kb, vb, bm, captured, (None, None), out.astype(q.dtype), lse),
                                            (dout.astype(q.dtype), dlse))
        if k.shape[0] != kb.shape[0]:    # K/V of batch 1 broadcast over the batch
            dk, dv = dk.sum(0, keepdims=True), dv.sum(0, keepdims=True)
        d_score = tuple(jnp.zeros_like(c) if g is None else g for c, g in zip(score_consts, dcap))
        return dq, dk, dv, d_score

    return forward, backward, score_consts
