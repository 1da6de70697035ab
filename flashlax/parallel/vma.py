"""Varying manual axes: loop carries and Pallas outputs inside ``jax.shard_map`` with ``check_vma=True``.

Inside ``jax.shard_map`` every value carries the mesh axes it varies over. A loop's initial carry built
from constants (``jnp.zeros``) varies over none while the body's result varies like the inputs, and JAX
rejects the loop ("the manual axis types do not match"). :func:`match_vma` casts initial carries
(``lax.pcast(..., to="varying")``, a type change with no run-time cost) to vary like the arrays they are
computed from; :func:`out_struct` gives a ``pallas_call`` output the type of its inputs; and
:func:`cotangent_like` gives a custom_vjp's cotangent the type of its primal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _varying(x) -> frozenset:
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset() if mat is None else mat.varying


def varying_axes(*trees) -> frozenset:
    """The mesh axes any array leaf of ``trees`` varies over (empty outside shard_map)."""
    axes = frozenset()
    for leaf in jax.tree.leaves(trees):
        if hasattr(leaf, "dtype"):
            axes |= _varying(leaf)
    return axes


def match_vma(tree, *like):
    """``tree`` with every array leaf cast to vary over the axes that ``like`` varies over.

    For loop carries built from constants inside ``jax.shard_map``: the loop body's outputs vary like its
    inputs, so the initial carry must too. Outside shard_map (or with ``check_vma=False``) it returns
    ``tree`` unchanged."""
    axes = varying_axes(like)
    if not axes:
        return tree

    def cast(leaf):
        missing = tuple(sorted(axes - _varying(leaf), key=str))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, tree)


def out_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output type that varies over the manual axes ``like`` varies over (its inputs):
    inside ``jax.shard_map`` with ``check_vma=True`` an output without it is an error."""
    axes = varying_axes(like)
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))


def cotangent_like(grad, primal):
    """``grad`` as a custom_vjp cotangent of ``primal``: in its dtype, summed (``psum``) over the mesh axes
    it varies over and ``primal`` does not (an array every device holds whole, e.g. a bias table a
    score_mod captures: its gradient is the sum of the devices' shares), and varying where ``primal``
    does. Outside shard_map, or with ``check_vma=False`` (shard_map then sums such cotangents itself),
    only the dtype changes."""
    axes = tuple(sorted(varying_axes(grad) - varying_axes(primal), key=str))
    grad = lax.psum(grad, axes) if axes else grad
    return match_vma(grad.astype(jnp.result_type(primal)), primal)
