"""Ring attention (flex_attention with context_axis=): values and gradients of one device, full and
causal (zigzag order) with GQA and captured-array mods, XLA path and Pallas kernel (interpreter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import flashlax
from flashlax import masks
from flashlax.parallel.ring import from_zigzag, to_zigzag
from conftest import normal
from _helpers import assert_close, put, specs, with_grads

B, HQ, HKV, L, D = 2, 4, 2, 64, 16
MESH = jax.make_mesh((2, 4), ("b", "sp"))            # Explicit: batch over b, sequence over sp
SEQ = P("b", None, "sp")
SEG = jnp.asarray(np.sort(np.random.default_rng(1).integers(0, 3, (B, L)), axis=1), jnp.int32)
TABLE = 0.1 * normal(9, (HQ, 2 * L))


def _inputs():
    rng = np.random.default_rng(0)      # numpy draws: jax.random compiles for every shape (seconds here)
    return normal(rng, (B, HQ, L, D)), normal(rng, (B, HKV, L, D)), normal(rng, (B, HKV, L, D))


def _bias(table):
    return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + L]


CASES = {
    # name: (mask_mod, with a learned bias table, return_lse)
    "full": (None, False, False),
    "causal": (masks.causal, False, False),
    "document_causal_bias_lse": (masks.and_masks(masks.causal, masks.document(SEG)), True, True),
}


def _attend(case, impl, context_axis):
    mask_mod, biased, return_lse = CASES[case]

    def fn(table, q, k, v):
        return flashlax.flex_attention(q, k, v, score_mod=_bias(table) if biased else None, mask_mod=mask_mod,
                                       return_lse=return_lse, impl=impl, interpret=impl == "pallas",
                                       context_axis=context_axis)
    return fn


@pytest.mark.parametrize("impl,case", [("xla", "full"), ("xla", "causal"), ("xla", "document_causal_bias_lse"),
                                       ("pallas", "causal"),
                                       pytest.param("pallas", "document_causal_bias_lse", marks=pytest.mark.slow)])
def test_ring_matches_one_device(impl, case):
    """Outputs and gradients of one device; the compiled ring program (forward and backward: outputs and
    gradients come from one program) passes K/V around the ring and never all-gathers."""
    args = (TABLE,) + _inputs()
    ring, single = _attend(case, impl, "sp"), _attend(case, "xla", None)
    loss = lambda out: sum(jnp.sum(x * jnp.cos(x)) for x in jax.tree.leaves(out))
    run = lambda fn: jax.jit(with_grads(fn, loss, (0, 1, 2, 3)))
    with jax.set_mesh(MESH):
        sharded = (TABLE,) + put(MESH, SEQ, *args[1:])
        compiled = run(ring).lower(*sharded).compile()
        got, got_grads = compiled(*sharded)
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "collective-permute" in hlo
    want, want_grads = run(single)(*args)
    assert_close(got, want, what="forward")
    assert_close(got_grads, want_grads, what="gradients (table, q, k, v)")
    assert all(spec[:3] == ("b", None, "sp") for spec in specs(got) + specs(got_grads[1:]))


def test_ring_with_block_mask_inside_callers_shard_map():
    """A block mask built over the global sequence, and a caller's shard_map over the context axis (the
    arrays are then the contiguous local shards)."""
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    bm = flashlax.create_block_mask(masks.sliding_window(12), None, None, L, L, block_q=8, block_kv=8)
    fn = lambda q, k, v, ctx: flashlax.flex_attention(q, k, v, block_mask=bm, context_axis=ctx)
    mapped = jax.shard_map(lambda q, k, v: fn(q, k, v, "sp"), mesh=mesh, in_specs=P(None, None, "sp"),
                           out_specs=P(None, None, "sp"))
    args = _inputs()
    loss = lambda out: jnp.sum(out * jnp.cos(out))
    (got, got_grads), (want, want_grads) = (jax.jit(with_grads(f, loss, (0, 1, 2)))(*args)
                                            for f in (mapped, lambda *a: fn(*a, None)))
    assert_close(got, want)
    assert_close(got_grads, want_grads, what="gradients")


def test_zigzag_order():
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    x = jnp.arange(16.0).reshape(1, 1, 16)        # 8 chunks of 2 positions
    zig = jax.shard_map(lambda t: to_zigzag(t, "sp", 4), mesh=mesh, in_specs=P(None, None, "sp"),
                        out_specs=P(None, None, "sp"))(x)
    chunks = np.asarray(zig).reshape(8, 2)[:, 0] // 2
    assert chunks.tolist() == [0, 7, 1, 6, 2, 5, 3, 4]      # device i: chunks i and 2n - 1 - i
    back = jax.shard_map(lambda t: from_zigzag(t, "sp", 4), mesh=mesh, in_specs=P(None, None, "sp"),
                         out_specs=P(None, None, "sp"))(zig)
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("kwargs,message", [
    (dict(context_axis="nope"), "not an axis of the mesh"),
    (dict(context_axis="sp", impl="repeat"), "impl 'xla' or 'pallas'"),
    (dict(context_axis="sp", length=36), "must split evenly"),
    (dict(context_axis="sp", block_q=16), "block_mask tiles"),
])
def test_errors(kwargs, message):
    length = kwargs.pop("length", L)
    q, k, v = (x[:, :, :length] for x in _inputs())
    if "block_q" in kwargs:
        kwargs["block_mask"] = flashlax.create_block_mask(masks.causal, None, None, length, length,
                                                          block_q=kwargs.pop("block_q"), block_kv=8)
    with jax.set_mesh(MESH), pytest.raises(ValueError, match=message):
        flashlax.flex_attention(*put(MESH, SEQ, q, k, v), mask_mod=masks.causal, **kwargs)
