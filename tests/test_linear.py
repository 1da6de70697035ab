"""gated_delta_rule: every implementation the backend offers against the float64 recurrent reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import TOLERANCES, rel_err
from flashlax import available_impls, gated_delta_rule
from flashlax._residuals import residual_bytes
from flashlax.fallbacks.linear import _unit_lower_inverse, gated_delta_rule_chunked, gated_delta_rule_chunked_fat
from flashlax.reference import gated_delta_rule_reference

IMPLS = available_impls("gated_delta_rule")      # recurrent, chunked, chunked_fat on CPU (+ ssd on GPU)
# On CPU the dispatcher runs "chunked" one (batch, head) slice at a time; "chunked_batched" is the same
# function with all slices batched, as the GPU runs it, so both layouts meet the reference here.
CHECKED = IMPLS + ("chunked_batched",)
GRAD_NAMES = ("q", "k", "v", "log_alpha", "beta", "initial_state")

# bf16 / f16 inputs are upcast and computed in float32; the output and every gradient are stored in
# the input dtype, so each element carries one rounding of 2^-9 (bf16) / 2^-12 (f16) relative, and the
# norm-wise error is about that: 1e-2 / 2e-3 leave a 4-5x margin over the rounding, far below what a
# wrong formula gives (O(1)).
LOW_PRECISION_TOL = {"bfloat16": 1e-2, "float16": 2e-3}


def err_vs_reference(x, ref) -> float:
    """rel_err, with the reference norm floored at 1e-30: float32 cannot hold values that small (XLA
    flushes subnormals, e.g. a gradient through exp(-92)), so there the absolute error must be tiny."""
    ref_norm = np.linalg.norm(np.asarray(ref, np.float64))
    return rel_err(x, ref) if ref_norm >= 1e-30 else rel_err(x, ref) * ref_norm / 1e-30


def make_inputs(seed, batch, heads, seq_len, dk, dv, *, dtype=np.float32, la_lo=-1.0, la_hi=0.0,
                with_beta=True, with_state=True, beta_range=(0.0, 2.0)):
    """Fresh random inputs. With beta the keys are L2-normalised (the delta rule is a contraction only
    for beta * |k|^2 <= 2, as in every gated-delta-rule model); log_alpha ~ U[la_lo, la_hi]."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seq_len, dk))
    k = rng.standard_normal((batch, heads, seq_len, dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True) if with_beta else k / np.sqrt(dk)
    v = rng.standard_normal((batch, heads, seq_len, dv))
    log_alpha = rng.uniform(la_lo, la_hi, (batch, heads, seq_len))
    beta = rng.uniform(*beta_range, (batch, heads, seq_len)) if with_beta else None
    state = rng.standard_normal((batch, heads, dk, dv)) if with_state else None
    cast = lambda x, dt: None if x is None else jnp.asarray(x, dt)  # noqa: E731
    return dict(q=cast(q, dtype), k=cast(k, dtype), v=cast(v, dtype), log_alpha=cast(log_alpha, np.float32),
                beta=cast(beta, np.float32), initial_state=cast(state, np.float32))


def run_with_grads(fn, inputs, cotangents, **kwargs):
    """(o, final_state, {name: gradient}) through a random cotangent on both outputs."""
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    do, dstate = cotangents

    def loss(*diff):
        args = dict(inputs, **dict(zip(names, diff)))
        o, state = fn(args["q"], args["k"], args["v"], args["log_alpha"], args["beta"],
                      initial_state=args["initial_state"], return_final_state=True, **kwargs)
        return (jnp.sum(o.astype(do.dtype) * do) + jnp.sum(state * dstate)), (o, state)

    grads, (o, state) = jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
        *[inputs[n] for n in names])
    return o, state, dict(zip(names, grads))


def reference(inputs, cotangents, scale=None):
    """float64 recurrent reference on the (already rounded) inputs, with gradients."""
    with jax.enable_x64():
        inputs64 = {n: None if x is None else jnp.asarray(np.asarray(x, np.float64)) for n, x in inputs.items()}
        cot64 = tuple(jnp.asarray(np.asarray(c, np.float64)) for c in cotangents)
        dk = inputs["q"].shape[-1]
        fn = functools.partial(gated_delta_rule_reference, scale=dk ** -0.5 if scale is None else scale)
        # one jitted program (eagerly, every op of the scan's derivative compiles on its own)
        o, state, grads = jax.jit(lambda inputs, cot: run_with_grads(fn, inputs, cot))(inputs64, cot64)
        return np.asarray(o), np.asarray(state), {n: np.asarray(g) for n, g in grads.items()}


def random_cotangents(inputs, seed):
    rng = np.random.default_rng(seed + 1)
    q, v = inputs["q"], inputs["v"]
    do = jnp.asarray(rng.standard_normal(v.shape), v.dtype)
    dstate = jnp.asarray(rng.standard_normal(q.shape[:2] + (q.shape[-1], v.shape[-1])), jnp.float32)
    return do, dstate


def check_against_reference(inputs, impls, tol, seed=0, chunk_size=64, scale=None):
    cot = random_cotangents(inputs, seed)
    ref_o, ref_state, ref_grads = reference(inputs, cot, scale)
    for impl in impls:
        if impl == "chunked_batched":
            dk = inputs["q"].shape[-1]
            fn = functools.partial(gated_delta_rule_chunked, chunk_size=chunk_size, sequential_heads=False,
                                   scale=dk ** -0.5 if scale is None else scale)
        else:
            fn = functools.partial(gated_delta_rule, impl=impl, chunk_size=chunk_size, scale=scale)
        o, state, grads = run_with_grads(fn, inputs, cot)
        assert o.dtype == inputs["v"].dtype and o.shape == ref_o.shape, impl
        assert state.dtype == jnp.float32 and state.shape == ref_state.shape, impl
        errs = {"o": err_vs_reference(o, ref_o), "final_state": err_vs_reference(state, ref_state)}
        for name, g in grads.items():
            assert g.dtype == inputs[name].dtype, (impl, name, g.dtype)
            errs["d" + name] = err_vs_reference(g, ref_grads[name])
        bad = {name: err for name, err in errs.items() if not err <= tol}
        if set(bad) & {"o", "final_state"}:
            # A forward value can be a sum that cancels (T = 1: o = scale (q . k) v with q . k near 0), where
            # float32 is only accurate relative to the size of its terms (found: q . k = 2.6e-5 with
            # |q| . |k| = 0.38). Measure those against max(|ref|, 1e-2 |ref on |inputs||): the second is
            # the size of the terms (no cancellation), so a wrong formula (error O(1)) still fails.
            abs_o, abs_state, _ = reference({n: None if x is None else jnp.abs(x) for n, x in inputs.items()},
                                            cot, scale)
            for name, got, ref, size in (("o", o, ref_o, abs_o), ("final_state", state, ref_state, abs_state)):
                if name in bad:
                    floor = 1e-2 * np.linalg.norm(np.asarray(size, np.float64))
                    denom = max(np.linalg.norm(np.asarray(ref, np.float64)), floor)
                    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) / denom
                    if err <= tol:
                        del bad[name]
        assert not bad, f"{impl}: relative errors above {tol}: {bad}"


# ---------------------------------------------------------------------------------------------------
# Property tests against the float64 reference
# ---------------------------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**31 - 1),
       batch=st.integers(1, 2), heads=st.integers(1, 2),
       seq_len=st.one_of(st.sampled_from([1, 15, 64, 65, 127, 200, 257]), st.integers(1, 300)),
       dk=st.sampled_from([4, 8, 16]), dv=st.sampled_from([4, 8, 24]),
       chunk_size=st.sampled_from([16, 32, 64, 128]),
       la_lo=st.sampled_from([-1e-3, -0.1, -1.0, -5.0, -100.0]),
       with_beta=st.booleans(), with_state=st.booleans())
def test_matches_float64_reference(seed, batch, heads, seq_len, dk, dv, chunk_size, la_lo, with_beta, with_state):
    inputs = make_inputs(seed, batch, heads, seq_len, dk, dv, la_lo=la_lo, with_beta=with_beta,
                         with_state=with_state)
    check_against_reference(inputs, CHECKED, TOLERANCES["float32"], seed, chunk_size)


@pytest.mark.parametrize("dtype, with_beta", [("bfloat16", True), ("float16", False)])
def test_low_precision_inputs(dtype, with_beta):
    inputs = make_inputs(31, 1, 2, 45, 8, 16, dtype=jnp.dtype(dtype), with_beta=with_beta)
    check_against_reference(inputs, CHECKED, LOW_PRECISION_TOL[dtype], seed=31, chunk_size=32)


def test_mixed_strong_and_weak_decay_keeps_float32_accuracy():
    """A -1e4 token (a reset) followed by tokens with small decay: exponents taken as differences of
    in-chunk cumulative sums would lose ~1e-3 absolute to cancellation; segment sums must not."""
    inputs = make_inputs(3, 1, 2, 80, 8, 8, la_lo=-0.02)       # the shapes of the edge cases: compiled once
    reset = np.zeros((1, 2, 80), bool)
    reset[..., [5, 40, 55, 56, 70]] = True
    inputs["log_alpha"] = jnp.where(reset, -1e4, inputs["log_alpha"])
    check_against_reference(inputs, CHECKED, TOLERANCES["float32"], seed=3, chunk_size=32)


@pytest.mark.parametrize("seed", [0, 1])
def test_strong_decay_log_alpha_gradient(seed):
    """log_alpha ~ U[-100, 0]: in-chunk decays near 0 next to O(1) diagonal terms. A log_alpha gradient
    formed as differences of row and column sums lost 1e-2..4e-2 relative here (hypothesis found it)."""
    inputs = make_inputs(seed, 1, 1, 15, 16, 4, la_lo=-100.0)
    check_against_reference(inputs, CHECKED, TOLERANCES["float32"], seed=seed, chunk_size=16)


@pytest.mark.parametrize("size", [1, 8, 13, 33, 128])
def test_unit_lower_inverse_matches_numpy(size):
    """The UT-transform inverse (closed-form 8x8 diagonal blocks, then doubling; sizes that are not powers
    of two or below the base block are padded inside) against numpy's float64 inverse, with the entries'
    scale of the delta rule (beta up to 2, unit-norm keys)."""
    rng = np.random.default_rng(size)
    a = jnp.asarray(np.tril(rng.uniform(-1.0, 1.0, (3, 2, size, size)), -1) * 2.0 / np.sqrt(size), jnp.float32)
    inverse = jax.jit(_unit_lower_inverse)          # as the impls run it: inside a jitted program
    got = np.asarray(inverse(a), np.float64)
    want = np.linalg.inv(np.eye(size) + np.asarray(a, np.float64))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    with jax.enable_x64():
        got64 = np.asarray(inverse(jnp.asarray(a, jnp.float64)))
    np.testing.assert_allclose(got64, want, atol=1e-12 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("dk", [64, 128])
def test_benchmark_shapes_compile(dk):
    """fwd+bwd of chunked (per slice and batched) and chunked_fat compile at the benchmark's shape, B2 H8
    T2048 (compile only: an XLA CPU simplifier crash in session 6 showed only at shapes like these), and
    the per-slice version's temp buffer stays below 2 inputs."""
    sds = [jax.ShapeDtypeStruct((2, 8, 2048, d), jnp.float32) for d in (dk, dk, dk)]
    sds += [jax.ShapeDtypeStruct((2, 8, 2048), jnp.float32)] * 2
    for impl, opts in (("chunked", dict(sequential_heads=True)), ("chunked", {}), ("chunked_fat", {})):
        fn = gated_delta_rule_chunked if impl == "chunked" else gated_delta_rule_chunked_fat

        def fwd_bwd(q, k, v, la, beta, do, fn=fn, opts=opts):
            out, pullback = jax.vjp(lambda *a: fn(*a, scale=0.1, **opts), q, k, v, la, beta)
            return out, pullback(do)

        compiled = jax.jit(fwd_bwd).lower(*sds, sds[2]).compile()
        if opts:
            # One (batch, head) slice at a time keeps XLA's temp small (12 / 24 MB measured in session 6);
            # 4 copies of the [B*H, 1, 1, T, d] inputs had pushed it to 45 MB, past glibc's 32 MB mmap
            # threshold, so every call page-faulted it in again.
            one_input = 2 * 8 * 2048 * dk * 4
            assert compiled.memory_analysis().temp_size_in_bytes < 2 * one_input


def test_scale_and_dk_ne_dv():
    inputs = make_inputs(4, 2, 1, 40, 16, 8)
    check_against_reference(inputs, CHECKED, TOLERANCES["float32"], seed=4, chunk_size=16, scale=0.7)


# ---------------------------------------------------------------------------------------------------
# Edge cases: extreme decays, T = 1, beta = 0 and 2 must give finite values and gradients
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["log_alpha=-1e4", "log_alpha=0", "T=1", "beta=0", "beta=2", "no_beta_strong"])
def test_edge_cases_finite(case):
    seq_len = 1 if case == "T=1" else 80
    inputs = make_inputs(7, 1, 2, seq_len, 8, 8, with_beta=case != "no_beta_strong")
    if case in ("log_alpha=-1e4", "no_beta_strong"):
        inputs["log_alpha"] = jnp.full_like(inputs["log_alpha"], -1e4)
    if case == "log_alpha=0":
        inputs["log_alpha"] = jnp.zeros_like(inputs["log_alpha"])
    if case.startswith("beta="):
        inputs["beta"] = jnp.full_like(inputs["beta"], float(case[5:]))
    cot = random_cotangents(inputs, 7)
    for impl in IMPLS:
        o, state, grads = run_with_grads(functools.partial(gated_delta_rule, impl=impl, chunk_size=32), inputs, cot)
        for name, x in [("o", o), ("state", state)] + list(grads.items()):
            assert np.all(np.isfinite(np.asarray(x, np.float64))), (impl, case, name)
    # and still right: the values are compared with the reference as well
    check_against_reference(inputs, CHECKED, TOLERANCES["float32"], seed=7, chunk_size=32)


def test_strong_decay_resets_the_state():
    """log_alpha = -1e4 forgets everything: o_t depends only on token t (a check independent of the reference)."""
    inputs = make_inputs(8, 1, 1, 40, 4, 4, with_state=True)
    inputs["log_alpha"] = jnp.full_like(inputs["log_alpha"], -1e4)
    q, k, v, beta = (np.asarray(inputs[n], np.float64) for n in ("q", "k", "v", "beta"))
    expected = 0.5 * beta[..., None] * np.sum(q * k, -1, keepdims=True) * v     # scale = 4 ** -0.5
    for impl in IMPLS:
        o = gated_delta_rule(**inputs, impl=impl, chunk_size=16)
        assert rel_err(o, expected) < 1e-6, impl


# ---------------------------------------------------------------------------------------------------
# Composition and determinism
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_grad_compose(impl):
    """vmap of jit(grad) and vmap of the forward equal the per-example results."""
    stacked = [make_inputs(s, 1, 2, 21, 4, 4) for s in (12, 13)]
    fn = functools.partial(gated_delta_rule, impl=impl, chunk_size=16)

    def loss(q, k, v, log_alpha, beta, initial_state):
        return jnp.sum(jnp.sin(fn(q, k, v, log_alpha, beta, initial_state=initial_state)))

    grad_fn = jax.grad(loss, argnums=tuple(range(6)))
    batched_args = [jnp.stack([s[n] for s in stacked]) for n in GRAD_NAMES]
    batched_grads = jax.vmap(jax.jit(grad_fn))(*batched_args)
    batched_out = jax.vmap(lambda *a: fn(*a[:5], initial_state=a[5]))(*batched_args)
    for i, single in enumerate(stacked):
        # eager grad (the jitted impl's own vjp) vs vmap(jit(grad)); eager grads are checked against
        # the reference everywhere else
        for a, c in zip(grad_fn(*[single[n] for n in GRAD_NAMES]), batched_grads):
            np.testing.assert_allclose(c[i], a, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(batched_out[i], fn(**single), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    inputs = make_inputs(21, 1, 2, 45, 8, 16)
    cot = random_cotangents(inputs, 21)
    fn = functools.partial(gated_delta_rule, impl=impl, chunk_size=32)
    first = jax.tree_util.tree_leaves(run_with_grads(fn, inputs, cot))
    second = jax.tree_util.tree_leaves(run_with_grads(fn, inputs, cot))
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_return_final_state_and_default_impl():
    inputs = make_inputs(5, 1, 1, 20, 8, 8, with_state=False)
    o = gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["log_alpha"], inputs["beta"])
    o2, state = gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["log_alpha"], inputs["beta"],
                                 return_final_state=True)
    assert o.shape == (1, 1, 20, 8) and state.shape == (1, 1, 8, 8) and state.dtype == jnp.float32
    assert np.array_equal(o, o2)
    # continuing from the final state equals running the concatenated sequence
    more = make_inputs(6, 1, 1, 20, 8, 8, with_state=False)
    o_next = gated_delta_rule(more["q"], more["k"], more["v"], more["log_alpha"], more["beta"],
                              initial_state=state)
    joined = {n: jnp.concatenate([inputs[n], more[n]], axis=2) for n in ("q", "k", "v", "log_alpha", "beta")}
    o_all = gated_delta_rule(**joined)
    np.testing.assert_allclose(np.concatenate([o, o_next], axis=2), o_all, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Residual memory: chunked saves O(inputs), chunked_fat more, recurrent O(T * dk * dv)
# ---------------------------------------------------------------------------------------------------

def test_residual_sizes():
    batch, heads, seq_len, dk, dv = 1, 2, 1024, 32, 32
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (f32(batch, heads, seq_len, dk), f32(batch, heads, seq_len, dk), f32(batch, heads, seq_len, dv),
            f32(batch, heads, seq_len), f32(batch, heads, seq_len), f32(batch, heads, dk, dv))
    input_bytes = sum(int(np.prod(a.shape)) * 4 for a in args)

    def measure(impl):
        fn = lambda q, k, v, la, b, s: gated_delta_rule(q, k, v, la, b, initial_state=s, impl=impl)  # noqa: E731
        return residual_bytes(fn, *args, include_args=True)

    chunked, chunked_shapes = measure("chunked")
    fat, _ = measure("chunked_fat")
    recurrent, _ = measure("recurrent")
    assert chunked <= input_bytes, (chunked, input_bytes, chunked_shapes)     # only the inputs
    assert fat > 2 * chunked                                                   # per-chunk states and more
    assert recurrent >= seq_len * batch * heads * dk * dv * 4                  # a state per token
    # excluding the arguments themselves, chunked keeps nothing
    assert residual_bytes(lambda *a: gated_delta_rule(*a[:5], initial_state=a[5], impl="chunked"), *args)[0] == 0
    for by_slice in (False, True):      # both layouts of chunked (the dispatcher picks by backend)
        batched = lambda *a, s=by_slice: gated_delta_rule_chunked(*a[:5], initial_state=a[5], scale=0.2,  # noqa: E731
                                                                  sequential_heads=s)
        assert residual_bytes(batched, *args)[0] == 0


# ---------------------------------------------------------------------------------------------------
# Validation and dispatch errors
# ---------------------------------------------------------------------------------------------------

def _good():
    return make_inputs(0, 1, 2, 10, 8, 4, with_state=False)


@pytest.mark.parametrize("change, match", [
    (dict(k=jnp.ones((1, 2, 10, 6))), r"q and k .*k \(1, 2, 10, 6\)"),
    (dict(v=jnp.ones((1, 2, 9, 4))), r"v must be .*v \(1, 2, 9, 4\)"),
    (dict(q=jnp.ones((2, 10, 8))), r"q must be \[B, H, T, d\].*q \(2, 10, 8\)"),
    (dict(log_alpha=jnp.ones((1, 2, 11))), r"log_alpha must be \[B, H, T\].*log_alpha \(1, 2, 11\)"),
    (dict(beta=jnp.ones((1, 2, 10, 1))), r"beta must be .*beta \(1, 2, 10, 1\)"),
    (dict(initial_state=jnp.ones((1, 2, 4, 8))), r"initial_state must be .*\(1, 2, 8, 4\).*\(1, 2, 4, 8\)"),
    (dict(q=jnp.ones((1, 2, 10, 8), jnp.int32)), r"q must be floating"),
    (dict(log_alpha=jnp.ones((1, 2, 10), jnp.int32)), r"log_alpha must be floating"),
    (dict(q=jnp.ones((1, 2, 10, 8), jnp.bfloat16)), r"one dtype"),
    (dict(chunk_size=48), r"chunk_size .* 48"),
    (dict(chunk_size=8), r"chunk_size .* 8"),
    (dict(chunk_size=256), r"chunk_size .* 256"),
    (dict(chunk_size=64.0), r"chunk_size"),
])
def test_validation_errors(change, match):
    kwargs = dict(_good(), **change)
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(**kwargs)


def test_validation_happens_before_tracing():
    inputs = _good()
    with pytest.raises(ValueError, match="log_alpha"):
        jax.jit(lambda q: gated_delta_rule(q, inputs["k"], inputs["v"], inputs["log_alpha"][..., :5]))(inputs["q"])


def test_unknown_impl_and_ssd_on_cpu():
    with pytest.raises(ValueError, match="unknown impl 'fast'.*recurrent.*chunked.*chunked_fat.*ssd"):
        gated_delta_rule(**_good(), impl="fast")
    if jax.default_backend() == "cpu":
        with pytest.raises(RuntimeError, match=r"^ssd requires an accelerator backend\.$"):
            gated_delta_rule(**_good(), impl="ssd")
