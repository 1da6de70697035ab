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
from flashlax.fallbacks.attention import broadcast_kv_batch, mask_extent
from flashlax.kernels import _tiles
from flashlax.kernels._tiles import LOG2E, TileMod, pow2
from flashlax.kernels.configs import FlashConfig, check_config, flash_config, shrink_to_fit
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


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, st: _Static, n_cap: int, lq: int, lkv: int, d: int, dv: int, nq: int, nkv: int):
    cfg = st.config
    bq, bkv = cfg.block_q, cfg.block_kv
    q_ref, k_ref, v_ref = refs[:3]
    pos = 3
    if st.has_block_mask:
        kv_num_ref, kv_idx_ref, full_num_ref, full_idx_ref, full_first_ref, full_run_ref = refs[3:9]
        pos = 9
    cap_refs = refs[pos:pos + n_cap]
    o_ref, lse_ref = refs[pos + n_cap:]
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
    # Base-2 factor of the scores, folded into the exponent's FMA (_tiles.softmax_update); the running
    # max is taken on the unscaled scores, so the factor must be positive.
    if st.score_mod is None:
        mult = st.scale * LOG2E if st.scale > 0 else 1.0
    else:
        mult = LOG2E

    def visit(kv_tile, carry, masked: bool):
        m_prev, l_prev, acc_prev = carry
        kv_start = pl.multiple_of(kv_tile * bkv, bkv)
        k = _tiles.load_tile(k_ref, kv_start, bkv, lkv, dp, d, aligned=kv_aligned)
        v = _tiles.load_tile(v_ref, kv_start, bkv, lkv, dvp, dv, aligned=kv_aligned)
        qk = _tiles.dot_nt(q, k, precision)
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
        # s: scores in units that `mult` turns into base-2 exponents (raw q.k when scale > 0).
        if st.score_mod is None:
            s = qk if st.scale > 0 else qk * (st.scale * LOG2E)
        else:
            s = st.score_mod(score_caps, qk * st.scale, b, h, q_idx, kv_idx)
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
    if gp == 1:
        _tiles.store_tile(o_ref, q_start, out, lq, dv, aligned=True)
        _tiles.store_vec(lse_ref, q_start, lse, lq)
    else:
        plgpu.store(o_ref.at[:, _tiles.ds(q_start, bqh), _tiles.ds(0, dvp)], out.reshape(gp, bqh, dvp).astype(o_ref.dtype),
                    mask=_mask3(gp, q_start, bqh, lq, dvp, dv))
        rows_ok = jnp.broadcast_to(_tiles.row_mask(q_start, bqh, lq)[None, :], (gp, bqh))
        plgpu.store(lse_ref.at[:, _tiles.ds(q_start, bqh)], lse.reshape(gp, bqh), mask=rows_ok)


def _mask3(gp, start, rows, n_rows, cols, n_cols):
    """bool [gp, rows, cols]: in-range rows (start + i < n_rows) and columns (< n_cols) of a head group."""
    ok = _tiles.row_mask(start, rows, n_rows)[None, :, None] & (jnp.arange(cols) < n_cols)[None, None, :]
    return jnp.broadcast_to(ok, (gp, rows, cols))


def _forward_call(st: _Static, q, k, v, bm: masks_lib.BlockMask | None, captured):
    """pallas_call of the forward. Returns (out [B, Hq, Lq, Dv] q.dtype, lse [B, Hq, Lq] float32)."""
    bsz, hq, lq, d = q.shape
    _, hkv, lkv, dv = v.shape
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

    in_specs = [
        _spec((None, qh, lq, dp), lambda h, i, b: (b, h, 0, 0)),
        _spec((None, None, lkv, dp), lambda h, i, b: (b, kv_head(h), 0, 0)),
        _spec((None, None, lkv, dvp), lambda h, i, b: (b, kv_head(h), 0, 0)),
    ]
    args = [q, k, v]
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
    out, lse = pl.pallas_call(
        kernel,
        grid=(nq, hq // gp, bsz) if cfg.q_major else (hq // gp, nq, bsz),
        in_specs=in_specs,
        out_specs=[_spec((None, qh, lq, dvp), lambda h, i, b: (b, h, 0, 0)),
                   _spec((None, qh, lq), lambda h, i, b: (b, h, 0))],
        out_shape=[out_struct((bsz, hq, lq, dv), q.dtype, *args),
                   out_struct((bsz, hq, lq), jnp.float32, *args)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=st.interpret,
        name="flex_attention_fwd",
    )(*args)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# custom_vjp
# ----------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, bm, captured):
    return _forward_call(st, q, k, v, bm, captured)


def _flash_fwd(st, q, k, v, bm, captured):
    out, lse = _forward_call(st, q, k, v, bm, captured)
    return (out, lse), (q, k, v, bm, captured, out, lse)


def _flash_bwd(st, res, cts):
    q, k, v, bm, captured, out, lse = res
    dout, dlse = cts
    if st.return_lse or _kernel_bwd() is None:
        # lse cotangents (or no backward kernel module): vjp of the blockwise XLA path, which returns
        # the same (out, lse) and differentiates through lse as well.
        dq, dk, dv, dcap = _xla_vjp(st, q, k, v, bm, captured, dout, dlse)
    else:
        dq, dk, dv, dcap = _kernel_vjp(st, q, k, v, bm, captured, out, lse, dout)
    dcap = tuple(None if not _is_float(c) else cotangent_like(g, c) for c, g in zip(captured, dcap))
    return cotangent_like(dq, q), cotangent_like(dk, k), cotangent_like(dv, v), None, dcap


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
                                     mask_mod=mask, captured=caps, scale=st.scale, config=None,
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


def _resolve_block_mask(block_mask, mask_mod, cfg: FlashConfig, pack: int, bsz, hq, lq, lkv, fits: Callable):
    """Returns (block_mask or None, config, kv_sub): a block mask whose query tiles are the kernel's
    (block_q // pack rows per head) and whose KV tiles each span ``kv_sub`` kernel KV tiles.

    A block mask's KV tiles may be a multiple of the kernel's (the H200 D128 forward steps 64 keys inside
    the default 128-key mask tiles); a mask built here uses KV tiles of at least 128 keys (create_block_mask's
    default, which the backward's tiles are tuned for), fewer only for short sequences."""
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
    if tiles[0] * pack in _SUPPORTED_TILES and tiles[1] in _SUPPORTED_TILES:
        kv = cfg.block_kv if tiles[1] % cfg.block_kv == 0 else tiles[1]
        tuned = dataclasses.replace(cfg, block_q=tiles[0] * pack, block_kv=kv)
        if fits(tuned):
            return block_mask, tuned, tiles[1] // kv
    if mask_mod is None:
        raise ValueError(f"flex_attention_pallas: block_mask tiles {tiles} are not a supported kernel tile "
                         f"(powers of two 16..256 within the shared-memory budget) and there is no mask_mod "
                         f"to rebuild it with tiles ({cfg.block_q // pack}, {cfg.block_kv})")
    return build(*mask_extent(mask_mod, bsz, hq))


def _setup(q, k, v, score_mod, mask_mod, block_mask, scale, return_lse, interpret, config, device_kind):
    """Config, block mask and traced mods of one call: ``(st, k, v, bm, captured)`` with K/V broadcast to
    q's batch, or None when a mod needs the XLA path."""
    k, v = broadcast_kv_batch(q, k, v)    # K/V of batch 1 (FlexAttention broadcasts them)
    _check_inputs(q, k, v)
    bsz, hq, lq, d = q.shape
    lkv, dv = k.shape[2], v.shape[-1]
    scale = float(d ** -0.5 if scale is None else scale)
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    try:
        # Mods are traced once, for scalars; their captured arrays become kernel inputs.
        score_tm = TileMod.make(score_mod, "score")
        mask_tm = TileMod.make(mask_mod, "mask")
    except _tiles.UnsupportedModError:
        return None             # a mod reads a captured array other than point-wise: the XLA path
    tile_reads = sum(tm.tile_reads for tm in (score_tm, mask_tm) if tm is not None)
    kind = device_kind
    if kind is None:
        kind = jax.devices()[0].device_kind if not interpret else "cpu-interpret"
    if config is None:
        dense_kv_len = lkv if block_mask is None and mask_mod is None else None
        cfg = shrink_to_fit(flash_config(d, dv, q.dtype, kind, dense_kv_len), d, dv, q.dtype, kind, tile_reads)
        # Do not launch tiles far longer than the sequence (tiny inputs).
        groups = hq // k.shape[1]
        rows = max(16, pow2(lq) * (groups if cfg.pack_gqa else 1))
        cfg = dataclasses.replace(cfg, block_q=min(cfg.block_q, rows),
                                  block_kv=min(cfg.block_kv, max(16, pow2(lkv))))
    else:
        cfg = config
        check_config(cfg, d, dv, q.dtype, kind, tile_reads=tile_reads)

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
                             f"q {q.shape}, k {k.shape} (needs (1 or B, 1 or Hq, Lq, Lkv))")
        head_dep = bm_h > 1
    else:
        head_dep = mask_mod is not None and mask_extent(mask_mod, bsz, hq)[1] is not None
    groups = hq // k.shape[1]
    pack = groups if (cfg.pack_gqa and groups > 1 and groups & (groups - 1) == 0
                      and cfg.block_q // groups >= 16 and not head_dep) else 1
    bm, cfg, kv_sub = _resolve_block_mask(block_mask, mask_mod, cfg, pack, bsz, hq, lq, lkv, fits)
    if bm is None:
        mask_tm = None          # no block mask means no mask: every tile is full
    captured = tuple(jnp.asarray(c) for c in (score_tm.captured if score_tm else ())) + \
        tuple(jnp.asarray(c) for c in (mask_tm.captured if mask_tm else ()))
    st = _Static(config=cfg, scale=scale, score_mod=score_tm, mask_mod=mask_tm,
                 n_score_cap=score_tm.num_captured if score_tm else 0, has_block_mask=bm is not None,
                 return_lse=bool(return_lse), interpret=bool(interpret),
                 reverse_q=bm is not None, pack=pack, kv_sub=kv_sub)
    return st, k, v, bm, captured


def flex_attention_pallas(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale=None,
                          return_lse=False, interpret=False, config: FlashConfig | None = None,
                          device_kind: str | None = None):
    """Flash attention with flex mods, Pallas/Triton kernel.

    q: [B, Hq, Lq, D], k: [B, Hkv, Lkv, D], v: [B, Hkv, Lkv, Dv], Hq % Hkv == 0 (query head h reads KV
    head h // (Hq // Hkv)). score_mod(score, b, h, q_idx, kv_idx), mask_mod(b, h, q_idx, kv_idx);
    block_mask: a BlockMask (its tiles become the kernel's tiles when supported, else it is rebuilt from
    the mask_mod) or None. Returns out [B, Hq, Lq, Dv] in q's dtype, or (out, lse [B, Hq, Lq] float32).
    ``config``: a FlashConfig (default: :func:`flash_config` for the device kind, head dims and dtype).
    Differentiable in q, k, v and float arrays captured by the mods.
    """
    prep = _setup(q, k, v, score_mod, mask_mod, block_mask, scale, return_lse, interpret, config, device_kind)
    if prep is None:
        # A mod reads its captured arrays in a way the kernel cannot (a slice or reduction, not a point
        # read): run the blockwise XLA path instead (same results, memory linear in length).
        from flashlax.fallbacks.attention import flex_attention_xla
        return flex_attention_xla(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                  scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                                  return_lse=return_lse)
    st, k, v, bm, captured = prep
    out, lse = _flash(st, q, k, v, bm, captured)
    return (out, lse) if return_lse else out


def kernel_passes(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale, return_lse=False,
                  interpret=False):
    """The kernels of one call as two passes, without the custom_vjp (what ring attention runs per K/V
    block): ``(forward, backward, score_consts)`` as :func:`flashlax.fallbacks.attention.blockwise_passes`,
    whose passes it returns when a mod needs the XLA path."""
    prep = _setup(q, k, v, score_mod, mask_mod, block_mask, scale, return_lse, interpret, None, None)
    if prep is None:
        from flashlax.fallbacks.attention import blockwise_passes
        return blockwise_passes(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                scale=scale)
    st, kb, vb, bm, captured = prep
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
        dq, dk, dv, _, dcap = _flash_bwd(st, (q, kb, vb, bm, captured, out.astype(q.dtype), lse),
                                         (dout.astype(q.dtype), dlse))
        if k.shape[0] != kb.shape[0]:    # K/V of batch 1 broadcast over the batch
            dk, dv = dk.sum(0, keepdims=True), dv.sum(0, keepdims=True)
        d_score = tuple(jnp.zeros_like(c) if g is None else g for c, g in zip(score_consts, dcap))
        return dq, dk, dv, d_score

    return forward, backward, score_consts
