"""Every op per shard of its inputs' batch and head axes, and the dispatch of ``context_axis=``.

The mesh and the shardings come from the inputs' types: under ``jit`` on a mesh with Explicit axes (what
``jax.make_mesh`` returns in jax 0.11.2) an array's type says which mesh axes split its batch and head
dimensions. The op then runs in ``jax.shard_map`` over exactly those axes: each device computes its
shard with the op's implementation, and the outputs come back sharded like the inputs, with no
all-gather of q/k/v. Other Explicit shardings of the inputs (a sequence or head-dim axis without
``context_axis``) are gathered first (``jax.sharding.reshard``), as any jax op would need.

Mods see global indices: ``b`` and ``h`` are shifted by the shard's first batch element / head (and with
``context_axis`` ``q_idx`` / ``kv_idx`` are global positions), so a mod reading a captured array indexes it
as it would on one device.

Inside a user's ``jax.shard_map`` the op sees the local shards and runs as it does on one device (``b``,
``h`` are local there, as for any function in shard_map). On Auto meshes the types say nothing about the
shardings: XLA's SPMD partitioner splits the XLA paths along batch and heads on its own, and the Pallas
kernels (custom calls it cannot split) go through ``custom_partitioning`` (:mod:`flashlax.parallel.auto`,
with ``jax.set_mesh``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from flashlax import _mods


# ----------------------------------------------------------------------------------------------------
# The mesh and the mesh axes of an array's dimensions
# ----------------------------------------------------------------------------------------------------

def mesh_of(*arrays):
    """The mesh in the inputs' types (Explicit shardings), else the context mesh (``jax.set_mesh``, or the
    enclosing ``shard_map``); may be empty."""
    for x in arrays:
        if x is None:
            continue
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return jax.sharding.get_abstract_mesh()


def _explicit_axes(x, dim: int) -> tuple[str, ...]:
    """Mesh axes (Explicit) that split dimension ``dim`` of ``x`` according to its type."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return ()
    entry = spec[dim]
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _auto_axes() -> tuple[str, ...]:
    """Axes of the context mesh (``jax.set_mesh``) of type Auto with more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(a for a in mesh.auto_axes if mesh.shape[a] > 1)


def _is_sharded(x) -> bool:
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(entry is not None for entry in spec)


def _axis_size(mesh, axes: tuple[str, ...]) -> int:
    size = 1
    for name in axes:
        size *= mesh.shape[name]
    return size


# ----------------------------------------------------------------------------------------------------
# A placement: which mesh axes split which kind of dimension, and shard_map over them
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Placement:
    """Mesh axes per kind of dimension. Layout strings name each dimension of an array: ``b`` batch, ``h``
    query heads, ``k`` K/V heads, ``s`` sequence (the context axis), ``.`` not split.

    ``axes`` maps ``b``, ``h``, ``k`` to tuples of mesh axis names (empty: not split); ``context`` is the
    context axis or None, ``context_manual`` says the caller's shard_map already made it manual (the
    arrays are then local shards along it)."""

    mesh: object
    axes: dict
    context: str | None = None
    context_manual: bool = False
    check_vma: bool = True
    auto: bool = False          # an Auto mesh: the split is chosen at compile time (parallel/auto.py)

    def names(self, letter: str) -> tuple[str, ...]:
        if letter == "s":
            return (self.context,) if self.context is not None and not self.context_manual else ()
        return self.axes.get(letter, ())

    def size(self, letter: str) -> int:
        return _axis_size(self.mesh, self.names(letter))

    @property
    def context_size(self) -> int:
        return self.mesh.shape[self.context]

    def global_len(self, local_len: int) -> int:
        """A sequence length of the whole sequence (the arrays are shards of it when the caller's
        shard_map made the context axis manual)."""
        return local_len * self.context_size if self.context_manual else local_len

    @property
    def manual(self) -> frozenset:
        return frozenset(name for letter in "bhks" for name in self.names(letter))

    def spec(self, layout: str, x) -> P:
        if x is None:
            return P()
        if len(layout) != x.ndim:
            raise AssertionError(f"layout {layout!r} for an array of shape {x.shape}")
        # A dimension of size 1 stays whole (K/V of batch 1, a block mask built without B or H).
        return P(*((self.names(c) or None) if n > 1 else None for c, n in zip(layout, x.shape)))

    def offset(self, letter: str, local_size: int):
        """First global index of this shard along a dimension of that letter (traced int32; 0 unsplit)."""
        names = self.names(letter)
        if not names:
            return jnp.int32(0)
        return (lax.axis_index(names) * local_size).astype(jnp.int32)

    def run(self, local: Callable, args: tuple, layouts: tuple, out_layouts):
        """``local(*args)`` per shard: ``jax.shard_map`` over the placement's axes, the inputs first resharded
        (Explicit axes) to the layouts' specs. ``layouts`` matches ``args`` leaf for leaf (a layout per array,
        None args allowed); ``out_layouts`` is a layout per output leaf, as a pytree prefix of the result."""
        leaves, treedef = jax.tree.flatten(args, is_leaf=lambda x: x is None)
        flat_layouts = jax.tree.leaves(layouts, is_leaf=lambda x: x is None or isinstance(x, str))
        if len(flat_layouts) != len(leaves):
            raise AssertionError(f"{len(flat_layouts)} layouts for {len(leaves)} arrays")
        specs = [self.spec(layout, x) for layout, x in zip(flat_layouts, leaves)]
        if self.mesh.explicit_axes:   # the types must say what shard_map's in_specs say
            leaves = [x if x is None else jax.sharding.reshard(x, NamedSharding(self.mesh, spec))
                      for x, spec in zip(leaves, specs)]
        args = jax.tree.unflatten(treedef, leaves)
        if not self.manual:
            return local(*args)
        out_specs = jax.tree.map(lambda layout: P(*((self.names(c) or None) for c in layout)), out_layouts)
        in_specs = jax.tree.unflatten(treedef, specs)
        return jax.shard_map(local, mesh=self.mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                             axis_names=set(self.manual), check_vma=self.check_vma)(*args)


    def run_mods(self, local: Callable, mods, args: tuple, layouts: tuple, out_layouts, *, kv_heads: int = 1,
                 differentiable: bool = False):
        """``local(placement, mods, *args)`` per shard, as :meth:`run`; ``mods`` ((mod, kind), ...) are handed
        to ``local`` (rebuilt from explicit operands on an Auto mesh, where the split is only known when XLA
        partitions the program: :mod:`flashlax.parallel.auto`)."""
        if self.auto:
            from flashlax.parallel import auto
            make = lambda mesh, axes: Placement(mesh, axes, check_vma=self.check_vma)
            return auto.run(make, local, mods, args, layouts, out_layouts, kv_heads=kv_heads,
                            differentiable=differentiable)
        plain = tuple(mod for mod, _ in mods)
        return self.run(lambda *a: local(self, plain, *a), args, layouts, out_layouts)


def plan(op: str, q, *others, heads: int, kv_heads: int, context_axis: str | None = None,
         check_vma: bool = True, kernel: bool = False) -> Placement | None:
    """The placement of an op's call, or None when nothing is sharded (the op runs as on one device).

    Batch and head axes come from q's type; ``context_axis`` (validated here) splits the sequence.
    K/V heads follow the query heads when the head axes divide them; otherwise K/V stay whole on each
    device, which then reads the one K/V head its query heads use (needs the shard's query heads to
    divide the group size)."""
    mesh = mesh_of(q, *others)
    if context_axis is not None:
        if mesh.empty or context_axis not in mesh.axis_names:
            names = () if mesh.empty else mesh.axis_names
            raise ValueError(f"{op}: context_axis={context_axis!r} is not an axis of the mesh (axes {names}); "
                             "set the mesh with jax.set_mesh(mesh) or shard the inputs on it")
    if mesh.empty:
        return None
    explicit = set(mesh.explicit_axes)
    batch = tuple(a for a in _explicit_axes(q, 0) if a in explicit)
    head = tuple(a for a in _explicit_axes(q, 1) if a in explicit)
    context_manual = False
    if context_axis is not None:
        if context_axis in batch + head:
            raise ValueError(f"{op}: context_axis={context_axis!r} also splits the batch or heads of q "
                             f"(q is sharded {jax.typeof(q).sharding.spec})")
        # Inside the caller's shard_map over the context axis the arrays are already local shards.
        context_manual = mesh._name_to_type[context_axis] == AxisType.Manual
    elif not batch and not head and not any(_is_sharded(x) for x in (q, *others) if x is not None):
        # On an Auto mesh XLA's partitioner splits the XLA paths by itself, not a kernel (a custom call).
        return Placement(mesh, {}, check_vma=check_vma, auto=True) if kernel and _auto_axes() else None
    n_head = _axis_size(mesh, head)
    kv = head if kv_heads % n_head == 0 else ()
    if not kv and n_head > 1:
        groups = heads // kv_heads
        local_heads = heads // n_head
        if groups % local_heads:
            raise ValueError(f"{op}: heads are split over {n_head} devices ({head}), which divides neither the "
                             f"{kv_heads} K/V heads nor puts whole groups on a device (Hq={heads}, G={groups}); "
                             "use a head axis size that divides Hkv")
    return Placement(mesh, {"b": batch, "h": head, "k": kv}, context_axis, context_manual, check_vma)


def global_shapes(*arrays, context_axis: str | None):
    """Shapes (``jax.ShapeDtypeStruct``) of [B, H, L, D] arrays with L the whole sequence's length: inside
    the caller's shard_map over ``context_axis`` the arrays hold 1 / n of it."""
    mesh = jax.sharding.get_abstract_mesh()
    parts = 1
    if context_axis is not None and not mesh.empty and context_axis in mesh.axis_names \
            and mesh._name_to_type[context_axis] == AxisType.Manual:
        parts = mesh.shape[context_axis]
    return tuple(jax.ShapeDtypeStruct(x.shape[:2] + (x.shape[2] * parts,) + x.shape[3:], x.dtype) for x in arrays)


def local_kv_heads(placement: Placement, k, v, heads: int, kv_heads: int, h0):
    """K/V heads of this shard: all of the local ones when K/V heads are split with the query heads, else
    the one K/V head (of the whole K/V on this device) that this shard's query heads read."""
    if placement.names("k") or not placement.names("h"):
        return k, v
    first = h0 // (heads // kv_heads)
    return (lax.dynamic_slice_in_dim(k, first, 1, axis=1), lax.dynamic_slice_in_dim(v, first, 1, axis=1))


# ----------------------------------------------------------------------------------------------------
# Mods on shards: local indices -> global ones
# ----------------------------------------------------------------------------------------------------

def shift_mod(mod: Callable | None, kind: str, *, b=0, h=0, q_pos: Callable | None = None,
              kv_pos: Callable | None = None) -> Callable | None:
    """``mod`` seeing global indices: ``b + b``, ``h + h``, ``q_pos(q_idx)``, ``kv_pos(kv_idx)``. Offsets
    that are the constant 0 and position maps that are None are left out (a mod that does not read ``b``
    keeps its jaxpr, so its block mask is still built once at trace time)."""
    if mod is None:
        return None
    reads_b, reads_h = _mods.reads_batch_head(mod, kind)
    shift_b = reads_b and not (isinstance(b, int) and b == 0)
    shift_h = reads_h and not (isinstance(h, int) and h == 0)
    if not (shift_b or shift_h or q_pos or kv_pos):
        return mod

    def indices(bi, hi, qi, ki):
        return (bi + b if shift_b else bi, hi + h if shift_h else hi,
                q_pos(qi) if q_pos else qi, kv_pos(ki) if kv_pos else ki)

    if kind == "score":
        return lambda score, bi, hi, qi, ki: mod(score, *indices(bi, hi, qi, ki))
    return lambda bi, hi, qi, ki: mod(*indices(bi, hi, qi, ki))


def block_mask_layouts(block_mask, batch: int, heads: int):
    """Layouts of a BlockMask's arrays: split with the batch / heads when built per batch element / head."""
    if block_mask is None:
        return None
    bm, hm = block_mask.tile_kinds.shape[:2]
    layout = lambda x: ("b" if bm == batch and bm > 1 else ".") + ("h" if hm == heads and hm > 1 else ".") \
        + "." * (x.ndim - 2)
    return jax.tree.map(layout, block_mask)


# ----------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------

def _unsupported_extras(op: str, where: str, extra: dict, return_max: bool) -> None:
    """Paged K/V, kv_lens, kernel_options and max_scores are single-placement features for now: raise
    rather than drop them."""
    names = sorted(name for name, val in extra.items() if val is not None) + (["return_aux max_scores"]
                                                                            if return_max else [])
    if names:
        raise ValueError(f"{op}: {', '.join(names)} with {where} is not supported yet")


def flex_attention(fn: Callable, impl: str, q, k, v, *, score_mod, mask_mod, block_mask, scale,
                   return_lse: bool, interpret: bool, context_axis: str | None, return_max: bool = False,
                   extra: dict | None = None):
    """flex_attention's implementation ``fn`` (dispatcher name ``impl``) per shard, or ring attention over
    ``context_axis``. ``extra``: keyword arguments for ``fn`` on one placement (a Pallas kernel's paged
    K/V, kv_lens, kernel_options); ``return_max`` adds the row maxima to the outputs."""
    op = "flex_attention"
    extra = extra or {}
    heads, kv_heads = q.shape[1], k.shape[1]
    placement = plan(op, q, k, v, heads=heads, kv_heads=kv_heads, context_axis=context_axis,
                     check_vma=not interpret, kernel=impl == "pallas")
    if context_axis is not None:
        _unsupported_extras(op, f"context_axis={context_axis!r}", extra, return_max)
        from flashlax.parallel import ring
        return ring.flex_attention(placement, impl, q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                   block_mask=block_mask, scale=scale, return_lse=return_lse, interpret=interpret)
    call = lambda q, k, v, score_mod, mask_mod, block_mask: fn(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, scale=scale,
        return_lse=return_lse, interpret=interpret, **({"return_max": True} if return_max else {}), **extra)
    if placement is None:
        return call(q, k, v, score_mod, mask_mod, block_mask)
    _unsupported_extras(op, "inputs sharded over batch or heads", extra, return_max)
    batch = q.shape[0]

    def local(placement, mods, q, k, v, block_mask):
        score_mod, mask_mod = mods
        b0 = placement.offset("b", q.shape[0])
        h0 = placement.offset("h", q.shape[1])
        k, v = local_kv_heads(placement, k, v, heads, kv_heads, h0)
        local_mask = shift_mod(mask_mod, "mask", b=b0, h=h0)
        if block_mask is not None:
            block_mask = dataclasses.replace(block_mask, mask_mod=local_mask)
        return call(q, k, v, shift_mod(score_mod, "score", b=b0, h=h0), local_mask, block_mask)

    out_layouts = ("bh..", "bh.") if return_lse else "bh.."
    return placement.run_mods(local, ((score_mod, "score"), (mask_mod, "mask")), (q, k, v, block_mask),
                              ("bh..", "bk..", "bk..", block_mask_layouts(block_mask, batch, heads)), out_layouts,
                              kv_heads=kv_heads, differentiable=True)


def decode_attention(fn: Callable, impl: str, q, k_cache, v_cache, *, kv_lens, scale, num_splits, score_mod,
                     mask_mod, return_lse: bool, interpret: bool, context_axis: str | None,
                     extra: dict | None = None, lens_range: tuple[int, int] | None = None):
    """decode_attention's implementation ``fn`` per shard of the batch and heads, or over a cache split
    along its sequence axis (``context_axis``, :func:`flashlax.parallel.sequence.decode_attention`).
    ``lens_range`` (Lq, Lmax), for traced kv_lens: NaN rows where a length lies outside it, written by the
    Pallas kernel on one placement, else by an XLA step after the call (a cache split along its sequence
    gives its shards lengths outside [Lq, Lmax] on purpose)."""
    op = "decode_attention"
    extra = extra or {}
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    if extra.get("block_table") is not None and context_axis is not None:
        _unsupported_extras(op, f"context_axis={context_axis!r}", extra, False)
    placement = plan(op, q, k_cache, v_cache, heads=heads, kv_heads=kv_heads, context_axis=context_axis,
                     check_vma=not interpret, kernel=impl == "pallas")

    def call(q, k_cache, v_cache, kv_lens, score_mod, mask_mod, return_lse=return_lse, **kw):
        return fn(q, k_cache, v_cache, kv_lens=kv_lens, scale=scale, num_splits=num_splits, score_mod=score_mod,
                  mask_mod=mask_mod, return_lse=return_lse, interpret=interpret, **extra, **kw)

    if placement is None:
        if lens_range is not None and impl == "pallas":   # the kernel's final store writes the NaN rows
            return call(q, k_cache, v_cache, kv_lens, score_mod, mask_mod, nan_outside_lens=True)
        result = call(q, k_cache, v_cache, kv_lens, score_mod, mask_mod)
    else:
        _unsupported_extras(op, "sharded inputs", extra, False)
        result = _decode_sharded(placement, call, q, k_cache, v_cache, kv_lens, score_mod=score_mod,
                                 mask_mod=mask_mod, return_lse=return_lse)
    if lens_range is None:
        return result
    from flashlax.fallbacks.decode import nan_rows
    return nan_rows(result, kv_lens, *lens_range)


def _decode_sharded(placement, call, q, k_cache, v_cache, kv_lens, *, score_mod, mask_mod, return_lse: bool):
    """decode_attention's ``call`` per shard of the batch and heads, or over a cache split along its sequence
    axis (``placement.context``)."""
    if placement.context is not None:
        from flashlax.parallel import sequence
        return sequence.decode_attention(placement, call, q, k_cache, v_cache, kv_lens, score_mod=score_mod,
                                         mask_mod=mask_mod, return_lse=return_lse)
    heads, kv_heads = q.shape[1], k_cache.shape[1]

    def local(placement, mods, q, k_cache, v_cache, kv_lens):
        score_mod, mask_mod = mods
        b0 = placement.offset("b", q.shape[0])
        h0 = placement.offset("h", q.shape[1])
        k_cache, v_cache = local_kv_heads(placement, k_cache, v_cache, heads, kv_heads, h0)
        return call(q, k_cache, v_cache, kv_lens, shift_mod(score_mod, "score", b=b0, h=h0),
                    shift_mod(mask_mod, "mask", b=b0, h=h0))

    return placement.run_mods(local, ((score_mod, "score"), (mask_mod, "mask")), (q, k_cache, v_cache, kv_lens),
                              ("bh..", "bk..", "bk..", "b"), ("bh..", "bh.") if return_lse else "bh..",
                              kv_heads=kv_heads)


def gated_delta_rule(fn: Callable, q, k, v, log_alpha, beta, *, initial_state, return_final_state: bool,
                     context_axis: str | None, kernel: bool = False, **options):
    """gated_delta_rule's implementation ``fn`` per shard of the batch and heads, or sequence parallel over
    ``context_axis`` (:func:`flashlax.parallel.sequence.gated_delta_rule`). ``kernel``: ``fn`` is a Pallas
    kernel (on an Auto mesh it runs per shard through custom_partitioning, as XLA cannot split it).
    ``options``: the impl's other keyword arguments (scale, chunk_size, ...)."""
    heads = q.shape[1]
    placement = plan("gated_delta_rule", q, k, v, log_alpha, beta, initial_state, heads=heads, kv_heads=heads,
                     context_axis=context_axis, check_vma=not options.get("interpret", False), kernel=kernel)

    def call(q, k, v, log_alpha, beta, initial_state, return_final_state=return_final_state):
        return fn(q, k, v, log_alpha, beta, initial_state=initial_state, return_final_state=return_final_state,
                  **options)

    if placement is None:
        if getattr(fn, "keywords", {}).get("sequential_heads") and _auto_axes():
            # One (batch, head) slice at a time is a lax.map, which XLA's partitioner cannot split: on an
            # Auto mesh the batched program keeps the inputs' batch/head sharding.
            fn = functools.partial(fn, sequential_heads=False)
        return call(q, k, v, log_alpha, beta, initial_state)
    if context_axis is not None:
        from flashlax.parallel import sequence
        return sequence.gated_delta_rule(placement, call, q, k, v, log_alpha, beta, initial_state,
                                         return_final_state=return_final_state)
    outs = ("bh..", "bh..") if return_final_state else "bh.."
    return placement.run_mods(lambda placement, mods, *args: call(*args), (), (q, k, v, log_alpha, beta, initial_state),
                              ("bh..",) * 3 + ("bh.",) * 2 + ("bh..",), outs, kv_heads=heads, differentiable=True)
