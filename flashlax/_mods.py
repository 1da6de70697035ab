"""score_mod / mask_mod semantics shared by every implementation.

Mods follow PyTorch FlexAttention: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and
``mask_mod(b, h, q_idx, kv_idx) -> bool`` are written for *scalars*. A mod may index a captured array
with several indices, reduce (``(E[q_idx] * E[kv_idx]).sum()``) or chain (``bias[b][q_idx]``), so it
cannot simply be called on broadcast index arrays. This module

- checks a mod once with scalar arguments (:func:`check_mod`): argument count, a scalar result, bool for
  masks and floating point for scores, each failure a ``ValueError`` naming the mod;
- evaluates a mod over broadcastable index arrays with scalar meaning (:func:`apply_mod`): nested
  ``jax.vmap`` over the axes each argument varies on, so point-wise mods compile to the same broadcast
  ops as before and the rest (gathers of rows, reductions) are batched correctly;
- says which of ``b`` / ``h`` a mod reads (:func:`reads_batch_head`), from its jaxpr;
- decides whether two mods are the same (:func:`same_mod`), for block masks passed with a mod;
- substitutes the arrays a mod captures (:func:`captured_arrays`, :func:`with_captured`), so they can be
  explicit arguments of a custom_vjp (gradients to a captured bias table).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import Literal

_ARG_NAMES = {"score": ("score", "b", "h", "q_idx", "kv_idx"), "mask": ("b", "h", "q_idx", "kv_idx")}


def scalar_args(kind: str) -> list[jax.ShapeDtypeStruct]:
    """The abstract scalar arguments of a mod: float32 score, int32 indices."""
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return ([jax.ShapeDtypeStruct((), jnp.float32)] if kind == "score" else []) + [i32] * 4


def _trace(mod: Callable, kind: str, op: str):
    name = f"{kind}_mod"
    try:
        return jax.make_jaxpr(mod)(*scalar_args(kind))
    except TypeError as err:
        raise ValueError(f"{op}: {name} must take {len(_ARG_NAMES[kind])} scalar arguments "
                         f"{_ARG_NAMES[kind]} and return a scalar; calling it raised TypeError: {err}") from err


def check_mod(op: str, mod: Callable | None, kind: str) -> None:
    """Raises ValueError (naming ``op`` and the mod) unless ``mod`` is None or a callable that takes the
    scalar arguments of its kind and returns a scalar bool (mask) / floating point (score) value."""
    if mod is None:
        return
    name = f"{kind}_mod"
    if not callable(mod):
        raise ValueError(f"{op}: {name} must be callable or None, got {type(mod).__name__}")
    closed = _trace(mod, kind, op)
    outs = closed.out_avals
    if len(outs) != 1:
        raise ValueError(f"{op}: {name} must return one scalar, got {len(outs)} outputs")
    out = outs[0]
    if out.shape != ():
        raise ValueError(f"{op}: {name} must return a scalar for scalar arguments (mods are written for "
                         f"scalars, as in FlexAttention), got shape {out.shape}")
    if kind == "mask" and out.dtype != jnp.bool_:
        raise ValueError(f"{op}: mask_mod must return bool, got {out.dtype} (compare explicitly, e.g. "
                         "`x != 0`)")
    if kind == "score" and not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"{op}: score_mod must return a floating-point score, got {out.dtype}")


def apply_mod(mod: Callable, *args):
    """``mod`` applied with scalar semantics to arguments that broadcast together.

    Each argument is a scalar or an array; the result has the broadcast shape, element [i...] being
    ``mod`` of the arguments' elements at [i...]. Implemented as nested ``jax.vmap`` over only the axes
    an argument varies on (size-1 axes are not mapped), so a point-wise mod costs what it did before."""
    args = [jnp.asarray(a) for a in args]
    shape = jnp.broadcast_shapes(*(a.shape for a in args))
    nd = len(shape)
    full = [a.reshape((1,) * (nd - a.ndim) + a.shape) for a in args]
    squeezed = [a.reshape(tuple(n for n in a.shape if n != 1)) for a in full]
    fn = mod
    for axis in reversed(range(nd)):
        in_axes = tuple(0 if a.shape[axis] != 1 else None for a in full)
        if any(ax is not None for ax in in_axes):
            fn = jax.vmap(fn, in_axes=in_axes)
    return jnp.reshape(fn(*squeezed), shape)


def reads_batch_head(mod: Callable, kind: str = "mask") -> tuple[bool, bool]:
    """(reads b, reads h): whether the mod's result depends on its ``b`` / ``h`` argument (from the
    jaxpr after dead-code elimination)."""
    closed = _trace(mod, kind, "create_block_mask")
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    used = used[len(closed.jaxpr.constvars):]
    offset = 1 if kind == "score" else 0
    return bool(used[offset]), bool(used[offset + 1])


def _same_const(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    try:
        return np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype \
            and bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except Exception:  # noqa: BLE001  (non-array constants: compare as objects only)
        return False


def same_mod(a: Callable, b: Callable, kind: str = "mask") -> bool:
    """True when ``a`` and ``b`` are the same mod: the same object, or the same scalar program over the
    same captured values (a lambda written twice, ``and_masks`` rebuilt from the same parts)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    ja, jb = jax.make_jaxpr(a)(*scalar_args(kind)), jax.make_jaxpr(b)(*scalar_args(kind))
    if str(ja.jaxpr) != str(jb.jaxpr) or len(ja.consts) != len(jb.consts):
        return False
    return all(_same_const(x, y) for x, y in zip(ja.consts, jb.consts))


def captured_arrays(fn: Callable, *example_args) -> tuple:
    """The arrays (constants or tracers) ``fn`` closes over, from a trace at ``example_args``."""
    return tuple(jax.make_jaxpr(fn)(*example_args).consts)


def with_captured(fn: Callable, captured: tuple, values) -> Callable:
    """``fn`` with the captured arrays ``captured`` (from :func:`captured_arrays`) replaced by ``values``.

    ``fn`` is traced again at each call's arguments and that trace evaluated with the substitutes. Inside
    ``jax.shard_map`` a substitute may vary over more mesh axes than the array it replaces (a copy made
    varying outside a loop, so that differentiating it inside the loop needs no collective there); the
    trace is then evaluated by :func:`_eval_retyped`."""
    swap = {id(c): v for c, v in zip(captured, values)}

    def call(*args):
        closed = jax.make_jaxpr(fn)(*args)
        consts = [swap.get(id(c), c) for c in closed.consts]
        if all(_varying(a) == _varying(b) for a, b in zip(consts, closed.consts)):
            return jax.core.eval_jaxpr(closed.jaxpr, consts, *args)[0]
        return _eval_retyped(closed.jaxpr, consts, args)[0]

    return call


_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call")


def _varying(x) -> frozenset:
    from flashlax.parallel.vma import varying_axes
    return varying_axes(x)


def _eval_retyped(jaxpr, consts, args):
    """Evaluates ``jaxpr`` where inputs may vary over more mesh axes than it was traced with: each
    primitive's operands are cast to vary alike (as jnp does when tracing), call primitives are inlined
    (a custom_jvp / custom_vjp inside a mod is then differentiated as written, not by its rule)."""
    from flashlax.parallel.vma import match_vma
    env: dict = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS:
            inner = next(eqn.params[key] for key in ("jaxpr", "call_jaxpr", "fun_jaxpr") if key in eqn.params)
            inner_consts = list(getattr(inner, "consts", ()))
            inner = getattr(inner, "jaxpr", inner)
            outs = _eval_retyped(inner, inner_consts, vals[len(vals) - len(inner.invars):])
        elif name == "pvary":         # the trace's own cast: the operand may already vary over those axes
            missing = tuple(a for a in eqn.params["axes"] if a not in _varying(vals[0]))
            outs = [jax.lax.pcast(vals[0], missing, to="varying") if missing else vals[0]]
        else:
            vals = match_vma(vals, *[x for x in vals if hasattr(x, "dtype")])
            outs = eqn.primitive.bind(*vals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
