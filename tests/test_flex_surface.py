"""The rest of FlexAttention's surface on flex_attention (issue 18): ``return_aux`` with per-row max scores,
``kernel_options``, and block masks whose tiles are part of the mask (``BlockMask.from_kv_blocks``), on
every implementation (Pallas interpreted on CPU). References are dense numpy float64 computations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from conftest import TOLERANCES, rel_err
from flashlax import masks
from flashlax.attention import AuxOutput, AuxRequest
from flashlax.kernels.configs import parse_kernel_options

IMPLS = [("xla", {}), ("repeat", {}), ("pallas", dict(interpret=True))]
IDS = [name for name, _ in IMPLS]


def _inputs(seed, batch=2, hq=4, hkv=2, lq=24, lkv=40, dim=16):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(np.float32)
                 for shape in ((batch, hq, lq, dim), (batch, hkv, lkv, dim), (batch, hkv, lkv, dim)))


def _dense(q, k, v, allowed, score_fn=None):
    """numpy float64: (out, lse, row max of the scores) with K/V heads repeated to the query heads and
    ``allowed`` a bool [B or 1, Hq or 1, Lq, Lkv]; fully masked rows give 0, -inf, -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    if score_fn is not None:
        s = score_fn(s)
    s = np.where(allowed, s, -np.inf)
    row_max = s.max(-1)
    safe = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(s - safe[..., None])
    total = p.sum(-1)
    out = np.einsum("bhqk,bhkd->bhqd", p, v) / np.where(total > 0, total, 1.0)[..., None]
    lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return out, lse, row_max


# ----------------------------------------------------------------------------------------------------
# return_aux
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,kw", IMPLS, ids=IDS)
def test_max_scores_against_dense(impl, kw):
    """A softcap score_mod, a mask that hides everything from head 3 (rows of -inf) and keys past
    q_idx + 10 otherwise: max_scores is the largest modded, masked score of the row; lse alongside."""
    q, k, v = _inputs(0)
    score_mod = lambda s, b, h, q_idx, kv_idx: 2.0 * jnp.tanh(s / 2.0)  # noqa: E731
    mask_mod = lambda b, h, q_idx, kv_idx: (h != 3) & (kv_idx <= q_idx + 10)  # noqa: E731
    out, aux = flashlax.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, impl=impl,
                                       return_aux=AuxRequest(lse=True, max_scores=True), **kw)
    assert isinstance(aux, AuxOutput) and aux.max_scores.shape == q.shape[:3]
    h = np.arange(4)[None, :, None, None]
    allowed = (h != 3) & (np.arange(40)[None, None, None, :] <= np.arange(24)[None, None, :, None] + 10)
    want_out, want_lse, want_max = _dense(q, k, v, allowed, lambda s: 2.0 * np.tanh(s / 2.0))
    assert rel_err(out, want_out) <= TOLERANCES["float32"]
    got_max, got_lse = np.asarray(aux.max_scores, np.float64), np.asarray(aux.lse, np.float64)
    np.testing.assert_array_equal(got_max[:, 3], -np.inf)
    np.testing.assert_array_equal(got_lse[:, 3], -np.inf)
    np.testing.assert_allclose(got_max[:, :3], want_max[:, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_lse[:, :3], want_lse[:, :3], rtol=1e-5, atol=1e-5)
    only_max = flashlax.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, impl=impl,
                                       return_aux=AuxRequest(max_scores=True), **kw)[1]
    assert only_max.lse is None
    np.testing.assert_array_equal(np.asarray(only_max.max_scores), np.asarray(aux.max_scores))


@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_max_scores_scale_units_in_the_kernel(scale):
    """The kernel keeps raw q.k (scale > 0) or scaled scores (scale <= 0) in its running max: max_scores
    comes back in the units of the scores either way."""
    q, k, v = _inputs(1, lq=16, lkv=16)
    _, aux = flashlax.flex_attention(q, k, v, scale=scale, impl="pallas", interpret=True,
                                     return_aux=AuxRequest(max_scores=True))
    s = np.einsum("bhqd,bhkd->bhqk", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, axis=1))
    np.testing.assert_allclose(np.asarray(aux.max_scores), (s * scale).max(-1), rtol=1e-5, atol=1e-5)


def test_return_aux_conventions():
    q, k, v = _inputs(2, lq=8, lkv=8)
    out, aux = flashlax.flex_attention(q, k, v, return_aux=AuxRequest())
    assert aux == AuxOutput(None, None) and out.shape == q.shape
    out_lse, lse = flashlax.flex_attention(q, k, v, return_lse=True)        # return_lse keeps working
    _, aux_lse = flashlax.flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    np.testing.assert_array_equal(np.asarray(aux_lse.lse), np.asarray(lse))
    with pytest.raises(ValueError, match="not both"):
        flashlax.flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(ValueError, match="AuxRequest"):
        flashlax.flex_attention(q, k, v, return_aux=(True, True))
    jitted = jax.jit(lambda q, k, v: flashlax.flex_attention(q, k, v, return_aux=AuxRequest(True, True)))(q, k, v)
    assert isinstance(jitted[1], AuxOutput)
    # lse through return_aux is differentiable; max_scores carries no gradient
    grad_aux = jax.grad(lambda q: flashlax.flex_attention(q, k, v, return_aux=AuxRequest(lse=True))[1].lse.sum())(q)
    grad_lse = jax.grad(lambda q: flashlax.flex_attention(q, k, v, return_lse=True)[1].sum())(q)
    np.testing.assert_allclose(np.asarray(grad_aux), np.asarray(grad_lse), rtol=1e-6)
    grad_max = jax.grad(lambda q: flashlax.flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))[1]
                        .max_scores.sum())(q)
    assert not np.asarray(grad_max).any()


# ----------------------------------------------------------------------------------------------------
# kernel_options
# ----------------------------------------------------------------------------------------------------

def test_kernel_options_names_and_precedence():
    opts = parse_kernel_options(dict(BLOCK_M=32, BLOCK_N=16, num_warps=2, fwd_num_warps=8, num_stages=3,
                                     bwd_BLOCK_M1=16, bwd_num_stages=1, pack_gqa=True))
    assert opts.fwd == dict(block_q=32, block_kv=16, num_warps=8, num_stages=3, pack_gqa=True)
    assert opts.bwd == dict(num_warps_dkv=2, num_warps_dq=2, num_stages_dkv=1, num_stages_dq=1, block_q_dkv=16)
    assert opts.fixed_tiles and not parse_kernel_options(dict(num_warps=4)).fixed_tiles


@pytest.mark.parametrize("impl", ["xla", "repeat", "pallas"])
@pytest.mark.parametrize("options,match", [
    (dict(BLOCK_K=64), "unknown kernel_options"),
    (dict(PRESCALE_QK=True), "unknown kernel_options"),
    (dict(BLOCK_M=48), "power of two"),
    (dict(bwd_BLOCK_N2=8), "power of two"),
    (dict(num_warps=3), "num_warps"),
    (dict(num_stages=True), "must be an int"),
    ([("BLOCK_M", 64)], "must be a dict"),
])
def test_kernel_options_rejected_on_every_impl(impl, options, match):
    q, k, v = _inputs(3, lq=8, lkv=8)
    with pytest.raises(ValueError, match=match):
        flashlax.flex_attention(q, k, v, kernel_options=options, impl=impl, interpret=True)


def test_kernel_options_checked_against_shared_memory():
    """On "pallas" a config over the device's shared memory (the interpreter stands for the smallest
    budget, 99 KB) is a ValueError naming kernel_options, forward or backward, before anything runs; the
    XLA impls accept and ignore the same options."""
    q, k, v = _inputs(4, hq=2, hkv=1, lq=16, lkv=16, dim=128)
    big = dict(BLOCK_M=128, BLOCK_N=128, num_stages=4)
    with pytest.raises(ValueError, match=r"kernel_options .* do not fit this device.*101376"):
        flashlax.flex_attention(q, k, v, kernel_options=big, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"kernel_options .*\(backward\) do not fit"):
        flashlax.flex_attention(q, k, v, impl="pallas", interpret=True,
                                kernel_options=dict(bwd_BLOCK_M1=256, bwd_BLOCK_N1=256, bwd_num_stages=4))
    plain = flashlax.flex_attention(q, k, v, impl="xla")
    np.testing.assert_array_equal(np.asarray(flashlax.flex_attention(q, k, v, impl="xla", kernel_options=big)),
                                  np.asarray(plain))


def test_kernel_options_set_the_kernel_tiles():
    """BLOCK_M / BLOCK_N / warps / stages reach the kernel: a causal block mask of 32x32 tiles is rebuilt
    for 16x16 kernel tiles (result unchanged), and backward options give the same gradients."""
    q, k, v = _inputs(5, lq=40, lkv=40)
    bm = flashlax.create_block_mask(masks.causal, None, None, 40, 40, BLOCK_SIZE=32)
    want = flashlax.flex_attention(q, k, v, block_mask=bm, impl="xla")
    opts = dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1, bwd_BLOCK_M1=16, bwd_BLOCK_N1=16,
                bwd_BLOCK_M2=16, bwd_BLOCK_N2=16)
    from flashlax.kernels import flash_attention
    seen = []
    real = flash_attention._forward_call

    def spy(st, *args):
        seen.append((st.config, st.bwd_config, st.kv_sub))
        return real(st, *args)

    flash_attention._forward_call = spy
    try:
        loss = lambda q, kw: (flashlax.flex_attention(q, k, v, block_mask=bm, impl=kw.pop("impl"), **kw) ** 2).sum()  # noqa: E731
        got_grad = jax.grad(loss)(q, dict(impl="pallas", interpret=True, kernel_options=opts))
    finally:
        flash_attention._forward_call = real
    cfg, bwd, kv_sub = seen[-1]
    assert (cfg.block_q, cfg.block_kv, cfg.num_warps, cfg.num_stages) == (16, 16, 2, 1)
    assert (bwd.block_q_dkv, bwd.block_kv_dq, bwd.num_warps_dq) == (16, 16, 2)
    assert kv_sub * 16 == 64          # the mask was rebuilt with 64-key tiles the kernel steps 16 at a time
    want_grad = jax.grad(loss)(q, dict(impl="xla"))
    assert rel_err(got_grad, want_grad) <= 1e-5
    got = flashlax.flex_attention(q, k, v, block_mask=bm, impl="pallas", interpret=True, kernel_options=opts)
    assert rel_err(got, want) <= TOLERANCES["float32"]


# ----------------------------------------------------------------------------------------------------
# Block masks from tile lists: the tiles are part of the mask
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,kw", IMPLS, ids=IDS)
def test_from_kv_blocks_mask_on_every_impl(impl, kw):
    """16x16 tiles over [B=2, 32, 48]: batch 0 row 0 partial tile 1 (mod: even kv_idx), full tile 2; row 1
    partial tile 0; batch 1 row 0 nothing (rows of -inf), row 1 full tiles 0 and 1. The XLA impls' own
    tiles (other sizes) must not change the meaning; a tile in no list is masked even where the mod says
    attend."""
    q, k, v = _inputs(6, lq=32, lkv=48)
    even = lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0  # noqa: E731
    bm = masks.BlockMask.from_kv_blocks(
        jnp.array([[[1, 1]], [[0, 0]]]), jnp.array([[[[1, 0, 0], [0, 0, 0]]], [[[0, 0, 0], [0, 0, 0]]]]),
        jnp.array([[[1, 0]], [[0, 2]]]), jnp.array([[[[2, 0, 0], [0, 0, 0]]], [[[0, 0, 0], [0, 1, 0]]]]),
        BLOCK_SIZE=16, mask_mod=even)
    allowed = np.zeros((2, 1, 32, 48), bool)
    evens = (np.arange(48) % 2 == 0)[None, :]
    allowed[0, 0, 0:16, 16:32] = evens[:, 16:32]
    allowed[0, 0, 0:16, 32:48] = True
    allowed[0, 0, 16:32, 0:16] = evens[:, 0:16]
    allowed[1, 0, 16:32, 0:32] = True
    out, aux = flashlax.flex_attention(q, k, v, block_mask=bm, impl=impl, return_aux=AuxRequest(lse=True), **kw)
    want_out, want_lse, _ = _dense(q, k, v, allowed)
    assert rel_err(out, want_out) <= TOLERANCES["float32"]
    np.testing.assert_array_equal(np.asarray(aux.lse)[1, :, :16], -np.inf)
    np.testing.assert_allclose(np.asarray(aux.lse)[0], want_lse[0], rtol=1e-5)
    with pytest.raises(ValueError, match="mask_mod differs"):
        flashlax.flex_attention(q, k, v, block_mask=bm, mask_mod=masks.causal, impl=impl, **kw)


def test_sliced_block_mask_rows_for_decoding():
    """Decoding with a block mask built for the whole sequence (as PyTorch users do): the query-tile row
    of the new token, cropped to one row; the result equals attention of that query row alone."""
    q, k, v = _inputs(7, lq=64, lkv=64)
    bm = flashlax.create_block_mask(masks.causal, None, None, 64, 64, BLOCK_SIZE=16)
    row = bm[:, :, 2]._adjust(1, 64)             # query tile 2 holds positions 32..47; its first row is 32
    got = flashlax.flex_attention(q[:, :, 32:33], k, v, block_mask=row)
    want = _dense(q[:, :, 32:33], k, v, (np.arange(64) <= 32)[None, None, None, :])[0]
    assert rel_err(got, want) <= TOLERANCES["float32"]
