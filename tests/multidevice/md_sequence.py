"""context_axis= for decode_attention (a KV cache split along its sequence axis, one LSE merge) and
gated_delta_rule (sequence parallel: state maps combined across devices, forward and backward): the
values (and gradients) of one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flashlax
from flashlax import masks, score_mods
from conftest import normal
from _helpers import assert_close, put, specs, with_grads

MESH = jax.make_mesh((2, 4), ("b", "sp"))
SEQ = P("b", None, "sp")



# ------------------------------------------------------------------------------------------------
# decode_attention over a sequence-split cache
# ------------------------------------------------------------------------------------------------

B, HQ, HKV, LMAX, D, LQ = 2, 4, 2, 64, 16, 3
# Lengths in the first part, across parts (new tokens straddling a boundary: 17, 33), full.
LENS = [[64, 64], [17, 33], [3, 40], [15, 16]]
SCORE = score_mods.alibi(jnp.arange(1.0, HQ + 1) / HQ)           # reads h and the positions
MASK = lambda b, h, q_idx, kv_idx: (kv_idx != q_idx - 5) | (b == 1)   # reads b and the positions


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_attention(impl):
    q, k, v = normal(0, (B, HQ, LQ, D)), normal(1, (B, HKV, LMAX, D)), normal(2, (B, HKV, LMAX, D))
    fn = lambda q, k, v, lens, ctx: flashlax.decode_attention(
        q, k, v, kv_lens=lens, score_mod=SCORE, mask_mod=MASK, return_lse=True, impl=impl,
        interpret=impl == "pallas", context_axis=ctx)
    single, split = jax.jit(lambda *a: fn(*a, None)), jax.jit(lambda *a: fn(*a, "sp"))
    for lens in map(jnp.asarray, LENS):
        with jax.set_mesh(MESH):
            got = split(*((put(MESH, P("b"), q),) + put(MESH, SEQ, k, v)), lens)
        assert_close(got, single(q, k, v, lens), what=f"kv_lens={lens}")
    assert specs(got) == [("b", None, None, None), ("b", None, None)]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_attention_traced_lens_outside_range(impl):
    """Traced kv_lens outside [Lq, Lmax] give NaN rows over a sequence-split cache as on one device (the
    shards' own lengths lie outside that range on purpose, so the guard runs after the merge); the other
    sequence's rows are untouched."""
    q, k, v = normal(0, (B, HQ, LQ, D)), normal(1, (B, HKV, LMAX, D)), normal(2, (B, HKV, LMAX, D))
    split = jax.jit(lambda q, k, v, lens: flashlax.decode_attention(
        q, k, v, kv_lens=lens, return_lse=True, impl=impl, interpret=impl == "pallas", context_axis="sp"))
    for lens, bad in (([LMAX + 1, 40], 0), ([33, LQ - 1], 1), ([33, -2 ** 31], 1)):
        lens = jnp.asarray(lens, jnp.int32)
        with jax.set_mesh(MESH):
            out, lse = (np.asarray(x) for x in split(*((put(MESH, P("b"), q),) + put(MESH, SEQ, k, v)), lens))
        ok = 1 - bad
        want = flashlax.decode_attention(q[ok:ok + 1], k[ok:ok + 1], v[ok:ok + 1], kv_lens=lens[ok:ok + 1],
                                         return_lse=True, impl="xla")
        assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all(), f"kv_lens={lens}"
        assert_close((out[ok:ok + 1], lse[ok:ok + 1]), want, what=f"kv_lens={lens}")


def test_decode_attention_cache_too_short():
    q, k = normal(0, (B, HQ, 9, D)), normal(1, (B, HKV, 32, D))
    with jax.set_mesh(MESH), pytest.raises(ValueError, match="parts of at least Lq=9"):
        flashlax.decode_attention(q, *put(MESH, SEQ, k, k), context_axis="sp")


# ------------------------------------------------------------------------------------------------
# gated_delta_rule, sequence parallel
# ------------------------------------------------------------------------------------------------

H, T, DK, DV = 2, 64, 8, 16


def _gdr_inputs(seed=3):
    q, k, v = normal(seed, (B, H, T, DK)), normal(seed + 1, (B, H, T, DK)), normal(seed + 2, (B, H, T, DV))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    log_alpha = -jax.nn.softplus(normal(seed + 3, (B, H, T)))
    beta = jax.nn.sigmoid(normal(seed + 4, (B, H, T)))
    return q, k, v, log_alpha, beta, 0.1 * normal(seed + 5, (B, H, DK, DV))


@pytest.mark.parametrize("impl,with_beta", [("chunked", True), ("chunked", False),
                                            pytest.param("chunked_fat", True, marks=pytest.mark.slow),
                                            ("recurrent", True), ("ssd", True), ("ssd", False)])
def test_gated_delta_rule(impl, with_beta):
    def fn(q, k, v, log_alpha, beta, state, ctx):
        return flashlax.gated_delta_rule(q, k, v, log_alpha, beta if with_beta else None, initial_state=state,
                                         return_final_state=True, chunk_size=16, impl=impl, context_axis=ctx,
                                         interpret=impl == "ssd")

    loss = lambda out: sum(jnp.sum(x * jnp.cos(x)) for x in out)
    # outputs and gradients from one program each (one compile, not two)
    run = lambda ctx: jax.jit(with_grads(lambda *a: fn(*a, ctx), loss, tuple(range(6))))
    args = _gdr_inputs()
    with jax.set_mesh(MESH):
        sharded = put(MESH, SEQ, *args[:3]) + put(MESH, P("b", None, "sp"), *args[3:5]) + (put(MESH, P("b"), args[5]),)
        got, got_grads = run("sp")(*sharded)
    want, grads = run(None)(*args)
    assert_close(got, want, what="outputs, final state")
    assert_close(got_grads[:4] + got_grads[5:], grads[:4] + grads[5:], what="gradients")
    if with_beta:
        assert_close(got_grads[4], grads[4], what="d beta")
    assert specs(got) == [("b", None, "sp", None), ("b", None, None, None)]


def test_gated_delta_rule_length_not_divisible():
    q, k, v, log_alpha, beta, _ = (x[:, :, :60] if x.ndim > 2 and x.shape[2] == T else x for x in _gdr_inputs())
    mesh = jax.make_mesh((8,), ("sp",))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="must split evenly"):
        flashlax.gated_delta_rule(q, k, v, log_alpha, beta, context_axis="sp")


def test_x64():
    """jax_enable_x64: int64 lengths, float64 positions never appear (indices stay int32), float32 inputs
    give the one-device values on every context-parallel path."""
    q, k, v = normal(0, (B, HQ, LQ, D)), normal(1, (B, HKV, LMAX, D)), normal(2, (B, HKV, LMAX, D))
    qf = normal(3, (B, HQ, LMAX, D))
    gdr = _gdr_inputs()
    with jax.enable_x64():
        lens = jnp.asarray([40, 17], jnp.int64)
        dec = lambda ctx: jax.jit(lambda q, k, v, lens: flashlax.decode_attention(
            q, k, v, kv_lens=lens, mask_mod=MASK, context_axis=ctx))(q, k, v, lens)
        ring = lambda ctx, *a: jax.jit(lambda *a: flashlax.flex_attention(*a, mask_mod=masks.causal,
                                                                          context_axis=ctx))(*a)
        lin = lambda ctx, *a: jax.jit(lambda *a: flashlax.gated_delta_rule(*a, chunk_size=16, context_axis=ctx))(*a)
        want = (dec(None), ring(None, qf, k, v), lin(None, *gdr[:5]))
        with jax.set_mesh(MESH):
            got = (dec("sp"), ring("sp", *put(MESH, SEQ, qf, k, v)), lin("sp", *put(MESH, SEQ, *gdr[:3]),
                                                                         *put(MESH, P("b", None, "sp"), *gdr[3:5])))
    assert_close(got, want)
