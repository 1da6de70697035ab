"""In-kernel helpers shared by the flash-attention kernels (forward, dK/dV, dQ): tile positions and edge
masks, masked tile loads/stores, the online-softmax update, and score_mod / mask_mod evaluation on a tile
including mods that capture arrays.

Captured arrays (segment ids, ALiBi slopes, a relative-bias table) cannot be closed over by a Pallas
kernel, and the Triton lowering has no ``gather``. :class:`TileMod` therefore

1. traces the mod once (``jax.make_jaxpr``) to find the arrays it closes over (``TileMod.captured``);
   the caller passes them to ``pallas_call`` as extra inputs (whole-array BlockSpecs, see
   :func:`captured_specs`) and to ``custom_vjp`` as differentiable arguments;
2. inside the kernel, re-traces the mod for the tile's shapes and evaluates its jaxpr with each captured
   array replaced by its *ref*: point gathers ``x[b, q_idx]`` / ``table[h, offset]`` and
   ``dynamic_slice`` reads ``slopes[h]`` become ref loads with (clamped) index arrays, which the Triton
   lowering turns into pointer gathers; every other primitive is bound as usual.
The same ``TileMod`` evaluates with plain arrays outside a kernel (XLA paths, vjp through the captured
arrays). A mod whose captured-array use is not a point read raises :class:`UnsupportedModError` while the
kernel is traced; ``flex_attention_pallas`` then routes the call to the XLA path.

Conventions: inside a kernel the mods see ``b``, ``h`` as int32 scalars, ``q_idx`` int32 [BQ, 1] and
``kv_idx`` int32 [1, BKV]; the score is float32 [BQ, BKV].

Numerics of the online softmax (:func:`softmax_update`): the running max is kept in the scores' own
units and the base-2 factor (scale * log2 e) is folded into one FMA in front of ``ex2`` (:func:`exp2_fma`);
masked scores are ``-inf``. A row whose maximum is still ``-inf`` (nothing allowed so far) subtracts 0
instead, so ``exp2(-inf - 0) = 0`` and no ``inf - inf`` NaN appears; such a row ends with l = 0,
output 0 and lse = -inf (:func:`softmax_finalize`).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.state.types import AbstractRef
from jax.extend.core import Literal
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax._precision import pallas_precision
from flashlax.parallel.vma import match_vma

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class UnsupportedModError(NotImplementedError):
    """A score_mod / mask_mod uses a captured array in a way the kernels cannot evaluate in-kernel."""


def pow2(n: int) -> int:
    """Smallest power of two >= n (Triton tensor dims must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


# ----------------------------------------------------------------------------------------------------
# Tile positions, edge masks, masked loads and stores
# ----------------------------------------------------------------------------------------------------

def i32(x):
    """An index as int32: Python ints, and the int64 that jax_enable_x64 gives loop counters and literals,
    so every index of one slice has one integer type (the interpreter's dynamic_slice requires it)."""
    if isinstance(x, (int, np.integer)):
        return np.int32(x)
    return x if x.dtype == jnp.int32 else x.astype(jnp.int32)


def ds(start, size: int):
    """``pl.ds`` with an int32 start (see :func:`i32`)."""
    return pl.ds(i32(start), size)


def tile_positions(q_start, kv_start, block_q: int, block_kv: int):
    """(q_idx int32 [BQ, 1], kv_idx int32 [1, BKV]): absolute positions of a tile's rows and columns."""
    q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    return q_idx, kv_idx


def row_mask(start, rows: int, n_rows: int):
    """bool [rows]: which of rows start .. start+rows-1 lie inside an axis of length n_rows."""
    return (start + jnp.arange(rows, dtype=jnp.int32)) < n_rows


def sum_all(x):
    """Sum of every element of a tile, one axis at a time: Pallas' Triton lowering of a reduction over two
    axes breaks inside a mesh with Explicit axes (it keeps the 2-D sharding on the 1-D step; jax 0.11.2)."""
    while x.ndim > 1:
        x = jnp.sum(x, axis=-1)
    return jnp.sum(x)


def tile_mask(start, rows: int, n_rows: int, cols: int, n_cols: int, aligned: bool):
    """bool [rows, cols] mask of the cells of a tile from row ``start`` that lie inside [n_rows, n_cols]
    (None when every cell does: ``aligned`` rows and no column padding)."""
    mask = None
    if not (aligned and n_rows % rows == 0):
        mask = jnp.broadcast_to(row_mask(start, rows, n_rows)[:, None], (rows, cols))
    if cols != n_cols:
        col_ok = jnp.broadcast_to((jnp.arange(cols, dtype=jnp.int32) < n_cols)[None, :], (rows, cols))
        mask = col_ok if mask is None else mask & col_ok
    return mask


@dataclasses.dataclass(frozen=True)
class Pages:
    """A paged K/V ref as one kernel program sees it (``flashlax.paged``): the K/V ref is
    [num_pages, page_size, C] (one KV head of the pool) and ``table`` the int32 [max_pages] ref of this
    sequence's block table; logical row r lives at row r % page_size of page table[r // page_size].

    ``lookup`` says how a tile finds its pages (:func:`page_ids`): "auto" (one scalar table read when one
    page holds the tile, a vector read of one entry per row otherwise), "rows" (the vector read always),
    "scalars" (one scalar read per page of the tile, spread over its rows by selects)."""

    table: Any
    page_size: int
    num_pages: int
    max_pages: int
    lookup: str = "auto"


def page_read(lookup: str, page_size: int, rows: int) -> str:
    """How :func:`page_ids` reads the block table for a tile of ``rows`` rows: "one" (one scalar read: one
    page holds the tile), "scalars" (one scalar read per page of the tile) or "rows" (a [rows] vector read,
    one entry per row: a load Triton's pipeliner pipelines, so K/V loads that use it in the same loop step
    count as indirect loads)."""
    if page_size % rows == 0 and lookup != "rows":
        return "one"
    if lookup == "scalars" and rows % page_size == 0:
        return "scalars"
    return "rows"


def page_ids(pages: Pages, start, rows: int):
    """The pool pages of the logical rows start .. start+rows-1 (``start`` a multiple of ``rows``): an int32
    scalar when one page holds them all and ``pages.lookup`` is not "rows", else int32 [rows], one per row
    (:func:`page_read`). Table entries and page numbers are clamped into range, so entries past the
    sequence, whatever they hold, never address outside the pool."""
    ps = np.int32(pages.page_size)

    def read(entry):
        return jnp.clip(pages.table[jnp.clip(entry, 0, pages.max_pages - 1)], 0, pages.num_pages - 1)

    how = page_read(pages.lookup, pages.page_size, rows)
    if how == "one":
        return read(lax.div(i32(start), ps))
    iota = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    if how == "scalars":
        first = lax.div(i32(start), ps)
        ids = jnp.broadcast_to(read(first), (rows,))
        for k in range(1, rows // pages.page_size):
            ids = jnp.where(iota >= k * pages.page_size, read(first + k), ids)
        return ids
    return read(lax.div(i32(start) + iota, ps))


def kv_tile_view(ref, start, rows: int, cols: int, pages: Pages | None = None, page=None):
    """``ref.at[...]`` of the logical rows start .. start+rows-1, columns 0 .. cols-1 of a K/V ref: a
    [L, >= cols] ref, or a paged one (``pages``; ``page``: the tile's :func:`page_ids` when the caller read
    them already, e.g. one loop step ahead). A scalar page is one block of that page; a vector of pages (one
    per row) is a row gather."""
    if pages is None:
        return ref.at[ds(start, rows), ds(0, cols)]
    if page is None:
        page = page_ids(pages, start, rows)
    ps = np.int32(pages.page_size)
    if jnp.ndim(page) == 0:
        return ref.at[page, ds(pl.multiple_of(lax.rem(i32(start), ps), rows), rows), ds(0, cols)]
    pos = i32(start) + lax.broadcasted_iota(jnp.int32, (rows,), 0)
    return ref.at[page[:, None], lax.rem(pos, ps)[:, None], lax.broadcasted_iota(jnp.int32, (1, cols), 1)]


def load_tile(ref, start, rows: int, n_rows, cols: int, n_cols: int, aligned: bool = False,
              pages: Pages | None = None):
    """[rows, cols] tile of a [n_rows, >= n_cols] ref from row ``start``; 0 outside the array.

    ``cols`` is the power-of-two padded width (head dim 96 -> 128): columns >= n_cols read as 0, so they
    add nothing to q.k and produce columns that are never stored. ``aligned=True`` promises ``start`` is a
    multiple of ``rows`` below n_rows; when also n_rows % rows == 0 the row mask is dropped (plain loads).
    ``n_rows`` may be traced (a per-sequence length; pass aligned=False). ``pages``: a paged K/V ref
    (:func:`kv_tile_view`).
    """
    mask = tile_mask(start, rows, n_rows, cols, n_cols, aligned)
    view = kv_tile_view(ref, start, rows, cols, pages)
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=mask, other=0.0)


def store_tile(ref, start, val, n_rows: int, n_cols: int, aligned: bool = False):
    """Stores val [rows, cols] at row ``start`` of a [n_rows, >= n_cols] ref, skipping out-of-range cells."""
    rows, cols = val.shape
    mask = tile_mask(start, rows, n_rows, cols, n_cols, aligned)
    plgpu.store(ref.at[ds(start, rows), ds(0, cols)], val.astype(ref.dtype), mask=mask)


def load_vec(ref, start, rows: int, n_rows: int, other=0.0):
    """[rows] slice of a [n_rows] ref from ``start``; ``other`` outside."""
    return plgpu.load(ref.at[ds(start, rows)], mask=row_mask(start, rows, n_rows), other=other)


def store_vec(ref, start, val, n_rows: int):
    plgpu.store(ref.at[ds(start, val.shape[0])], val.astype(ref.dtype),
                mask=row_mask(start, val.shape[0], n_rows))


def leading_run(count, indices):
    """(first [...], run [...]) int32 of block-mask lists (host side, before a kernel): each list's first
    tile index and the length of the run of consecutive indices first, first + 1, ... at its start (at
    most ``count``); kernels step that run by address arithmetic instead of index loads."""
    first = indices[..., 0]
    j = jnp.arange(indices.shape[-1], dtype=jnp.int32).reshape((1,) * (indices.ndim - 1) + (-1,))
    consecutive = (indices == first[..., None] + j) & (j < count[..., None])
    run = jnp.cumprod(consecutive.astype(jnp.int32), axis=-1).sum(-1, dtype=jnp.int32)
    return first.astype(jnp.int32), run


def kv_edge_bias(kv_start, block_kv: int, kv_len: int):
    """float32 [1, BKV]: 0 for columns < kv_len, -inf past the end (added to base-2 scores).

    Only needed when kv_len % block_kv != 0; callers skip it statically otherwise.
    """
    ok = row_mask(kv_start, block_kv, kv_len)[None, :]
    return jnp.where(ok, 0.0, -jnp.inf).astype(jnp.float32)


def dot_nt(a, b, precision=None):
    """a [m, k] @ b [n, k]^T -> [m, n] float32. float32 inputs: pass precision=HIGHEST (IEEE, no tf32)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_nn(a, b, precision=None):
    """a [m, k] @ b [k, n] -> [m, n] float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_tn(a, b, precision=None):
    """a [k, m]^T @ b [k, n] -> [m, n] float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


# Matmul precision for inputs of a dtype: IEEE float32 (HIGHEST) for float32 unless the caller asks for tf32,
# None (native tensor-core path) for 16-bit inputs (flashlax/_precision.py)
dot_precision = pallas_precision


# ----------------------------------------------------------------------------------------------------
# Online softmax (base-2 domain, float32 statistics)
# ----------------------------------------------------------------------------------------------------

def _f32_imm(x: float) -> str:
    """A float32 constant as a PTX immediate (0fXXXXXXXX)."""
    return "0f" + struct.pack(">f", float(x)).hex().upper()


def _fma_asm(x, a: float, b, then_ex2: bool, interpret: bool):
    """x * a + b (then 2** of it) in float32; on the GPU one inline-PTX ``fma.rn.f32`` (and one
    ``ex2.approx.ftz.f32``) per element, so the multiply and the add cannot end up as two instructions."""
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), x.shape)
    if interpret or x.dtype != jnp.float32:
        y = x * a + b
        return jnp.exp2(y) if then_ex2 else y
    fma_ptx = "fma.rn.f32 {dst}, $1, " + _f32_imm(a) + ", $2;"
    asm = ("{ .reg .f32 t; " + fma_ptx.format(dst="t") + " ex2.approx.ftz.f32 $0, t; }" if then_ex2
           else fma_ptx.format(dst="$0"))
    [out] = plgpu.elementwise_inline_asm(asm, args=[x, b], constraints="=f,f,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return out


def exp2_fma(x, a: float, b, interpret: bool = False):
    """2**(x * a + b) in float32: x [m, n], a a Python float, b broadcastable to x (a per-row [m, 1]).
    On the GPU one FMA and one ex2 per element (:func:`_fma_asm`). Interpreted: jnp.exp2(x * a + b)."""
    return _fma_asm(x, a, b, True, interpret)


def fma(x, a: float, b, interpret: bool = False):
    """x * a + b in float32 with one ``fma.rn.f32`` per element on the GPU (x [m, n], a a Python float, b
    broadcastable to x)."""
    return _fma_asm(x, a, b, False, interpret)


def exponent_factor(scale: float, has_score_mod: bool) -> float:
    """The base-2 factor ``mult`` of :func:`softmax_update` for a kernel's scores: scale * log2 e on raw q.k
    (scale > 0, no score_mod), 1 when a non-positive scale is applied to the scores first, log2 e after a
    score_mod (it sees scaled scores). The running max is taken in the scores' units, so it is positive."""
    if has_score_mod:
        return LOG2E
    return scale * LOG2E if scale > 0 else 1.0


def kernel_scores(qk, scale: float, score_mod, caps, b, h, q_idx, kv_idx):
    """A tile's scores in the units :func:`exponent_factor` turns into base-2 exponents: raw q.k (scale > 0,
    no score_mod), q.k * scale * log2 e (scale <= 0), or the score_mod of the scaled scores."""
    if score_mod is None:
        return qk if scale > 0 else qk * (scale * LOG2E)
    return score_mod(caps, qk * scale, b, h, q_idx, kv_idx)


def softmax_update(s, m_prev, l_prev, mult: float, interpret: bool = False):
    """One KV tile of the online softmax with the base-2 factor folded into the exponent's FMA.

    s: float32 [BQ, BKV] scores in any positive multiple of the natural-log domain (raw q.k when there is
    no score_mod), -inf where masked; ``mult`` > 0 turns them into base-2 exponents (scale * log2 e, or
    log2 e after a score_mod). m_prev, l_prev: float32 [BQ] running max (in s's units) and sum.
    p = 2**(s * mult - m * mult) is one FMA and one ex2 per element (:func:`exp2_fma`), one multiply per
    element less than scaling the scores first (H200: 1-2% off the forward, session 4).
    Returns (p [BQ, BKV] float32, alpha [BQ], m_new, l_new); the caller forms
    ``acc_new = alpha[:, None] * acc_prev + p @ v`` (kept separate so it can cast p to v's dtype).
    """
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)      # nothing allowed yet: avoid -inf - -inf
    p = exp2_fma(s, mult, (-mult * m_use)[:, None], interpret)
    alpha = jnp.exp2((m_prev - m_use) * mult)
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    return p, alpha, m_new, l_new


def softmax_finalize(acc, m, l, mult: float = 1.0):
    """(out float32 [BQ, Dv], lse float32 [BQ] natural log). ``m * mult`` is the base-2 running max.
    Rows with l == 0 (fully masked) give out = 0 and lse = -inf."""
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[:, None]
    lse = jnp.where(empty, -jnp.inf, (m * mult + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# score_mod / mask_mod on a tile, with captured arrays
# ----------------------------------------------------------------------------------------------------

def _is_ref(x) -> bool:
    aval = getattr(x, "aval", None)
    return isinstance(aval, AbstractRef)


@dataclasses.dataclass(frozen=True, eq=False)
class TileMod:
    """A score_mod or mask_mod traced once, for scalars, with the arrays it closes over made explicit.

    kind: "score" (``fn(score, b, h, q_idx, kv_idx)``) or "mask" (``fn(b, h, q_idx, kv_idx)``).
    jaxpr: ``fn`` traced with scalar arguments (the FlexAttention convention: mods are written for
    scalars). captured: every array the trace closed over (segment ids, slopes, tables, constants), in
    the order of ``jaxpr.constvars``.

    ``tm(captured, *args)`` evaluates the mod on arguments of any broadcast-compatible shapes (a kernel
    tile: b, h scalars, q_idx [BQ, 1], kv_idx [1, BKV]; a dense XLA plane; a backward sub-tile), with
    ``captured[i]`` standing for ``self.captured[i]``. ``captured[i]`` may be an array or a tracer (XLA
    side: differentiable in it, also under ``jax.vjp``) or a Pallas ref (inside a kernel: reads become ref
    loads with index arrays, i.e. pointer gathers in the Triton lowering). The scalar jaxpr is evaluated
    elementwise with broadcasting, so it is never re-traced: nothing touches the original closure again,
    which keeps the backward free of leaked tracers. The result is broadcast to the arguments' common
    shape, float32 for score mods and bool for mask mods. Unsupported captured-array uses raise
    :class:`UnsupportedModError` (only point reads ``x[i, j]`` of captured arrays are supported).
    """

    fn: Callable
    kind: str
    jaxpr: Any
    captured: tuple

    @staticmethod
    def make(fn: Callable | None, kind: str) -> "TileMod | None":
        """Traces ``fn`` once for scalars; None for None. Call while captured tracers are alive."""
        if fn is None:
            return None
        closed = jax.make_jaxpr(fn)(*_scalar_args(kind))
        if len(closed.jaxpr.outvars) != 1:
            raise ValueError(f"{kind}_mod must return one array, got {len(closed.jaxpr.outvars)} outputs")
        tm = TileMod(fn, kind, closed.jaxpr, tuple(closed.consts))
        # Evaluate once abstractly on a small tile so unsupported uses fail here, before any kernel.
        jax.eval_shape(lambda caps: tm(caps, *_tile_args(kind, 2, 2)),
                       [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in tm.captured])
        return tm

    @property
    def num_captured(self) -> int:
        return len(self.captured)

    @property
    def tile_reads(self) -> int:
        """How many captured-array reads index by both q_idx and kv_idx (a [BQ, BKV] pointer gather, as
        in a relative-bias table). Triton stages each such tile through shared memory for its layout
        change, which the configs' shared-memory estimate must count; reads by q_idx or kv_idx alone
        (segment ids) or by b/h (slopes) are vectors or scalars and cost nothing there."""
        q_pos, kv_pos = (3, 4) if self.kind == "score" else (2, 3)
        taint = {v: frozenset() for v in self.jaxpr.invars}
        taint[self.jaxpr.invars[q_pos]] = frozenset("q")
        taint[self.jaxpr.invars[kv_pos]] = frozenset("k")
        return _count_tile_reads(self.jaxpr, taint, set(self.jaxpr.constvars))

    def __call__(self, captured: Sequence[Any], *args):
        if len(captured) != len(self.captured):
            raise ValueError(f"TileMod: expected {len(self.captured)} captured arrays, got {len(captured)}")
        n_args = 5 if self.kind == "score" else 4
        if len(args) != n_args:
            raise ValueError(f"TileMod: a {self.kind}_mod takes {n_args} arguments, got {len(args)}")
        args = [jnp.asarray(a) for a in args]
        # Indices are int32 (the mod was traced so); int64 ones come from jnp.arange under jax_enable_x64.
        args = [a.astype(jnp.int32) if jnp.issubdtype(a.dtype, jnp.integer) and a.dtype != jnp.int32 else a
                for a in args]
        out = _eval_jaxpr(self.jaxpr, [_Captured(c) for c in captured], args)[0]
        if isinstance(out, (_Captured, _Cols)):
            raise UnsupportedModError(f"{self.kind}_mod returns a captured array itself")
        shape = jnp.broadcast_shapes(*[jnp.shape(a) for a in args])
        out = jnp.broadcast_to(out, shape)
        return out.astype(jnp.float32) if self.kind == "score" else out.astype(jnp.bool_)


def make_tile_mods(score_mod: Callable | None, mask_mod: Callable | None):
    """(score TileMod or None, mask TileMod or None), or None when a mod reads its captured arrays in a way
    a kernel cannot (a slice or a reduction, not a point read: UnsupportedModError); the caller then takes
    its XLA path, which computes the same result. Mods are traced once, for scalars."""
    try:
        return TileMod.make(score_mod, "score"), TileMod.make(mask_mod, "mask")
    except UnsupportedModError:
        return None


def _count_tile_reads(jaxpr, taint: dict, captured: set) -> int:
    """Counts gathers / dynamic slices of captured arrays whose indices depend on both q and kv."""
    def get(v):
        return frozenset() if isinstance(v, Literal) else taint.get(v, frozenset())

    count = 0
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        union = frozenset().union(*ins) if ins else frozenset()
        name = eqn.primitive.name
        if name in ("gather", "dynamic_slice") and not isinstance(eqn.invars[0], Literal) \
                and eqn.invars[0] in captured and frozenset(union) >= {"q", "k"}:
            count += 1
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if inner is not None and hasattr(inner, "eqns" if not hasattr(inner, "jaxpr") else "jaxpr"):
            inner_jaxpr = inner.jaxpr if hasattr(inner, "jaxpr") else inner
            inner_taint = dict(zip(inner_jaxpr.invars, ins))
            inner_captured = set(inner_jaxpr.constvars) | {iv for iv, v in zip(inner_jaxpr.invars, eqn.invars)
                                                           if not isinstance(v, Literal) and v in captured}
            count += _count_tile_reads(inner_jaxpr, inner_taint, inner_captured)
        for v in eqn.outvars:
            taint[v] = union
    return count


def _scalar_args(kind: str):
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    if kind == "score":
        return [jax.ShapeDtypeStruct((), jnp.float32), i32, i32, i32, i32]
    if kind == "mask":
        return [i32, i32, i32, i32]
    raise ValueError(f"TileMod: kind must be 'score' or 'mask', got {kind!r}")


def _tile_args(kind: str, bq: int, bkv: int):
    i32 = jnp.int32
    idx = [jnp.int32(0), jnp.int32(0), jnp.zeros((bq, 1), i32), jnp.zeros((1, bkv), i32)]
    return ([jnp.zeros((bq, bkv), jnp.float32)] + idx) if kind == "score" else idx


def captured_specs(captured: Sequence[Any]) -> list:
    """Whole-array BlockSpecs for captured arrays (one block covering the array, for every program)."""
    return [pl.BlockSpec(tuple(jnp.shape(c)), (lambda nd: (lambda *_: (0,) * nd))(jnp.ndim(c)))
            for c in captured]


# --- the evaluator ---------------------------------------------------------------------------------
# Every runtime value stands for a field of scalars: its nominal aval in the jaxpr has size 1 (shape ()
# or (1, ..., 1)), its runtime shape is whatever the arguments broadcast to. Elementwise primitives are
# bound after broadcasting their operands; size-1 reshapes are identities; reads of a captured array
# (dynamic_slice of size 1, or a point gather whose index vector was concatenated from scalars) become
# point loads x[i, j, ...] with index arrays clamped into range.

@dataclasses.dataclass
class _Captured:
    x: Any            # array, tracer, or Pallas ref


@dataclasses.dataclass
class _Cols:
    cols: list        # an index vector (nominal shape (k,)) held as k scalar fields


def _unit(aval) -> bool:
    return all(d == 1 for d in getattr(aval, "shape", ()))


_RESHAPES = ("squeeze", "reshape", "broadcast_in_dim", "expand_dims", "copy", "copy_p", "transpose")
# Reductions of a size-1 value are the value itself.
_UNIT_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                    "reduce_xor")
# Primitives that act element by element: evaluating them on a whole tile is the scalar mod applied to
# each element. Anything else in a mod is not evaluated on tiles (UnsupportedModError).
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type cos cosh digamma
    div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or population_count pow real reduce_precision rem round
    rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan
    tanh xor
""".split())


def _point_load(x, shape, index_of_dim: dict):
    """x[i_0, ..., i_n], i_d = index_of_dim.get(d, 0) clamped into [0, shape[d] - 1], broadcast together."""
    if not shape:
        return x[...]
    idx = [jnp.clip(jnp.asarray(index_of_dim.get(d, 0)).astype(jnp.int32), 0, n - 1)
           for d, n in enumerate(shape)]
    if all(jnp.ndim(i) == 0 for i in idx):
        return x[tuple(idx)]
    idx = jnp.broadcast_arrays(*idx)
    return x[tuple(idx)]


def _eval_jaxpr(jaxpr, consts, args):
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        outs = _eval_eqn(eqn, [read(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, vals):
    prim, params, name = eqn.primitive, eqn.params, eqn.primitive.name
    if name not in ("dynamic_slice", "gather"):
        # A captured array of one element (a traced scale, a temperature) used as a value: a point read.
        vals = [_point_load(v.x, tuple(var.aval.shape), {}) if isinstance(v, _Captured) and _unit(var.aval)
                else v for v, var in zip(vals, eqn.invars)]
    if name == "dynamic_slice" and isinstance(vals[0], _Captured):
        sizes = tuple(params["slice_sizes"])
        shape = tuple(eqn.invars[0].aval.shape)
        if any(s != 1 for s in sizes):
            raise UnsupportedModError(f"a mod slices {sizes} out of a captured array of shape {shape}; "
                                      "only point reads x[i, j, ...] are supported in the kernels")
        return [_point_load(vals[0].x, shape, dict(enumerate(vals[1:])))]
    if name == "gather" and isinstance(vals[0], _Captured):
        return [_gather(vals[0].x, tuple(eqn.invars[0].aval.shape), vals[1], **params)]
    if name == "concatenate" and all(_unit(v.aval) for v in eqn.invars) and len(eqn.outvars[0].aval.shape) == 1:
        return [_Cols([_field(x) for x in vals])]
    if name in ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat",
                "checkpoint"):
        inner = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
        if inner is None:
            raise UnsupportedModError(f"cannot evaluate the {name} primitive inside a mod")
        jaxpr, consts = (inner.jaxpr, [_Captured(c) for c in inner.consts]) if hasattr(inner, "consts") \
            else (inner, [])
        return _eval_jaxpr(jaxpr, consts, vals)
    if any(isinstance(v, (_Captured, _Cols)) for v in vals):
        raise UnsupportedModError(f"a mod uses a captured array in a {name} primitive; only point reads "
                                  "x[i, j, ...] are supported in the kernels")
    if not all(_unit(v.aval) for v in list(eqn.invars) + list(eqn.outvars)):
        raise UnsupportedModError(f"a mod builds a non-scalar value with {name} "
                                  f"({[v.aval for v in eqn.outvars]}); mods must be written for scalars")
    if name in _RESHAPES or name in _UNIT_REDUCTIONS:   # identities on fields of scalars
        return [vals[0]]
    if name == "dot_general":                            # a product of two size-1 operands
        out_dtype = params.get("preferred_element_type") or jnp.result_type(*vals)
        return [(jnp.asarray(vals[0]) * jnp.asarray(vals[1])).astype(out_dtype)]
    if name not in _ELEMENTWISE:
        # Not provably point-wise on a tile (sort, cumsum, scatter, ...): the caller takes a correct path.
        raise UnsupportedModError(f"a mod uses the {name} primitive, which the kernels do not evaluate on tiles")
    vals = [jnp.asarray(v) for v in vals]
    shape = jnp.broadcast_shapes(*[v.shape for v in vals]) if vals else ()
    vals = [jnp.broadcast_to(v, shape) if v.shape != shape else v for v in vals]
    vals = match_vma(vals, *vals)   # XLA side inside shard_map: literals vary like the other operands
    out = prim.bind(*vals, **params)
    return list(out) if prim.multiple_results else [out]


def _field(x):
    if isinstance(x, _Cols):
        if len(x.cols) != 1:
            raise UnsupportedModError("nested index vectors in a mod")
        return x.cols[0]
    return x


def _gather(x, shape, indices, *, dimension_numbers, slice_sizes, mode, fill_value, **_):
    dn = dimension_numbers
    if (dn.offset_dims or dn.operand_batching_dims or any(s != 1 for s in slice_sizes)
            or tuple(sorted(dn.collapsed_slice_dims)) != tuple(range(len(shape)))):
        raise UnsupportedModError(f"gather from a captured array of shape {shape} with {dn}, "
                                  f"slice_sizes={slice_sizes}: only point reads x[i, j, ...] are supported")
    cols = indices.cols if isinstance(indices, _Cols) else [indices]
    index_of_dim = dict(zip(dn.start_index_map, cols))
    val = _point_load(x, shape, index_of_dim)
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        ok = True
        for d, i in index_of_dim.items():
            ok = ok & (i >= 0) & (i < shape[d])
        fill = fill_value if fill_value is not None else (
            jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0)
        val = jnp.where(ok, val, jnp.asarray(fill, val.dtype))
    return val
