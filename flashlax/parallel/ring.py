"""Ring attention: flex_attention with the sequence split over a mesh axis (``context_axis=``).

Each of the n devices of the axis holds L / n query rows and L / n keys of every batch element and head.
The K/V blocks go round the ring with ``jax.lax.ppermute``: at step s device i attends its queries to
the block of device i - s with the op's own implementation (the XLA blockwise path or the Pallas
kernel), while the block for step s + 1 is already on its way (the ppermute has no data dependence on
that step's compute, so XLA's scheduler overlaps them). Partial results are merged by log-sum-exp.
GQA stays native: the blocks that travel have the Hkv K/V heads.

Backward (a custom_vjp, also a ring): K/V go round again and the dK/dV accumulators travel with them,
each device adding its share; after n steps plus one ppermute they are home. Each block's backward runs
from the merged output and log-sum-exp (its probabilities are then the global ones), so nothing is
recomputed beyond what the single-device backward recomputes, and nothing saved grows with n.

Load balance. With a mask (causal, sliding window, documents, ...) the op runs on a zigzag order: the
sequence is cut into 2n chunks and device i holds chunks i and 2n - 1 - i, so under a causal mask every
device has the same number of visible (query chunk, key chunk) pairs at every step. The inputs stay in
the natural contiguous order on the axis; the op moves the halves into zigzag order and back with
``ppermute`` (q, k, v in, out and lse back). Without a mask the contiguous order is balanced already.

Masks across shard boundaries: mods get global positions (``q_idx``, ``kv_idx`` in the natural order of
the whole sequence, ``b`` and ``h`` global as well). The block mask is built once over the global
[Lq, Lkv] plane (at trace time for a mod that captures no traced array) or given by the caller, and each
step reads the tiles of its (query chunks, key chunks); empty tiles are skipped inside the step as on one
device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from flashlax import _mods
from flashlax import masks as masks_lib
from flashlax.fallbacks.attention import NEG_INF, acc_dtype, mask_extent, zero_cotangent
from flashlax.parallel.shard import Placement, block_mask_layouts, local_kv_heads, shift_mod
from flashlax.parallel.vma import cotangent_like, match_vma

RING_IMPLS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True, eq=False)
class _Ring:
    """Everything about one ring call that is not an array (the custom_vjp's nondiff argument)."""

    axis: str
    parts: int              # devices on the axis
    zigzag: bool
    chunk_q: int            # query rows per chunk (2 chunks per device with zigzag, else 1)
    chunk_kv: int
    tile_q: int             # block-mask tiles
    tile_kv: int
    scale: float
    impl: str
    interpret: bool
    return_lse: bool
    score_mod: Callable | None      # consts -> mod, global indices
    mask_mod: Callable | None


# ----------------------------------------------------------------------------------------------------
# Positions: chunks held by a device, zigzag order
# ----------------------------------------------------------------------------------------------------

def _chunks(rc: _Ring, device):
    """Chunk ids (int32 scalars) a device holds, in local order."""
    if not rc.zigzag:
        return (device,)
    return (device, 2 * rc.parts - 1 - device)


def _positions(chunks, chunk_len: int) -> Callable:
    """Local index -> global position for the given chunks held back to back."""
    if len(chunks) == 1:
        return lambda i: i + chunks[0] * chunk_len
    first, second = chunks
    return lambda i: jnp.where(i < chunk_len, i + first * chunk_len, i + (second - 1) * chunk_len)


def _tile_ids(chunks, chunk_len: int, tile: int):
    """Global tile indices covering the given chunks, in local order."""
    per = chunk_len // tile
    return jnp.concatenate([c * per + jnp.arange(per, dtype=jnp.int32) for c in chunks])


def _zigzag_perms(parts: int):
    """ppermute pairs moving the first / second half of each device's contiguous block (chunks 2i, 2i + 1)
    to the device that holds that chunk in zigzag order."""
    home = lambda c: c if c < parts else 2 * parts - 1 - c
    return ([(i, home(2 * i)) for i in range(parts)], [(i, home(2 * i + 1)) for i in range(parts)])


def to_zigzag(x, axis: str, parts: int, dim: int = 2):
    """Contiguous blocks (device i: chunks 2i, 2i + 1) -> zigzag (device j: chunks j, 2n - 1 - j)."""
    perm_a, perm_b = _zigzag_perms(parts)
    first, second = jnp.split(x, 2, axis=dim)
    got_a, got_b = lax.ppermute(first, axis, perm_a), lax.ppermute(second, axis, perm_b)
    even = lax.axis_index(axis) % 2 == 0       # even devices get their low chunk from the first halves
    return jnp.concatenate([jnp.where(even, got_a, got_b), jnp.where(even, got_b, got_a)], axis=dim)


def from_zigzag(x, axis: str, parts: int, dim: int = 2):
    """The inverse of :func:`to_zigzag`."""
    perm_a, perm_b = _zigzag_perms(parts)
    low, high = jnp.split(x, 2, axis=dim)
    even = lax.axis_index(axis) % 2 == 0
    back = lambda perm: [(dst, src) for src, dst in perm]
    first = lax.ppermute(jnp.where(even, low, high), axis, back(perm_a))
    second = lax.ppermute(jnp.where(even, high, low), axis, back(perm_b))
    return jnp.concatenate([first, second], axis=dim)


# ----------------------------------------------------------------------------------------------------
# One step: this device's queries against one K/V block
# ----------------------------------------------------------------------------------------------------

def _closure_convert(mod: Callable | None, kind: str):
    """(consts -> mod, consts): the arrays ``mod`` captures as explicit values (custom_vjp arguments)."""
    if mod is None:
        return None, ()
    captured = _mods.captured_arrays(mod, *_mods.scalar_args(kind))
    return (lambda consts: _mods.with_captured(mod, captured, consts)), captured


def _step_passes(rc: _Ring, q, k_blk, v_blk, score_consts, mask_consts, kinds, device, source):
    """(forward, backward, score_consts) of the implementation for this device's queries against the
    K/V block of ``source`` (see flashlax.fallbacks.attention.blockwise_passes)."""
    q_chunks, kv_chunks = _chunks(rc, device), _chunks(rc, source)
    q_pos, kv_pos = _positions(q_chunks, rc.chunk_q), _positions(kv_chunks, rc.chunk_kv)
    score = None if rc.score_mod is None else shift_mod(rc.score_mod(score_consts), "score", q_pos=q_pos,
                                                        kv_pos=kv_pos)
    mask = None if rc.mask_mod is None else shift_mod(rc.mask_mod(mask_consts), "mask", q_pos=q_pos,
                                                      kv_pos=kv_pos)
    block_mask = None
    if kinds is not None:
        rows = _tile_ids(q_chunks, rc.chunk_q, rc.tile_q)
        cols = _tile_ids(kv_chunks, rc.chunk_kv, rc.tile_kv)
        local = jnp.take(jnp.take(kinds, rows, axis=2), cols, axis=3)
        block_mask = masks_lib.block_mask_from_kinds(local, q.shape[2], k_blk.shape[2], rc.tile_q, rc.tile_kv,
                                                     mask_mod=mask)
    if rc.impl == "pallas":
        from flashlax.kernels.flash_attention import kernel_passes
        return kernel_passes(q, k_blk, v_blk, score_mod=score, mask_mod=mask, block_mask=block_mask,
                             scale=rc.scale, return_lse=rc.return_lse, interpret=rc.interpret)
    from flashlax.fallbacks.attention import blockwise_passes
    return blockwise_passes(q, k_blk, v_blk, score_mod=score, mask_mod=mask, block_mask=block_mask,
                            scale=rc.scale)


def _merge(out, lse, out_s, lse_s):
    """Two partial attentions (each normalised by its own sum) merged by log-sum-exp."""
    m = jnp.maximum(lse, lse_s)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    w, w_s = jnp.exp(lse - m_safe), jnp.exp(lse_s - m_safe)
    total = w + w_s
    has_any = total > 0
    safe = jnp.where(has_any, total, 1.0)
    out = (w[..., None] * out + w_s[..., None] * out_s.astype(out.dtype)) / safe[..., None]
    return out, jnp.where(has_any, m_safe + jnp.log(safe), NEG_INF)


def _gather_grads(consts, step_consts, step_grads, dtype):
    """Cotangents (``dtype``) of the float arrays among ``consts`` from a step's cotangents of its own list
    of captured arrays (the step's mod captures ``consts`` and traced positions; matched by identity);
    zeros for the others."""
    out = []
    for c in consts:
        g = [dg for sc, dg in zip(step_consts, step_grads) if sc is c] if _is_float(c) else []
        out.append(sum(g[1:], g[0]).astype(dtype) if g else jnp.zeros(jnp.shape(c), dtype))
    return tuple(out)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# ----------------------------------------------------------------------------------------------------
# The ring, forward and backward
# ----------------------------------------------------------------------------------------------------

def _shift_right(rc: _Ring):
    return [(i, (i + 1) % rc.parts) for i in range(rc.parts)]


def _forward(rc: _Ring, q, k, v, score_consts, mask_consts, kinds):
    device = lax.axis_index(rc.axis)
    acc = acc_dtype(q.dtype)

    def step(s, carry):
        k_blk, v_blk, out, lse = carry
        # Issued first, used next step: no data dependence on this step's compute, so it overlaps it.
        k_next, v_next = lax.ppermute((k_blk, v_blk), rc.axis, _shift_right(rc))
        forward, _, _ = _step_passes(rc, q, k_blk, v_blk, score_consts, mask_consts, kinds, device,
                                     (device - s) % rc.parts)
        out_s, lse_s = forward()
        out, lse = _merge(out, lse, out_s, lse_s.astype(acc))
        return k_next, v_next, out, lse

    init = (jnp.zeros(q.shape[:3] + (v.shape[-1],), acc), jnp.full(q.shape[:3], NEG_INF, acc))
    init = (k, v) + match_vma(init, q, k, v)
    _, _, out, lse = lax.fori_loop(0, rc.parts, step, init)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(rc: _Ring, q, k, v, score_consts, mask_consts, kinds):
    return _forward(rc, q, k, v, score_consts, mask_consts, kinds)


def _ring_fwd(rc, q, k, v, score_consts, mask_consts, kinds):
    out, lse = _forward(rc, q, k, v, score_consts, mask_consts, kinds)
    return (out, lse), (q, k, v, score_consts, mask_consts, kinds, out, lse)


def _ring_bwd(rc, res, cts):
    q, k, v, score_consts, mask_consts, kinds, out, lse = res
    dout, dlse = cts
    device = lax.axis_index(rc.axis)
    acc = acc_dtype(q.dtype)
    perm = _shift_right(rc)

    def step(s, carry):
        k_blk, v_blk, dk_sent, dv_sent, dq, d_score = carry
        k_next, v_next = lax.ppermute((k_blk, v_blk), rc.axis, perm)
        # The accumulators of this block's dK/dV, from the device that had the block last step.
        dk_acc, dv_acc = lax.ppermute((dk_sent, dv_sent), rc.axis, perm)
        _, backward, step_consts = _step_passes(rc, q, k_blk, v_blk, varying_consts, mask_consts, kinds, device,
                                                (device - s) % rc.parts)
        dq_s, dk_s, dv_s, d_step = backward(out, lse, dout, dlse)
        d_score = tuple(a + g for a, g in zip(d_score, _gather_grads(varying_consts, step_consts, d_step, acc)))
        return (k_next, v_next, dk_acc + dk_s.astype(acc), dv_acc + dv_s.astype(acc), dq + dq_s.astype(acc),
                d_score)

    # The captured float arrays enter the ring varying like q: each step's cotangents stay per device
    # and are summed over the devices once, after the ring (no collective inside the steps' loops).
    varying_consts = tuple(match_vma(c, q, k, v) if _is_float(c) else c for c in score_consts)
    zeros = (jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc), jnp.zeros(q.shape, acc),
             tuple(jnp.zeros(jnp.shape(c), acc) for c in score_consts))
    init = (k, v) + match_vma(zeros, q, k, v, out, dout)
    _, _, dk_sent, dv_sent, dq, d_score = lax.fori_loop(0, rc.parts, step, init)
    dk, dv = lax.ppermute((dk_sent, dv_sent), rc.axis, perm)       # the last hop home
    grads = (dq, dk, dv, d_score, tuple(map(zero_cotangent, mask_consts)))
    primals = (q, k, v, score_consts, mask_consts)
    return jax.tree.map(_cotangent_of, grads, primals) + (None if kinds is None else zero_cotangent(kinds),)


def _cotangent_of(grad, primal):
    if not _is_float(primal):
        return zero_cotangent(primal)
    return cotangent_like(grad, primal)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------

def _mask_tile(chunk: int) -> int:
    """The block-mask tile for chunks of that length: the largest power of two <= 128 dividing it."""
    return math.gcd(chunk, masks_lib.DEFAULT_BLOCK)


def flex_attention(placement: Placement, impl: str, q, k, v, *, score_mod, mask_mod, block_mask, scale,
                   return_lse: bool, interpret: bool):
    op = "flex_attention"
    axis, parts = placement.context, placement.context_size
    if impl not in RING_IMPLS:
        raise ValueError(f"{op}: context_axis runs ring attention with impl 'xla' or 'pallas', got impl={impl!r}")
    masked = mask_mod is not None or block_mask is not None
    chunks = 2 * parts if masked else parts
    lq, lkv = placement.global_len(q.shape[2]), placement.global_len(k.shape[2])
    if lq % chunks or lkv % chunks:
        order = f"2 x {parts} chunks (the zigzag order of a masked call)" if masked else f"{parts} parts"
        raise ValueError(f"{op}: Lq={lq} and Lkv={lkv} must split evenly over context_axis={axis!r} into "
                         f"{order} (q {q.shape}, k {k.shape})")
    chunk_q, chunk_kv = lq // chunks, lkv // chunks
    if block_mask is not None:
        tile_q, tile_kv = block_mask.block_q, block_mask.block_kv
        if chunk_q % tile_q or chunk_kv % tile_kv:
            raise ValueError(f"{op}: block_mask tiles ({tile_q}, {tile_kv}) must divide the chunks of the ring "
                             f"({chunk_q} query rows, {chunk_kv} keys per chunk, context_axis={axis!r} of "
                             f"{parts} devices); build it with block_q={_mask_tile(chunk_q)}, "
                             f"block_kv={_mask_tile(chunk_kv)}")
        mask_mod = mask_mod if mask_mod is not None else block_mask.mask_mod
    else:
        tile_q, tile_kv = _mask_tile(chunk_q), _mask_tile(chunk_kv)
    heads, kv_heads, batch = q.shape[1], k.shape[1], q.shape[0]
    def local(q, k, v, block_mask):
        b0 = placement.offset("b", q.shape[0])
        h0 = placement.offset("h", q.shape[1])
        k, v = local_kv_heads(placement, k, v, heads, kv_heads, h0)
        score = shift_mod(score_mod, "score", b=b0, h=h0)
        mask = shift_mod(mask_mod, "mask", b=b0, h=h0)
        kinds = None
        if block_mask is not None:
            kinds = block_mask.tile_kinds
        elif mask is not None:       # over the global plane: mods see global positions
            bm, hm = mask_extent(mask, q.shape[0], q.shape[1])
            kinds = masks_lib.create_block_mask(mask, bm, hm, lq, lkv, block_q=tile_q,
                                                block_kv=tile_kv).tile_kinds
        if mask is None and kinds is not None:
            mask = _mask_from_kinds(kinds, tile_q, tile_kv)
        score_rebuild, score_consts = _closure_convert(score, "score")
        mask_rebuild, mask_consts = _closure_convert(mask, "mask")
        rc = _Ring(axis, parts, masked, chunk_q, chunk_kv, tile_q, tile_kv, float(scale), impl, bool(interpret),
                   bool(return_lse), score_rebuild, mask_rebuild)
        if masked:
            q, k, v = (to_zigzag(x, axis, parts) for x in (q, k, v))
        out, lse = _ring(rc, q, k, v, score_consts, mask_consts, kinds)
        if masked:
            out, lse = from_zigzag(out, axis, parts), from_zigzag(lse, axis, parts)
        return (out, lse) if return_lse else out

    return placement.run(local, (q, k, v, block_mask),
                         ("bhs.", "bks.", "bks.", block_mask_layouts(block_mask, batch, heads)),
                         ("bhs.", "bhs") if return_lse else "bhs.")


def _mask_from_kinds(kinds, tile_q: int, tile_kv: int) -> Callable:
    """A mask_mod for a block mask given without one: allowed exactly where its tile is FULL."""
    bm, hm = kinds.shape[:2]

    def mask_mod(b, h, q_idx, kv_idx):
        return kinds[b if bm > 1 else 0, h if hm > 1 else 0, q_idx // tile_q, kv_idx // tile_kv] == masks_lib.FULL

    return mask_mod
