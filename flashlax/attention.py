"""Front ends of softmax attention: ``flex_attention`` and ``dot_product_attention``.

Both validate their inputs before anything is traced, then ask the dispatcher for an implementation
(``flashlax.dispatch.resolve``): ``"xla"`` (blockwise online softmax, the CPU default), ``"repeat"`` (K/V
repeated to Hq heads, the old baseline) and ``"pallas"`` (the GPU kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashlax import _mods, dispatch, paged
from flashlax import masks as masks_lib
from flashlax.masks import BlockMask
from flashlax.parallel import shard as parallel


def _shape_error(name: str, what: str, **shapes) -> ValueError:
    seen = ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items())
    return ValueError(f"{name}: {what} (got {seen})")


def check_attention_inputs(op: str, q, k, v) -> None:
    """Shapes and dtypes of q [B, Hq, Lq, D], k [B or 1, Hkv, Lkv, D], v [B or 1, Hkv, Lkv, Dv]."""
    shapes = dict(q=q.shape, k=k.shape, v=v.shape)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise _shape_error(op, f"{name} must be 4-D [B, H, L, D]", **shapes)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be a floating dtype, got {x.dtype} "
                             f"(dtypes q={q.dtype}, k={k.dtype}, v={v.dtype})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k and v must have the same dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.shape[0] != v.shape[0] or k.shape[0] not in (1, q.shape[0]):
        raise _shape_error(op, "k and v must share a batch size that is q's or 1 (broadcast)", **shapes)
    if k.shape[1] != v.shape[1]:
        raise _shape_error(op, "k and v must have the same number of heads Hkv", **shapes)
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise _shape_error(op, f"query heads Hq={q.shape[1]} must be a multiple of KV heads Hkv={k.shape[1]}",
                           **shapes)
    if q.shape[3] != k.shape[3]:
        raise _shape_error(op, f"head dims of q (D={q.shape[3]}) and k (D={k.shape[3]}) differ", **shapes)
    if k.shape[2] != v.shape[2]:
        raise _shape_error(op, f"v length {v.shape[2]} differs from k length {k.shape[2]}", **shapes)
    if min(q.shape) < 1 or min(k.shape) < 1 or min(v.shape) < 1:
        raise _shape_error(op, "every dimension must be >= 1", **shapes)


def check_mods(op: str, score_mod, mask_mod) -> None:
    """score_mod(score, b, h, q_idx, kv_idx) -> float and mask_mod(b, h, q_idx, kv_idx) -> bool, checked
    with scalar arguments (ValueError naming the mod otherwise)."""
    _mods.check_mod(op, score_mod, "score")
    _mods.check_mod(op, mask_mod, "mask")


def _is_concrete_number(x) -> bool:
    if isinstance(x, numbers.Number) and not isinstance(x, bool):
        return True
    if isinstance(x, jax.core.Tracer):
        return False
    return np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.number)


def resolve_scale(op: str, scale, head_dim: int, score_mod: Callable | None = None):
    """(scale as a Python float, score_mod). A traced scale (a jit argument, or differentiated) becomes
    part of the score_mod, ``score_mod(scale * s, ...)`` with the op's scale 1, so it stays
    differentiable; it is captured as a [1] array read at index 0, a point read the kernels support."""
    if scale is None:
        return float(head_dim) ** -0.5, score_mod
    if _is_concrete_number(scale):
        value = float(scale)
        if not np.isfinite(value):
            raise ValueError(f"{op}: scale must be finite, got {value}")
        return value, score_mod
    scale_arr = jnp.asarray(scale)
    if scale_arr.ndim != 0 or not jnp.issubdtype(scale_arr.dtype, jnp.floating) and \
            not jnp.issubdtype(scale_arr.dtype, jnp.integer):
        raise ValueError(f"{op}: scale must be a scalar number, got {scale_arr.dtype} of shape {scale_arr.shape}")
    scale_vec = jnp.reshape(scale_arr, (1,))

    def scaled(score, b, h, q_idx, kv_idx):
        s = score * scale_vec[0].astype(score.dtype)
        return s if score_mod is None else score_mod(s, b, h, q_idx, kv_idx)

    return 1.0, scaled


def _check_block_mask(op: str, block_mask, mask_mod, q, k) -> None:
    if not isinstance(block_mask, BlockMask):
        raise ValueError(f"{op}: block_mask must be a BlockMask (create_block_mask) or None, "
                         f"got {type(block_mask).__name__}")
    bm, hm, bq_len, bkv_len = block_mask.shape
    if (bq_len, bkv_len) != (q.shape[2], k.shape[2]):
        raise ValueError(f"{op}: block_mask was built for Lq={bq_len}, Lkv={bkv_len} but q has Lq={q.shape[2]} "
                         f"and k has Lkv={k.shape[2]} (q={tuple(q.shape)}, k={tuple(k.shape)})")
    if bm not in (1, q.shape[0]) or hm not in (1, q.shape[1]):
        raise ValueError(f"{op}: block_mask batch/heads (Bm={bm}, Hm={hm}) must be 1 or match B={q.shape[0]}, "
                         f"Hq={q.shape[1]} (block_mask.shape={block_mask.shape}, q={tuple(q.shape)})")
    if block_mask.mask_mod is not None:
        reads_b, reads_h = _mods.reads_batch_head(block_mask.mask_mod)
        for dim, built, want, reads in (("B", bm, q.shape[0], reads_b), ("H", hm, q.shape[1], reads_h)):
            if reads and built != want:
                raise ValueError(f"{op}: block_mask was built with {dim}={built} but its mask_mod reads "
                                 f"`{dim.lower()}` and the call has {dim}={want} (block_mask.shape="
                                 f"{block_mask.shape}, q={tuple(q.shape)})")
    if mask_mod is not None and not _mods.same_mod(mask_mod, block_mask.mask_mod):
        built = "no mask_mod (every tile full)" if block_mask.mask_mod is None else "another mask_mod"
        raise ValueError(f"{op}: mask_mod differs from the one block_mask was built from ({built}); pass "
                         "block_mask alone, or a block mask built from this mask_mod")


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` returns (PyTorch's
    AuxRequest): ``lse`` the log-sum-exp of each row, ``max_scores`` the maximum of each row's scores."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs of ``flex_attention(..., return_aux=...)`` (PyTorch's AuxOutput): each float32
    [B, Hq, Lq], or None when not requested. ``lse``: natural-log log-sum-exp of the row's scores
    (differentiable). ``max_scores``: the largest score of the row after score_mod and the mask (the scaled
    logit ``scale * q.k`` modded; no gradient). Fully masked rows: -inf for both."""

    lse: jax.Array | None = None
    max_scores: jax.Array | None = None


def _check_kv_lens(op: str, kv_lens, batch: int, kv_len: int) -> jax.Array:
    """int32 [B] per-sequence key counts in [0, Lkv] (concrete values checked; traced ones clamped)."""
    lens = jnp.asarray(kv_lens)
    if lens.shape != (batch,) or not jnp.issubdtype(lens.dtype, jnp.integer):
        raise ValueError(f"{op}: kv_lens must be integer [B={batch}], got {lens.dtype} {lens.shape}")
    if not isinstance(lens, jax.core.Tracer):
        values = np.asarray(lens)
        if values.min() < 0 or values.max() > kv_len:
            raise ValueError(f"{op}: kv_lens must lie in [0, Lkv={kv_len}], got {values.tolist()}")
    return jnp.clip(lens, 0, kv_len).astype(jnp.int32)


def flex_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, score_mod: Callable | None = None,
                   mask_mod: Callable | None = None, block_mask: BlockMask | None = None,
                   scale: float | None = None, return_lse: bool = False, return_aux: AuxRequest | None = None,
                   kernel_options: dict | None = None, block_table: jax.Array | None = None,
                   kv_lens: jax.Array | None = None, impl: str | None = None, interpret: bool = False,
                   context_axis: str | None = None):
    """Softmax attention with FlexAttention-style score and mask mods (GQA native).

    Args:
      q: [B, Hq, Lq, D]; k: [B or 1, Hkv, Lkv, D]; v: [B or 1, Hkv, Lkv, Dv] (K/V of batch 1 are
        broadcast), one floating dtype, Hq % Hkv == 0. Query head h reads KV head h // (Hq // Hkv).
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` or None, written for scalars as in
        PyTorch FlexAttention (it may index captured arrays, reduce, chain indexing); ``score`` is the
        scaled logit ``scale * q.k``.
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` or None (True = attend), scalar semantics.
      block_mask: a BlockMask from :func:`create_block_mask` (it carries its mask_mod) or
        ``BlockMask.from_kv_blocks`` (its tiles are part of the mask, as in PyTorch); passing it with a
        different ``mask_mod`` is a ValueError.
      scale: default ``D ** -0.5``; a Python number, or a traced scalar (then differentiable).
      return_lse: also return the log-sum-exp [B, Hq, Lq] float32 (natural log).
      return_aux: an :class:`AuxRequest` (PyTorch's spelling): return (out, :class:`AuxOutput`) with the
        lse and/or the row maximum of the scores (``max_scores``). Not together with ``return_lse``.
      kernel_options: a dict overriding the Pallas kernel's config with PyTorch's names: ``BLOCK_M``,
        ``BLOCK_N`` (forward tiles), ``num_warps``, ``num_stages``, their ``fwd_`` / ``bwd_`` variants and
        ``bwd_BLOCK_M1`` / ``N1`` (dK/dV pass) / ``M2`` / ``N2`` (dQ pass), plus ``pack_gqa`` and
        ``q_major``. Names and values are checked on every impl; the XLA impls have no such knobs and
        ignore them (so the same call runs on CPU); on "pallas" a config that needs more shared memory
        than the device has is a ValueError before anything compiles.
      block_table: int32 [B, max_pages] for paged K/V: k, v are then pages [num_pages, Hkv, page_size, D]
        (``Dv`` for v) and page ``block_table[b, j]`` holds keys j * page_size ... of sequence b; Lkv =
        max_pages * page_size. Pages may be shared and in any order. "pallas" reads the pages in the kernel
        (forward; its backward gathers them); the XLA impls gather them first. Gradients reach the pages.
      kv_lens: int [B] or None: keys at or past kv_lens[b] are masked (and never read by the kernel), e.g.
        the filled part of a paged cache. Values in [0, Lkv]; changing them never recompiles.
      impl: None (the backend's default), "xla", "repeat" or "pallas" (GPU kernel).
      interpret: run the Pallas kernel in the Pallas interpreter (CPU testing).
      context_axis: a mesh axis name: context parallelism. The sequence (Lq and Lkv) is split over that
        axis, contiguously in axis order, and the op runs ring attention (K/V blocks passed around the
        axis with ``jax.lax.ppermute`` while each device computes, forward and backward). Masked calls
        run on a load-balanced zigzag order internally. Mods get global positions. Needs a mesh
        (``jax.set_mesh``, Explicit shardings of the inputs, or a ``shard_map`` over that axis); impl
        "xla" or "pallas". See docs/API.md, "Sharding and context parallelism".

    Returns:
      out [B, Hq, Lq, Dv] in q's dtype, or (out, lse), or (out, AuxOutput) with ``return_aux``. Fully
      masked rows give out 0 and lse (and max_scores) -inf. Sharded inputs (batch, heads) give outputs
      sharded like them.

    Raises:
      ValueError: bad shapes/dtypes, a mod with the wrong arguments or result type, a block mask that does
        not fit, a bad block table / kv_lens, unknown or invalid kernel_options (or, on "pallas", options
        that do not fit the device's shared memory), return_lse with return_aux.
      RuntimeError: impl="pallas" on CPU without ``interpret=True``.

    Example:
      >>> q = k = v = jnp.ones((1, 2, 8, 16))
      >>> flashlax.flex_attention(q, k, v, mask_mod=flashlax.masks.causal).shape
      (1, 2, 8, 16)
      >>> out, aux = flashlax.flex_attention(q, k, v, return_aux=flashlax.AuxRequest(max_scores=True))
      >>> aux.max_scores.shape
      (1, 2, 8)
    """
    op = "flex_attention"
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    k_view, v_view = k, v           # what the checks see: the logical [B, Hkv, Lkv, D] of a paged cache
    if block_table is not None:
        if jnp.ndim(block_table) != 2 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"{op}: with block_table [B, max_pages], k and v are pages [num_pages, Hkv, "
                             f"page_size, D]; got block_table {jnp.shape(block_table)}, k {k.shape}, v {v.shape}")
        kv_len = jnp.shape(block_table)[1] * k.shape[2]
        k_view, v_view = (jax.ShapeDtypeStruct((q.shape[0], x.shape[1], kv_len, x.shape[3]), x.dtype)
                          for x in (k, v))
    check_attention_inputs(op, q, k_view, v_view)
    if kv_lens is not None:
        kv_lens = _check_kv_lens(op, kv_lens, q.shape[0], k_view.shape[2])
    if block_table is not None:
        block_table = paged.check_block_table(op, block_table, k, v, q.shape[0], kv_lens)
    check_mods(op, score_mod, mask_mod)
    if block_mask is not None:
        # Inside the caller's shard_map over context_axis, q and k are shards of the masked sequence.
        _check_block_mask(op, block_mask, mask_mod, *parallel.global_shapes(q, k_view, context_axis=context_axis))
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise ValueError(f"{op}: return_aux must be an AuxRequest or None, got {type(return_aux).__name__}")
    if return_aux is not None and return_lse:
        raise ValueError(f"{op}: pass return_lse or return_aux, not both (AuxRequest(lse=True) asks for the lse)")
    if kernel_options is not None:
        from flashlax.kernels.configs import parse_kernel_options   # names and values, on every impl
        parse_kernel_options(kernel_options, op)
    effective_mask = mask_mod if mask_mod is not None else (block_mask.mask_mod if block_mask is not None else None)
    if block_mask is not None and (block_mask.layout_defines_mask or kv_lens is not None):
        # The tiles are part of the mask (from_kv_blocks), or the lengths cut it: the impls get a mod that
        # is the whole mask, and a block mask whose tiles agree with it.
        if kv_lens is not None:
            block_mask = masks_lib.restrict_keys(block_mask, kv_lens)
        else:
            block_mask = dataclasses.replace(block_mask, mask_mod=block_mask.exact_mask_mod(),
                                             layout_defines_mask=False)
        effective_mask = block_mask.mask_mod
    elif kv_lens is not None:
        below = masks_lib.keys_below(kv_lens)
        effective_mask = below if effective_mask is None else masks_lib.and_masks(effective_mask, below)
    scale, score_mod = resolve_scale(op, scale, q.shape[3], score_mod)
    entry, fn = dispatch.resolve(op, impl, interpret=interpret)
    want_lse = bool(return_lse) or (return_aux is not None and return_aux.lse)
    want_max = return_aux is not None and return_aux.max_scores
    extra = {}
    if entry.kind == "pallas":
        extra = {name: val for name, val in (("block_table", block_table), ("kv_lens", kv_lens),
                                             ("kernel_options", kernel_options)) if val is not None}
    else:       # the XLA impls see contiguous K/V, zero past kv_lens (garbage there cannot leak)
        if block_table is not None:
            k, v = (paged.gather_pages(x, block_table) for x in (k, v))
        if kv_lens is not None:
            k, v = (paged.zero_past(jnp.broadcast_to(x, (q.shape[0],) + x.shape[1:]), kv_lens) for x in (k, v))
    result = parallel.flex_attention(fn, entry.name, q, k, v, score_mod=score_mod, mask_mod=effective_mask,
                                     block_mask=block_mask, scale=scale, return_lse=want_lse, interpret=interpret,
                                     context_axis=context_axis, return_max=want_max, extra=extra)
    if return_aux is None:
        return result
    out, lse = result[:2] if isinstance(result, tuple) else (result, None)
    return out, AuxOutput(lse=lse if return_aux.lse else None,
                          max_scores=result[2] if want_max else None)


# ----------------------------------------------------------------------------------------------------
# dot_product_attention: jax.nn.dot_product_attention's contract on top of flex_attention
# ----------------------------------------------------------------------------------------------------

def _ensure_4d(x):
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _broadcast_lookup(array: jax.Array, name: str, full_shape: tuple[int, ...]) -> Callable:
    """``array`` broadcastable to [B, N, T, S] -> a scalar function of (b, h, q_idx, kv_idx) reading it."""
    if array.ndim != 4:
        raise ValueError(f"dot_product_attention: {name} must be 4-D (broadcastable to BNTS={full_shape}), "
                         f"got shape {array.shape}")
    for axis, (have, want) in enumerate(zip(array.shape, full_shape)):
        if have not in (1, want):
            raise ValueError(f"dot_product_attention: {name} shape {array.shape} is not broadcastable to "
                             f"BNTS={full_shape} (axis {axis})")
    broadcast = tuple(n == 1 for n in array.shape)

    def lookup(b, h, q_idx, kv_idx):
        index = tuple(0 if one else i for one, i in zip(broadcast, (b, h, q_idx, kv_idx)))
        return array[index]

    return lookup


def _large_negative(logits_dtype) -> np.ndarray:
    """jax's masked logit: -0.7 * the dtype's max, capped at float32's range (finite in float32)."""
    dtype_max = min(float(jnp.finfo(logits_dtype).max), float(jnp.finfo(jnp.float32).max))
    return np.asarray(-0.7 * dtype_max, dtype=logits_dtype)


def _window_mask(left: int, right: int):
    """jax's local window: key j is visible from query i when i - left <= j <= i + right (entries may be
    negative: an empty or shifted window, as jax allows)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    return mask_mod


@functools.partial(jax.jit, static_argnames=("static_scale", "is_causal", "window", "impl", "return_residual"))
def _dot_product_attention(query, key, value, bias, mask, dynamic_scale, query_seq_lengths, key_value_seq_lengths,
                           *, static_scale, is_causal, window, impl, return_residual):
    """The computation behind :func:`dot_product_attention` on 4-D BTNH arrays, jitted as one program (so
    the -inf kept inside for masked scores never shows up as an output, e.g. under ``jax.debug_infs``)."""
    batch, kv_len, kv_heads, _ = key.shape
    q_len, heads = query.shape[1], query.shape[2]
    full_shape = (batch, heads, q_len, kv_len)
    mask_mods = []
    if mask is not None:
        mask_mods.append(_broadcast_lookup(mask, "mask", full_shape))
    if is_causal:
        mask_mods.append(masks_lib.causal)
    if window is not None:
        mask_mods.append(_window_mask(*window))
    if query_seq_lengths is not None:
        mask_mods.append(lambda b, h, q_idx, kv_idx: q_idx < query_seq_lengths[b])
    if key_value_seq_lengths is not None:
        mask_mods.append(lambda b, h, q_idx, kv_idx: kv_idx < key_value_seq_lengths[b])
    mask_mod = masks_lib.and_masks(*mask_mods) if mask_mods else None

    score_mod = None
    if bias is not None:
        read_bias = _broadcast_lookup(bias, "bias", full_shape)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + read_bias(b, h, q_idx, kv_idx).astype(score.dtype)

    q = jnp.swapaxes(query, 1, 2)  # BTNH -> BNTH
    k = jnp.swapaxes(key, 1, 2)
    v = jnp.swapaxes(value, 1, 2)
    scale = static_scale if dynamic_scale is None else dynamic_scale
    out, lse = flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, return_lse=True,
                              impl=impl)
    out = jnp.swapaxes(out, 1, 2)  # [B, T, N, H]
    fully_masked = jnp.swapaxes(lse == -jnp.inf, 1, 2)  # [B, T, N]
    if mask_mod is not None:
        # jax masks with a large finite negative logit, so a row with every key masked averages all values.
        groups = heads // kv_heads
        # Per KV group ([B, T, K, G, H] views: a split of the head axis, which keeps a head sharding).
        mean_v = value.astype(jnp.float32).mean(axis=1)[:, None, :, None, :].astype(out.dtype)  # [B, 1, K, 1, H]
        grouped = (batch, q_len, kv_heads, groups)
        out = jnp.where(fully_masked.reshape(grouped)[..., None], mean_v, out.reshape(grouped + (-1,)))
        out = out.reshape(batch, q_len, heads, -1)
    if query_seq_lengths is not None:
        rows = jnp.arange(q_len)[None, :, None, None] < query_seq_lengths[:, None, None, None]
        out = out * rows.astype(out.dtype)
    if not return_residual:
        return out
    # jax's residual: logsumexp of the (masked) logits, in key's dtype, without gradient; a fully masked row
    # has every logit at the large negative value, whose log-sum-exp rounds back to that value.
    logits_dtype = jnp.promote_types(query.dtype, jnp.float32)
    residual = jnp.where(fully_masked, _large_negative(logits_dtype), jnp.swapaxes(lse, 1, 2).astype(logits_dtype))
    return out, lax.stop_gradient(residual.astype(key.dtype))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False, dropout_rng=None, dropout_rate=0.0,
                          broadcast_dropout=True, deterministic=True, dtype=None, precision=None, module=None):
    """Drop-in for ``jax.nn.dot_product_attention``: same arguments, BTNH layout and results.

    Args:
      query: [B, T, N, H] (or [T, N, H]); key, value: [B, S, K, H], N % K == 0 (GQA), one dtype.
      bias: broadcastable to [B, N, T, S], added to the scaled logits (differentiable).
      mask: broadcastable to [B, N, T, S]; bool (True = attend) or numeric (nonzero = attend, as flax's
        float masks).
      scale: default ``H ** -0.5``; a number or a traced scalar (differentiable).
      is_causal: query i sees keys 0..i. local_window_size: int or (left, right): key j visible from query
        i when i - left <= j <= i + right.
      query_seq_lengths, key_value_seq_lengths: integer [B]; rows past the query length are 0.
      implementation: None (flashlax's default for the backend: the Pallas kernel on GPU, the blockwise
        XLA path on CPU), "xla", "pallas" (flashlax's GPU kernel) or "cudnn" (delegated to jax).
      return_residual: also return jax's residual, the log-sum-exp [B, T, N] in key's dtype, without
        gradient (a fully masked row gives jax's finite value, -0.7 * float32 max).
      dropout_rng, dropout_rate, broadcast_dropout, deterministic, dtype, precision, module: the keywords
        flax passes to an ``attention_fn``. Dropout is not supported (``dropout_rate > 0`` with
        ``deterministic=False`` raises); ``dtype``, ``precision`` and ``module`` are ignored (float32 is
        always computed in full precision). Any other keyword is a TypeError, as in jax.

    Returns:
      The output in query's shape and dtype, or (output, residual). A row with every key masked gets the
      mean of the values, exactly as jax's large-negative-logit masking gives.

    Raises:
      TypeError: an unknown keyword argument (as jax). ValueError: shapes, dtypes or broadcasts that do not
      fit, an unknown implementation, dropout. RuntimeError: implementation="pallas" without a GPU.

    Example:
      >>> x = jnp.ones((2, 8, 4, 16))
      >>> flashlax.dot_product_attention(x, x, x, is_causal=True).shape
      (2, 8, 4, 16)
    """
    op = "dot_product_attention"
    if dropout_rate and not deterministic:
        raise ValueError(f"{op}: attention dropout is not supported (dropout_rate={dropout_rate}, "
                         "deterministic=False)")
    del dropout_rng, broadcast_dropout, dtype, precision, module
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation="cudnn", return_residual=return_residual)
    if implementation not in (None, "xla", "pallas"):
        raise ValueError(f"{op}: unsupported implementation {implementation!r}; valid: None, 'xla', 'cudnn', "
                         "'pallas'")
    output_shape = jnp.shape(query)
    query, key, value = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    batch, _, kv_heads, head_dim = key.shape
    shapes = dict(query=query.shape, key=key.shape, value=value.shape)
    if value.shape != key.shape:
        raise _shape_error(op, "value must have the shape of key [B, S, K, H]", **shapes)
    if value.dtype != key.dtype or query.dtype != key.dtype:
        raise ValueError(f"{op}: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    if query.shape[0] != batch or query.shape[3] != head_dim:
        raise _shape_error(op, "query must be [B, T, N, H] with B and H of key", **shapes)
    if query.shape[2] % kv_heads:
        raise _shape_error(op, f"query heads N={query.shape[2]} must be a multiple of key/value heads "
                               f"K={kv_heads}", **shapes)
    full_shape = (batch, query.shape[2], query.shape[1], key.shape[1])
    if mask is not None:
        mask = _ensure_4d(mask)
        if mask.dtype != jnp.bool_:  # flax builds float masks (1 = attend); jax itself wants bool
            if not jnp.issubdtype(mask.dtype, jnp.number):
                raise ValueError(f"{op}: mask must be bool (or numeric, nonzero = attend), got {mask.dtype} "
                                 f"(shape {mask.shape})")
            mask = mask != 0
        _broadcast_lookup(mask, "mask", full_shape)
    if bias is not None:
        bias = _ensure_4d(bias)
        _broadcast_lookup(bias, "bias", full_shape)
    lengths = {}
    for name, value_ in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if value_ is not None:
            arr = jnp.asarray(value_)
            if arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.integer):
                raise ValueError(f"{op}: {name} must be integer [B={batch}], got {arr.dtype} {arr.shape}")
            value_ = arr.astype(jnp.int32)
        lengths[name] = value_
    window = None
    if local_window_size is not None:
        if isinstance(local_window_size, numbers.Integral):
            local_window_size = (local_window_size, local_window_size)
        window = tuple(int(w) for w in local_window_size)
        if len(window) != 2:
            raise ValueError(f"{op}: local_window_size must be an int or (left, right), got {local_window_size}")
    if scale is None or _is_concrete_number(scale):
        static_scale, dynamic_scale = (None if scale is None else float(scale)), None
    else:
        static_scale, dynamic_scale = None, jnp.asarray(scale)
    if static_scale is not None and not np.isfinite(static_scale):
        raise ValueError(f"{op}: scale must be finite, got {static_scale}")
    out = _dot_product_attention(query, key, value, bias, mask, dynamic_scale, lengths["query_seq_lengths"],
                                 lengths["key_value_seq_lengths"], static_scale=static_scale,
                                 is_causal=bool(is_causal), window=window, impl=implementation,
                                 return_residual=bool(return_residual))
    if return_residual:
        out, residual = out
        return out.reshape(output_shape), residual.reshape(output_shape[:-1])
    return out.reshape(output_shape)
