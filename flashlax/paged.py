"""Paged KV caches: validation of a block table and the XLA paths' view of the pages.

A paged cache is a pool of pages ``k_pages [num_pages, Hkv, page_size, D]`` (``v_pages`` likewise, head dim
Dv) and a block table ``int32 [B, max_pages]``: page ``block_table[b, j]`` holds positions
``j * page_size ... (j + 1) * page_size - 1`` of sequence b, so each sequence sees a logical cache of
``max_pages * page_size`` positions. Pages may be shared between sequences (a common prefix) and appear in
any order. Entries past a sequence's length are never used (they may hold anything; the kernels clamp every
index they read into range).

The Pallas kernels read the block table in the kernel and load each K/V tile from its page
(``flashlax.kernels._tiles.kv_tile_view``): no gather of the cache in memory. The XLA paths gather the
pages into a contiguous ``[B, Hkv, max_pages * page_size, D]`` cache first (:func:`gather_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _cdiv(a, b):
    return -(-a // b)


def check_block_table(op: str, block_table, k_pages, v_pages, batch: int, kv_lens=None) -> jax.Array:
    """Validates a paged cache for ``batch`` sequences and returns the block table as int32.

    k_pages [num_pages, Hkv, page_size, D] and v_pages [num_pages, Hkv, page_size, Dv] (one dtype is the
    caller's check); block_table integer [batch, max_pages]. Concrete tables are checked eagerly: every entry
    a sequence uses (all of them, or the first cdiv(kv_lens[b], page_size) when kv_lens is concrete) must lie
    in [0, num_pages). ValueError names the argument and the shapes.
    """
    shapes = (f"k_pages={tuple(jnp.shape(k_pages))}, v_pages={tuple(jnp.shape(v_pages))}, "
              f"block_table={tuple(jnp.shape(block_table))}")
    if jnp.ndim(k_pages) != 4 or jnp.ndim(v_pages) != 4 or jnp.shape(k_pages)[:3] != jnp.shape(v_pages)[:3]:
        raise ValueError(f"{op}: a paged cache is k/v pages [num_pages, Hkv, page_size, D] that agree in "
                         f"[num_pages, Hkv, page_size] (got {shapes})")
    table = jnp.asarray(block_table)
    if table.ndim != 2 or table.shape[0] != batch or table.shape[1] < 1 \
            or not jnp.issubdtype(table.dtype, jnp.integer):
        raise ValueError(f"{op}: block_table must be integer [B={batch}, max_pages >= 1], got {table.dtype} "
                         f"(got {shapes})")
    num_pages, _, page_size, _ = jnp.shape(k_pages)
    if isinstance(table, jax.core.Tracer):
        return table.astype(jnp.int32)
    values = np.asarray(table)
    used = np.ones(values.shape, bool)
    if kv_lens is not None and not isinstance(kv_lens, jax.core.Tracer):
        pages_needed = _cdiv(np.asarray(kv_lens).astype(np.int64), page_size)
        used = np.arange(values.shape[1])[None, :] < pages_needed[:, None]
    bad = used & ((values < 0) | (values >= num_pages))
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(f"{op}: block_table[{b}, {j}] = {values[b, j]} is not a page of the pool "
                         f"(num_pages={num_pages}; {shapes})")
    return jnp.asarray(values.astype(np.int32))


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """[num_pages, H, page_size, D] pages and int [B, max_pages] table -> the contiguous cache
    [B, H, max_pages * page_size, D] (indices clamped into range). Differentiable in ``pages``: the
    gradient of a page shared by several sequences is the sum of theirs."""
    batch, max_pages = block_table.shape
    _, heads, page_size, dim = pages.shape
    rows = jnp.take(pages, block_table, axis=0, mode="clip")           # [B, max_pages, H, page_size, D]
    return jnp.swapaxes(rows, 1, 2).reshape(batch, heads, max_pages * page_size, dim)


def zero_past(cache: jax.Array, kv_lens: jax.Array) -> jax.Array:
    """cache [B, H, L, D] with rows at or past kv_lens[b] set to 0, so whatever a cache holds there (NaN
    included) cannot reach a P @ V product or a gradient."""
    rows = jnp.arange(cache.shape[2], dtype=jnp.int32)[None, :] < kv_lens[:, None]
    return jnp.where(rows[:, None, :, None], cache, jnp.zeros((), cache.dtype))
