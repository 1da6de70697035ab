"""Slow, obviously-correct references (float64-capable) used by tests and benchmarks.

Softmax attention: ``attention_reference`` and ``decode_reference`` materialise the scores; run them under
``jax.enable_x64()`` with float64 inputs.

Linear attention: the recurrent ``lax.scan`` implementation is the reference; run it under
``jax.enable_x64()`` with float64 inputs for error measurements.
"""

import jax.numpy as jnp
from jax import lax

from flashlax._mods import apply_mod

from flashlax.fallbacks.linear import gated_delta_rule_recurrent as gated_delta_rule_reference  # noqa: F401


def attention_reference(q, k, v, *, score_mod=None, mask_mod=None, scale=None):
    """Materialised softmax attention: q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv]
    -> (out [B, Hq, Lq, Dv], lse [B, Hq, Lq]), computed in the input dtype (float64 under enable_x64).

    Query head h reads KV head h // (Hq // Hkv) by index mapping. Fully masked rows: out 0, lse -inf.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    kv_of_head = jnp.arange(q_heads) // (q_heads // kv_heads)
    k_per_head, v_per_head = k[:, kv_of_head], v[:, kv_of_head]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q.astype(acc), k_per_head.astype(acc),
                        precision=lax.Precision.HIGHEST) * scale
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(q_heads, dtype=jnp.int32)[None, :, None, None]
    q_idx = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
    kv_idx = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
    if score_mod is not None:
        scores = apply_mod(score_mod, scores, b, h, q_idx, kv_idx).astype(acc)
    allowed = jnp.ones(scores.shape, bool)
    if mask_mod is not None:
        allowed = jnp.broadcast_to(apply_mod(mask_mod, b, h, q_idx, kv_idx), scores.shape)
    scores = jnp.where(allowed, scores, -jnp.inf)
    # Softmax does not depend on the shift, so no gradient flows through it: JAX's max gradient divides by
    # the count of elements equal to the max, which is 0 (0 * inf = NaN) wherever XLA evaluates the scores
    # twice with different roundings (XLA CPU at -O0 does).
    row_max = lax.stop_gradient(scores.max(-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    total = weights.sum(-1)
    has_any = total > 0
    total_safe = jnp.where(has_any, total, 1.0)
    out = jnp.einsum("bhqk,bhkd->bhqd", weights / total_safe[..., None], v_per_head.astype(acc),
                     precision=lax.Precision.HIGHEST)
    lse = jnp.where(has_any, row_max[..., 0] + jnp.log(total_safe), -jnp.inf)
    return out, lse


def decode_reference(q, k_cache, v_cache, *, kv_lens=None, scale=None, score_mod=None, mask_mod=None):
    """Decode attention by materialisation: q [B, Hq, Lq, D], caches [B, Hkv, Lmax, D], kv_lens int [B].

    New token i sits at absolute position kv_lens - Lq + i and sees cache positions <= its own; mods see
    that absolute position as q_idx. Rows past kv_lens are sliced away logically (their values are
    replaced by 0 before use, so garbage there cannot leak). Returns (out [B, Hq, Lq, D], lse [B, Hq, Lq]).
    """
    batch, _, q_len, _ = q.shape
    max_len = k_cache.shape[2]
    kv_lens = jnp.full((batch,), max_len, jnp.int32) if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    positions = jnp.arange(max_len)
    valid = positions[None, :] < kv_lens[:, None]  # [B, Lmax]
    k_clean = jnp.where(valid[:, None, :, None], k_cache, 0)
    v_clean = jnp.where(valid[:, None, :, None], v_cache, 0)
    q_offset = (kv_lens - q_len).astype(jnp.int32)  # absolute position of new token 0, per batch row

    def shifted_score_mod(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx + q_offset[b], kv_idx)

    def decode_mask(b, h, q_idx, kv_idx):
        q_pos = q_idx + q_offset[b]
        allowed = (kv_idx <= q_pos) & (kv_idx < kv_lens[b])
        return allowed & mask_mod(b, h, q_pos, kv_idx) if mask_mod is not None else allowed

    return attention_reference(q, k_clean, v_clean, scale=scale, mask_mod=decode_mask,
                               score_mod=shifted_score_mod if score_mod is not None else None)
