"""Front end of decode_attention: validates, then asks the dispatcher for an implementation."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flashlax import dispatch, paged
from flashlax.attention import check_mods, resolve_scale
from flashlax.parallel import shard as parallel

MAX_NEW_TOKENS = 16


@jax.custom_jvp
def _not_differentiable(q, k_cache, v_cache):
    """Identity on the inputs whose derivative raises: decode_attention is an inference op (its loop runs
    to max(kv_lens), a traced value, which reverse mode cannot follow under jit), and it says so the
    same way eagerly and under jit, in forward and reverse mode. Train with flex_attention."""
    return q, k_cache, v_cache


@_not_differentiable.defjvp
def _not_differentiable_jvp(primals, tangents):
    raise TypeError("decode_attention is not differentiable (an inference op); use flex_attention, which "
                    "takes the same score_mod / mask_mod, for gradients")


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, kv_lens: jax.Array | None = None,
                     block_table: jax.Array | None = None, scale: float | None = None, num_splits: int | None = None,
                     score_mod: Callable | None = None, mask_mod: Callable | None = None, return_lse: bool = False,
                     impl: str | None = None, interpret: bool = False, context_axis: str | None = None):
    """Attention of 1..16 new tokens against a KV cache (split-KV flash decoding).

    Args:
      q: [B, Hq, Lq, D], 1 <= Lq <= 16 new tokens (speculative decoding verifies several).
      k_cache, v_cache: [B, Hkv, Lmax, D] and [B, Hkv, Lmax, Dv], one dtype with q; Hq % Hkv == 0.
      kv_lens: integer [B] valid cache lengths including the new tokens (default Lmax). New token i sits
        at position kv_lens - Lq + i and sees cache positions <= its own; rows past kv_lens are never used.
        Changing values never recompiles.
      block_table: int32 [B, max_pages] for a paged cache: k_cache, v_cache are then pages
        [num_pages, Hkv, page_size, D / Dv], page ``block_table[b, j]`` holds positions
        j * page_size ... of sequence b (Lmax = max_pages * page_size). Pages may be shared between
        sequences and come in any order; entries past a sequence's length are never used. The Pallas
        kernel reads the pages in place; the XLA path gathers them first.
      scale: default D ** -0.5 (a number or a traced scalar).
      num_splits: parts of the cache reduced in parallel and merged by log-sum-exp (None: chosen from the
        shape and the device).
      score_mod, mask_mod: as in flex_attention (scalar semantics); q_idx is the new token's absolute
        position.
      return_lse: also return lse [B, Hq, Lq] float32.
      impl: None (the backend's default: "pallas" on GPU, "xla" on CPU), "xla" or "pallas".
      interpret: run the Pallas kernel in the Pallas interpreter (CPU testing).
      context_axis: a mesh axis name splitting the caches' sequence axis (Lmax, contiguously in axis
        order): each device attends its part of the cache and one log-sum-exp merge across the axis (pmax,
        psum) gives the result (the long-context serving case); q and kv_lens are global. Sharded inputs
        (batch, heads) give outputs sharded like them. See docs/API.md, "Sharding and context parallelism".

    Returns:
      out [B, Hq, Lq, Dv] in q's dtype, or (out, lse).

    Raises:
      ValueError: bad shapes or dtypes, Lq outside 1..16, concrete kv_lens outside [Lq, Lmax] (traced ones
        give NaN rows for that batch element instead), bad mods or num_splits, a block table that is not
        integer [B, max_pages] or (when concrete) uses a page outside the pool.
      RuntimeError: impl="pallas" on CPU without interpret=True.
      TypeError: when differentiated (an inference op; train with flex_attention).

    Example:
      >>> q, cache = jnp.ones((2, 8, 1, 64)), jnp.ones((2, 2, 1024, 64))
      >>> flashlax.decode_attention(q, cache, cache, kv_lens=jnp.array([700, 1024])).shape
      (2, 8, 1, 64)
      >>> pages, table = jnp.ones((8, 2, 256, 64)), jnp.array([[3, 0, 5, 1], [2, 7, 4, 6]])
      >>> flashlax.decode_attention(q, pages, pages, kv_lens=jnp.array([700, 1024]), block_table=table).shape
      (2, 8, 1, 64)
    """
    op = "decode_attention"
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    shapes = f"q={tuple(q.shape)}, k_cache={tuple(k_cache.shape)}, v_cache={tuple(v_cache.shape)}"
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{op}: {name} must be 4-D [B, H, L, D] (got {shapes})")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be a floating dtype, got {x.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"{op}: q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    batch, q_heads, q_len, head_dim = q.shape
    if block_table is None and not (k_cache.shape[0] == v_cache.shape[0] == batch):
        raise ValueError(f"{op}: batch sizes of q, k_cache and v_cache differ (got {shapes})")
    if not 1 <= q_len <= MAX_NEW_TOKENS:
        raise ValueError(f"{op}: q must hold 1..{MAX_NEW_TOKENS} new tokens, got Lq={q_len} (got {shapes})")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{op}: k_cache and v_cache must agree in [B, Hkv, Lmax] (pages: [num_pages, Hkv, "
                         f"page_size]) (got {shapes})")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if block_table is not None:
        if jnp.ndim(block_table) != 2:
            raise ValueError(f"{op}: block_table must be [B, max_pages], got shape {jnp.shape(block_table)} "
                             f"({shapes})")
        max_len = jnp.shape(block_table)[1] * k_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{op}: query heads Hq={q_heads} must be a multiple of cache heads Hkv={kv_heads} "
                         f"(got {shapes})")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: head dims of q (D={head_dim}) and k_cache (D={k_cache.shape[3]}) differ "
                         f"(got {shapes})")
    if max_len < q_len:
        raise ValueError(f"{op}: cache length Lmax={max_len} is shorter than the Lq={q_len} new tokens "
                         f"(got {shapes})")
    check_mods(op, score_mod, mask_mod)
    traced_lens = False
    if kv_lens is None:
        kv_lens = jnp.full((batch,), max_len, jnp.int32)
    else:
        kv_lens = jnp.asarray(kv_lens)
        if kv_lens.shape != (batch,) or not jnp.issubdtype(kv_lens.dtype, jnp.integer):
            raise ValueError(f"{op}: kv_lens must be integer [B={batch}], got {kv_lens.dtype} {kv_lens.shape}")
        if isinstance(kv_lens, jax.core.Tracer):
            traced_lens = True
        else:
            lens = np.asarray(kv_lens)
            if lens.min() < q_len or lens.max() > max_len:
                raise ValueError(f"{op}: kv_lens must lie in [Lq={q_len}, Lmax={max_len}] (they include the new "
                                 f"tokens), got {lens.tolist()}")
        if kv_lens.dtype != jnp.int32:
            # int64 under jax_enable_x64: values are checked (eagerly) or NaN-guarded (traced) against Lmax,
            # which fits int32, so the clipped cast keeps every verdict. int32 lengths go as given (one XLA
            # op fewer around the kernel in a serving step; the kernels clamp the rows they read).
            kv_lens = jnp.clip(kv_lens, -1, max_len + 1).astype(jnp.int32)
    if num_splits is not None and (not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool)
                                   or not 1 <= num_splits <= max_len):
        raise ValueError(f"{op}: num_splits must be None or an int in [1, Lmax={max_len}], got {num_splits!r}")
    if block_table is not None:
        block_table = paged.check_block_table(op, block_table, k_cache, v_cache, batch, kv_lens)
    scale, score_mod = resolve_scale(op, scale, head_dim, score_mod)
    entry, fn = dispatch.resolve(op, impl, interpret=interpret)
    q, k_cache, v_cache = _not_differentiable(q, k_cache, v_cache)
    extra = {}
    if block_table is not None and entry.kind == "pallas":
        extra = dict(block_table=block_table)      # the kernel reads the pages in place
    elif block_table is not None:
        k_cache, v_cache = (paged.gather_pages(c, block_table) for c in (k_cache, v_cache))
    # Traced kv_lens cannot be checked here: a batch element whose length lies outside [Lq, Lmax] gets NaN
    # rows (output and lse) instead of plausible numbers (``lens_range``: in the kernel where it can).
    return parallel.decode_attention(fn, entry.name, q, k_cache, v_cache, kv_lens=kv_lens, scale=scale,
                                     num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                                     return_lse=bool(return_lse), interpret=interpret, context_axis=context_axis,
                                     extra=extra, lens_range=(q_len, max_len) if traced_lens else None)
