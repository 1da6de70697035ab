"""Decode attention (a few new tokens against a KV cache) in pure XLA: split-KV flash decoding.

The cache is cut into ``num_splits`` contiguous parts. All parts advance together, one ``block_kv``
chunk per loop step (the split index is a batch dimension of the matmuls), each keeping its own online-
softmax state; the parts are merged by log-sum-exp at the end. The ``G * Lq`` query rows of one KV group
(G = Hq // Hkv query heads times Lq new tokens) form one matrix, so every K/V chunk is read once for the
whole group. The loop runs only over chunks below ``max(kv_lens)``, a traced value, so changing kv_lens
never recompiles and cache rows past kv_lens are never used (values there are zeroed before the P @ V
product, so NaN garbage cannot leak).

On GPU the default step covers a whole split (one loop step): when the splits tile the cache exactly the
[B, Hkv, S, split_len, D] view is a reshape, so the cache is read in place by two batched matmuls instead
of being copied chunk by chunk (H200, B1 Hq32 Hkv8 D128 Lq4 KV 65536: 0.555 ms with 1024-row steps).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flashlax import dispatch
from flashlax import _mods
from flashlax.fallbacks.attention import NEG_INF, acc_dtype, masked_score_mod, precision_for
from flashlax.parallel.vma import match_vma

DEFAULT_BLOCK_KV = 1024  # cache rows per step and split (fastest of 512-16384 on the 2-core CPU, PERF_NOTES)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_num_splits(batch: int, kv_heads: int, max_len: int, backend: str | None = None) -> int:
    """Splits for the shape and device: 1 on CPU (XLA already threads each matmul; more splits only add
    merge work); on GPU enough parts to give ~128 independent (batch, head, split) groups, each >= 512
    rows long."""
    if dispatch.backend_family(backend) != "gpu":
        return 1
    want = _cdiv(128, batch * kv_heads)
    return max(1, min(want, max_len // 512, 64))


def decode_attention_xla(q, k_cache, v_cache, *, kv_lens, scale, num_splits=None, score_mod=None, mask_mod=None,
                         return_lse=False, interpret=False, block_kv: int | None = None):
    """q: [B, Hq, Lq, D], k_cache: [B, Hkv, Lmax, D], v_cache: [B, Hkv, Lmax, Dv], kv_lens: int32 [B]
    -> out [B, Hq, Lq, Dv] (and lse [B, Hq, Lq] float32). New token i sits at position kv_lens - Lq + i
    and sees the cache up to itself; mods get that absolute position as q_idx. ``interpret`` is ignored.
    """
    del interpret
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, max_len, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    groups = q_heads // kv_heads
    rows = groups * q_len
    splits = num_splits or choose_num_splits(batch, kv_heads, max_len)
    split_len = _cdiv(max_len, splits)
    if block_kv is None and dispatch.backend_family(None) == "gpu":
        block_kv = split_len
    chunk = min(block_kv or DEFAULT_BLOCK_KV, split_len)
    # One step per split and splits that tile the cache: every chunk starts at its split's start, so the
    # chunks are a reshape of the cache (no copies).
    in_place = chunk == split_len and splits * split_len == max_len
    precision = precision_for(q.dtype)
    acc_t = acc_dtype(q.dtype)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)

    q_rows = q.reshape(batch, kv_heads, rows, head_dim)
    i32 = jnp.int32
    b_idx = jnp.arange(batch, dtype=i32).reshape(batch, 1, 1, 1, 1, 1)
    h_idx = jnp.arange(q_heads, dtype=i32).reshape(1, kv_heads, 1, groups, 1, 1)
    q_pos = (kv_lens[:, None] - q_len + jnp.arange(q_len, dtype=i32)[None, :]).reshape(batch, 1, 1, 1, q_len, 1)
    split_lo = jnp.arange(splits, dtype=i32) * split_len  # [S]
    split_hi = jnp.minimum(split_lo + split_len, max_len)
    tile6 = (batch, kv_heads, splits, groups, q_len, chunk)

    def step(t, carry):
        m, l, acc = carry
        nominal = split_lo + t * chunk  # [S]: first row this step owns in each split
        starts = jnp.clip(nominal, 0, max_len - chunk)  # a chunk never runs past the cache
        if in_place:  # t == 0 is the only step, and starts == split_lo
            k_t = k_cache.reshape(batch, kv_heads, splits, chunk, head_dim)
            v_t = v_cache.reshape(batch, kv_heads, splits, chunk, dv)
        else:
            k_t = jnp.stack([lax.dynamic_slice_in_dim(k_cache, starts[s], chunk, axis=2) for s in range(splits)], 2)
            v_t = jnp.stack([lax.dynamic_slice_in_dim(v_cache, starts[s], chunk, axis=2) for s in range(splits)], 2)
        pos = starts[:, None] + jnp.arange(chunk, dtype=i32)[None, :]  # [S, C]
        owned = (pos >= nominal[:, None]) & (pos < split_hi[:, None])
        in_cache = pos[None] < kv_lens[:, None, None]  # [B, S, C]
        v_t = jnp.where(in_cache[:, None, :, :, None], v_t, 0)  # garbage past kv_lens must not reach P @ V
        s = jnp.einsum("bhmd,bhscd->bhsmc", q_rows, k_t, precision=precision, preferred_element_type=acc_t)
        s = (s * scale).reshape(tile6)
        kv_idx = pos.reshape(1, 1, splits, 1, 1, chunk)
        allowed = owned.reshape(1, 1, splits, 1, 1, chunk) & (kv_idx <= q_pos)
        if mask_mod is not None:
            allowed = allowed & _mods.apply_mod(mask_mod, b_idx, h_idx, q_pos, kv_idx)
        allowed = jnp.broadcast_to(allowed, tile6)
        s = masked_score_mod(score_mod, s, allowed, b_idx, h_idx, q_pos, kv_idx)
        s = s.reshape(batch, kv_heads, splits, rows, chunk)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing allowed yet: exp() stays 0
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        pv = jnp.einsum("bhsmc,bhscd->bhsmd", p.astype(v_t.dtype), v_t, precision=precision,
                        preferred_element_type=acc_t)
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    state = (batch, kv_heads, splits, rows)
    init = (jnp.full(state, NEG_INF, acc_t), jnp.zeros(state, acc_t), jnp.zeros(state + (dv,), acc_t))
    init = match_vma(init, q, k_cache, v_cache, kv_lens)
    # Steps needed by the longest sequence (split 0 is the fullest); a traced trip count: no recompiles.
    # Clipped below too: any int32 length (traced, unchecked) gives a count in [0, split_len / chunk].
    steps = _cdiv(jnp.clip(jnp.max(kv_lens), 0, split_len), chunk)
    m, l, acc = lax.fori_loop(0, steps.astype(i32), step, init)

    # Merge the splits by log-sum-exp.
    m_all = m.max(2)
    m_all_safe = jnp.where(m_all == NEG_INF, 0.0, m_all)
    weight = jnp.exp(m - m_all_safe[:, :, None])  # [B, Hkv, S, rows]
    l_all = (weight * l).sum(2)
    acc_all = (weight[..., None] * acc).sum(2)
    has_any = l_all > 0
    l_safe = jnp.where(has_any, l_all, 1.0)
    out = (acc_all / l_safe[..., None]).astype(q.dtype).reshape(batch, q_heads, q_len, dv)
    if not return_lse:
        return out
    lse = jnp.where(has_any, m_all_safe + jnp.log(l_safe), NEG_INF).reshape(batch, q_heads, q_len)
    return out, lse


def nan_rows(result, kv_lens, q_len: int, max_len: int):
    """``result`` (out [B, Hq, Lq, Dv], or (out, lse [B, Hq, Lq])) with NaN rows for the batch elements whose
    kv_lens lie outside [Lq, Lmax]: the guard for traced lengths, which cannot be checked."""
    bad = (kv_lens < q_len) | (kv_lens > max_len)
    if isinstance(result, tuple):
        out, lse = result
        return jnp.where(bad[:, None, None, None], jnp.nan, out), jnp.where(bad[:, None, None], jnp.nan, lse)
    return jnp.where(bad[:, None, None, None], jnp.nan, result)
