"""Every op inside the caller's jax.shard_map with check_vma=True (the default), values and gradients of
one device; and under jit on an Auto mesh (XLA's partitioner splits the XLA paths along batch and heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import flashlax
from flashlax import masks
from conftest import normal
from _helpers import assert_close, put, run_and_gathers, specs, with_grads

B, HQ, HKV, L, D = 4, 4, 2, 32, 16
MESH = jax.make_mesh((4, 2), ("b", "h"), axis_types=(AxisType.Auto,) * 2)
BH = P("b", "h")
TABLE = 0.1 * normal(9, (2 * L,))



def _rel_bias(table):
    # A learned relative-position bias: its gradient sums the shares of every device.
    return lambda score, b, h, q_idx, kv_idx: score + table[q_idx - kv_idx + L]


def _gdr_inputs():
    q, k, v = normal(4, (B, HQ, L, D)), normal(5, (B, HQ, L, D)), normal(6, (B, HQ, L, D))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, v, -jax.nn.softplus(normal(7, (B, HQ, L))), jax.nn.sigmoid(normal(8, (B, HQ, L)))


CASES = {
    "flex_xla": (lambda t, q, k, v: flashlax.flex_attention(q, k, v, score_mod=_rel_bias(t), mask_mod=masks.causal),
                 "attention", True),
    "flex_repeat": (lambda t, q, k, v: flashlax.flex_attention(q, k, v, score_mod=_rel_bias(t), impl="repeat"),
                    "attention", True),
    "dot_product_attention": (lambda t, q, k, v: flashlax.dot_product_attention(
        q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True).swapaxes(1, 2), "attention", True),
    "decode_xla": (lambda t, q, k, v: flashlax.decode_attention(q[:, :, :2], k, v, score_mod=_rel_bias(t),
                                                                kv_lens=jnp.full((q.shape[0],), 20)),
                   "attention", False),
    **{f"gdr_{impl}": (lambda t, q, k, v, la, beta, impl=impl: flashlax.gated_delta_rule(
        q, k, v, la, beta, chunk_size=16, impl=impl), "linear", True)
       for impl in ("recurrent", "chunked", "chunked_fat")},
}


def _inputs(kind):
    if kind == "attention":
        return normal(0, (B, HQ, L, D)), normal(1, (B, HKV, L, D)), normal(2, (B, HKV, L, D))
    return _gdr_inputs()


def _sin_loss(out):
    return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(out))


def _grad(fn, n):
    return jax.grad(lambda *a: _sin_loss(fn(*a)), argnums=tuple(range(n)))


def _with_grads(fn, n):
    """Outputs and gradients (of _sin_loss, for the first n arguments) from one jitted program."""
    return jax.jit(with_grads(fn, _sin_loss, tuple(range(n))))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "gdr_chunked_fat" else c
                                  for c in sorted(CASES)])
def test_inside_shard_map(case):
    fn, kind, differentiable = CASES[case]
    args = _inputs(kind)
    mapped = lambda t, *a: jax.shard_map(lambda *x: fn(t, *x), mesh=MESH, in_specs=BH, out_specs=BH)(*a)
    if not differentiable:
        assert_close(jax.jit(mapped)(TABLE, *args), jax.jit(fn)(TABLE, *args))
        return
    # outputs and gradients from one program each (one compile, not two)
    (got, got_grads), (want, want_grads) = (_with_grads(f, len(args) + 1)(TABLE, *args) for f in (mapped, fn))
    assert_close(got, want)
    assert_close(got_grads, want_grads, what="gradients")


def _pallas_case(op):
    """(fn of arrays, the arrays, differentiable) for each Pallas kernel run in the interpreter."""
    if op.startswith("ssd"):
        q, k, v, la, beta = _gdr_inputs()
        args = (q, k, v, la) if op == "ssd_nobeta" else (q, k, v, la, beta)
        return (lambda *a: flashlax.gated_delta_rule(*a, chunk_size=16, impl="ssd", interpret=True)), args, True
    q, k, v = _inputs("attention")
    kw = dict(impl="pallas", interpret=True, mask_mod=masks.causal)
    if op == "flex":
        return (lambda q, k, v: flashlax.flex_attention(q, k, v, **kw)), (q, k, v), True
    return (lambda q, k, v: flashlax.decode_attention(q[:, :, :2], k, v, **kw)), (q, k, v), False


PALLAS_OPS = ["flex", "decode", "ssd", "ssd_nobeta"]


@pytest.mark.parametrize("op", PALLAS_OPS)
def test_pallas_inside_shard_map(op):
    """Values (and gradients) of the Pallas kernels inside a caller's shard_map equal one device. The
    interpreter needs check_vma=False there: the Pallas HLO interpreter pads blocks with constants that do
    not vary like the blocks (jax 0.11.2); the typing under check_vma=True is checked below, the real
    kernels under check_vma=True by scripts/gpu_shardmap.py on the GPU."""
    fn, args, differentiable = _pallas_case(op)
    mapped = jax.shard_map(fn, mesh=MESH, in_specs=BH, out_specs=BH, check_vma=False)
    if not differentiable:
        assert_close(jax.jit(mapped)(*args), jax.jit(fn)(*args))
        return
    # outputs and gradients from one program each (one compile, not two)
    (got, got_grads), (want, want_grads) = (_with_grads(f, len(args))(*args) for f in (mapped, fn))
    assert_close(got, want)
    assert_close(got_grads, want_grads, what="gradients")


@pytest.mark.parametrize("op", PALLAS_OPS)
def test_pallas_types_under_check_vma(op):
    """Inside shard_map with check_vma=True every pallas_call output and custom_vjp cotangent carries the
    manual axes of its inputs (else JAX raises while tracing): the outputs and gradients trace with the
    shapes and shardings of one device's shard."""
    fn, args, differentiable = _pallas_case(op)
    mapped = jax.shard_map(fn, mesh=MESH, in_specs=BH, out_specs=BH, check_vma=True)
    out = jax.eval_shape(mapped, *args)
    assert out.shape == jax.eval_shape(fn, *args).shape
    if differentiable:
        grads = jax.eval_shape(_grad(mapped, len(args)), *args)
        assert [g.shape for g in grads] == [a.shape for a in args]


@pytest.mark.parametrize("case", ["flex_xla", "decode_xla", "dot_product_attention", "gdr_recurrent", "gdr_chunked"])
def test_auto_mesh(case):
    """Auto axes do not show in the types: XLA's SPMD partitioner splits the XLA paths by itself. (The
    chunked gated_delta_rule gathers its small inverted diagonal blocks, [N, B, H, C / 8, 8, 8], whose
    flattening into one batch axis the partitioner cannot split; never q/k/v.)"""
    fn, kind, _ = CASES[case]
    args = _inputs(kind)
    with jax.set_mesh(MESH):
        got, gathers = run_and_gathers(fn, TABLE, *put(MESH, BH, *args))
    if case == "gdr_chunked":
        sizes = [np.prod([int(n) for n in g.split("[")[1].split("]")[0].split(",")]) for g in gathers]
        assert all(size < args[0].size for size in sizes), gathers
    else:
        assert gathers == []
    assert_close(got, jax.jit(fn)(TABLE, *args))
    assert specs(got)[0][:2] == ("b", "h")


@pytest.mark.parametrize("op", ["flex", "decode"])
def test_auto_mesh_pallas(op):
    """The Pallas kernels on an Auto mesh: custom_partitioning keeps the batch / head split (no gather),
    mods get global b / h, gradients (captured table included) match one device."""
    seg = (jnp.arange(L)[None, :] // 11 + jnp.arange(B)[:, None]) % 3
    mask = masks.and_masks(masks.causal, masks.document(seg))
    kw = dict(impl="pallas", interpret=True, mask_mod=mask)
    if op == "flex":
        fn = lambda t, q, k, v: flashlax.flex_attention(
            q, k, v, score_mod=lambda s, b, h, qi, ki: s + t[qi - ki + L] * (h + 1).astype(s.dtype), **kw)
    else:
        fn = lambda t, q, k, v: flashlax.decode_attention(q[:, :, :2], k, v, score_mod=_rel_bias(t), **kw)
    args = _inputs("attention")
    grad = _grad(fn, 4)
    with jax.set_mesh(MESH):
        sharded = put(MESH, BH, *args)
        got, gathers = run_and_gathers(fn, TABLE, *sharded)
        assert gathers == [] and specs(got)[0][:2] == ("b", "h")
        if op == "flex":
            got_grads, gathers = run_and_gathers(grad, TABLE, *sharded)
            assert gathers == []
    if op == "flex":       # one device: outputs and gradients from one program
        want, want_grads = _with_grads(fn, 4)(TABLE, *args)
        assert_close(got, want)
        assert_close(got_grads, want_grads, what="gradients")
    else:
        assert_close(got, jax.jit(fn)(TABLE, *args))


def test_auto_mesh_ssd():
    """The ssd kernels on an Auto mesh: custom_partitioning keeps the batch / head split (no gather of the
    inputs), values, final state and gradients (initial state included) equal one device."""
    args = _gdr_inputs() + (0.1 * normal(9, (B, HQ, D, D)),)
    fn = lambda q, k, v, la, beta, state: flashlax.gated_delta_rule(
        q, k, v, la, beta, initial_state=state, chunk_size=16, impl="ssd", interpret=True, return_final_state=True)
    grad = _grad(fn, len(args))
    with jax.set_mesh(MESH):
        sharded = put(MESH, BH, *args)
        got, gathers = run_and_gathers(fn, *sharded)
        assert gathers == [] and all(spec[:2] == ("b", "h") for spec in specs(got))
        got_grads, gathers = run_and_gathers(grad, *sharded)
        assert gathers == []
    # one device: outputs and gradients from one program
    want, want_grads = _with_grads(fn, len(args))(*args)
    assert_close(got, want)
    assert_close(got_grads, want_grads, what="gradients")
