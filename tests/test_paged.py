"""Paged KV caches (issue 18): decode_attention and flex_attention with ``block_table`` give what the same
call gives on the contiguous cache, on every impl (Pallas interpreted on CPU), with pages in shuffled order,
pages shared between sequences (a common prefix), page sizes that are smaller than, equal to or larger than
the kernel's tiles (and not a power of two), NaN in every row a sequence does not own, and gradients that
reach the page pool. ``gpu``-marked tests run the compiled kernels at the benchmark's sizes.

Expected pools and their gradients are built here with numpy loops over the block table (by hand), not
with ``flashlax.paged``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from conftest import TOLERANCES, rel_err
from flashlax import masks


def _paged_cache(rng, batch, heads, max_pages, page_size, dim, *, shared_prefix=0, spare=2, dtype=np.float32):
    """(pool [num_pages, heads, page_size, dim], block_table [batch, max_pages], contiguous caches
    [batch, heads, max_pages * page_size, dim]): every sequence's pages in shuffled order in the pool,
    the first ``shared_prefix`` pages of every sequence the same pages (so the same keys), and ``spare``
    pages of NaN that no sequence uses."""
    own = batch * (max_pages - shared_prefix)
    num_pages = shared_prefix + own + spare
    order = rng.permutation(num_pages)                  # pool slot of logical page n
    pool = np.full((num_pages, heads, page_size, dim), np.nan, dtype)
    table = np.zeros((batch, max_pages), np.int32)
    contiguous = np.zeros((batch, heads, max_pages * page_size, dim), dtype)
    prefix = rng.normal(size=(shared_prefix, heads, page_size, dim)).astype(dtype)
    n = 0
    for j in range(shared_prefix):
        pool[order[n]] = prefix[j]
        table[:, j] = order[n]
        n += 1
    for b in range(batch):
        for j in range(shared_prefix, max_pages):
            pool[order[n]] = rng.normal(size=(heads, page_size, dim)).astype(dtype)
            table[b, j] = order[n]
            n += 1
    for b in range(batch):
        for j in range(max_pages):
            contiguous[b, :, j * page_size:(j + 1) * page_size] = pool[table[b, j]]
    return pool, table, contiguous


def _poison_past(pool, table, kv_lens, page_size):
    """NaN in every pooled row at or past its sequence's length (pages shared by a prefix stay intact:
    they lie below every length here)."""
    pool = pool.copy()
    for b, n in enumerate(kv_lens):
        for j in range(table.shape[1]):
            rows = np.arange(j * page_size, (j + 1) * page_size) >= n
            pool[table[b, j]][:, rows] = np.nan
    return pool


def _scatter_add_pages(grad_contiguous, table, num_pages, page_size):
    """The gradient a pool gets from the contiguous caches' gradient: each page sums its sequences'."""
    batch, heads, _, dim = grad_contiguous.shape
    out = np.zeros((num_pages, heads, page_size, dim), np.float64)
    for b in range(batch):
        for j in range(table.shape[1]):
            out[table[b, j]] += grad_contiguous[b, :, j * page_size:(j + 1) * page_size]
    return out


# ----------------------------------------------------------------------------------------------------
# decode_attention
# ----------------------------------------------------------------------------------------------------

DECODE_CASES = [
    # (id, page_size, max_pages, shared_prefix, Lq, impl). Interpreted decode tiles are 64 keys here:
    # pages of 16 and 48 are looked up row by row, 64 and 128 are one table read per tile.
    ("p16_shared_xla", 16, 6, 2, 1, "xla"),
    ("p16_shared_pallas", 16, 6, 2, 3, "pallas"),
    ("p48_pallas", 48, 3, 0, 2, "pallas"),
    ("p128_shared_pallas", 128, 2, 1, 1, "pallas"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_paged_equals_contiguous(case):
    name, page_size, max_pages, shared, q_len, impl = case
    rng = np.random.default_rng(sum(map(ord, name)))
    batch, hq, hkv, dim = 2, 4, 2, 32
    k_pool, table, k_cont = _paged_cache(rng, batch, hkv, max_pages, page_size, dim, shared_prefix=shared)
    rng2 = np.random.default_rng(1)
    v_pool = rng2.normal(size=k_pool.shape).astype(np.float32)
    v_cont = np.stack([np.concatenate([v_pool[table[b, j]] for j in range(max_pages)], axis=1) for b in range(batch)])
    max_len = max_pages * page_size
    lens = np.array([max_len, shared * page_size + 5 + q_len], np.int32)
    q = rng.normal(size=(batch, hq, q_len, dim)).astype(np.float32)
    kw = dict(kv_lens=jnp.asarray(lens), impl=impl, interpret=impl == "pallas", return_lse=True)
    out_c, lse_c = flashlax.decode_attention(q, k_cont, v_cont, num_splits=2, **kw)
    k_bad, v_bad = (_poison_past(p, table, lens, page_size) for p in (k_pool, v_pool))
    out_p, lse_p = flashlax.decode_attention(q, k_bad, v_bad, block_table=jnp.asarray(table), num_splits=2, **kw)
    assert np.isfinite(np.asarray(out_p)).all()
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out_c), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse_c), rtol=2e-6, atol=2e-6)


def test_decode_paged_under_jit_new_tables_do_not_recompile():
    """The block table is read in the kernel: new tables and lengths reuse the compiled call; x64 on."""
    rng = np.random.default_rng(3)
    k_pool, table, k_cont = _paged_cache(rng, 2, 2, 4, 16, 32)
    q = jnp.asarray(rng.normal(size=(2, 4, 1, 32)), jnp.float32)

    @jax.jit
    def run(q, pool, table, lens):
        return flashlax.decode_attention(q, pool, pool, kv_lens=lens, block_table=table, impl="pallas",
                                         interpret=True, num_splits=1)

    with jax.enable_x64(True):
        for perm in (np.arange(4), np.array([2, 0, 3, 1])):
            t = table[:, perm]
            cont = np.stack([np.concatenate([k_pool[t[b, j]] for j in range(4)], axis=1) for b in range(2)])
            lens = jnp.asarray([64, 40], jnp.int64)
            want = flashlax.decode_attention(q, cont, cont, kv_lens=lens, impl="xla")
            got = run(q, jnp.asarray(k_pool), jnp.asarray(t, jnp.int64), lens)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
    assert run._cache_size() == 1


# ----------------------------------------------------------------------------------------------------
# flex_attention
# ----------------------------------------------------------------------------------------------------

FLEX_IMPLS = [("xla", {}), ("repeat", {}), ("pallas", dict(interpret=True))]


def _flex_case(seed=5, page_size=16, max_pages=4, shared=1):
    rng = np.random.default_rng(seed)
    batch, hq, hkv, q_len, dim = 2, 4, 2, 24, 16
    k_pool, table, k_cont = _paged_cache(rng, batch, hkv, max_pages, page_size, dim, shared_prefix=shared)
    v_pool, _, _ = _paged_cache(np.random.default_rng(seed), batch, hkv, max_pages, page_size, dim, shared_prefix=shared)
    v_cont = np.stack([np.concatenate([v_pool[table[b, j]] for j in range(max_pages)], axis=1) for b in range(batch)])
    q = rng.normal(size=(batch, hq, q_len, dim)).astype(np.float32)
    lens = np.array([max_pages * page_size, page_size * shared + 9], np.int32)
    return q, k_pool, v_pool, table, k_cont, v_cont, lens


@pytest.mark.parametrize("impl,kw", FLEX_IMPLS, ids=[i for i, _ in FLEX_IMPLS])
def test_flex_paged_equals_contiguous(impl, kw):
    """Shuffled, shared pages; kv_lens with NaN past them; a mask that ends each query's keys at its
    position plus 20 (tiles of every kind); lse too."""
    q, k_pool, v_pool, table, k_cont, v_cont, lens = _flex_case()
    mod = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 20  # noqa: E731
    common = dict(mask_mod=mod, kv_lens=jnp.asarray(lens), return_lse=True, impl=impl, **kw)
    out_c, lse_c = flashlax.flex_attention(q, k_cont, v_cont, **common)
    k_bad, v_bad = (_poison_past(p, table, lens, 16) for p in (k_pool, v_pool))
    out_p, lse_p = flashlax.flex_attention(q, k_bad, v_bad, block_table=jnp.asarray(table), **common)
    assert np.isfinite(np.asarray(out_p)).all()
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out_c), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse_c), rtol=2e-6, atol=2e-6)
    # kv_lens hides keys: the same as a mask that reads them
    lens_j = jnp.asarray(lens)
    by_mask = flashlax.flex_attention(q, k_cont, v_cont, mask_mod=lambda b, h, i, j: (j <= i + 20) & (j < lens_j[b]),
                                      impl=impl, **kw)
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(by_mask), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("impl,kw", [FLEX_IMPLS[0], FLEX_IMPLS[2]], ids=["xla", "pallas"])
def test_flex_paged_gradients_reach_the_pool(impl, kw):
    """d/dpages = the contiguous caches' gradient added page by page (a shared page sums both sequences')."""
    q, k_pool, v_pool, table, k_cont, v_cont, lens = _flex_case(seed=8, page_size=32, max_pages=2)
    bm = flashlax.create_block_mask(masks.causal, None, None, 24, 64, BLOCK_SIZE=16)
    common = dict(block_mask=bm, kv_lens=jnp.asarray(lens), impl=impl, **kw)

    def loss(q, k, v, **extra):
        return (flashlax.flex_attention(q, k, v, **common, **extra) ** 2).sum()

    dq_c, dk_c, dv_c = jax.grad(loss, argnums=(0, 1, 2))(q, k_cont, v_cont)
    dq_p, dk_p, dv_p = jax.grad(loss, argnums=(0, 1, 2))(q, k_pool, v_pool, block_table=jnp.asarray(table))
    tol = 2e-5
    assert rel_err(dq_p, dq_c) <= tol
    for got, contiguous in ((dk_p, dk_c), (dv_p, dv_c)):
        want = _scatter_add_pages(np.asarray(contiguous, np.float64), table, k_pool.shape[0], 32)
        assert rel_err(got, want) <= tol


def test_flex_paged_page_smaller_than_kernel_tile_and_block_mask():
    """Pages of 16 under 32-key kernel tiles (row-by-row page lookup in the flash kernel) with a block
    mask of 16x32 tiles, against the XLA path on the contiguous cache."""
    q, k_pool, v_pool, table, k_cont, v_cont, lens = _flex_case(seed=11, page_size=16, max_pages=4, shared=2)
    bm = flashlax.create_block_mask(masks.causal, None, None, 24, 64, BLOCK_SIZE=(16, 32))
    want = flashlax.flex_attention(q, k_cont, v_cont, block_mask=bm, impl="xla")
    got = flashlax.flex_attention(q, k_pool, v_pool, block_table=jnp.asarray(table), block_mask=bm, impl="pallas",
                                  interpret=True, kernel_options=dict(BLOCK_M=16, BLOCK_N=32))
    assert rel_err(got, want) <= TOLERANCES["float32"]


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------

def _small():
    pool = jnp.zeros((6, 2, 16, 32))
    return jnp.ones((2, 4, 1, 32)), pool, jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)


@pytest.mark.parametrize("op", ["decode", "flex"])
@pytest.mark.parametrize("bad,match", [
    (dict(block_table=jnp.zeros((2, 3))), "block_table must be integer"),
    (dict(block_table=jnp.zeros((3, 3), jnp.int32)), "block_table must be integer"),
    (dict(block_table=jnp.zeros((2,), jnp.int32)), "block_table"),
    (dict(block_table=jnp.asarray([[0, 1, 2], [3, 4, 6]], jnp.int32)), r"block_table\[1, 2\] = 6"),
    (dict(block_table=jnp.asarray([[0, 1, -1], [3, 4, 5]], jnp.int32)), r"block_table\[0, 2\] = -1"),
    (dict(v_cache=jnp.zeros((6, 2, 8, 32))), "agree"),
])
def test_block_table_errors(op, bad, match):
    q, pool, table = _small()
    args = dict(k_cache=pool, v_cache=pool, block_table=table)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        if op == "decode":
            flashlax.decode_attention(q, args["k_cache"], args["v_cache"], block_table=args["block_table"])
        else:
            flashlax.flex_attention(q, args["k_cache"], args["v_cache"], block_table=args["block_table"])


def test_entries_past_the_length_may_hold_anything():
    """Only the pages a sequence uses are checked (here 2 of 3 for lengths 20 and 32)."""
    q, pool, _ = _small()
    table = jnp.asarray([[0, 1, 99], [3, 4, -7]], jnp.int32)
    out = flashlax.decode_attention(q, pool, pool, kv_lens=jnp.asarray([20, 32]), block_table=table)
    assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match="kv_lens"):
        flashlax.flex_attention(q, pool, pool, block_table=table, kv_lens=jnp.asarray([20, 49]))


PAGE_LOOKUP_CASES = [
    # (page_size, DecodeConfig.page_lookup, page_prefetch: steps ahead). 64-key tiles: a tile spans four
    # pages of 16 or one of 64; pages of 48 straddle tiles ("scalars" then reads row by row).
    (16, "scalars", 1), (16, "rows", 0), (16, "auto", 3), (64, "rows", 2), (64, "scalars", 0), (48, "scalars", 1),
]


@pytest.mark.parametrize("page_size,lookup,prefetch", PAGE_LOOKUP_CASES)
def test_decode_paged_lookup_modes_equal_contiguous(page_size, lookup, prefetch):
    """Every way the decode kernel finds a tile's pages (one table read per page or per row, read in the
    step or one step ahead) reads the same keys: equal to the contiguous cache, NaN past the lengths."""
    import dataclasses

    from flashlax.kernels.configs import decode_config
    from flashlax.kernels.decode import decode_attention_pallas
    rng = np.random.default_rng(page_size + len(lookup) + prefetch)
    batch, hq, hkv, dim, max_pages = 2, 4, 2, 32, 384 // page_size
    k_pool, table, k_cont = _paged_cache(rng, batch, hkv, max_pages, page_size, dim, shared_prefix=1)
    v_pool = rng.normal(size=k_pool.shape).astype(np.float32)
    v_cont = np.stack([np.concatenate([v_pool[table[b, j]] for j in range(max_pages)], axis=1) for b in range(batch)])
    lens = np.array([max_pages * page_size, page_size + 70], np.int32)
    q = rng.normal(size=(batch, hq, 2, dim)).astype(np.float32)
    cfg = dataclasses.replace(decode_config(dim, dim, np.float32, "NVIDIA H200"), page_lookup=lookup,
                              page_prefetch=prefetch, paged=(("num_stages", 5), ("page_prefetch", prefetch)))
    assert cfg.block_kv == 64
    kw = dict(kv_lens=jnp.asarray(lens), interpret=True, return_lse=True, num_splits=3)
    out_c, lse_c = decode_attention_pallas(q, k_cont, v_cont, **kw)
    k_bad, v_bad = (_poison_past(p, table, lens, page_size) for p in (k_pool, v_pool))
    out_p, lse_p = decode_attention_pallas(q, k_bad, v_bad, block_table=jnp.asarray(table), config=cfg, **kw)
    assert np.isfinite(np.asarray(out_p)).all()
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out_c), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse_c), rtol=2e-6, atol=2e-6)


def test_decode_paged_shared_memory_counts_the_pipelined_buffers():
    """An explicit paged config that reads the table in the loop step (no read-ahead) is checked against
    shared memory as Triton allocates it: (stages - 1) // 2 + 1 K/V buffers behind the vector table read.
    7 stages at D128 bf16 (230 KB counted at face value, over the H200's 227 KB) fit so; the same stages
    with read-ahead do not, and raise."""
    import dataclasses

    from flashlax.kernels.configs import decode_config
    from flashlax.kernels.decode import decode_attention_pallas
    rng = np.random.default_rng(7)
    k_pool, table, k_cont = _paged_cache(rng, 1, 1, 16, 16, 128, dtype=np.float32)
    k_pool, k_cont = (jnp.asarray(x, jnp.bfloat16) for x in (k_pool, k_cont))
    q = jnp.asarray(rng.normal(size=(1, 4, 1, 128)), jnp.bfloat16)
    base = decode_config(128, 128, jnp.bfloat16, "NVIDIA H200")
    kw = dict(interpret=True, device_kind="NVIDIA H200", num_splits=2)
    in_step = dataclasses.replace(base, paged=(), num_stages=7, page_prefetch=0, programs_per_sm=1)
    got = decode_attention_pallas(q, k_pool, k_pool, block_table=jnp.asarray(table), config=in_step, **kw)
    want = decode_attention_pallas(q, k_cont, k_cont, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="shared memory"):
        decode_attention_pallas(q, k_pool, k_pool, block_table=jnp.asarray(table),
                                config=dataclasses.replace(in_step, page_prefetch=1), **kw)


@pytest.mark.parametrize("field,bad", [("page_lookup", "gather"), ("page_prefetch", True), ("page_prefetch", 9),
                                       ("paged", (("stages", 3),)), ("paged", (("num_stages", 0),))])
def test_decode_config_paged_fields_validated(field, bad):
    from flashlax.kernels.configs import DecodeConfig
    with pytest.raises(ValueError, match=field):
        DecodeConfig(**{field: bad})


# ----------------------------------------------------------------------------------------------------
# Real GPU (pytest -m gpu)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("shape", [(8, 1, 16384), (1, 16, 65536), (32, 1, 4096)], ids=lambda s: f"b{s[0]}_lq{s[1]}_l{s[2]}")
def test_gpu_decode_paged_equals_contiguous(shape, page_size):
    """Compiled decode kernel, bf16 Hq32 Hkv8 D128: shuffled pages, ragged lengths, against the contiguous
    cache through the same kernel (the gather runs on the GPU here, only to build the expectation)."""
    batch, q_len, max_len = shape
    max_pages = max_len // page_size
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    num_pages = batch * max_pages
    k_pool = jax.random.normal(keys[0], (num_pages, 8, page_size, 128), jnp.bfloat16)
    v_pool = jax.random.normal(keys[1], (num_pages, 8, page_size, 128), jnp.bfloat16)
    table = jax.random.permutation(keys[2], num_pages).reshape(batch, max_pages).astype(jnp.int32)
    lens = jax.random.randint(keys[3], (batch,), q_len, max_len + 1).at[0].set(max_len)
    q = jax.random.normal(keys[3], (batch, 32, q_len, 128), jnp.bfloat16)
    gather = lambda pool: jnp.swapaxes(pool[table], 1, 2).reshape(batch, 8, max_len, 128)  # noqa: E731
    want = flashlax.decode_attention(q, gather(k_pool), gather(v_pool), kv_lens=lens, impl="pallas")
    got = jax.jit(lambda *a: flashlax.decode_attention(a[0], a[1], a[2], kv_lens=a[3], block_table=a[4],
                                                       impl="pallas"))(q, k_pool, v_pool, lens, table)
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_gpu_flex_paged_equals_contiguous(page_size):
    """Compiled flash forward with paged K/V (B2 Hq32 Hkv8 L4096 D128 bf16, causal, kv_lens)."""
    batch, length = 2, 4096
    max_pages = length // page_size
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    k_pool = jax.random.normal(keys[0], (batch * max_pages, 8, page_size, 128), jnp.bfloat16)
    v_pool = jax.random.normal(keys[1], (batch * max_pages, 8, page_size, 128), jnp.bfloat16)
    table = jax.random.permutation(keys[2], batch * max_pages).reshape(batch, max_pages).astype(jnp.int32)
    q = jax.random.normal(keys[3], (batch, 32, length, 128), jnp.bfloat16)
    lens = jnp.asarray([length, length - 1000])
    gather = lambda pool: jnp.swapaxes(pool[table], 1, 2).reshape(batch, 8, length, 128)  # noqa: E731
    kw = dict(mask_mod=masks.causal, kv_lens=lens, impl="pallas")
    want = flashlax.flex_attention(q, gather(k_pool), gather(v_pool), **kw)
    got = flashlax.flex_attention(q, k_pool, v_pool, block_table=table, **kw)
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) <= 1e-2


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_kernels_lower_to_triton(page_size):
    """Both kernels with paged K/V (row-by-row page lookup at 16 under 64-key tiles, one table read per
    tile at 64 and 256) go through the Pallas Triton lowering for an abstract H200 at the decode sizes."""
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)
    batch, length = 2, 4096
    pool = jax.ShapeDtypeStruct((batch * length // page_size, 8, page_size, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((batch, length // page_size), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    from flashlax.kernels.decode import decode_attention_pallas
    from flashlax.kernels.flash_attention import flex_attention_pallas

    def decode(q, k, v, table, lens):
        return decode_attention_pallas(q, k, v, kv_lens=lens, block_table=table, device_kind="NVIDIA H200")

    def prefill(q, k, v, table, lens):
        return flex_attention_pallas(q, k, v, mask_mod=masks.causal, block_table=table, kv_lens=lens,
                                     device_kind="NVIDIA H200")

    for fn, q_len, name in ((decode, 4, "decode_attention"), (prefill, 256, "flex_attention_fwd")):
        q = jax.ShapeDtypeStruct((batch, 32, q_len, 128), jnp.bfloat16)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(q, pool, pool, table, lens).lower(lowering_platforms=("cuda",)).as_text()
        assert name in text
