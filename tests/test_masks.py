"""BlockMask tile classification against a dense evaluation, the mask/score library, block masks under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashlax
from flashlax import masks, score_mods
from flashlax.masks import EMPTY, FULL, PARTIAL


def _dense(mask_mod, bm, hm, lq, lkv):
    b = np.arange(bm)[:, None, None, None]
    h = np.arange(hm)[None, :, None, None]
    q = np.arange(lq)[None, None, :, None]
    kv = np.arange(lkv)[None, None, None, :]
    return np.broadcast_to(np.asarray(mask_mod(jnp.asarray(b), jnp.asarray(h), jnp.asarray(q), jnp.asarray(kv))),
                           (bm, hm, lq, lkv))


def _expected_kinds(dense, block_q, block_kv):
    bm, hm, lq, lkv = dense.shape
    nq, nkv = -(-lq // block_q), -(-lkv // block_kv)
    kinds = np.zeros((bm, hm, nq, nkv), np.int8)
    for i in range(nq):
        for j in range(nkv):
            tile = dense[:, :, i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv]
            n_allowed = tile.sum((2, 3))
            kinds[:, :, i, j] = np.where(n_allowed == 0, EMPTY, np.where(n_allowed == tile[0, 0].size, FULL, PARTIAL))
    return kinds


def _check_index_lists(num, idx, selected):
    """count and ascending indices of the selected tiles first; padding entries are valid indices."""
    n = selected.shape[-1]
    np.testing.assert_array_equal(num, selected.sum(-1))
    assert idx.min() >= 0 and idx.max() < n
    for pos in np.ndindex(selected.shape[:-1]):
        want = np.flatnonzero(selected[pos])
        np.testing.assert_array_equal(idx[pos][: len(want)], want)


def _segments(rng, batch, length):
    return jnp.asarray(np.sort(rng.integers(0, 4, (batch, length)), axis=1), jnp.int32)


@st.composite
def mask_case(draw):
    return dict(name=draw(st.sampled_from(["causal", "window", "prefix", "document", "doc_and_causal", "or",
                                           "per_head"])),
                batch=draw(st.integers(1, 3)), heads=draw(st.integers(1, 3)), q_len=draw(st.integers(1, 70)),
                kv_len=draw(st.integers(1, 70)), block_q=draw(st.integers(1, 32)), block_kv=draw(st.integers(1, 32)),
                seed=draw(st.integers(0, 1000)))


def _library_mask(case):
    rng = np.random.default_rng(case["seed"])
    name = case["name"]
    if name == "causal":
        return masks.causal, None, None
    if name == "window":
        return masks.sliding_window(int(rng.integers(0, 9)), int(rng.integers(0, 4))), None, None
    if name == "prefix":
        return masks.prefix_lm(int(rng.integers(0, 12))), None, None
    if name == "or":
        return masks.or_masks(masks.sliding_window(2), masks.prefix_lm(3)), None, None
    if name == "per_head":
        return (lambda b, h, q, kv: (q + h) % 5 >= kv % 3), None, case["heads"]
    doc = masks.document(_segments(rng, case["batch"], case["q_len"]), _segments(rng, case["batch"], case["kv_len"]))
    if name == "document":
        return doc, case["batch"], None
    return masks.and_masks(doc, masks.causal), case["batch"], None


@given(case=mask_case())
def test_tile_kinds_match_dense(case):
    mask_mod, bdim, hdim = _library_mask(case)
    lq, lkv, bq, bkv = case["q_len"], case["kv_len"], case["block_q"], case["block_kv"]
    bm = flashlax.create_block_mask(mask_mod, bdim, hdim, lq, lkv, block_q=bq, block_kv=bkv)
    dense = _dense(mask_mod, bdim or 1, hdim or 1, lq, lkv)
    kinds = _expected_kinds(dense, bq, bkv)
    np.testing.assert_array_equal(np.asarray(bm.tile_kinds), kinds)
    assert bm.shape == (bdim or 1, hdim or 1, lq, lkv)
    np.testing.assert_array_equal(np.asarray(bm.to_dense()), dense)
    _check_index_lists(np.asarray(bm.kv_num_blocks), np.asarray(bm.kv_indices), kinds == PARTIAL)
    _check_index_lists(np.asarray(bm.full_kv_num_blocks), np.asarray(bm.full_kv_indices), kinds == FULL)
    _check_index_lists(np.asarray(bm.q_num_blocks), np.asarray(bm.q_indices), np.swapaxes(kinds == PARTIAL, -1, -2))
    _check_index_lists(np.asarray(bm.full_q_num_blocks), np.asarray(bm.full_q_indices),
                       np.swapaxes(kinds == FULL, -1, -2))


def test_create_block_mask_under_jit_with_traced_segments():
    rng = np.random.default_rng(0)
    seg = _segments(rng, 2, 100)

    def build(seg):
        return flashlax.create_block_mask(masks.and_masks(masks.document(seg), masks.causal), 2, None, 100, 100,
                                          block_q=32, block_kv=16)

    traced = jax.jit(build)(seg)
    eager = build(seg)
    for name in ("tile_kinds", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices"):
        np.testing.assert_array_equal(getattr(traced, name), getattr(eager, name))
    dense = _dense(masks.and_masks(masks.document(seg), masks.causal), 2, 1, 100, 100)
    np.testing.assert_array_equal(traced.tile_kinds, _expected_kinds(dense, 32, 16))


def test_no_mask_is_all_full():
    bm = flashlax.create_block_mask(None, None, None, 50, 70, block_q=16, block_kv=32)
    assert np.all(np.asarray(bm.tile_kinds) == FULL) and bm.sparsity() == 0.0
    causal = flashlax.create_block_mask(masks.causal, None, None, 512, 512)
    assert causal.sparsity() == pytest.approx(6 / 16)


def test_mask_library_semantics():
    q = jnp.arange(12)[:, None]
    kv = jnp.arange(12)[None, :]
    qn, kvn = np.arange(12)[:, None], np.arange(12)[None, :]
    np.testing.assert_array_equal(masks.causal(0, 0, q, kv), qn >= kvn)
    np.testing.assert_array_equal(masks.sliding_window(3, 1)(0, 0, q, kv), (kvn >= qn - 3) & (kvn <= qn + 1))
    np.testing.assert_array_equal(masks.prefix_lm(4)(0, 0, q, kv), (qn >= kvn) | (kvn < 4))
    seg = jnp.array([[0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]])
    np.testing.assert_array_equal(masks.document(seg)(0, 0, q, kv), np.asarray(seg)[0][:, None] == np.asarray(seg)[0])
    both = masks.and_masks(masks.causal, masks.sliding_window(2))(0, 0, q, kv)
    np.testing.assert_array_equal(both, (qn >= kvn) & (kvn >= qn - 2))
    either = masks.or_masks(masks.sliding_window(0), masks.prefix_lm(1))(0, 0, q, kv)
    np.testing.assert_array_equal(either, (qn == kvn) | (qn >= kvn) | (kvn < 1))


def test_score_mod_library_semantics():
    rng = np.random.default_rng(1)
    score = jnp.asarray(rng.normal(size=(1, 3, 5, 7)), jnp.float32)
    b = jnp.zeros((1, 1, 1, 1), jnp.int32)
    h = jnp.arange(3)[None, :, None, None]
    q = jnp.arange(5)[None, None, :, None]
    kv = jnp.arange(7)[None, None, None, :]
    slopes = jnp.array([0.5, 0.25, 0.125])
    np.testing.assert_allclose(score_mods.alibi(slopes)(score, b, h, q, kv),
                               np.asarray(score) + np.asarray(slopes)[:, None, None] * (np.arange(7)[None, :] - np.arange(5)[:, None]),
                               rtol=1e-6)
    np.testing.assert_allclose(score_mods.softcap(2.0)(score, b, h, q, kv), 2.0 * np.tanh(np.asarray(score) / 2.0),
                               rtol=1e-6)
    table = jnp.asarray(rng.normal(size=(3, 9)), jnp.float32)  # L = 5: offsets -4..4, clamped beyond
    offsets = np.clip(np.arange(5)[:, None] - np.arange(7)[None, :] + 4, 0, 8)
    expected = np.asarray(score) + np.asarray(table)[:, offsets][None]
    np.testing.assert_allclose(score_mods.relative_bias(table)(score, b, h, q, kv), expected, rtol=1e-6)


@pytest.mark.parametrize("call", [
    lambda: masks.sliding_window(-1),
    lambda: masks.prefix_lm(-2),
    lambda: masks.document(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32)),
    lambda: masks.document(jnp.zeros((2, 3))),
    lambda: masks.and_masks(),
    lambda: masks.or_masks(masks.causal, 3),
    lambda: score_mods.alibi(jnp.ones((2, 2))),
    lambda: score_mods.softcap(0.0),
    lambda: score_mods.relative_bias(jnp.ones((4,))),
    lambda: flashlax.create_block_mask(masks.causal, None, None, 0, 8),
    lambda: flashlax.create_block_mask(masks.causal, 0, None, 8, 8),
    lambda: flashlax.create_block_mask(masks.causal, None, None, 8, 8, block_q=0),
    lambda: flashlax.create_block_mask("causal", None, None, 8, 8),
])
def test_library_errors(call):
    with pytest.raises(ValueError):
        call()


def test_block_mask_under_jit_is_built_at_trace_time():
    """A mod capturing no traced array is classified while tracing (its lists become constants: nothing
    runs per call); one capturing traced segment ids is staged and gives the same lists as eagerly."""
    def eqn_names(fn, *args):
        return {e.primitive.name for e in jax.make_jaxpr(fn)(*args).eqns}

    causal_sum = lambda x: masks.create_block_mask(masks.causal, None, None, 300, 300, block_q=32,
                                                   block_kv=32).kv_indices.sum() + x
    assert "scan" not in eqn_names(causal_sum, 1)
    seg = jnp.asarray(np.repeat(np.arange(5), 60)[None], jnp.int32)
    traced = lambda s: masks.create_block_mask(masks.document(s), 1, None, 300, 300, block_q=32, block_kv=32)
    assert "scan" in eqn_names(lambda s: traced(s).kv_num_blocks, seg)
    eager, jitted = traced(seg), jax.jit(traced)(seg)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        np.testing.assert_array_equal(np.asarray(getattr(eager, name)), np.asarray(getattr(jitted, name)))
