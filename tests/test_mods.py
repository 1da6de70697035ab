"""Scalar semantics of score_mod / mask_mod (the FlexAttention convention), on every softmax path.

Each catalogue entry is a mod written for scalars plus the dense [B, H, Lq, Lkv] array it means, built here
with numpy independently of flashlax; outputs and gradients are compared with a float64 dense reference
that uses those arrays. Mods that only make sense for scalars (captured tables indexed by several
indices, reductions, chained indexing, jnp.dot) are the point: evaluated on broadcast index arrays they
give silently wrong results.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from flashlax import _mods, masks
from flashlax.kernels import _tiles
from conftest import TOLERANCES, normal, rel_err

B, HQ, HKV, LQ, LKV, D = 2, 4, 2, 11, 13, 16
RNG = np.random.default_rng(0)
E = RNG.standard_normal((max(LQ, LKV), 3)).astype(np.float32)       # per-position embeddings
BIAS3 = RNG.standard_normal((B, LQ, LKV)).astype(np.float32)         # [b][q][kv]
TABLE = RNG.standard_normal((LQ, 5)).astype(np.float32)              # reduced over its last axis
SLOPES = np.linspace(0.1, 0.7, HQ).astype(np.float32)
FLAGS = RNG.random((max(LQ, LKV), 3)) < 0.3                          # [pos, feature] bool
DOCS = np.sort(RNG.integers(0, 3, (B, max(LQ, LKV))), axis=1).astype(np.int32)
TEMP = np.float32(0.7)

_b = np.arange(B)[:, None, None, None]
_h = np.arange(HQ)[None, :, None, None]
_q = np.arange(LQ)[None, None, :, None]
_k = np.arange(LKV)[None, None, None, :]
_FULL = (B, HQ, LQ, LKV)


def _e():
    return jnp.asarray(E)


SCORE_CATALOGUE = {
    # name: (score_mod, additive bias it means or None, multiplier it means)
    "embedding_dot_sum": (lambda s, b, h, q, kv: s + (_e()[q] * _e()[kv]).sum(),
                          np.broadcast_to((E[:LQ] @ E[:LKV].T)[None, None], _FULL), 1.0),
    "jnp_dot": (lambda s, b, h, q, kv: s + jnp.dot(_e()[q], _e()[kv]),
                np.broadcast_to((E[:LQ] @ E[:LKV].T)[None, None], _FULL), 1.0),
    "chained_index": (lambda s, b, h, q, kv: s + jnp.asarray(BIAS3)[b][q][kv],
                      np.broadcast_to(BIAS3[:, None], _FULL), 1.0),
    "reduction_max": (lambda s, b, h, q, kv: s + jnp.asarray(TABLE)[q].max(),
                      np.broadcast_to(TABLE.max(1)[None, None, :, None], _FULL), 1.0),
    "pointwise_alibi_abs": (lambda s, b, h, q, kv: s - jnp.asarray(SLOPES)[h] * jnp.abs(q - kv),
                            np.broadcast_to(-SLOPES[None, :, None, None] * np.abs(_q - _k), _FULL), 1.0),
    "captured_scalar": (lambda s, b, h, q, kv: s * jnp.asarray(TEMP), None, float(TEMP)),
}

MASK_CATALOGUE = {
    "flags_any": (lambda b, h, q, kv: (jnp.asarray(FLAGS)[q] & jnp.asarray(FLAGS)[kv]).any(),
                  np.broadcast_to((FLAGS[:LQ, None] & FLAGS[None, :LKV]).any(-1)[None, None], _FULL)),
    "chained_documents": (lambda b, h, q, kv: jnp.asarray(DOCS)[b][q] == jnp.asarray(DOCS)[b][kv],
                          np.broadcast_to(DOCS[:, None, :LQ, None] == DOCS[:, None, None, :LKV], _FULL)),
    "block_diagonal_or_head": (lambda b, h, q, kv: ((q // 4) == (kv // 4)) | (h == 1),
                               np.broadcast_to(((_q // 4) == (_k // 4)) | (_h == 1), _FULL)),
}

IMPLS = [("xla", False), ("repeat", False), ("pallas", True)]


def _inputs(seed):
    rng = np.random.default_rng(seed)
    q = normal(rng, (B, HQ, LQ, D))
    k = normal(rng, (B, HKV, LKV, D))
    v = normal(rng, (B, HKV, LKV, D))
    dout = normal(rng, (B, HQ, LQ, D))
    return q, k, v, dout


def _dense_reference(q, k, v, dout, bias, mult, allowed):
    """float64 materialised attention with the meaning given as dense arrays; (out, dq, dk, dv)."""
    with jax.enable_x64():
        q, k, v, dout = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, dout))
        rep = HQ // HKV

        def f(q, k, v):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, jnp.repeat(k, rep, 1)) * D ** -0.5 * mult
            if bias is not None:
                s = s + jnp.asarray(bias, jnp.float64)
            if allowed is not None:
                s = jnp.where(allowed, s, -jnp.inf)
            m = jnp.max(s, -1, keepdims=True)
            m = jnp.where(jnp.isfinite(m), m, 0.0)
            e = jnp.exp(s - m)
            denom = e.sum(-1, keepdims=True)
            out = jnp.einsum("bhqk,bhkd->bhqd", e / jnp.where(denom > 0, denom, 1.0), jnp.repeat(v, rep, 1))
            return jnp.sum(out * dout), out

        (_, out), grads = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(q, k, v)
        return np.asarray(out), [np.asarray(g) for g in grads]


def _run(impl, interpret, q, k, v, dout, **kw):
    def loss(q, k, v):
        out = flashlax.flex_attention(q, k, v, impl=impl, interpret=interpret, **kw)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("name", sorted(SCORE_CATALOGUE))
def test_score_mod_catalogue(name, impl, interpret):
    score_mod, bias, mult = SCORE_CATALOGUE[name]
    q, k, v, dout = _inputs(len(name))
    out, grads = _run(impl, interpret, q, k, v, dout, score_mod=score_mod, mask_mod=masks.causal)
    causal = np.broadcast_to(_q >= _k, _FULL)
    ref, ref_grads = _dense_reference(q, k, v, dout, bias, mult, causal)
    assert rel_err(out, ref) <= TOLERANCES["float32"], name
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 4 * TOLERANCES["float32"], name


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("name", sorted(MASK_CATALOGUE))
def test_mask_mod_catalogue(name, impl, interpret):
    mask_mod, allowed = MASK_CATALOGUE[name]
    q, k, v, dout = _inputs(len(name) + 1)
    out, grads = _run(impl, interpret, q, k, v, dout, mask_mod=mask_mod)
    ref, ref_grads = _dense_reference(q, k, v, dout, None, 1.0, allowed)
    assert rel_err(out, ref) <= TOLERANCES["float32"], name
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 4 * TOLERANCES["float32"], name


@pytest.mark.parametrize("name", ["embedding_dot_sum", "jnp_dot"])
def test_decode_scalar_score_mods(name):
    """decode_attention gives mods the new token's absolute position as q_idx, with scalar meaning."""
    score_mod = SCORE_CATALOGUE[name][0]
    lq = 3
    rng = np.random.default_rng(5)
    q = normal(rng, (B, HQ, lq, D))
    k = normal(rng, (B, HKV, LKV, D))
    v = normal(rng, (B, HKV, LKV, D))
    kv_lens = np.array([9, LKV], np.int32)
    out = flashlax.decode_attention(q, k, v, kv_lens=jnp.asarray(kv_lens), score_mod=score_mod, impl="xla")
    # Dense reference: token i of batch b sits at position kv_lens[b] - lq + i.
    pos = kv_lens[:, None] - lq + np.arange(lq)[None, :]                       # [B, lq]
    rows = []
    for b in range(B):
        s = np.einsum("hqd,hkd->hqk", np.asarray(q[b], np.float64),
                      np.repeat(np.asarray(k[b], np.float64), HQ // HKV, 0)) * D ** -0.5
        s = s + (E[pos[b]].astype(np.float64) @ E[:LKV].T.astype(np.float64))[None]
        s = np.where(np.arange(LKV)[None, None, :] <= pos[b][None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        rows.append(np.einsum("hqk,hkd->hqd", p, np.repeat(np.asarray(v[b], np.float64), HQ // HKV, 0)))
    assert rel_err(out, np.stack(rows)) <= TOLERANCES["float32"]


# ----------------------------------------------------------------------------------------------------
# Validation: arguments, result types, block masks that do not describe the mask
# ----------------------------------------------------------------------------------------------------

def _small():
    q, k, v, _ = _inputs(0)
    return q, k, v


@pytest.mark.parametrize("kw,message", [
    (dict(mask_mod=lambda b, h, q: q >= 0), "mask_mod must take 4 scalar arguments"),
    (dict(score_mod=lambda s, b, h, q: s), "score_mod must take 5 scalar arguments"),
    (dict(mask_mod=lambda b, h, q, kv: q - kv), "mask_mod must return bool, got int32"),
    (dict(mask_mod=lambda b, h, q, kv: (q >= kv).astype(jnp.float32)), "mask_mod must return bool, got float32"),
    (dict(score_mod=lambda s, b, h, q, kv: s > 0), "score_mod must return a floating-point score, got bool"),
    (dict(score_mod=lambda s, b, h, q, kv: s + _e()[q]), "score_mod must return a scalar"),
    (dict(mask_mod=1.5), "mask_mod must be callable"),
])
@pytest.mark.parametrize("op", ["flex_attention", "decode_attention"])
def test_bad_mods_raise_naming_the_mod(op, kw, message):
    q, k, v = _small()
    call = (lambda: flashlax.flex_attention(q, k, v, **kw)) if op == "flex_attention" else \
        (lambda: flashlax.decode_attention(q[:, :, :2], k, v, **kw))
    with pytest.raises(ValueError, match=message):
        call()
    if "mask_mod" in kw:
        with pytest.raises(ValueError, match=message.replace(op, "create_block_mask")):
            flashlax.create_block_mask(kw["mask_mod"], B, HQ, LQ, LKV)


def test_block_mask_built_from_another_mod_raises():
    q, k, v = (normal(i, (1, 2, 1024, 16)) for i in range(3))
    bm = flashlax.create_block_mask(masks.causal, None, None, 1024, 1024)
    anti_causal = lambda b, h, q_idx, kv_idx: q_idx <= kv_idx
    with pytest.raises(ValueError, match="mask_mod differs from the one block_mask was built from"):
        flashlax.flex_attention(q, k, v, mask_mod=anti_causal, block_mask=bm)
    noop = flashlax.create_block_mask(None, None, None, 1024, 1024)
    with pytest.raises(ValueError, match="no mask_mod"):
        flashlax.flex_attention(q, k, v, mask_mod=masks.causal, block_mask=noop)
    # The same mod, or the same program written again, is accepted and gives the mod's result.
    again = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    out = flashlax.flex_attention(q, k, v, mask_mod=again, block_mask=bm)
    ref = flashlax.flex_attention(q, k, v, mask_mod=masks.causal)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reads", ["b", "h"])
def test_block_mask_with_none_extent_for_a_mod_that_reads_it(reads):
    mod = (lambda b, h, q, kv: (q >= kv) | (b == 1)) if reads == "b" else (lambda b, h, q, kv: (q >= kv) | (h == 1))
    with pytest.raises(ValueError, match=f"mask_mod reads `{reads}` but {reads.upper()}=None"):
        flashlax.create_block_mask(mod, None, None, 1024, 1024)
    # With the extent given, a head-dependent mask is right on every head at L = 1024 (several tiles).
    bm = flashlax.create_block_mask(mod, 2, 4, 1024, 1024)
    q, k, v = (normal(i, (2, 4, 1024, 16)) for i in range(3))
    out = flashlax.flex_attention(q, k, v, block_mask=bm)
    ref = flashlax.flex_attention(q, k, v, mask_mod=mod, impl="repeat")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_reads_batch_head_from_the_jaxpr():
    assert _mods.reads_batch_head(masks.causal) == (False, False)
    assert _mods.reads_batch_head(lambda b, h, q, kv: (h * 0 + q) >= kv) == (False, True)   # read, even if * 0
    assert _mods.reads_batch_head(masks.document(jnp.asarray(DOCS), jnp.asarray(DOCS))) == (True, False)


# ----------------------------------------------------------------------------------------------------
# Gradients through masked positions
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_nan_only_under_the_mask_does_not_leak_into_gradients(impl, interpret):
    """A score_mod that is NaN exactly where the causal mask forbids (sqrt of a negative offset)."""
    def score_mod(s, b, h, q_idx, kv_idx):
        return s * jnp.sqrt((q_idx - kv_idx).astype(jnp.float32) + 1.0)

    q, k, v, dout = _inputs(11)
    out, grads = _run(impl, interpret, q, k, v, dout, score_mod=score_mod, mask_mod=masks.causal)
    offset = np.sqrt(np.maximum(_q - _k, 0) + 1.0)
    assert np.all(np.isfinite(out))
    for g in grads:
        assert np.all(np.isfinite(g))
    # Against the reference with the multiplier as a dense array (finite everywhere it is used).
    with jax.enable_x64():
        q64, k64, v64, do64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, dout))

        def f(q, k, v):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, jnp.repeat(k, 2, 1)) * D ** -0.5 * offset
            s = jnp.where(_q >= _k, s, -jnp.inf)
            p = jax.nn.softmax(s, -1)
            return jnp.sum(jnp.einsum("bhqk,bhkd->bhqd", p, jnp.repeat(v, 2, 1)) * do64)

        ref_grads = jax.grad(f, (0, 1, 2))(q64, k64, v64)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 4 * TOLERANCES["float32"]


# ----------------------------------------------------------------------------------------------------
# The kernels evaluate on tiles only what is provably point-wise
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mod,tile_ok", [
    (lambda b, h, q, kv: q >= kv, True),
    (lambda b, h, q, kv: jnp.asarray(DOCS)[b, q] == jnp.asarray(DOCS)[b, kv], True),
    (lambda b, h, q, kv: jnp.asarray(FLAGS)[q].any(), False),                     # a row read and reduced
    (lambda b, h, q, kv: jnp.cumsum(jnp.asarray(DOCS)[b])[q] > kv, False),        # a scan over a row
])
def test_tile_mod_refuses_what_is_not_point_wise(mod, tile_ok):
    if tile_ok:
        assert _tiles.TileMod.make(mod, "mask") is not None
    else:
        with pytest.raises(_tiles.UnsupportedModError):
            _tiles.TileMod.make(mod, "mask")
