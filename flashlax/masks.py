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
import inspect
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

    The names it shares with PyTorch's ``torch.nn.attention.flex_attention.BlockMask`` mean what they mean
    there: ``BLOCK_SIZE`` (block_q, block_kv), ``seq_lengths`` (Lq, Lkv), ``shape``, :meth:`from_kv_blocks`,
    indexing ``bm[b]``, ``bm[b, h]``, ``bm[:, :, q_tiles]``, :meth:`to_dense` (per tile), :meth:`to_string`,
    :meth:`sparsity` (a percentage) and :meth:`_adjust`. The per-element mask is :meth:`to_element_mask`.

    ``layout_defines_mask``: the tiles are part of the mask's meaning (a block mask from
    :meth:`from_kv_blocks`, as in PyTorch): an element of an EMPTY tile is masked, of a FULL tile attended,
    of a PARTIAL tile decided by ``mask_mod``. Otherwise (create_block_mask) ``mask_mod`` alone is the
    mask and the tiles only say where it may be skipped. :meth:`exact_mask_mod` gives the mod with that
    meaning either way.
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
    layout_defines_mask: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, Lq, Lkv)."""
        bm, hm = self.tile_kinds.shape[:2]
        return (bm, hm, self.q_len, self.kv_len)

    @property
    def num_tiles(self) -> tuple[int, int]:
        return self.tile_kinds.shape[2], self.tile_kinds.shape[3]

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]:  # noqa: N802 (PyTorch's name)
        """(block_q, block_kv), PyTorch's name."""
        return (self.block_q, self.block_kv)

    @property
    def seq_lengths(self) -> tuple[int, int]:
        """(Lq, Lkv), PyTorch's name."""
        return (self.q_len, self.kv_len)

    # --- construction from tile lists (PyTorch's from_kv_blocks) -------------------------------------

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       BLOCK_SIZE: int | tuple[int, int] = None, mask_mod: MaskMod | None = None,  # noqa: N803
                       seq_lengths: tuple[int, int] | None = None) -> "BlockMask":
        """A block mask from its tile lists, as ``torch...BlockMask.from_kv_blocks``.

        Args:
          kv_num_blocks: int [..., nq] partial tiles per query-tile row; ``...`` is (B, H), (H,) or ().
          kv_indices: int [..., nq, K] their kv-tile indices (entries past the count are ignored).
          full_kv_num_blocks, full_kv_indices: the same for full tiles (both or neither); a full tile is
            attended without ``mask_mod``.
          BLOCK_SIZE: tile size, an int or (block_q, block_kv) (default 128).
          mask_mod: decides inside partial tiles (default: ``noop_mask``, the whole tile attended).
          seq_lengths: (Lq, Lkv); default (nq * block_q, K * block_kv) as PyTorch. More tile rows than
            cdiv(Lq, block_q) are cropped.

        Returns:
          A BlockMask with ``layout_defines_mask``: tiles in neither list are masked. The index lists are
          rebuilt ascending (the tiles, not their order, are the mask). Works under jit (traced lists);
          concrete lists are validated (ValueError for an index out of range or a tile in both lists).
        """
        op = "BlockMask.from_kv_blocks"
        block_q, block_kv = _block_size(op, BLOCK_SIZE, None, None)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError(f"{op}: pass both full_kv_num_blocks and full_kv_indices, or neither")
        lists = [(jnp.asarray(kv_num_blocks), jnp.asarray(kv_indices), "kv")]
        if full_kv_num_blocks is not None:
            lists.append((jnp.asarray(full_kv_num_blocks), jnp.asarray(full_kv_indices), "full_kv"))
        num0, idx0 = lists[0][:2]
        for num, idx, name in lists:
            if not 2 <= idx.ndim <= 4 or num.shape != idx.shape[:-1] or \
                    not (jnp.issubdtype(num.dtype, jnp.integer) and jnp.issubdtype(idx.dtype, jnp.integer)):
                raise ValueError(f"{op}: {name}_indices must be integer [..., nq, K] with {name}_num_blocks "
                                 f"[..., nq] (... = (B, H), (H,) or ()), got {idx.dtype} {idx.shape} and "
                                 f"{num.dtype} {num.shape}")
            if idx.shape[:-1] != idx0.shape[:-1]:
                raise ValueError(f"{op}: kv_* and full_kv_* lists disagree in [..., nq]: {idx0.shape} vs {idx.shape}")
        nq = idx0.shape[-2]
        if seq_lengths is None:
            q_len, kv_len = nq * block_q, idx0.shape[-1] * block_kv
        else:
            q_len, kv_len = (int(x) for x in seq_lengths)
            if q_len < 1 or kv_len < 1:
                raise ValueError(f"{op}: seq_lengths must be positive, got {seq_lengths}")
            if _cdiv(q_len, block_q) > nq:
                raise ValueError(f"{op}: seq_lengths {seq_lengths} need {_cdiv(q_len, block_q)} query-tile rows "
                                 f"of {block_q}, the lists have {nq}")
        nq, nkv = _cdiv(q_len, block_q), _cdiv(kv_len, block_kv)
        mask_mod = noop_mask if mask_mod is None else mask_mod
        _mods.check_mod(op, mask_mod, "mask")

        def selected(num, idx, name):
            num = num.reshape((1,) * (3 - num.ndim) + num.shape)[..., :nq].astype(jnp.int32)
            idx = idx.reshape((1,) * (4 - idx.ndim) + idx.shape)[..., :nq, :].astype(jnp.int32)
            listed = jnp.arange(idx.shape[-1], dtype=jnp.int32).reshape(1, 1, 1, -1) < num[..., None]
            if not isinstance(idx, jax.core.Tracer) and not isinstance(num, jax.core.Tracer):
                bad = np.asarray(listed & ((idx < 0) | (idx >= nkv)))
                if bad.any():
                    raise ValueError(f"{op}: {name}_indices list kv tiles outside [0, {nkv}) (Lkv={kv_len}, "
                                     f"block {block_kv}), e.g. {np.asarray(idx)[bad][:4].tolist()}")
            bmb, hmb = idx.shape[:2]
            pos = (jnp.arange(bmb)[:, None, None, None], jnp.arange(hmb)[None, :, None, None],
                   jnp.arange(nq)[None, None, :, None], jnp.where(listed, idx, nkv))
            return jnp.zeros((bmb, hmb, nq, nkv), jnp.bool_).at[pos].set(True, mode="drop")

        def build():
            partial = selected(*lists[0])
            full = selected(*lists[1]) if len(lists) > 1 else jnp.zeros_like(partial)
            partial, full = jnp.broadcast_arrays(partial, full)
            if not isinstance(partial, jax.core.Tracer) and bool(np.any(np.asarray(partial & full))):
                raise ValueError(f"{op}: a tile is listed both in kv_indices and full_kv_indices")
            kinds = jnp.where(full, FULL, jnp.where(partial, PARTIAL, EMPTY)).astype(jnp.int8)
            return block_mask_from_kinds(kinds, q_len, kv_len, block_q, block_kv, mask_mod,
                                         layout_defines_mask=True)

        return _eager_if_concrete(build)

    # --- the mask itself ---------------------------------------------------------------------------

    def exact_mask_mod(self) -> MaskMod:
        """The mask_mod that is exactly this block mask's mask: ``mask_mod`` itself, or with
        ``layout_defines_mask`` one that reads the tiles (FULL: attend, EMPTY: not, PARTIAL: mask_mod).
        A mask without mod and layout (``block_mask_from_kinds``) attends its FULL tiles only."""
        if not self.layout_defines_mask and self.mask_mod is not None:
            return self.mask_mod
        kinds = self.tile_kinds
        mod = self.mask_mod if self.mask_mod is not None else (lambda b, h, q_idx, kv_idx: False)
        bm, hm = kinds.shape[:2]
        bq, bkv = np.int32(self.block_q), np.int32(self.block_kv)

        def layout_mod(b, h, q_idx, kv_idx):
            # lax.div: indices are >= 0 (jnp's floor division adds a sign fix-up Triton kernels reject)
            kind = kinds[b if bm > 1 else 0, h if hm > 1 else 0, jax.lax.div(q_idx, bq), jax.lax.div(kv_idx, bkv)]
            return (kind == FULL) | ((kind == PARTIAL) & mod(b, h, q_idx, kv_idx))

        return layout_mod

    def to_element_mask(self) -> jax.Array:
        """bool [Bm, Hm, Lq, Lkv]: the mask element by element (small shapes; what ``to_dense`` returned
        before it took PyTorch's per-tile meaning)."""
        dense = _evaluate_dense(self.exact_mask_mod(), self.shape[0], self.shape[1], self.q_len, self.kv_len)
        return jnp.broadcast_to(dense, self.shape)

    def to_dense(self) -> jax.Array:
        """int32 [Bm, Hm, nq, nkv]: 1 for each tile that is computed (partial or full), as PyTorch."""
        return (self.tile_kinds != EMPTY).astype(jnp.int32)

    def sparsity(self) -> float:
        """Percentage of tiles that are not computed (empty), as PyTorch (host side, not under jit).
        PyTorch divides by the element count Bm*Hm*Lq*Lkv instead of the tile count, the same figure when
        the lengths are multiples of the tiles (and below 0 when they are not)."""
        return float(100.0 * (np.asarray(self.tile_kinds) == EMPTY).mean())

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """The tiles as a picture, one per (b, h) up to ``limit``, as PyTorch's ``to_string``: each cell
        two characters, "██" where every tile it covers is computed, "░░" where some are, "  " where none;
        at most ``grid_size`` (rows, cols) cells (-1: one cell per tile). Host side."""
        dense = np.asarray(self.to_dense())
        n_rows, n_cols = dense.shape[2:]
        if grid_size == -1:
            max_rows, max_cols = n_rows, n_cols
        elif isinstance(grid_size, (int, np.integer)):
            max_rows = max_cols = int(grid_size)
        else:
            max_rows, max_cols = grid_size
        row_step, col_step = max(1, _cdiv(n_rows, max_rows)), max(1, _cdiv(n_cols, max_cols))
        pictures = []
        for count, (b, h) in enumerate(np.ndindex(*dense.shape[:2])):
            if count == limit:
                pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                             "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            lines = [f"{(b, h)}"]
            for r in range(0, n_rows, row_step):
                cells = []
                for c in range(0, n_cols, col_step):
                    frac = dense[b, h, r:r + row_step, c:c + col_step].mean()
                    cells.append("██" if frac == 1 else "  " if frac == 0 else "░░")
                lines.append("".join(cells))
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
                f"{self.to_string().strip()}\n)")

    # --- cropping and indexing ------------------------------------------------------------------------

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The upper-left [new_q_len, new_kv_len] corner (PyTorch's ``_adjust``, used when decoding with a
        block mask built for the full length). Tiles keep their kinds; mask_mod is unchanged."""
        for name, val, old in (("new_q_len", new_q_len, self.q_len), ("new_kv_len", new_kv_len, self.kv_len)):
            if not isinstance(val, (int, np.integer)) or not 1 <= val <= old:
                raise ValueError(f"BlockMask._adjust: {name} must be an int in [1, {old}] (a crop of "
                                 f"shape {self.shape}), got {val!r}")
        nq, nkv = _cdiv(new_q_len, self.block_q), _cdiv(new_kv_len, self.block_kv)
        return _eager_if_concrete(lambda: block_mask_from_kinds(
            self.tile_kinds[:, :, :nq, :nkv], int(new_q_len), int(new_kv_len), self.block_q, self.block_kv,
            self.mask_mod, layout_defines_mask=self.layout_defines_mask))

    def __getitem__(self, index) -> "BlockMask":
        """``bm[b]``, ``bm[b, h]``, ``bm[b, h, q_tiles]`` with ints, slices or 1-D integer arrays (traced
        ones too): the block mask of those batch elements, heads and query-tile rows, as PyTorch.

        Differences from PyTorch: the result keeps all four dims (an int selects a dim of size 1, which
        broadcasts); it keeps its meaning, so mask_mod is carried over with its arguments mapped back to the
        selected batch elements, heads and rows (PyTorch replaces it by ``noop_mask``). Selecting query
        tiles gives Lq = (tiles selected) * block_q; rows past the original Lq attend nothing. An axis of
        size 1 (a mask independent of it) accepts any index."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise ValueError(f"BlockMask[...]: at most 3 indices (batch, head, query tile), got {len(index)}")
        kinds = self.tile_kinds
        sels = []
        for axis, idx in enumerate(index):
            sel = _axis_selection(idx, kinds.shape[axis], ("batch", "head", "query tile")[axis])
            if sel is not None:
                rows = sel if kinds.shape[axis] > 1 else jnp.zeros_like(sel)
                kinds = jnp.take(kinds, rows, axis=axis, mode="clip")
            sels.append(sel)
        sels += [None] * (3 - len(sels))
        sel_b, sel_h, sel_q = sels
        q_len = self.q_len if sel_q is None else int(sel_q.shape[0]) * self.block_q
        ragged = self.q_len % self.block_q != 0
        mod = self.mask_mod
        if mod is not None and any(s is not None for s in sels):
            reads_b, reads_h = _mods.reads_batch_head(mod)
            mod = _remapped_mod(mod, sel_b if reads_b else None, sel_h if reads_h else None, sel_q,
                                self.block_q, self.q_len if ragged and not self.layout_defines_mask else None)
        if sel_q is not None and ragged and not self.layout_defines_mask:
            # The old last tile stuck out past Lq: its extra rows are masked by the mod now, so it is no
            # longer full.
            last = (sel_q == self.num_tiles[0] - 1)[None, None, :, None]
            kinds = jnp.where(last & (kinds == FULL), jnp.int8(PARTIAL), kinds)
        return _eager_if_concrete(lambda: block_mask_from_kinds(
            kinds, q_len, self.kv_len, self.block_q, self.block_kv, mod,
            layout_defines_mask=self.layout_defines_mask))


def restrict_keys(block_mask: BlockMask, kv_lens: jax.Array) -> BlockMask:
    """The block mask with keys at or past ``kv_lens[b]`` (int32 [B]) masked as well: per batch element,
    tiles past the length become EMPTY and full tiles the length cuts become PARTIAL; the mod is the exact
    mod and'ed with the length (usable under jit with traced lengths)."""
    kinds = block_mask.tile_kinds
    lens = kv_lens.astype(jnp.int32)[:, None, None, None]
    starts = (jnp.arange(kinds.shape[3], dtype=jnp.int32) * block_mask.block_kv)[None, None, None, :]
    ends = jnp.minimum(starts + block_mask.block_kv, block_mask.kv_len)
    kinds = jnp.where(starts >= lens, jnp.int8(EMPTY),
                      jnp.where((ends > lens) & (kinds == FULL), jnp.int8(PARTIAL), kinds))
    mod = and_masks(block_mask.exact_mask_mod(), keys_below(kv_lens))
    return _eager_if_concrete(lambda: block_mask_from_kinds(kinds, block_mask.q_len, block_mask.kv_len,
                                                            block_mask.block_q, block_mask.block_kv, mod))


def keys_below(kv_lens: jax.Array) -> MaskMod:
    """mask_mod: key kv_idx of sequence b is visible when kv_idx < kv_lens[b] (int [B])."""
    lens = jnp.asarray(kv_lens)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    return mask_mod


def _axis_selection(idx, n: int, name: str):
    """int32 [k] indices selected on an axis of size n (None: the whole axis). n == 1 (the mask does not
    depend on the axis) accepts any index, and a slice keeps it as is."""
    if isinstance(idx, slice):
        if n == 1 or idx == slice(None):
            return None
        return jnp.asarray(np.arange(*idx.indices(n)), jnp.int32)
    if isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
        if n > 1 and not -n <= idx < n:
            raise ValueError(f"BlockMask[...]: {name} index {idx} is out of range for {n}")
        if n == 1 and idx < 0:
            raise ValueError(f"BlockMask[...]: {name} index {idx} must be >= 0 on an axis the mask does not depend on")
        return jnp.asarray([idx % n if n > 1 else idx], jnp.int32)
    arr = jnp.asarray(idx)
    if arr.ndim > 1 or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"BlockMask[...]: a {name} index must be an int, a slice or a 1-D integer array, got "
                         f"{arr.dtype} of shape {arr.shape}")
    arr = arr.reshape(-1)
    if not isinstance(arr, jax.core.Tracer):
        vals = np.asarray(arr)
        if vals.size == 0 or (n > 1 and ((vals < -n) | (vals >= n)).any()) or (n == 1 and (vals < 0).any()):
            raise ValueError(f"BlockMask[...]: {name} indices {vals.tolist()} are empty or out of range for {n}")
        arr = np.where(vals < 0, vals + n, vals) if n > 1 else vals
    return jnp.asarray(arr).astype(jnp.int32)


def _remapped_mod(mod: MaskMod, sel_b, sel_h, sel_q, block_q: int, old_q_len: int | None) -> MaskMod:
    """mask_mod of a sub-mask: its b / h / query row map back to the selected ones of the original.
    ``old_q_len``: mask rows that map past it (the original's ragged last tile)."""
    bq = np.int32(block_q)

    def remapped(b, h, q_idx, kv_idx):
        ok = True
        if sel_b is not None:
            b = sel_b[b]
        if sel_h is not None:
            h = sel_h[h]
        if sel_q is not None:
            q_idx = sel_q[jax.lax.div(q_idx, bq)] * bq + jax.lax.rem(q_idx, bq)
            if old_q_len is not None:
                ok = q_idx < old_q_len
        return mod(b, h, q_idx, kv_idx) & ok

    return remapped


def _block_size(op: str, BLOCK_SIZE, block_q, block_kv) -> tuple[int, int]:  # noqa: N803
    """(block_q, block_kv) from PyTorch's ``BLOCK_SIZE`` (int or pair) and/or our keywords."""
    if BLOCK_SIZE is not None:
        pair = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, (int, np.integer)) else tuple(BLOCK_SIZE)
        if len(pair) != 2:
            raise ValueError(f"{op}: BLOCK_SIZE must be an int or (block_q, block_kv), got {BLOCK_SIZE!r}")
        for name, mine, theirs in (("block_q", block_q, pair[0]), ("block_kv", block_kv, pair[1])):
            if mine is not None and mine != theirs:
                raise ValueError(f"{op}: BLOCK_SIZE={BLOCK_SIZE!r} disagrees with {name}={mine}")
        block_q, block_kv = pair
    block_q = DEFAULT_BLOCK if block_q is None else block_q
    block_kv = DEFAULT_BLOCK if block_kv is None else block_kv
    for name, val in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{op}: {name} (BLOCK_SIZE) must be a positive int, got {val!r}")
    return int(block_q), int(block_kv)


def _eager_if_concrete(build: Callable[[], BlockMask]) -> BlockMask:
    try:
        # Eager wherever the inputs are concrete; a captured tracer stages the ops as usual.
        with jax.ensure_compile_time_eval():
            return build()
    except Exception:  # noqa: BLE001
        # No device to evaluate on (tracing under an abstract mesh for another platform): stage it.
        # A genuine error of the mod is raised again by the staged build.
        return build()


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
                          mask_mod: MaskMod | None = None, layout_defines_mask: bool = False) -> BlockMask:
    """Builds the index lists of a BlockMask from its int8 [Bm, Hm, nq, nkv] tile kinds."""
    partial, full = tile_kinds == PARTIAL, tile_kinds == FULL
    kv_num, kv_idx = _indices_of(partial)
    full_kv_num, full_kv_idx = _indices_of(full)
    q_num, q_idx = _indices_of(jnp.swapaxes(partial, -1, -2))
    full_q_num, full_q_idx = _indices_of(jnp.swapaxes(full, -1, -2))
    return BlockMask(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx,
                     tile_kinds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv,
                     mask_mod=mask_mod, layout_defines_mask=layout_defines_mask)


DEFAULT_BLOCK = 128     # create_block_mask's default tile (both axes), as in torch's FlexAttention


def create_block_mask(mask_mod: MaskMod | None, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      *, block_q: int | None = None, block_kv: int | None = None,
                      BLOCK_SIZE: int | tuple[int, int] | None = None) -> BlockMask:  # noqa: N803
    """The tile structure of ``mask_mod`` over [B, H, Q_LEN, KV_LEN], for reuse across calls.

    Cuts the [Q_LEN, KV_LEN] plane into ``block_q x block_kv`` tiles and classifies each as empty, partial
    or full, so kernels skip empty tiles and evaluate ``mask_mod`` only on partial ones.

    Args:
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` written for scalars (True = attend), or None
        (no mask: every tile full).
      B, H: batch size and query heads, or None when the mask does not depend on them (a mod that reads
        ``b`` / ``h`` then raises).
      Q_LEN, KV_LEN: sequence lengths. block_q, block_kv: tile sizes (default 128); or ``BLOCK_SIZE``,
        PyTorch's spelling: an int (both) or (block_q, block_kv).

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
    block_q, block_kv = _block_size("create_block_mask", BLOCK_SIZE, block_q, block_kv)
    for name, val in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
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

    return _eager_if_concrete(build)


def noop_mask(b, h, q_idx, kv_idx):
    """Every position attends (PyTorch's ``noop_mask``)."""
    return jnp.ones((), jnp.bool_)


def create_mask(mod_fn: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int) -> jax.Array:
    """bool [B or 1, H or 1, Q_LEN, KV_LEN]: a mask_mod evaluated at every position, or where a score_mod
    (five arguments) leaves a score finite, as PyTorch's ``create_mask`` (small shapes; tests)."""
    params = [p for p in inspect.signature(mod_fn).parameters.values()
              if p.default is inspect.Parameter.empty] if callable(mod_fn) else []
    kind = "score" if len(params) == 5 else "mask"
    _mods.check_mod("create_mask", mod_fn, kind)
    for name, val in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if (val is not None or name in ("Q_LEN", "KV_LEN")) and (not isinstance(val, (int, np.integer)) or val < 1):
            raise ValueError(f"create_mask: {name} must be a positive int{' or None' if name in 'BH' else ''}, "
                             f"got {val!r}")
    shape = (B or 1, H or 1, Q_LEN, KV_LEN)
    if kind == "mask":
        return jnp.broadcast_to(_evaluate_dense(mod_fn, *shape), shape)
    b, h, q, kv = (jnp.arange(n, dtype=jnp.int32).reshape([n if i == a else 1 for i in range(4)])
                   for a, n in enumerate(shape))
    scores = _mods.apply_mod(mod_fn, jnp.zeros(shape, jnp.float32), b, h, q, kv)
    return scores != -jnp.inf


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
