"""Measure what reverse-mode autodiff keeps alive between the forward and the backward."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np


def residual_bytes(fn: Callable, *args, include_args: bool = False) -> tuple[int, list[str]]:
    """Bytes and shapes of the residuals ``jax.vjp(fn, *args)`` saves for the backward.

    Traced abstractly (``jax.eval_shape``: nothing runs, so large shapes are cheap to measure). Residuals
    that are the arguments themselves are live anyway and are skipped unless ``include_args``.
    Returns ``(total_bytes, ["float32[2,8,64,64]", ...])`` sorted by size, largest first.
    """
    is_arg: list[bool] = []

    def probe(*primals):
        _, pullback = jax.vjp(fn, *primals)
        leaves = jax.tree_util.tree_leaves(pullback)
        arg_ids = {id(x) for x in jax.tree_util.tree_leaves(primals)}
        is_arg.extend(id(leaf) in arg_ids for leaf in leaves)
        return leaves

    leaves = jax.eval_shape(probe, *args)
    kept = [leaf for leaf, from_arg in zip(leaves, is_arg) if include_args or not from_arg]
    kept.sort(key=lambda leaf: -leaf.size * np.dtype(leaf.dtype).itemsize)
    total = sum(int(leaf.size) * np.dtype(leaf.dtype).itemsize for leaf in kept)
    shapes = [f"{np.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]" for leaf in kept]
    return total, shapes
