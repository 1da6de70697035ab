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

Numerics of the online softmax (:func:`softmax_update`): scores are kept in the base-2 domain
(``s * log2(e)``) so the kernel uses ``exp2``; masked scores are ``-inf``. A row whose maximum is still
``-inf`` (nothing allowed so far) subtracts 0 instead, so ``exp2(-inf - 0) = 0`` and no ``inf - inf`` NaN
appears; such a row ends with l = 0, output 0 and lse = -inf (:func:`softmax_finalize`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.state.types import AbstractRef
from jax.extend.core import Literal
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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

def tile_positions(q_start, kv_start, block_q: int, block_kv: int):
    """(q_idx int32 [BQ, 1], kv_idx int32 [1, BKV]): absolute positions of a tile's rows and columns."""
    q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    return q_idx, kv_idx


def row_mask(start, rows: int, n_rows: int):
    """bool [rows]: which of rows start .. start+rows-1 lie inside an axis of length n_rows."""
    return (start + jnp.arange(rows, dtype=jnp.int32)) < n_rows


def load_tile(ref, start, rows: int, n_rows: int, cols: int, n_cols: int):
    """[rows, cols] tile of a [n_rows, >= n_cols] ref from row ``start``; 0 outside the array.

    ``cols`` is the power-of-two padded width (head dim 96 -> 128): columns >= n_cols read as 0, so they
    add nothing to q.k and produce columns that are never stored.
    """
    mask = row_mask(start, rows, n_rows)[:, None]
    if cols != n_cols:
        mask = mask & (jnp.arange(cols, dtype=jnp.int32) < n_cols)[None, :]
    return plgpu.load(ref.at[pl.ds(start, rows), pl.ds(0, cols)], mask=mask, other=0.0)


def store_tile(ref, start, val, n_rows: int, n_cols: int):
    """Stores val [rows, cols] at row ``start`` of a [n_rows, >= n_cols] ref, skipping out-of-range cells."""
    rows, cols = val.shape
    mask = row_mask(start, rows, n_rows)[:, None]
    if cols != n_cols:
        mask = mask & (jnp.arange(cols, dtype=jnp.int32) < n_cols)[None, :]
    plgpu.store(ref.at[pl.ds(start, rows), pl.ds(0, cols)], val.astype(ref.dtype), mask=mask)


def load_vec(ref, start, rows: int, n_rows: int, other=0.0):
    """[rows] slice of a [n_rows] ref from ``start``; ``other`` outside."""
    return plgpu.load(ref.at[pl.ds(start, rows)], mask=row_mask(start, rows, n_rows), other=other)


def store_vec(ref, start, val, n_rows: int):
    plgpu.store(ref.at[pl.ds(start, val.shape[0])], val.astype(ref.dtype),
                mask=row_mask(start, val.shape[0], n_rows))


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


def dot_precision(dtype) -> Any:
    """Matmul precision for inputs of ``dtype``: HIGHEST for float32 (the Triton lowering maps DEFAULT and
    HIGH to tf32, HIGHEST to IEEE float32), None (native tensor-core path) for 16-bit inputs."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ----------------------------------------------------------------------------------------------------
# Online softmax (base-2 domain, float32 statistics)
# ----------------------------------------------------------------------------------------------------

def softmax_update(s2, m_prev, l_prev, acc_prev):
    """One KV tile of the online softmax.

    s2: float32 [BQ, BKV] scores times log2(e), -inf where masked. m_prev, l_prev: float32 [BQ] running
    max (base 2) and sum; acc_prev: float32 [BQ, Dv] unnormalised output.
    Returns (p [BQ, BKV] float32, alpha [BQ], m_new, l_new); the caller forms
    ``acc_new = alpha[:, None] * acc_prev + p @ v`` (kept separate so it can cast p to v's dtype).
    """
    del acc_prev
    m_new = jnp.maximum(m_prev, jnp.max(s2, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)      # nothing allowed yet: avoid -inf - -inf
    p = jnp.exp2(s2 - m_use[:, None])
    alpha = jnp.exp2(m_prev - m_use)
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    return p, alpha, m_new, l_new


def softmax_finalize(acc, m, l):
    """(out float32 [BQ, Dv], lse float32 [BQ] natural log). Rows with l == 0 (fully masked) give
    out = 0 and lse = -inf."""
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[:, None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# score_mod / mask_mod on a tile, with captured arrays
# ----------------------------------------------------------------------------------------------------

def _is_ref(x) -> bool:
    aval = getattr(x, "aval", None)
    return isinstance(aval, AbstractRef)


@dataclasses.dataclass(frozen=True, eq=False)
class TileMod:
    """A score_mod or mask_mod with the arrays it closes over made explicit.

    kind: "score" (``fn(score, b, h, q_idx, kv_idx)``) or "mask" (``fn(b, h, q_idx, kv_idx)``).
    captured: the arrays ``fn`` closes over (found by tracing), in a fixed order; pass them (or refs to
    them, or tracers standing for them) to :meth:`__call__` in that order.

    ``tm(captured, *args)`` evaluates ``fn(*args)`` with ``captured[i]`` in place of ``self.captured[i]``.
    ``captured[i]`` may be an array (XLA side: differentiable in it) or a Pallas ref (inside a kernel:
    reads become ref loads). The result is broadcast to the common shape of the index arguments (and
    the score), float32 for score mods and bool for mask mods.
    """

    fn: Callable
    kind: str
    captured: tuple

    @staticmethod
    def make(fn: Callable | None, kind: str, example_shape: tuple[int, int] = (16, 16)) -> "TileMod | None":
        """Traces ``fn`` once at an example tile shape to find its captured arrays; None for None."""
        if fn is None:
            return None
        bq, bkv = example_shape
        args = _example_args(kind, bq, bkv)
        closed = jax.make_jaxpr(fn)(*args)
        return TileMod(fn, kind, tuple(closed.consts))

    @property
    def num_captured(self) -> int:
        return len(self.captured)

    def __call__(self, captured: Sequence[Any], *args):
        if len(captured) != len(self.captured):
            raise ValueError(f"TileMod: expected {len(self.captured)} captured arrays, got {len(captured)}")
        specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
        closed = jax.make_jaxpr(self.fn)(*specs)
        consts = []
        for c in closed.consts:
            j = next((i for i, own in enumerate(self.captured) if own is c), None)
            consts.append(c if j is None else captured[j])
        out = _eval_jaxpr(closed.jaxpr, consts, list(args))[0]
        out = _materialize(out)
        shape = jnp.broadcast_shapes(*[jnp.shape(a) for a in args])
        out = jnp.broadcast_to(out, shape)
        return out.astype(jnp.float32) if self.kind == "score" else out.astype(jnp.bool_)


def _example_args(kind: str, bq: int, bkv: int):
    i32 = jnp.int32
    idx = [jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((), i32),
           jax.ShapeDtypeStruct((bq, 1), i32), jax.ShapeDtypeStruct((1, bkv), i32)]
    if kind == "score":
        return [jax.ShapeDtypeStruct((bq, bkv), jnp.float32)] + idx
    if kind == "mask":
        return idx
    raise ValueError(f"TileMod: kind must be 'score' or 'mask', got {kind!r}")


def captured_specs(captured: Sequence[Any], grid_rank: int) -> list:
    """Whole-array BlockSpecs for captured arrays (one block covering the array, every program)."""
    del grid_rank
    return [pl.BlockSpec(tuple(jnp.shape(c)), (lambda nd: (lambda *_: (0,) * nd))(jnp.ndim(c)))
            for c in captured]


# --- the evaluator ---------------------------------------------------------------------------------
# Lazy values for the index plumbing that jnp indexing emits before a gather:
#   broadcast_in_dim x[..., None]  -> _Trailing(x)
#   concatenate([..., None] parts, dimension=-1) -> _Cols([parts])
# so a gather on a captured ref can read one index array per indexed dimension, without ever
# building the [..., k] index tensor (Triton has no gather and only 2-operand last-dim concatenates).

@dataclasses.dataclass
class _Trailing:
    base: Any


@dataclasses.dataclass
class _Cols:
    cols: list


@dataclasses.dataclass
class _Captured:
    ref: Any


def _materialize(x):
    if isinstance(x, _Trailing):
        return jnp.expand_dims(_materialize(x.base), -1)
    if isinstance(x, _Cols):
        return jnp.concatenate([jnp.expand_dims(c, -1) for c in x.cols], axis=-1)
    if isinstance(x, _Captured):
        return x.ref[...]
    return x


def _columns(idx) -> list:
    if isinstance(idx, _Cols):
        return list(idx.cols)
    if isinstance(idx, _Trailing):
        return [_materialize(idx.base)]
    idx = _materialize(idx)
    return [idx[..., i] for i in range(idx.shape[-1])]


def _ref_point_load(ref, shape, index_of_dim: dict):
    """ref[i_0, ..., i_n] with i_d = index_of_dim.get(d, 0) clamped into [0, shape[d] - 1]."""
    idx = []
    for d, n in enumerate(shape):
        i = index_of_dim.get(d, jnp.int32(0))
        idx.append(jnp.clip(jnp.asarray(i).astype(jnp.int32), 0, n - 1))
    if not shape:
        return ref[...]
    return ref[tuple(idx)]


def _gather_from_ref(ref, indices, *, dimension_numbers, slice_sizes, mode, fill_value, **_):
    shape = tuple(ref.shape)
    dn = dimension_numbers
    if (dn.offset_dims or dn.operand_batching_dims or any(s != 1 for s in slice_sizes)
            or tuple(sorted(dn.collapsed_slice_dims)) != tuple(range(len(shape)))):
        raise UnsupportedModError(f"gather from a captured array of shape {shape} with {dn}, "
                                  f"slice_sizes={slice_sizes}: only point reads x[i, j, ...] are supported")
    cols = _columns(indices)
    index_of_dim = dict(zip(dn.start_index_map, cols))
    val = _ref_point_load(ref, shape, index_of_dim)
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        ok = jnp.ones(jnp.shape(val), jnp.bool_)
        for d, i in index_of_dim.items():
            ok = ok & (i >= 0) & (i < shape[d])
        fill = fill_value if fill_value is not None else (
            jnp.nan if jnp.issubdtype(ref.dtype, jnp.inexact) else 0)
        val = jnp.where(ok, val, jnp.asarray(fill, val.dtype))
    return val


def _dynamic_slice_from_ref(ref, *starts, slice_sizes, **_):
    shape = tuple(ref.shape)
    if any(s != 1 for s in slice_sizes):
        raise UnsupportedModError(f"dynamic_slice of size {slice_sizes} from a captured array of shape "
                                  f"{shape}: only single elements (x[i]) are supported")
    val = _ref_point_load(ref, shape, dict(enumerate(starts)))
    return jnp.broadcast_to(val, tuple(slice_sizes))


def _eval_jaxpr(jaxpr, consts, args):
    env: dict = {}

    def read(v):
        if isinstance(v, Literal):
            return v.val
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _Captured(c) if _is_ref(c) else c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a

    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        outs = _eval_eqn(eqn, vals)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, vals):
    prim, params = eqn.primitive, eqn.params
    name = prim.name
    if name == "gather" and isinstance(vals[0], _Captured):
        return [_gather_from_ref(vals[0].ref, vals[1], **params)]
    if name == "dynamic_slice" and isinstance(vals[0], _Captured):
        return [_dynamic_slice_from_ref(vals[0].ref, *[_materialize(s) for s in vals[1:]], **params)]
    if name == "broadcast_in_dim" and not isinstance(vals[0], (_Captured, _Cols, _Trailing)):
        x = vals[0]
        shape = tuple(params["shape"])
        if (jnp.ndim(x) >= 1 and shape == tuple(jnp.shape(x)) + (1,)
                and tuple(params["broadcast_dimensions"]) == tuple(range(jnp.ndim(x)))):
            return [_Trailing(x)]
    if name == "concatenate" and params["dimension"] == len(eqn.outvars[0].aval.shape) - 1 \
            and all(isinstance(x, (_Trailing, _Cols)) for x in vals):
        cols = []
        for x in vals:
            cols.extend(_columns(x))
        return [_Cols(cols)]
    if name in ("pjit", "jit", "closed_call", "core_call"):
        inner = params.get("jaxpr") or params.get("call_jaxpr")
        closed = inner if hasattr(inner, "consts") else None
        jaxpr = closed.jaxpr if closed is not None else inner
        consts = list(closed.consts) if closed is not None else []
        return _eval_jaxpr(jaxpr, consts, vals)
    if name == "custom_jvp_call":
        inner = params["call_jaxpr"]
        return _eval_jaxpr(inner.jaxpr, list(inner.consts), vals)
    if any(isinstance(x, _Captured) for x in vals) and eqn.params and any(
            hasattr(p, "eqns") or hasattr(p, "jaxpr") for p in params.values()):
        raise UnsupportedModError(f"captured array used inside a {name} primitive")
    vals = [_materialize(x) for x in vals]
    out = prim.bind(*vals, **params)
    return out if prim.multiple_results else [out]
