"""mask_mod library and BlockMask.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` is written for scalars (the PyTorch FlexAttention
convention): each argument is one int32 scalar and the result one bool, ``True`` meaning "attend". Every
implementation evaluates it with exactly that meaning (``flashlax._mods.apply_mod``), so a mod may index
captured arrays with several indices, reduce or chain indexing.

``create_block_mask`` cuts the [Lq, Lkv] plane into ``block_q x block_kv`` tiles and classifies each
tile as empty (no allowed element), full (every in-range element allowed) or partial. Kernels visit only
non-empty tiles and evaluate ``mask_mod`` only on partial ones. "In range" matters at the edges: a tile
that sticks out past Lq or Lkv can be full; the kernel masks positions >= Lq / Lkv itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flashlax import _mods

MaskMod = Callable[..., jax.Array]

EMPTY, PARTIAL, FULL = 0, 1, 2

# Elements evaluated per step when classifying tiles: bounds create_block_mask's memory.
_EVAL_CHUNK_ELEMS = 1 << 24


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Tile structure of a mask. ``Bm``/``Hm`` are B/H, or 1 when the mask does not depend on them.

    Row direction (forward, dQ pass), nq = cdiv(Lq, block_q), nkv = cdiv(Lkv, block_kv):
      kv_num_blocks       int32 [Bm, Hm, nq]       partial tiles in each query-tile row
      kv_indices          int32 [Bm, Hm, nq, nkv]  their kv-tile indices, ascending, then padding
      full_kv_num_blocks  int32 [Bm, Hm, nq]       full tiles in each row
      full_kv_indices     int32 [Bm, Hm, nq, nkv]  their kv-tile indices, ascending, then padding
    Column direction (the transposed mask, for the dK/dV pass), same meaning with q and kv swapped:
      q_num_blocks, full_q_num_blocks [Bm, Hm, nkv]; q_indices, full_q_indices [Bm, Hm, nkv, nq]
    tile_kinds            int8  [Bm, Hm, nq, nkv]  EMPTY / PARTIAL / FULL per tile
    Padding entries of the index arrays are valid tile indices (never out of range), so a kernel may
    load one past the count safely.
    """

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array
    full_kv_indices: jax.Array
    q_num_blocks: jax.Array
    q_indices: jax.Array
    full_q_num_blocks: jax.Array
    full_q_indices: jax.Array
    tile_kinds: jax.Array
    q_len: int = dataclasses.field(metadata=dict(static=True))
    kv_len: int = dataclasses.field(metadata=dict(static=True))
    block_q: int = dataclasses.field(metadata=dict(static=True))
    block_kv: int = dataclasses.field(metadata=dict(static=True))
    mask_mod: MaskMod | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, Lq, Lkv)."""
        bm, hm = self.tile_kinds.shape[:2]
        return (bm, hm, self.q_len, self.kv_len)

    @property
    def num_tiles(self) -> tuple[int, int]:
        return self.tile_kinds.shape[2], self.tile_kinds.shape[3]

    def sparsity(self) -> float:
        """Fraction of tiles that are empty (host-side; not for use under jit)."""
        kinds = np.asarray(self.tile_kinds)
        return float((kinds == EMPTY).mean())

    def to_dense(self) -> jax.Array:
        """bool [Bm, Hm, Lq, Lkv]: the mask itself (for tests and small shapes)."""
        return _evaluate_dense(self.mask_mod, self.shape[0], self.shape[1], self.q_len, self.kv_len) \
            if self.mask_mod is not None else jnp.repeat(jnp.repeat(
                self.tile_kinds == FULL, self.block_q, axis=2), self.block_kv, axis=3
            )[:, :, : self.q_len, : self.kv_len]


def _evaluate_dense(mask_mod: MaskMod, bm: int, hm: int, lq: int, lkv: int) -> jax.Array:
    b = jnp.arange(bm, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(hm, dtype=jnp.int32)[None, :, None, None]
    q = jnp.arange(lq, dtype=jnp.int32)[None, None, :, None]
    kv = jnp.arange(lkv, dtype=jnp.int32)[None, None, None, :]
    return _mods.apply_mod(mask_mod, b, h, q, kv)


def _indices_of(selected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For a bool [..., n] array: (count [...], indices [..., n]) with the selected positions first, ascending."""
    count = selected.sum(-1, dtype=jnp.int32)
    order = jnp.argsort(jnp.logical_not(selected), axis=-1, stable=True).astype(jnp.int32)
    return count, order


def _tile_kinds(mask_mod: MaskMod, bm: int, hm: int, lq: int, lkv: int, block_q: int, block_kv: int) -> jax.Array:
    nq, nkv = _cdiv(lq, block_q), _cdiv(lkv, block_kv)
    # kv tiles evaluated together per step, so one step touches at most _EVAL_CHUNK_ELEMS elements.
    kv_chunk = max(1, min(nkv, _EVAL_CHUNK_ELEMS // max(1, bm * hm * block_q * block_kv)))
    n_chunks = _cdiv(nkv, kv_chunk)
    b = jnp.arange(bm, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(hm, dtype=jnp.int32)[None, :, None, None]

    def one_step(ij):
        i, j = ij // n_chunks, ij % n_chunks
        q_idx = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
        kv_idx = j * kv_chunk * block_kv + jnp.arange(kv_chunk * block_kv, dtype=jnp.int32)
        allowed = _mods.apply_mod(mask_mod, b, h, q_idx[None, None, :, None], kv_idx[None, None, None, :])
        allowed = jnp.broadcast_to(allowed, (bm, hm, block_q, kv_chunk * block_kv))
        in_range = (q_idx < lq)[:, None] & (kv_idx < lkv)[None, :]
        allowed = (allowed & in_range[None, None]).reshape(bm, hm, block_q, kv_chunk, block_kv)
        n_allowed = allowed.sum((2, 4), dtype=jnp.int32)
        n_in_range = in_range.reshape(1, 1, block_q, kv_chunk, block_kv).sum((2, 4), dtype=jnp.int32)
        return jnp.where(n_allowed == 0, EMPTY,
                         jnp.where(n_allowed == n_in_range, FULL, PARTIAL)).astype(jnp.int8)

    kinds = jax.lax.map(one_step, jnp.arange(nq * n_chunks, dtype=jnp.int32))  # [nq*n_chunks, bm, hm, kv_chunk]
    kinds = kinds.reshape(nq, n_chunks, bm, hm, kv_chunk).transpose(2, 3, 0, 1, 4)
    kinds = kinds.reshape(bm, hm, nq, n_chunks * kv_chunk)[..., :nkv]
    return kinds


def block_mask_from_kinds(tile_kinds: jax.Array, q_len: int, kv_len: int, block_q: int, block_kv: int,
                          mask_mod: MaskMod | None = None) -> BlockMask:
    """Builds the index lists of a BlockMask from its int8 [Bm, Hm, nq, nkv] tile kinds."""
    partial, full = tile_kinds == PARTIAL, tile_kinds == FULL
    kv_num, kv_idx = _indices_of(partial)
    full_kv_num, full_kv_idx = _indices_of(full)
    q_num, q_idx = _indices_of(jnp.swapaxes(partial, -1, -2))
    full_q_num, full_q_idx = _indices_of(jnp.swapaxes(full, -1, -2))
    return BlockMask(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx,
                     tile_kinds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv,
                     mask_mod=mask_mod)


DEFAULT_BLOCK = 128     # create_block_mask's default tile (both axes), as in torch's FlexAttention


def create_block_mask(mask_mod: MaskMod | None, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      *, block_q: int = DEFAULT_BLOCK, block_kv: int = DEFAULT_BLOCK) -> BlockMask:
    """The tile structure of ``mask_mod`` over [B, H, Q_LEN, KV_LEN], for reuse across calls.

    Cuts the [Q_LEN, KV_LEN] plane into ``block_q x block_kv`` tiles and classifies each as empty, partial
    or full, so kernels skip empty tiles and evaluate ``mask_mod`` only on partial ones.

    Args:
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` written for scalars (True = attend), or None
        (no mask: every tile full).
      B, H: batch size and query heads, or None when the mask does not depend on them (a mod that reads
        ``b`` / ``h`` then raises).
      Q_LEN, KV_LEN: sequence lengths. block_q, block_kv: tile sizes (default 128).

    Returns:
      A BlockMask (a pytree; usable under jit) that carries ``mask_mod``.

    Raises:
      ValueError: non-positive lengths or tiles, a mod with the wrong arguments or a non-bool result, a mod
        that reads ``b`` / ``h`` with B / H None.

    Works under ``jit``: a mod capturing only concrete arrays is classified once, at trace time; a mod
    capturing traced arrays (segment ids passed as jit arguments) is classified in the compiled program.

    Example:
      >>> bm = flashlax.create_block_mask(flashlax.masks.causal, None, None, 1024, 1024)
      >>> bm.num_tiles
      (8, 8)
    """
    for name, val in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"create_block_mask: {name} must be a positive int, got {val!r}")
    for name, val in (("B", B), ("H", H)):
        if val is not None and (not isinstance(val, (int, np.integer)) or val < 1):
            raise ValueError(f"create_block_mask: {name} must be a positive int or None, got {val!r}")
    _mods.check_mod("create_block_mask", mask_mod, "mask")
    if mask_mod is not None:
        reads_b, reads_h = _mods.reads_batch_head(mask_mod)
        for name, dim, reads in (("B", B, reads_b), ("H", H, reads_h)):
            if reads and dim is None:
                arg = "b" if name == "B" else "h"
                raise ValueError(f"create_block_mask: mask_mod reads `{arg}` but {name}=None (a mask that is the "
                                 f"same for every {'batch element' if name == 'B' else 'head'}); pass {name}")
    bm, hm = (B or 1), (H or 1)
    nq, nkv = _cdiv(Q_LEN, block_q), _cdiv(KV_LEN, block_kv)
    def build():
        if mask_mod is None:
            kinds = jnp.full((bm, hm, nq, nkv), FULL, jnp.int8)
        else:
            kinds = _tile_kinds(mask_mod, bm, hm, Q_LEN, KV_LEN, block_q, block_kv)
        return block_mask_from_kinds(kinds, Q_LEN, KV_LEN, block_q, block_kv, mask_mod)

    try:
        # Eager wherever the inputs are concrete; a captured tracer stages the ops as usual.
        with jax.ensure_compile_time_eval():
            return build()
    except Exception:  # noqa: BLE001
        # No device to evaluate on (tracing under an abstract mesh for another platform): stage it.
        # A genuine error of the mod is raised again by the staged build.
        return build()


# ----------------------------------------------------------------------------------------------------
# mask_mod library
# ----------------------------------------------------------------------------------------------------

def causal(b, h, q_idx, kv_idx):
    """Query i sees keys 0..i (top-left aligned, as PyTorch's causal mask_mod)."""
    return q_idx >= kv_idx


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """Query i sees keys i-left .. i+right."""
    if left < 0 or right < 0:
        raise ValueError(f"sliding_window: left and right must be >= 0, got left={left}, right={right}")

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    return mask_mod


def prefix_lm(prefix_len: int) -> MaskMod:
    """Causal, plus every query sees the first ``prefix_len`` keys (bidirectional prefix)."""
    if prefix_len < 0:
        raise ValueError(f"prefix_lm: prefix length must be >= 0, got {prefix_len}")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < prefix_len)

    return mask_mod


def document(q_segment_ids: jax.Array, kv_segment_ids: jax.Array | None = None) -> MaskMod:
    """Packed documents: query and key attend when their segment ids ([B, Lq] / [B, Lkv] int) match."""
    q_seg = jnp.asarray(q_segment_ids)
    kv_seg = q_seg if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    if q_seg.ndim != 2 or kv_seg.ndim != 2 or q_seg.shape[0] != kv_seg.shape[0]:
        raise ValueError("document: q_segment_ids and kv_segment_ids must be [B, Lq] and [B, Lkv], got "
                         f"{q_seg.shape} and {kv_seg.shape}")
    if not (jnp.issubdtype(q_seg.dtype, jnp.integer) and jnp.issubdtype(kv_seg.dtype, jnp.integer)):
        raise ValueError(f"document: segment ids must be integers, got {q_seg.dtype} and {kv_seg.dtype}")

    def mask_mod(b, h, q_idx, kv_idx):
        return q_seg[b, q_idx] == kv_seg[b, kv_idx]

    return mask_mod


def and_masks(*mods: MaskMod) -> MaskMod:
    """Allowed where every mod allows."""
    if not mods or not all(callable(m) for m in mods):
        raise ValueError("and_masks: needs one or more callable mask_mods")

    def mask_mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mask_mod


def or_masks(*mods: MaskMod) -> MaskMod:
    """Allowed where any mod allows."""
    if not mods or not all(callable(m) for m in mods):
        raise ValueError("or_masks: needs one or more callable mask_mods")

    def mask_mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return mask_mod
