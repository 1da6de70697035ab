"""Front ends of softmax attention: ``flex_attention`` and ``dot_product_attention``.

Both validate their inputs before anything is traced, then ask the dispatcher for an implementation
(``flashlax.dispatch.resolve``): ``"xla"`` (blockwise online softmax, the CPU default), ``"repeat"`` (K/V
repeated to Hq heads, the old baseline) and ``"pallas"`` (the GPU kernel).
"""

from __future__ import annotations

import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flashlax import dispatch
from flashlax import masks as masks_lib
from flashlax.masks import BlockMask


def _shape_error(name: str, what: str, **shapes) -> ValueError:
    seen = ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items())
    return ValueError(f"{name}: {what} (got {seen})")


def check_attention_inputs(op: str, q, k, v) -> None:
    """Shapes and dtypes of q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv]."""
    shapes = dict(q=q.shape, k=k.shape, v=v.shape)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise _shape_error(op, f"{name} must be 4-D [B, H, L, D]", **shapes)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be a floating dtype, got {x.dtype} "
                             f"(dtypes q={q.dtype}, k={k.dtype}, v={v.dtype})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k and v must have the same dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise _shape_error(op, "batch sizes of q, k and v differ", **shapes)
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
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            raise ValueError(f"{op}: {name} must be callable or None, got {type(mod).__name__}")


def resolve_scale(op: str, scale, head_dim: int) -> float:
    """The scale as a Python float (default head_dim ** -0.5)."""
    if scale is None:
        return float(head_dim) ** -0.5
    try:
        value = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise ValueError(f"{op}: scale must be a Python number or a concrete scalar, got {scale!r}") from err
    if not np.isfinite(value):
        raise ValueError(f"{op}: scale must be finite, got {value}")
    return value


def flex_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, score_mod: Callable | None = None,
                   mask_mod: Callable | None = None, block_mask: BlockMask | None = None,
                   scale: float | None = None, return_lse: bool = False, impl: str | None = None,
                   interpret: bool = False):
    """Softmax attention with FlexAttention-style score and mask mods (GQA native).

    q: [B, Hq, Lq, D], k: [B, Hkv, Lkv, D], v: [B, Hkv, Lkv, Dv], Hq % Hkv == 0; query head h reads
    KV head h // (Hq // Hkv). score = scale * q.k (scale defaults to D ** -0.5), then
    ``score_mod(score, b, h, q_idx, kv_idx)``; ``mask_mod(b, h, q_idx, kv_idx)`` (or ``block_mask``,
    which carries its mask_mod) says which keys each query sees.

    Returns out [B, Hq, Lq, Dv] in q's dtype, and lse [B, Hq, Lq] float32 (natural log) when
    ``return_lse``. Fully masked rows give out 0 and lse -inf.
    """
    op = "flex_attention"
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_attention_inputs(op, q, k, v)
    check_mods(op, score_mod, mask_mod)
    if block_mask is not None:
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
    effective_mask = mask_mod if mask_mod is not None else (block_mask.mask_mod if block_mask is not None else None)
    scale = resolve_scale(op, scale, q.shape[3])
    _, fn = dispatch.resolve(op, impl, interpret=interpret)
    return fn(q, k, v, score_mod=score_mod, mask_mod=effective_mask, block_mask=block_mask, scale=scale,
              return_lse=bool(return_lse), interpret=interpret)


# ----------------------------------------------------------------------------------------------------
# dot_product_attention: jax.nn.dot_product_attention's contract on top of flex_attention
# ----------------------------------------------------------------------------------------------------

def _ensure_4d(x):
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _broadcast_lookup(array: jax.Array, name: str, full_shape: tuple[int, ...]) -> Callable:
    """``array`` broadcastable to [B, N, T, S] -> a function of (b, h, q_idx, kv_idx) reading it."""
    if array.ndim != 4:
        raise ValueError(f"dot_product_attention: {name} must be 4-D (broadcastable to BNTS={full_shape}), "
                         f"got shape {array.shape}")
    for axis, (have, want) in enumerate(zip(array.shape, full_shape)):
        if have not in (1, want):
            raise ValueError(f"dot_product_attention: {name} shape {array.shape} is not broadcastable to "
                             f"BNTS={full_shape} (axis {axis})")
    if array.shape[1] not in (1, full_shape[1]):
        raise ValueError(f"dot_product_attention: {name} heads must be 1 or N={full_shape[1]}, got {array.shape}")
    broadcast = tuple(n == 1 for n in array.shape)

    def lookup(b, h, q_idx, kv_idx):
        index = tuple(0 if one else i for one, i in zip(broadcast, (b, h, q_idx, kv_idx)))
        return array[index]

    return lookup


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False, dropout_rng=None, dropout_rate=0.0,
                          broadcast_dropout=True, deterministic=True, dtype=None, precision=None, module=None,
                          **unused_flax_kwargs):
    """Drop-in for ``jax.nn.dot_product_attention`` (BTNH layout, same arguments and results).

    query: [B, T, N, H] (or [T, N, H]), key/value: [B, S, K, H], N % K == 0; bias/mask broadcastable to
    [B, N, T, S]. ``implementation``: None / "xla" (flashlax's blockwise XLA path), "cudnn" (delegated to
    jax), "pallas" (flashlax's Pallas kernel). Rows with every key masked out get the mean of the values,
    exactly as jax's large-negative-logit masking gives; rows past ``query_seq_lengths`` are 0.

    Also usable as a flax ``attention_fn``: the extra flax keywords are accepted; dropout is not
    supported (``dropout_rate > 0`` without ``deterministic`` raises), ``dtype``/``precision``/``module``
    are ignored (float32 is always computed in full precision).
    """
    op = "dot_product_attention"
    if dropout_rate and not deterministic:
        raise ValueError(f"{op}: attention dropout is not supported (dropout_rate={dropout_rate}, "
                         "deterministic=False)")
    del dropout_rng, broadcast_dropout, dtype, precision, module, unused_flax_kwargs
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation="cudnn", return_residual=return_residual)
    impl = {None: "xla", "xla": "xla", "pallas": "pallas"}.get(implementation)
    if impl is None:
        raise ValueError(f"{op}: unsupported implementation {implementation!r}; valid: None, 'xla', 'cudnn', "
                         "'pallas'")
    output_shape = jnp.shape(query)
    query, key, value = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    batch, kv_len, kv_heads, head_dim = key.shape
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
    q_len, heads = query.shape[1], query.shape[2]
    full_shape = (batch, heads, q_len, kv_len)

    mask_mods = []
    if mask is not None:
        mask = _ensure_4d(mask)
        if mask.dtype != jnp.bool_:  # flax builds float masks (1 = attend); jax itself wants bool
            if not (jnp.issubdtype(mask.dtype, jnp.number)):
                raise ValueError(f"{op}: mask must be bool (or numeric, nonzero = attend), got {mask.dtype} "
                                 f"(shape {mask.shape})")
            mask = mask != 0
        mask_mods.append(_broadcast_lookup(mask, "mask", full_shape))
    if is_causal:
        mask_mods.append(masks_lib.causal)
    if local_window_size is not None:
        if isinstance(local_window_size, numbers.Integral):
            local_window_size = (int(local_window_size), int(local_window_size))
        left, right = local_window_size
        mask_mods.append(masks_lib.sliding_window(int(left), int(right)))
    for name, lengths in (("query_seq_lengths", query_seq_lengths),
                          ("key_value_seq_lengths", key_value_seq_lengths)):
        if lengths is not None:
            lengths_arr = jnp.asarray(lengths)
            if lengths_arr.shape != (batch,) or lengths_arr.dtype != jnp.int32:
                raise ValueError(f"{op}: {name} must be int32 [B={batch}], got {lengths_arr.dtype} "
                                 f"{lengths_arr.shape}")
    if query_seq_lengths is not None:
        q_lens = jnp.asarray(query_seq_lengths)
        mask_mods.append(lambda b, h, q_idx, kv_idx: q_idx < q_lens[b])
    if key_value_seq_lengths is not None:
        kv_lens = jnp.asarray(key_value_seq_lengths)
        mask_mods.append(lambda b, h, q_idx, kv_idx: kv_idx < kv_lens[b])
    mask_mod = masks_lib.and_masks(*mask_mods) if mask_mods else None

    score_mod = None
    if bias is not None:
        bias = _ensure_4d(bias)
        read_bias = _broadcast_lookup(bias, "bias", full_shape)

        def score_mod(score, b, h, q_idx, kv_idx):
            return (score + read_bias(b, h, q_idx, kv_idx)).astype(score.dtype)

    q = jnp.swapaxes(query, 1, 2)  # BTNH -> BNTH
    k = jnp.swapaxes(key, 1, 2)
    v = jnp.swapaxes(value, 1, 2)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, return_lse=True,
                              impl=impl)
    out = jnp.swapaxes(out, 1, 2)  # [B, T, N, H]
    if mask_mod is not None:
        # jax masks with a large finite negative logit, so a row with every key masked averages all values.
        groups = heads // kv_heads
        mean_v = jnp.repeat(value.astype(jnp.float32).mean(axis=1), groups, axis=1)  # [B, N, H]
        fully_masked = jnp.swapaxes(lse == -jnp.inf, 1, 2)[..., None]  # [B, T, N, 1]
        out = jnp.where(fully_masked, mean_v[:, None].astype(out.dtype), out)
    if query_seq_lengths is not None:
        rows = jnp.arange(q_len)[None, :, None, None] < jnp.asarray(query_seq_lengths)[:, None, None, None]
        out = out * rows.astype(out.dtype)
    out = out.reshape(output_shape)
    if return_residual:
        return out, jnp.swapaxes(lse, 1, 2).astype(key.dtype).reshape(output_shape[:-1])
    return out
