"""Every op and implementation under jit on an Explicit mesh (jax.make_mesh's default) with inputs sharded
over batch and heads: the values and gradients of one device, outputs sharded like the inputs, and no
all-gather in the compiled program (forward and backward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flashlax
from flashlax import masks, score_mods
from conftest import normal
from _helpers import assert_close, put, run_and_gathers, specs, with_grads

B, HQ, HKV, L, D = 4, 4, 2, 32, 16
MESH = jax.make_mesh((4, 2), ("b", "h"))        # Explicit axes
BH = P("b", "h")



SEG = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, (B, L)), axis=1), jnp.int32)
SLOPES = jnp.arange(1.0, HQ + 1) / HQ
# Mods that read b (segment ids) and h (ALiBi slopes): sharded calls must give them global indices.
DOC_CAUSAL = masks.and_masks(masks.causal, masks.document(SEG))
ALIBI = score_mods.alibi(SLOPES)


def _attention_inputs(kv_heads=HKV):
    return normal(0, (B, HQ, L, D)), normal(1, (B, kv_heads, L, D)), normal(2, (B, kv_heads, L, D))


def _loss(out):
    return sum(jnp.sum(x * jnp.cos(x)) for x in jax.tree.leaves(out))


def _check(fn, args, in_specs, out_spec, differentiable=True):
    """fn on sharded args == fn on one device (values, gradients); outputs sharded like the inputs;
    no all-gather in the compiled program (forward and backward: one program gives the outputs and the
    gradients)."""
    sharded = tuple(put(MESH, spec, x) for spec, x in zip(in_specs, args))
    run = with_grads(fn, _loss, tuple(range(len(args)))) if differentiable else fn
    got, gathers = run_and_gathers(run, *sharded)
    want = jax.jit(run)(*args)
    out, want_out = (got[0], want[0]) if differentiable else (got, want)
    assert_close(out, want_out, what="forward")
    for spec in specs(out):
        assert spec[:len(out_spec)] == tuple(out_spec), f"output sharded {spec}, inputs {out_spec}"
    if differentiable:
        assert_close(got[1], want[1], what="gradients")
    assert gathers == [], "all-gather in the forward or backward"


@pytest.mark.parametrize("impl", ["xla", "repeat", "pallas"])
def test_flex_attention(impl):
    fn = lambda q, k, v: flashlax.flex_attention(q, k, v, score_mod=ALIBI, mask_mod=DOC_CAUSAL, return_lse=True,
                                                 impl=impl, interpret=impl == "pallas")
    _check(fn, _attention_inputs(), (BH,) * 3, BH)


def test_flex_attention_single_kv_head():
    """MQA with heads split over two devices: each device reads the one K/V head (K/V stay whole)."""
    fn = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal)
    _check(fn, _attention_inputs(kv_heads=1), (BH, P("b"), P("b")), BH)


def test_flex_attention_block_mask_and_kv_batch_one():
    """A block mask built per batch element is split with the batch; K/V of batch 1 broadcast."""
    bm = flashlax.create_block_mask(DOC_CAUSAL, B, None, L, L, block_q=16, block_kv=16)
    q, k, v = _attention_inputs()
    fn = lambda q, k, v: flashlax.flex_attention(q, k, v, block_mask=bm)
    _check(fn, (q, k[:1], v[:1]), (BH, P(None, "h"), P(None, "h")), BH)


def test_flex_attention_sequence_sharded_without_context_axis():
    """A sequence sharding without context_axis is gathered (values right), batch/heads stay split."""
    fn = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal)
    args = _attention_inputs()
    sharded = put(MESH, P("b", None, "h"), *args)
    assert_close(jax.jit(fn)(*sharded), jax.jit(fn)(*args))


def test_dot_product_attention():
    q, k, v = (x.swapaxes(1, 2) for x in _attention_inputs())
    bias = normal(3, (1, HQ, L, L))
    fn = lambda q, k, v: flashlax.dot_product_attention(q, k, v, bias, is_causal=True)
    _check(fn, (q, k, v), (P("b", None, "h"),) * 3, P("b", None, "h"))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_attention(impl):
    q, k, v = _attention_inputs()
    kv_lens = jnp.array([32, 7, 20, 3])
    fn = lambda q, k, v: flashlax.decode_attention(q[:, :, :3], k, v, kv_lens=kv_lens, score_mod=ALIBI,
                                                   mask_mod=DOC_CAUSAL, return_lse=True, impl=impl,
                                                   interpret=impl == "pallas")
    _check(fn, (q, k, v), (BH,) * 3, BH, differentiable=False)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_attention_traced_lens_outside_range(impl):
    """Traced kv_lens outside [Lq, Lmax] on inputs sharded over batch and heads: NaN rows for those
    sequences, the others as on one device."""
    q, k, v = _attention_inputs()
    fn = jax.jit(lambda q, k, v, lens: flashlax.decode_attention(q, k, v, kv_lens=lens, return_lse=True,
                                                                 impl=impl, interpret=impl == "pallas"))
    lens = jnp.asarray([L, 2, 20, L + 1], jnp.int32)
    q = q[:, :, :3]
    out, lse = (np.asarray(x) for x in fn(*(put(MESH, BH, x) for x in (q, k, v)), put(MESH, P("b"), lens)))
    ok = np.asarray([True, False, True, False])
    want_out, want_lse = flashlax.decode_attention(q[ok], k[ok], v[ok], kv_lens=lens[ok], return_lse=True,
                                                   impl="xla")
    assert np.isnan(out[~ok]).all() and np.isnan(lse[~ok]).all()
    assert_close((out[ok], lse[ok]), (want_out, want_lse))


@pytest.mark.parametrize("impl", [pytest.param("recurrent", marks=pytest.mark.slow), "chunked",
                                  pytest.param("chunked_fat", marks=pytest.mark.slow), "ssd"])
def test_gated_delta_rule(impl):
    q, k, v = normal(4, (B, HQ, L, D)), normal(5, (B, HQ, L, D)), normal(6, (B, HQ, L, D))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    log_alpha, beta = -jax.nn.softplus(normal(7, (B, HQ, L))), jax.nn.sigmoid(normal(8, (B, HQ, L)))
    state = 0.1 * normal(9, (B, HQ, D, D))
    fn = lambda *a: flashlax.gated_delta_rule(*a[:5], initial_state=a[5], return_final_state=True,
                                              chunk_size=16, impl=impl, interpret=impl == "ssd")
    _check(fn, (q, k, v, log_alpha, beta, state), (BH,) * 6, BH)
