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
    np.testing.assert_array_equal(np.asarray(bm.to_element_mask()), dense)
    np.testing.assert_array_equal(np.asarray(bm.to_dense()), (kinds != EMPTY).astype(np.int32))
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
    assert causal.sparsity() == pytest.approx(100 * 6 / 16)          # a percentage, as PyTorch


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


# ----------------------------------------------------------------------------------------------------
# PyTorch FlexAttention's BlockMask surface (issue 18). Expectations are written out by hand from
# PyTorch's documented meaning, not computed by the code under test.
# ----------------------------------------------------------------------------------------------------

def test_from_kv_blocks_partial_full_and_defaults():
    """Row 0 lists kv tile 1 as partial; row 1 tile 0 full and tile 1 partial; row 2 nothing. Tiles 2x4
    (BLOCK_SIZE as a (q, kv) pair); no mask_mod: a partial tile is attended whole (noop_mask), a tile in no
    list is masked. Default seq_lengths = (rows * 2, K * 4)."""
    bm = masks.BlockMask.from_kv_blocks(jnp.array([1, 1, 0]), jnp.array([[1, 0], [1, 0], [0, 0]]),
                                        jnp.array([0, 1, 0]), jnp.array([[0, 0], [0, 0], [0, 0]]),
                                        BLOCK_SIZE=(2, 4))
    assert bm.shape == (1, 1, 6, 8) and bm.seq_lengths == (6, 8) and bm.BLOCK_SIZE == (2, 4)
    assert bm.mask_mod is masks.noop_mask
    np.testing.assert_array_equal(np.asarray(bm.tile_kinds)[0, 0], [[EMPTY, PARTIAL], [FULL, PARTIAL], [EMPTY, EMPTY]])
    expected = np.zeros((6, 8), bool)
    expected[0:2, 4:8] = True          # row 0: tile 1
    expected[2:4, 0:8] = True          # row 1: tiles 0 and 1
    np.testing.assert_array_equal(np.asarray(bm.to_element_mask())[0, 0], expected)
    np.testing.assert_array_equal(np.asarray(bm.to_dense())[0, 0], [[0, 1], [1, 1], [0, 0]])
    assert bm.to_dense().dtype == jnp.int32
    assert bm.sparsity() == pytest.approx(100 * 3 / 6)


def test_from_kv_blocks_mod_decides_partial_tiles_only():
    """A mask_mod applies inside partial tiles; full tiles attend whatever it says (as PyTorch skips it
    there); B and H dims, seq_lengths shorter than the tiles (ragged) and under jit."""
    never = lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 2 == 0  # noqa: E731
    num = jnp.array([[[1, 0]], [[0, 1]]])               # [B=2, H=1, nq=2]
    idx = jnp.array([[[[0, 0], [0, 0]]], [[[0, 0], [1, 0]]]])
    fnum = jnp.array([[[0, 1]], [[1, 0]]])
    fidx = jnp.array([[[[0, 0], [1, 0]]], [[[1, 0], [0, 0]]]])
    build = lambda *a: masks.BlockMask.from_kv_blocks(*a, BLOCK_SIZE=4, mask_mod=never, seq_lengths=(7, 6))  # noqa: E731
    for bm in (build(num, idx, fnum, fidx), jax.jit(build)(num, idx, fnum, fidx)):
        assert bm.shape == (2, 1, 7, 6)
        q_i, kv_i = np.arange(7)[:, None], np.arange(6)[None, :]
        checker = (q_i + kv_i) % 2 == 0
        exp = np.zeros((2, 7, 6), bool)
        exp[0, 0:4, 0:4] = checker[0:4, 0:4]            # b0 row 0: tile 0 partial
        exp[0, 4:7, 4:6] = True                         # b0 row 1: tile 1 full
        exp[1, 0:4, 4:6] = True                         # b1 row 0: tile 1 full
        exp[1, 4:7, 4:6] = checker[4:7, 4:6]            # b1 row 1: tile 1 partial
        np.testing.assert_array_equal(np.asarray(bm.to_element_mask())[:, 0], exp)


@pytest.mark.parametrize("call", [
    lambda: masks.BlockMask.from_kv_blocks(jnp.array([1]), jnp.array([[3]]), BLOCK_SIZE=4, seq_lengths=(4, 8)),
    lambda: masks.BlockMask.from_kv_blocks(jnp.array([1]), jnp.array([[0]]), jnp.array([1]), jnp.array([[0]])),
    lambda: masks.BlockMask.from_kv_blocks(jnp.array([1]), jnp.array([[0]]), jnp.array([1]), None),
    lambda: masks.BlockMask.from_kv_blocks(jnp.array([1.0]), jnp.array([[0]])),
    lambda: masks.BlockMask.from_kv_blocks(jnp.array([1]), jnp.array([[0]]), BLOCK_SIZE=(4, 4, 4)),
    lambda: masks.BlockMask.from_kv_blocks(jnp.array([1]), jnp.array([[0]]), BLOCK_SIZE=4, seq_lengths=(9, 4)),
])
def test_from_kv_blocks_errors(call):
    """An index past the tiles, a tile in both lists, full lists half given, float counts, a bad BLOCK_SIZE,
    seq_lengths needing more tile rows than listed."""
    with pytest.raises(ValueError):
        call()


def test_to_dense_sparsity_to_string_as_pytorch():
    """Causal 64x64 in 16x16 tiles: per-tile lower triangle, 6 of 16 tiles empty (37.5 %), and PyTorch's
    picture: two characters per tile, a (b, h) header, the limit message after ``limit`` pictures."""
    bm = masks.create_block_mask(masks.causal, None, None, 64, 64, BLOCK_SIZE=16)
    np.testing.assert_array_equal(np.asarray(bm.to_dense())[0, 0], np.tril(np.ones((4, 4), np.int32)))
    assert bm.sparsity() == pytest.approx(37.5)
    assert bm.to_string() == "(0, 0)\n██      \n████    \n██████  \n████████\n"
    # 2x2 cells of 2x2 tiles each: the diagonal cells are partly computed
    assert bm.to_string(grid_size=2) == "(0, 0)\n░░  \n██░░\n"
    assert str(bm).startswith("BlockMask(shape=(1, 1, 64, 64), sparsity=37.50%, \n(0, 0)\n██")
    many = masks.create_block_mask(masks.causal, 2, 3, 32, 32, BLOCK_SIZE=16)
    text = many.to_string(limit=2)
    assert text.count("██") == 6 and text.startswith("(0, 0)\n") and "(0, 1)\n" in text
    assert "(1, 0)" not in text and "To print out more, set BlockMask.to_string(limit=N)" in text


def test_block_size_spellings():
    """BLOCK_SIZE as PyTorch spells it (int or (q, kv)); block_q / block_kv agreeing with it; disagreeing
    is a ValueError."""
    a = masks.create_block_mask(masks.causal, None, None, 100, 90, BLOCK_SIZE=(32, 16))
    b = masks.create_block_mask(masks.causal, None, None, 100, 90, block_q=32, block_kv=16)
    assert a.BLOCK_SIZE == (32, 16) and a.num_tiles == (4, 6)
    np.testing.assert_array_equal(np.asarray(a.tile_kinds), np.asarray(b.tile_kinds))
    assert masks.create_block_mask(masks.causal, None, None, 64, 64, BLOCK_SIZE=32).BLOCK_SIZE == (32, 32)
    assert masks.create_block_mask(None, None, None, 64, 64).BLOCK_SIZE == (128, 128)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        masks.create_block_mask(masks.causal, None, None, 64, 64, BLOCK_SIZE=32, block_q=16)


def test_indexing_batch_head_and_query_tiles():
    """bm[b], bm[b, h], bm[:, :, tiles]: the tiles of those batch elements / heads / query-tile rows, and the
    element mask of those rows (the mod follows the selection; PyTorch's result has the same tiles). All
    four dims are kept; an int selects a dim of size 1."""
    seg = jnp.array([[0] * 20 + [1] * 28, [0] * 5 + [1] * 43])
    per_head = lambda b, h, q_idx, kv_idx: (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx + h)  # noqa: E731
    bm = masks.create_block_mask(per_head, 2, 3, 48, 48, BLOCK_SIZE=16)
    dense = _dense(per_head, 2, 3, 48, 48)
    kinds = _expected_kinds(dense, 16, 16)
    one = bm[1]
    assert one.shape == (1, 3, 48, 48)
    np.testing.assert_array_equal(np.asarray(one.tile_kinds), kinds[1:2])
    np.testing.assert_array_equal(np.asarray(one.to_element_mask()), dense[1:2])
    bh = bm[0, 2]
    np.testing.assert_array_equal(np.asarray(bh.to_element_mask()), dense[0:1, 2:3])
    rows = bm[:, :, jnp.array([2, 0])]
    assert rows.shape == (2, 3, 32, 48) and rows.kv_num_blocks.shape == (2, 3, 2)
    np.testing.assert_array_equal(np.asarray(rows.tile_kinds), kinds[:, :, [2, 0]])
    np.testing.assert_array_equal(np.asarray(rows.to_element_mask()),
                                  np.concatenate([dense[:, :, 32:48], dense[:, :, 0:16]], axis=2))
    traced = jax.jit(lambda t: bm[:, 1, t].tile_kinds)(jnp.array([1]))
    np.testing.assert_array_equal(np.asarray(traced), kinds[:, 1:2, 1:2])
    with pytest.raises(ValueError):
        bm[2]
    # a mask independent of the batch accepts any batch index
    assert masks.create_block_mask(masks.causal, None, None, 48, 48)[5].shape == (1, 1, 48, 48)


def test_query_tile_past_a_ragged_end_attends_nothing():
    """Selecting the last query tile of Lq=40 in 16-row tiles gives 16 rows; the 8 past Lq attend nothing."""
    bm = masks.create_block_mask(masks.causal, None, None, 40, 40, BLOCK_SIZE=16)
    last = bm[:, :, 2]
    expected = np.zeros((16, 40), bool)
    expected[:8] = np.arange(32, 40)[:, None] >= np.arange(40)[None, :]
    np.testing.assert_array_equal(np.asarray(last.to_element_mask())[0, 0], expected)
    assert np.asarray(last.tile_kinds)[0, 0, 0, 0] == PARTIAL        # no longer full: its tail is masked


def test_adjust_crops_to_the_upper_left():
    """_adjust(q, kv) (PyTorch's crop for decoding): the corner of the mask, same mod, tiles cropped."""
    bm = masks.create_block_mask(masks.sliding_window(20), None, None, 128, 128, BLOCK_SIZE=32)
    small = bm._adjust(50, 70)
    assert small.shape == (1, 1, 50, 70) and small.num_tiles == (2, 3) and small.mask_mod is bm.mask_mod
    q_i, kv_i = np.arange(128)[:, None], np.arange(128)[None, :]
    window = ((kv_i >= q_i - 20) & (kv_i <= q_i))[None, None]
    np.testing.assert_array_equal(np.asarray(small.tile_kinds), _expected_kinds(window, 32, 32)[:, :, :2, :3])
    np.testing.assert_array_equal(np.asarray(small.to_element_mask()), window[:, :, :50, :70])
    for bad in ((129, 10), (0, 10), (10, 200)):
        with pytest.raises(ValueError):
            bm._adjust(*bad)


def test_create_mask_and_noop_mask():
    dense = masks.create_mask(masks.causal, None, None, 3, 4)
    assert dense.shape == (1, 1, 3, 4) and dense.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(dense)[0, 0], np.tril(np.ones((3, 4), bool)))
    per_head = masks.create_mask(lambda b, h, q_idx, kv_idx: kv_idx <= h, 2, 2, 2, 3)
    assert per_head.shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(np.asarray(per_head)[1, :, 0], [[True, False, False], [True, True, False]])
    # a score_mod: True where the score stays finite
    window = lambda s, b, h, q_idx, kv_idx: jnp.where(kv_idx >= q_idx - 1, s, -jnp.inf)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(masks.create_mask(window, None, None, 3, 3))[0, 0],
                                  [[True, True, True], [True, True, True], [False, True, True]])
    assert np.asarray(masks.create_mask(masks.noop_mask, 1, 1, 2, 2)).all()
    assert bool(masks.noop_mask(jnp.int32(0), jnp.int32(0), jnp.int32(5), jnp.int32(9)))


def test_block_mask_is_a_pytree_under_jit():
    bm = masks.BlockMask.from_kv_blocks(jnp.array([1, 2]), jnp.array([[0, 0], [0, 1]]), BLOCK_SIZE=8)
    leaves, tree = jax.tree_util.tree_flatten(bm)
    assert len(leaves) == 9
    again = jax.jit(lambda m: m)(bm)
    assert again.layout_defines_mask and again.mask_mod is masks.noop_mask and again.shape == bm.shape
    assert int(jax.jit(lambda m: m.kv_num_blocks.sum())(bm)) == 3
