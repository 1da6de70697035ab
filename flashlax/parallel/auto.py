"""The Pallas kernels per shard on Auto meshes: ``custom_partitioning``.

On a mesh with Auto axes the shardings are not in the types: only XLA's partitioner knows them, and it
cannot split a kernel (a custom call): it would gather q/k/v and run the kernel whole on every device.
Here the op's per-shard function becomes a ``custom_partitioning`` call, as in jax's cuDNN attention: at
compile time the partitioner reports the inputs' shardings, q's batch and head axes are kept (K/V heads
follow when the head axes divide them, every other dimension is replicated), and each device runs the
same per-shard function as under ``shard_map`` (``lax.axis_index`` gives its offsets). The arrays the
mods capture become explicit, replicated operands (a custom_partitioning function cannot close over
traced values), the mods are rebuilt from their jaxprs inside.

Gradients: a custom_vjp whose backward is a second custom_partitioning call running ``jax.vjp`` of the
per-shard function (the forward is recomputed per shard); cotangents of operands a device holds whole
(captured arrays, K/V of batch 1, K/V heads not split) are summed over the split axes.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding

from flashlax import _mods


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _rule(in_layouts, in_shapes, out_layouts, out_shapes) -> SdyShardingRule:
    """Batch / query-head / K/V-head dimensions share one factor each; every other dimension (and those of
    size 1) is its own factor that must stay replicated."""
    sizes, replicated = {}, []

    def mapping(layout, shape, tag):
        names = []
        for d, (c, n) in enumerate(zip(layout, shape)):
            if c in "bhk" and n > 1 and sizes.setdefault(c, n) == n:
                names.append(c)
            else:
                names.append(f"{tag}_{d}")
                replicated.append(names[-1])
        return tuple(names)

    ins = tuple(mapping(lay, s, f"in{i}") for i, (lay, s) in enumerate(zip(in_layouts, in_shapes)))
    outs = tuple(mapping(lay, s, f"out{i}") for i, (lay, s) in enumerate(zip(out_layouts, out_shapes)))
    return SdyShardingRule(ins, outs, need_replication_factors=tuple(replicated))


def _partitioned(fn: Callable, body: Callable, placement_of: Callable, in_layouts, out_layouts, operands,
                 out_shapes) -> Callable:
    """``fn(*operands)`` (the whole computation, a tuple of arrays) as a custom_partitioning call whose
    per-device program is ``body(placement, *local_operands)``. The constants ``fn``'s trace holds (block
    masks built at trace time, tile tables) become replicated operands: custom_partitioning takes none."""
    closed = jax.make_jaxpr(fn)(*operands)
    n = len(operands)
    consts = [jnp.asarray(c) for c in closed.consts]
    in_layouts = list(in_layouts) + ["." * c.ndim for c in consts]
    in_shapes = [tuple(x.shape) for x in list(operands) + consts]
    cp = custom_partitioning(lambda *ops: tuple(jax.core.eval_jaxpr(closed.jaxpr, ops[n:], *ops[:n])))

    def shardings(placement, mesh, layouts, shapes):
        return tuple(NamedSharding(mesh, placement.spec(lay, jax.ShapeDtypeStruct(s, jnp.float32)))
                     for lay, s in zip(layouts, shapes))

    def partition(mesh, arg_shapes, result_shape):
        placement = placement_of(mesh, arg_shapes[0].sharding)
        return (mesh, lambda *ops: body(placement, *ops[:n]), shardings(placement, mesh, out_layouts, out_shapes),
                shardings(placement, mesh, in_layouts, in_shapes))

    def infer(mesh, arg_shapes, result_shape):
        return shardings(placement_of(mesh, arg_shapes[0].sharding), mesh, out_layouts, out_shapes)

    cp.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=_rule(in_layouts, in_shapes, out_layouts, out_shapes))
    return lambda *ops: cp(*ops, *consts)


def run(make_placement: Callable, local: Callable, mods, args: tuple, layouts, out_layouts, *, kv_heads: int,
        differentiable: bool):
    """``local(placement, mods, *args)`` per shard of q's batch / head axes, through custom_partitioning.
    ``mods``: ((mod or None, "score" / "mask"), ...), handed to ``local`` rebuilt; ``layouts`` per leaf of
    ``args`` (None leaves allowed); ``out_layouts`` a layout per output leaf (a pytree prefix)."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=lambda x: x is None)
    flat_layouts = jax.tree.leaves(layouts, is_leaf=lambda x: x is None or isinstance(x, str))
    present = [i for i, x in enumerate(leaves) if x is not None]
    closed = [None if mod is None else jax.make_jaxpr(mod)(*_mods.scalar_args(kind)) for mod, kind in mods]
    consts = [jnp.asarray(c) for cj in closed if cj is not None for c in cj.consts]
    operands = [leaves[i] for i in present] + consts
    in_layouts = [flat_layouts[i] for i in present] + ["." * c.ndim for c in consts]
    in_shapes = [tuple(x.shape) for x in operands]
    out_tree = jax.tree.structure(out_layouts, is_leaf=lambda x: isinstance(x, str))
    flat_out_layouts = jax.tree.leaves(out_layouts, is_leaf=lambda x: isinstance(x, str))
    whole = make_placement(None, {})          # no split: the computation on global shapes

    def per_shard(placement, *ops):
        full = list(leaves)
        for i, x in zip(present, ops):
            full[i] = x
        rest, rebuilt = list(ops[len(present):]), []
        for cj in closed:
            if cj is None:
                rebuilt.append(None)
                continue
            values, rest = rest[:len(cj.consts)], rest[len(cj.consts):]
            rebuilt.append(functools.partial(lambda jaxpr, vals, *a: jax.core.eval_jaxpr(jaxpr, vals, *a)[0],
                                             cj.jaxpr, values))
        return tuple(jax.tree.leaves(local(placement, tuple(rebuilt), *jax.tree.unflatten(treedef, full))))

    out_shapes = [tuple(s.shape) for s in jax.eval_shape(functools.partial(per_shard, whole), *operands)]

    def placement_of(mesh, q_sharding):
        spec = tuple(q_sharding.spec) + (None, None)
        batch, head = _names(spec[0]), _names(spec[1])
        n_head = 1
        for name in head:
            n_head *= mesh.shape[name]
        return make_placement(mesh, {"b": batch, "h": head, "k": head if kv_heads % n_head == 0 else ()})

    forward = _partitioned(functools.partial(per_shard, whole), per_shard, placement_of, in_layouts,
                           flat_out_layouts, operands, out_shapes)
    if not differentiable:
        return jax.tree.unflatten(out_tree, list(forward(*operands)))

    floats = [i for i, x in enumerate(operands) if _is_float(x)]

    def grads(placement, *ops_and_cts):
        ops, cts = list(ops_and_cts[:len(operands)]), ops_and_cts[len(operands):]

        def of_floats(*values):
            for i, x in zip(floats, values):
                ops[i] = x
            return per_shard(placement, *ops)

        _, pullback = jax.vjp(of_floats, *[ops[i] for i in floats])
        out = []
        for i, g in zip(floats, pullback(tuple(cts))):
            spec = placement.spec(in_layouts[i], jax.ShapeDtypeStruct(in_shapes[i], jnp.float32))
            split = {n for entry in spec for n in _names(entry)}
            summed = tuple(n for n in sorted(placement.manual) if n not in split)
            out.append(lax.psum(g, summed) if summed else g)    # devices holding it whole: sum their shares
        return tuple(out)

    out_structs = [jax.ShapeDtypeStruct(s, jnp.result_type(x)) for s, x in
                   zip(out_shapes, jax.eval_shape(functools.partial(per_shard, whole), *operands))]
    backward = _partitioned(functools.partial(grads, whole), grads, placement_of,
                            in_layouts + flat_out_layouts, [in_layouts[i] for i in floats],
                            list(operands) + out_structs, [in_shapes[i] for i in floats])

    @jax.custom_vjp
    def op(*ops):
        return forward(*ops)

    def op_fwd(*ops):
        return forward(*ops), ops

    def op_bwd(ops, cts):
        got = iter(backward(*ops, *cts))
        return tuple(next(got) if i in floats else None for i in range(len(ops)))

    op.defvjp(op_fwd, op_bwd)
    return jax.tree.unflatten(out_tree, list(op(*operands)))
