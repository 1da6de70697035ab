"""score_mod library. A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` takes the scaled logit
``scale * q.k`` and int32 indices, written for scalars and traced with broadcasting."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

ScoreMod = Callable[..., jax.Array]


def alibi(slopes: jax.Array) -> ScoreMod:
    """ALiBi: adds ``slopes[h] * (kv_idx - q_idx)``; ``slopes`` float [H]."""
    slopes = jnp.asarray(slopes)
    if slopes.ndim != 1:
        raise ValueError(f"alibi: slopes must be [H], got shape {slopes.shape}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h].astype(score.dtype) * (kv_idx - q_idx).astype(score.dtype)

    return score_mod


def softcap(cap: float) -> ScoreMod:
    """Gemma-2 style logit soft-capping: ``cap * tanh(score / cap)``."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    return score_mod


def relative_bias(table: jax.Array) -> ScoreMod:
    """Learned relative-position bias: adds ``table[h, q_idx - kv_idx + (L - 1)]`` for table [H, 2L-1],
    or ``table[q_idx - kv_idx + (L - 1)]`` for table [2L-1]; offsets beyond the table are clamped.
    Gradients flow to ``table``."""
    table = jnp.asarray(table)
    if table.ndim not in (1, 2) or table.shape[-1] % 2 != 1:
        raise ValueError(f"relative_bias: table must be [2L-1] or [H, 2L-1], got shape {table.shape}")
    center = table.shape[-1] // 2

    def score_mod(score, b, h, q_idx, kv_idx):
        offset = jnp.clip(q_idx - kv_idx + center, 0, table.shape[-1] - 1)
        bias = table[h, offset] if table.ndim == 2 else table[offset]
        return score + bias.astype(score.dtype)

    return score_mod
