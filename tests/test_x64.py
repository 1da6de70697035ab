"""Every op and implementation with ``jax_enable_x64`` switched on, as scientific JAX code runs.

float32 / bfloat16 inputs give the results they give without x64 (indices stay int32 inside); float64
inputs are computed in float64 on the XLA paths (no silent loss to float32) and refused by the Pallas
kernels with a ValueError naming the dtype. Integer arguments made by ``jnp.array`` (int64 in this mode)
are accepted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from flashlax import masks, score_mods
from flashlax.reference import attention_reference
from conftest import TOLERANCES, normal, rel_err

B, HQ, HKV, L, D = 2, 4, 2, 37, 16


def _inputs(dtype, seed=0, lq=L, lkv=L):
    rng = np.random.default_rng(seed)
    q = normal(rng, (B, HQ, lq, D), dtype)
    k = normal(rng, (B, HKV, lkv, D), dtype)
    v = normal(rng, (B, HKV, lkv, D), dtype)
    return q, k, v


@pytest.mark.parametrize("impl,interpret", [("xla", False), ("repeat", False), ("pallas", True)])
def test_flex_attention_float32_under_x64(impl, interpret):
    q, k, v = _inputs(jnp.float32)
    slopes = jnp.linspace(0.1, 0.5, HQ, dtype=jnp.float32)
    kw = dict(mask_mod=masks.sliding_window(9), score_mod=score_mods.alibi(slopes), impl=impl, interpret=interpret)
    ref, ref_grad = flashlax.flex_attention(q, k, v, **kw), jax.grad(
        lambda q: flashlax.flex_attention(q, k, v, **kw).sum())(q)
    with jax.enable_x64():
        out = jax.jit(lambda q, k, v: flashlax.flex_attention(q, k, v, **kw))(q, k, v)
        grad = jax.grad(lambda q: flashlax.flex_attention(q, k, v, **kw).sum())(q)
    assert out.dtype == jnp.float32 and grad.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "repeat"])
def test_flex_attention_float64_is_computed_in_float64(impl):
    with jax.enable_x64():
        q, k, v = (x.astype(jnp.float64) for x in _inputs(jnp.float32, seed=1))
        out, lse = flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl=impl, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, mask_mod=masks.causal)
        assert out.dtype == jnp.float64
        assert rel_err(out, ref) <= 1e-12          # float32 arithmetic would give ~1e-7
        assert rel_err(lse, ref_lse) <= 1e-12


def test_pallas_refuses_float64():
    with jax.enable_x64():
        q, k, v = (x.astype(jnp.float64) for x in _inputs(jnp.float32))
        with pytest.raises(ValueError, match="float64"):
            flashlax.flex_attention(q, k, v, impl="pallas", interpret=True)


def test_create_block_mask_and_document_masks_under_x64():
    seg = np.sort(np.random.default_rng(0).integers(0, 3, (B, L)), axis=1)
    q, k, v = _inputs(jnp.float32, seed=2)
    ref = flashlax.flex_attention(q, k, v, mask_mod=masks.document(jnp.asarray(seg, jnp.int32)))
    with jax.enable_x64():
        mod = masks.document(jnp.asarray(seg))             # int64 segment ids
        bm = flashlax.create_block_mask(mod, B, None, L, L, block_q=16, block_kv=16)
        out = flashlax.flex_attention(q, k, v, block_mask=bm)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_decode_attention_under_x64_with_int64_lengths():
    q, k, v = _inputs(jnp.float32, seed=3, lq=2)
    lens = [20, L]
    ref = flashlax.decode_attention(q, k, v, kv_lens=jnp.asarray(lens, jnp.int32))
    with jax.enable_x64():
        kv_lens = jnp.array(lens)                          # int64 in this mode
        assert kv_lens.dtype == jnp.int64
        eager = flashlax.decode_attention(q, k, v, kv_lens=kv_lens)
        traced = jax.jit(lambda lens: flashlax.decode_attention(q, k, v, kv_lens=lens))(kv_lens)
        q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
        out64 = flashlax.decode_attention(q64, k64, v64, kv_lens=kv_lens)
        assert out64.dtype == jnp.float64
    np.testing.assert_allclose(eager, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(traced, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out64, ref, rtol=1e-5, atol=1e-6)


def test_dot_product_attention_under_x64_matches_jax():
    with jax.enable_x64():
        rng = np.random.default_rng(4)
        q, k, v = (jnp.asarray(rng.standard_normal((B, 9, HKV * 2, D))) for _ in range(3))   # float64 here
        lengths = jnp.array([5, 9])                                              # int64
        out = flashlax.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
        ref = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           key_value_seq_lengths=lengths.astype(jnp.int32))
        assert out.dtype == jnp.float64
        # jax itself takes the softmax of float64 logits in float32, so agreement is at float32's level.
        assert rel_err(out, ref) <= 1e-6


@pytest.mark.parametrize("impl", ["recurrent", "chunked", "chunked_fat"])
def test_gated_delta_rule_under_x64(impl):
    rng = np.random.default_rng(5)
    shape = (1, 2, 21, 8)
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    log_alpha = -np.logaddexp(0.0, -(rng.standard_normal(shape[:3]) + 2.0))       # log_sigmoid
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(shape[:3])))                    # sigmoid
    q, k, v, log_alpha, beta = (jnp.asarray(x, jnp.float32) for x in (q, k, v, log_alpha, beta))
    ref = flashlax.gated_delta_rule(q, k, v, log_alpha, beta, impl=impl, chunk_size=16)
    with jax.enable_x64():
        out = jax.jit(lambda *a: flashlax.gated_delta_rule(*a, impl=impl, chunk_size=16))(q, k, v, log_alpha, beta)
        grad = jax.grad(lambda q: flashlax.gated_delta_rule(q, k, v, log_alpha, beta, impl=impl,
                                                            chunk_size=16).sum())(q)
    assert out.dtype == jnp.float32 and np.all(np.isfinite(grad))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
