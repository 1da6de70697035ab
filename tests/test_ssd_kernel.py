"""The ssd Pallas kernels of gated_delta_rule: interpreted on CPU against the float64 recurrence (outputs,
final state, every gradient), the shipped configs' shared memory, and (``gpu`` marker) real sizes on a GPU.

Interpreted cases are few and small: each distinct shape compiles the interpreter's program once (3-10 s on
the 2-core CI box); the larger sweep is marked ``slow``.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import TOLERANCES, on_gpu, rel_err
from flashlax import dispatch, gated_delta_rule
from flashlax.kernels import configs
from flashlax.kernels.configs import SSDConfig, check_ssd_config, ssd_config, ssd_smem_bytes
from flashlax.kernels import ssd as ssd_module
from flashlax.kernels.ssd import gated_delta_rule_ssd
from test_linear import err_vs_reference, make_inputs, random_cotangents, reference, run_with_grads

INTERPRET = not on_gpu()
LOW_PRECISION_TOL = {"bfloat16": 1e-2, "float16": 2e-3}     # as tests/test_linear.py (interpreted: f32 math)


@functools.lru_cache(maxsize=None)
def ssd(chunk_size, **kw):
    """The kernel entry (interpreted on CPU) with the Pallas backward unless ``backward`` is given, scale
    dk^-1/2 unless given. Cached, so tests that share shapes share the compiled programs (see
    :func:`errors`). The front end (impl="ssd", backward "auto") is tested in test_front_end_default."""
    kw.setdefault("backward", "pallas")

    def fn(q, k, v, log_alpha, beta=None, **call_kw):
        return gated_delta_rule_ssd(q, k, v, log_alpha, beta, **{"scale": q.shape[-1] ** -0.5, **kw, **call_kw},
                                    chunk_size=chunk_size, interpret=INTERPRET)

    return fn


@functools.lru_cache(maxsize=None)
def _jitted_grads(fn, names):
    def run(inputs, cotangents):
        return run_with_grads(fn, dict(zip(names, inputs)), cotangents)

    return jax.jit(run)


def errors(fn, inputs, seed=0, scale=None):
    """Relative errors of o, the final state and every gradient against the float64 recurrence (one jit of
    the forward and backward per kernel variant: the interpreter compiles each shape once)."""
    cot = random_cotangents(inputs, seed)
    names = tuple(inputs)
    o, state, grads = _jitted_grads(fn, names)(tuple(inputs[n] for n in names), cot)
    ref_o, ref_state, ref_grads = reference(inputs, cot, scale)
    assert o.dtype == inputs["v"].dtype and state.dtype == jnp.float32
    errs = {"o": err_vs_reference(o, ref_o), "final_state": err_vs_reference(state, ref_state)}
    for name, g in grads.items():
        assert g.dtype == inputs[name].dtype, (name, g.dtype)
        errs["d" + name] = err_vs_reference(g, ref_grads[name])
    return errs


def assert_close(errs, tol):
    bad = {name: err for name, err in errs.items() if not err <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"


# ---------------------------------------------------------------------------------------------------
# Interpreted against the float64 recurrence
# ---------------------------------------------------------------------------------------------------

# (T, dk, dv, chunk, beta, initial state, log_alpha low end): odd T (partial last chunk), T a multiple of
# the chunk (the unmasked path), T shorter than one chunk, dk != dv and head dims below 16 / not powers of
# two, every chunk size, strong decays.
CASES = [
    (77, 8, 24, 32, True, True, -1.0),
    (77, 8, 24, 32, False, False, -1.0),
    (64, 16, 16, 16, True, False, -5.0),
    (5, 16, 16, 16, False, True, -1.0),
    (130, 32, 16, 64, True, True, -100.0),
    (100, 16, 16, 64, False, True, -1.0),
    (40, 16, 32, 128, True, True, -1.0),
]


@pytest.mark.parametrize("seq_len, dk, dv, chunk, with_beta, with_state, la_lo", CASES)
def test_matches_float64_reference(seq_len, dk, dv, chunk, with_beta, with_state, la_lo):
    inputs = make_inputs(seq_len, 1, 2, seq_len, dk, dv, la_lo=la_lo, with_beta=with_beta, with_state=with_state)
    # chunks 64 and 128 with the H200's configs (64-row sub-blocks in the output and gradient kernels;
    # the CPU/RTX 3090 configs cap the chunk at 64); the interpreter computes float32 products in IEEE
    fn = ssd(chunk, scale=dk ** -0.5, device_kind="NVIDIA H200") if chunk >= 64 else ssd(chunk)
    assert_close(errors(fn, inputs, seed=seq_len), TOLERANCES["float32"])


@pytest.mark.parametrize("with_beta", [True, False])
def test_transition_form(with_beta):
    """The other form of the sequential passes (S <- M_n S + H_n, adjoint <- M_n^T adj + R_n, D and dD formed
    in the parallel kernels), with 32-row sub-blocks in the output and gradient kernels."""
    inputs = make_inputs(9, 1, 2, 77, 8, 24, with_beta=with_beta, with_state=with_beta)
    cfg = dataclasses.replace(ssd_config(8, 24, jnp.float32, "cpu"), transition=True, block=32)
    assert_close(errors(ssd(32, scale=8 ** -0.5, config=cfg), inputs, seed=9), TOLERANCES["float32"])


@pytest.mark.parametrize("transition", ["without_beta", "h200"])
def test_transition_without_beta_selects_the_form(transition):
    """transition="without_beta": the transition form without beta, the two-product form with beta; and the
    H200 float32 dk 64 entry as shipped (the transition form both ways, M and H from their own kernel with
    beta). 64-row sub-blocks against the float64 recurrence both ways."""
    cfg = ssd_config(64, 64, jnp.float32, "NVIDIA H200")
    assert cfg.transition is True and cfg.mh_kernel
    if transition == "without_beta":
        cfg = dataclasses.replace(cfg, transition="without_beta")
    for with_beta, form in ((True, transition == "h200"), (False, True)):
        inputs = make_inputs(19, 1, 2, 90, 16, 16, with_beta=with_beta)
        st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=1.0,
                                    chunk_size=64, interpret=True, config=cfg, device_kind="NVIDIA H200")
        assert st.transition is form
        assert_close(errors(ssd(64, config=cfg), inputs, seed=19), TOLERANCES["float32"])
    with pytest.raises(ValueError, match="transition"):
        SSDConfig(transition="sometimes")


@pytest.mark.parametrize("sb", [16, 64])
def test_decay_segment_sums_keep_float32_accuracy(sb):
    """The in-block segment sums sum_{s < r <= t} la_r (cumulative sums down the masked columns) and the
    exclusive row prefix sums of log_alpha's gradient, against float64, on decays mixing -1e4 and -1e-3
    inside one block: each entry sums only its own segment, so the weak decays after a strong one keep
    float32 relative accuracy (a difference of prefix sums would lose ~1e-3 absolute there)."""
    from flashlax.kernels._ssd_tiles import Decays
    rng = np.random.default_rng(sb)
    la = np.where(rng.random(sb) < 0.2, -1e4, -rng.uniform(1e-3, 2e-3, sb)).astype(np.float32)
    x = rng.standard_normal((sb, sb)).astype(np.float32)
    dec = Decays([jnp.asarray(la)], sb)
    seg = np.asarray(dec.diag_seg(0))
    la64 = la.astype(np.float64)
    want = np.array([[la64[s + 1:t + 1].sum() if t > s else 0.0 for s in range(sb)] for t in range(sb)])
    assert np.all(seg[np.triu_indices(sb)] == 0.0)
    low = np.tril_indices(sb, -1)
    assert np.max(np.abs(seg[low] - want[low]) / np.abs(want[low])) < 1e-6
    pre = np.asarray(dec.prefix_before(jnp.asarray(x)))
    want_pre = np.cumsum(x.astype(np.float64), axis=1) - x
    assert np.max(np.abs(pre - want_pre)) < 1e-5 * np.max(np.abs(want_pre))


@pytest.mark.parametrize("case", ["log_alpha=-1e4", "log_alpha=0", "resets"])
def test_extreme_decays(case):
    """-1e4 everywhere (every step forgets), 0 everywhere (no decay: exp(0) = 1, no 0 * inf), and -1e4 resets
    among weak decays (exponents taken as differences of prefix sums would lose ~1e-3 after a reset).
    Shapes of the first two CASES, so the interpreter's programs are compiled once."""
    for with_beta in (True, False):
        inputs = make_inputs(3, 1, 2, 77, 8, 24, la_lo=-0.02, with_beta=with_beta, with_state=with_beta)
        if case == "log_alpha=-1e4":
            inputs["log_alpha"] = jnp.full_like(inputs["log_alpha"], -1e4)
        elif case == "log_alpha=0":
            inputs["log_alpha"] = jnp.zeros_like(inputs["log_alpha"])
        else:
            reset = np.zeros((1, 2, 77), bool)
            reset[..., [5, 31, 32, 40, 70]] = True
            inputs["log_alpha"] = jnp.where(reset, -1e4, inputs["log_alpha"])
        assert_close(errors(ssd(32), inputs, seed=3), TOLERANCES["float32"])


@pytest.mark.parametrize("with_beta, x64", [(True, False), (False, False), (True, True)])
def test_front_end_default(with_beta, x64):
    """impl="ssd" through gated_delta_rule: backward "auto" is the chunked XLA backward with beta and a head
    dim over 128, the Pallas backward otherwise (the faster on the H200); both against the float64
    recurrence, with jax_enable_x64 on too. The first CASES' shapes (dv 24 and, for the XLA backward, 136)."""
    dv = 136 if with_beta and x64 else 24
    inputs = make_inputs(77, 1, 2, 77, 8, dv, with_beta=with_beta, with_state=with_beta)
    static = lambda dtype, dv=dv: ssd_module.make_static(  # noqa: E731
        *(inputs[n][..., :dv].astype(dtype) for n in "qkv"), inputs.get("beta"), scale=1.0, chunk_size=32,
        interpret=True, config=None, device_kind=None)
    for dtype in (jnp.float32, jnp.bfloat16):
        assert static(dtype).backward == ("xla" if with_beta and dv > 128 else "pallas")
        assert static(dtype, 128).backward == "pallas"
    front = functools.partial(gated_delta_rule, impl="ssd", chunk_size=32, interpret=INTERPRET)
    with jax.enable_x64(x64):
        errs = errors(front, inputs, seed=77)
    assert_close(errs, TOLERANCES["float32"])


def test_backward_option_validated():
    inputs = make_inputs(0, 1, 1, 8, 4, 4)
    with pytest.raises(ValueError, match="backward must be"):
        gated_delta_rule_ssd(inputs["q"], inputs["k"], inputs["v"], inputs["log_alpha"], scale=1.0,
                             interpret=True, backward="triton")


def test_scale_beta_range_and_x64():
    """scale != dk^-1/2, beta over [0, 2], with jax_enable_x64 on (indices stay int32 inside the kernels;
    the inputs are float32 as the kernels require)."""
    inputs = make_inputs(4, 2, 1, 40, 16, 8, beta_range=(0.0, 2.0))
    with jax.enable_x64():
        errs = errors(ssd(16, scale=0.7), inputs, seed=4, scale=0.7)
    assert_close(errs, TOLERANCES["float32"])


@pytest.mark.parametrize("dtype, with_beta, backward", [("bfloat16", True, "pallas"), ("float16", False, "pallas"),
                                                         ("bfloat16", True, "xla")])
def test_low_precision_inputs(dtype, with_beta, backward):
    """16-bit inputs against the float64 recurrence, with either backward (backward "auto" takes the XLA one
    for 16-bit inputs too, with beta over head dim 128)."""
    inputs = make_inputs(31, 1, 2, 45, 8, 16, dtype=jnp.dtype(dtype), with_beta=with_beta)
    assert_close(errors(ssd(32, backward=backward), inputs, seed=31), LOW_PRECISION_TOL[dtype])


def deterministic_results(fn, inputs, seed):
    """Output, final state and gradients of two identical calls, asserted bit-identical; returns them."""
    cot = random_cotangents(inputs, seed)
    names = tuple(inputs)
    run = _jitted_grads(fn, names)
    first = jax.tree_util.tree_leaves(run(tuple(inputs[n] for n in names), cot))
    second = jax.tree_util.tree_leaves(run(tuple(inputs[n] for n in names), cot))
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    return first, cot


def test_deterministic_and_jit_vmap():
    inputs = make_inputs(21, 1, 2, 77, 8, 24)          # the first CASE's shapes (compiled once)
    deterministic_results(ssd(32), inputs, 21)
    # vmap over an extra leading axis under jit: the same as the unbatched calls
    names = ("q", "k", "v", "log_alpha", "beta", "initial_state")
    stacked = [jnp.stack([inputs[n], inputs[n][:, ::-1]]) for n in names]
    fn = ssd(32)
    out = jax.jit(jax.vmap(lambda q, k, v, la, b, s: fn(q, k, v, la, b, initial_state=s)))(*stacked)
    np.testing.assert_allclose(out[0], fn(**inputs), rtol=1e-6, atol=1e-6)
    flipped = {n: inputs[n][:, ::-1] for n in names}
    np.testing.assert_allclose(out[1], fn(**flipped), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), seq_len=st.integers(1, 200), dk=st.sampled_from([4, 16, 40]),
       dv=st.sampled_from([8, 16, 33]), chunk=st.sampled_from([16, 32, 64]),
       la_lo=st.sampled_from([-1e-3, -1.0, -100.0]), with_beta=st.booleans(), with_state=st.booleans())
def test_matches_float64_reference_sweep(seed, seq_len, dk, dv, chunk, la_lo, with_beta, with_state):
    inputs = make_inputs(seed, 1, 2, seq_len, dk, dv, la_lo=la_lo, with_beta=with_beta, with_state=with_state)
    assert_close(errors(ssd(chunk), inputs, seed=seed % 1000), TOLERANCES["float32"])


# ---------------------------------------------------------------------------------------------------
# Dispatch, configs
# ---------------------------------------------------------------------------------------------------

def test_without_beta_overrides():
    """SSDConfig.without_beta: the shipped H200 float32 dk 64 entry runs 32 dv columns per step without beta
    and its own 64 with beta; both against the float64 recurrence at dk = dv = 64 (without beta two dv steps in
    every chunk kernel), with an initial state and a partial last chunk."""
    cfg = ssd_config(64, 64, jnp.float32, "NVIDIA H200")
    assert cfg.block_v == 64 and dict(cfg.without_beta)["block_v"] == 32
    for with_beta, block_v in ((True, 64), (False, 32)):
        inputs = make_inputs(23, 1, 2, 100, 64, 64, with_beta=with_beta, with_state=True)
        st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=0.125,
                                    chunk_size=64, interpret=True, config=None, device_kind="NVIDIA H200")
        assert st.config.block_v == block_v and st.block_v() == block_v
        assert st.config == (cfg if with_beta else dataclasses.replace(cfg, block_v=32, store_p=False, without_beta=()))
    for with_beta in (False, True):   # with beta: the entry as shipped (stored P and k k^T G, paired wy products)
        inputs = make_inputs(23, 1, 2, 100, 64, 64, with_beta=with_beta, with_state=True)
        assert_close(errors(ssd(64, config=cfg), inputs, seed=23), TOLERANCES["float32"])
    assert cfg.resolved(True) is cfg and SSDConfig().resolved(False) == SSDConfig()


def test_dispatch_entry():
    entry = dispatch.TABLE["gated_delta_rule"]["ssd"]
    assert entry.kind == "pallas" and entry.target.endswith("ssd:gated_delta_rule_ssd")
    if not on_gpu():
        with pytest.raises(RuntimeError, match=r"^ssd requires an accelerator backend\.$"):
            gated_delta_rule(**make_inputs(0, 1, 1, 8, 4, 4), impl="ssd")


@pytest.mark.parametrize("family, kind", [("rtx3090", "NVIDIA GeForce RTX 3090"), ("h200", "NVIDIA H200")])
def test_shipped_configs_fit_shared_memory(family, kind):
    """Every shipped config fits its device's shared memory (99 KB per block on the RTX 3090) at every chunk
    size and the largest head dims of its entry, by the static estimate."""
    for (max_d, cls), cfg in configs.SSD_CONFIGS[family].items():
        dtype = jnp.float32 if cls == "32" else jnp.bfloat16
        assert ssd_config(max_d, max_d, dtype, kind) is cfg
        for form in (cfg, cfg.resolved(False)):        # with beta, and with the without_beta overrides
            for chunk in (16, 32, 64, 128):
                check_ssd_config(form, max_d, max_d, chunk, dtype, kind)
                assert ssd_smem_bytes(form, max_d, max_d, chunk, dtype) <= configs.smem_limit(kind)
    with pytest.raises(ValueError, match="shared memory"):
        check_ssd_config(SSDConfig(state_block_v=128, state_stages=4), 256, 256, 128, jnp.float32, kind)


def test_config_validation():
    with pytest.raises(ValueError, match="block"):
        SSDConfig(block=24)
    with pytest.raises(ValueError, match="f32_dot"):
        SSDConfig(f32_dot="tf32")
    with pytest.raises(ValueError, match="small_f32_dot"):
        SSDConfig(small_f32_dot="yes")
    for bad in ((("wy", 3),), (("ut", 8),), ("wy", 8)):
        with pytest.raises(ValueError, match="warps"):
            SSDConfig(warps=bad)
    with pytest.raises(ValueError, match="256"):
        ssd_config(512, 64, jnp.float32, "NVIDIA H200")
    for bad in ((("wy", 24),), (("state", 16),), ("wy", 16), (("wy", 8),)):
        with pytest.raises(ValueError, match="blocks"):
            SSDConfig(blocks=bad)
    with pytest.raises(ValueError, match="dqk_block_k"):
        SSDConfig(dqk_block_k=48)
    with pytest.raises(ValueError, match="reverse_rinc"):
        SSDConfig(reverse_rinc=1)
    for bad in ((("nope", 32),), (("without_beta", ()),), ("block_v", 32), [("block_v", 32)]):
        with pytest.raises(ValueError, match="without_beta"):
            SSDConfig(without_beta=bad)
    with pytest.raises(ValueError, match="block_v"):       # the overridden config is checked too
        SSDConfig(without_beta=(("block_v", 24),))
    with pytest.raises(ValueError, match="mh_kernel"):
        SSDConfig(mh_kernel="yes")
    with pytest.raises(ValueError, match="kdec"):
        SSDConfig(kdec=1)
    with pytest.raises(ValueError, match="store_p"):
        SSDConfig(store_p="yes")
    with pytest.raises(ValueError, match="store_kg"):
        SSDConfig(store_kg=1)


@pytest.mark.parametrize("with_beta, transition, rinc, mh", [(True, False, False, False), (True, False, True, False),
                                                           (True, True, False, True), (False, True, False, True)])
def test_per_kernel_blocks_match(with_beta, transition, rinc, mh):
    """SSDConfig.blocks and dqk_block_k: each chunk kernel cut into its own sub-blocks (the wy kernel reads T
    by [16, 16] tiles while the output and dqk kernels work on one [64, 64] tile, dout on [32, 32] ones) and
    the dqk kernel doing dk in two passes of 16 columns (D read per pass in the two-product form, formed
    again per pass as u - w S in the transition form with beta; dD formed in each pass and stored in the
    first in the transition form); with ``reverse_rinc`` the two-product form's reverse pass takes the
    adjoint-independent part of each step from the dout kernel; with ``mh_kernel`` the transition form's M and
    H come from their own kernel (a no-op without beta). Outputs and every gradient still match the float64
    recurrence, with a partial last chunk and an initial state."""
    cfg = dataclasses.replace(ssd_config(64, 64, jnp.float32, "NVIDIA H200"), f32_dot="ieee",
                              blocks=(("wy", 16), ("dout", 32)), dqk_block_k=16, transition=transition,
                              reverse_rinc=rinc, mh_kernel=mh)
    inputs = make_inputs(31, 1, 2, 160, 32, 16, la_lo=-0.1, with_beta=with_beta, with_state=True)
    assert_close(errors(ssd(64, config=cfg), inputs, seed=31), TOLERANCES["float32"])


@pytest.mark.parametrize("with_beta, rinc, dtype", [(True, False, "float32"), (True, True, "float32"),
                                                    (False, False, "float32"), (True, False, "bfloat16")])
def test_stored_kdec_matches(with_beta, rinc, dtype):
    """SSDConfig.kdec: the precompute stores k decayed to its chunk's end and the sequential passes (the
    forward's state pass, the backward's recomputation of it and its reverse pass, with and without
    reverse_rinc) read it instead of k and the decay vectors. A partial last chunk, dk not a power of two,
    strong decays and an initial state; without beta it is a no-op (there is no precompute), checked against
    the same reference. bfloat16 (as the H200's bf16 dk128 entry ships it): k_dec stored in bfloat16."""
    cfg = dataclasses.replace(ssd_config(24, 16, jnp.dtype(dtype), "cpu"), kdec=True, transition=False,
                              reverse_rinc=rinc)
    fn = ssd(32, scale=24 ** -0.5, config=cfg)
    inputs = make_inputs(13, 1, 2, 77, 24, 16, dtype=jnp.dtype(dtype), la_lo=-30.0, with_beta=with_beta,
                         with_state=True)
    st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=1.0,
                                chunk_size=32, interpret=True, config=cfg, device_kind="cpu")
    la = inputs["log_alpha"].astype(jnp.float32)
    pre = ssd_module.precompute_call(st, inputs["k"], inputs["v"], la, inputs.get("beta"))
    assert ("kdec" in pre) == with_beta
    if with_beta:    # what was stored: each key times exp(sum of log_alpha after it to its chunk's end)
        la64 = np.asarray(la, np.float64).reshape(1, 2, -1)
        pad = (-la64.shape[-1]) % 32
        blocks = np.pad(la64, ((0, 0), (0, 0), (0, pad))).reshape(1, 2, -1, 32)
        suffix = np.cumsum(blocks[..., ::-1], -1)[..., ::-1] - blocks        # sum over r > s inside the chunk
        want = np.exp(suffix).reshape(1, 2, -1)[..., :77, None] * np.asarray(inputs["k"], np.float64)
        got = np.asarray(pre["kdec"].astype(jnp.float32), np.float64)[..., :77, :24]
        assert pre["kdec"].dtype == inputs["k"].dtype
        assert rel_err(got, want) < (1e-5 if dtype == "float32" else 8e-3)
    assert_close(errors(fn, inputs, seed=13), TOLERANCES["float32"] if dtype == "float32" else LOW_PRECISION_TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ut_substitution_matches(dtype):
    """SSDConfig.ut_subst: the forward's precompute solves for w and u by block forward substitution over
    T's 16 x 16 diagonal blocks instead of forming T below the diagonal. Chunks of 64 (four sub-blocks, the
    longest chain), a partial last chunk, beta up to 2, an initial state: w and u equal the
    full-T precompute's (float32: 1e-5; bfloat16: within its rounding), and the op's output, final state and
    every gradient match the float64 recurrence, in bfloat16 no worse than twice the full-T path's error. Weak
    decays, so the blocks below the diagonal of A matter."""
    base = dataclasses.replace(ssd_config(24, 16, jnp.dtype(dtype), "cpu"), kdec=True, transition=False)
    cfg = dataclasses.replace(base, ut_subst=True)
    inputs = make_inputs(17, 1, 2, 150, 24, 16, dtype=jnp.dtype(dtype), la_lo=-0.2, with_state=True,
                         beta_range=(0.0, 2.0))
    la = inputs["log_alpha"].astype(jnp.float32)
    pre = {}
    for name, c in (("full", base), ("subst", cfg)):
        st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], scale=1.0,
                                    chunk_size=64, interpret=True, config=c, device_kind="cpu")
        pre[name] = ssd_module.precompute_call(st, inputs["k"], inputs["v"], la, inputs["beta"])
    for key in ("w", "u"):
        got, want = (np.asarray(pre[n][key].astype(jnp.float32), np.float64)[..., :150, :] for n in ("subst", "full"))
        assert np.all(np.isfinite(got))
        assert rel_err(got, want) < (1e-5 if dtype == "float32" else 1e-2), key
    errs = errors(ssd(64, scale=24 ** -0.5, config=cfg), inputs, seed=17)
    if dtype == "float32":
        assert_close(errs, TOLERANCES["float32"])
        with jax.enable_x64():     # index arithmetic and the float32 kernels under x64
            assert_close(errors(ssd(64, scale=24 ** -0.5, config=cfg), inputs, seed=17), TOLERANCES["float32"])
    else:
        ref = errors(ssd(64, scale=24 ** -0.5, config=base), inputs, seed=17)
        assert_close(errs, LOW_PRECISION_TOL[dtype])
        assert errs["o"] <= 2 * ref["o"] + 1e-4, (errs, ref)


@pytest.mark.parametrize("dtype, with_beta, kdec", [("float32", True, True), ("bfloat16", True, True),
                                                     ("float32", False, False)])
def test_fused_output_matches(dtype, with_beta, kdec):
    """SSDConfig.fuse_out: the forward's state pass forms the output itself (no chunk states, no D, no output
    kernel). dk != dv over several dv blocks of the state pass, a partial last chunk, an initial state: the
    output and final state equal the unfused forward's (the same products on the same rounded operands), and
    the op (output, final state, every gradient) matches the float64 recurrence."""
    base = dataclasses.replace(ssd_config(24, 40, jnp.dtype(dtype), "cpu"), kdec=kdec, transition=False,
                               state_block_v=16, block=64)
    cfg = dataclasses.replace(base, fuse_out=True)
    inputs = make_inputs(23, 1, 2, 150, 24, 40, dtype=jnp.dtype(dtype), la_lo=-0.5, with_state=True,
                         with_beta=with_beta)
    args = [inputs[n] for n in ("q", "k", "v", "log_alpha")] + [inputs.get("beta")]
    outs = {}
    for name, c in (("unfused", base), ("fused", cfg)):
        st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=24 ** -0.5,
                                    chunk_size=64, interpret=True, config=c, device_kind="cpu")
        assert ssd_module.fuses_output(st) == (name == "fused")
        q, k, v, la, beta = args
        outs[name] = ssd_module.forward(st, q, k, v, la.astype(jnp.float32),
                                        None if beta is None else beta.astype(jnp.float32),
                                        inputs["initial_state"].astype(jnp.float32))
    for got, want in zip(outs["fused"], outs["unfused"]):
        got, want = np.asarray(got.astype(jnp.float32), np.float64), np.asarray(want.astype(jnp.float32), np.float64)
        assert got.shape == want.shape and np.all(np.isfinite(got))
        assert rel_err(got, want) < 1e-6     # the interpreter gives 0.0: the same operations in the same order
    tol = TOLERANCES["float32"] if dtype == "float32" else LOW_PRECISION_TOL[dtype]
    assert_close(errors(ssd(64, scale=24 ** -0.5, config=cfg), inputs, seed=23), tol)
    # chunks over FUSE_OUT_MAX_CHUNK run unfused (the same function; P [C, C] would not fit)
    big = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=1.0,
                                 chunk_size=128, interpret=True, config=dataclasses.replace(cfg, max_chunk=128),
                                 device_kind="cpu")
    assert big.chunk == 128 and not ssd_module.fuses_output(big)


def _chunk_decay_matrix(la, chunk, strict=False):
    """float64 [B, H, T, C]: row t's decay from each column token of its chunk, exp(sum_{s < r <= t} la_r), 0
    where not causal (and on the diagonal when ``strict``); a numpy model of the kernels' G."""
    b, h, t = la.shape
    n = -(-t // chunk)
    blocks = np.pad(np.asarray(la, np.float64), ((0, 0), (0, 0), (0, n * chunk - t))).reshape(b, h, n, chunk)
    c = np.cumsum(blocks, -1)
    seg = c[..., :, None] - c[..., None, :]                 # [.., t, s] = sum_{s < r <= t}
    keep = np.tril(np.ones((chunk, chunk), bool), -1 if strict else 0)
    g = np.where(keep, np.exp(np.where(keep, seg, 0.0)), 0.0)
    return g.reshape(b, h, n * chunk, chunk)[:, :, :t]


def _chunk_gram(x, y, chunk):
    """float64 [B, H, T, C]: row t holds x_t . y_s for the tokens s of t's chunk."""
    b, h, t, _ = x.shape
    n = -(-t // chunk)
    pad = ((0, 0), (0, 0), (0, n * chunk - t), (0, 0))
    xb = np.pad(np.asarray(x, np.float64), pad).reshape(b, h, n, chunk, -1)
    yb = np.pad(np.asarray(y, np.float64), pad).reshape(b, h, n, chunk, -1)
    return np.einsum("bhnid,bhnjd->bhnij", xb, yb).reshape(b, h, n * chunk, chunk)[:, :, :t]


@pytest.mark.parametrize("with_beta, transition, dtype", [(True, True, "float32"), (True, False, "float32"),
                                                           (False, True, "float32"), (True, True, "bfloat16")])
def test_stored_p_and_kg_match(with_beta, transition, dtype):
    """SSDConfig.store_p / store_kg: the dout kernel stores P = scale (q k^T * G) and the dqk kernel takes
    log_alpha's gradient through P from it (dP * P) instead of forming q k^T; the backward's precompute stores
    k k^T * G_strict and the wy kernel reads it instead of forming k k^T. Sub-blocks differ between the
    writer and the reader (dout on 32-row blocks, dqk on one 64-row tile; the precompute's 16 x 16 UT blocks,
    wy on 32-row ones), a partial last chunk, an initial state, dk != dv. What is stored matches a float64
    model, the gradients match the config without the options (the same products, one fewer) and the float64
    recurrence."""
    base = dataclasses.replace(ssd_config(24, 16, jnp.dtype(dtype), "cpu"), transition=transition, block=64,
                               blocks=(("dout", 32), ("wy", 32)))
    cfg = dataclasses.replace(base, store_p=True, store_kg=True)
    inputs = make_inputs(29, 1, 2, 150, 24, 16, dtype=jnp.dtype(dtype), la_lo=-0.3, with_beta=with_beta,
                         with_state=True)
    scale = 24 ** -0.5
    st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=scale,
                                chunk_size=64, interpret=True, config=cfg, device_kind="cpu")
    la = inputs["log_alpha"].astype(jnp.float32)
    beta = inputs.get("beta")
    do = jnp.asarray(np.random.default_rng(3).standard_normal(inputs["v"].shape), inputs["v"].dtype)
    from flashlax.kernels import ssd_bwd
    pre = ssd_module.precompute_call(st, inputs["k"], inputs["v"], la, beta, emit_t=True)
    dout = ssd_bwd.dout_call(st, inputs["q"], inputs["k"], la, do, pre)
    q64, k64 = (np.asarray(inputs[n].astype(jnp.float32), np.float64) for n in ("q", "k"))
    want_p = scale * _chunk_gram(q64, k64, 64) * _chunk_decay_matrix(la, 64)
    low = dtype != "float32"
    assert dout["p"].dtype == jnp.float32 and dout["p"].shape == (1, 2, 150, 64)
    assert rel_err(np.asarray(dout["p"], np.float64), want_p) < (1e-2 if low else 1e-5)
    assert ("kg" in pre) == with_beta
    if with_beta:
        want_kg = _chunk_gram(k64, k64, 64) * _chunk_decay_matrix(la, 64, strict=True)
        assert pre["kg"].dtype == jnp.float32
        assert rel_err(np.asarray(pre["kg"], np.float64), want_kg) < (1e-2 if low else 1e-5)
    tol = TOLERANCES["float32"] if dtype == "float32" else LOW_PRECISION_TOL[dtype]
    got = errors(ssd(64, scale=scale, config=cfg), inputs, seed=29)
    assert_close(got, tol)
    if dtype == "float32":
        ref = errors(ssd(64, scale=scale, config=base), inputs, seed=29)
        assert all(got[n] <= 2 * ref[n] + 1e-6 for n in ref), (got, ref)


def _h200_backward_lowered(cfg) -> str:
    """The float32 dk 64 backward with beta (Pallas backward, ``cfg``) lowered through Pallas' Triton lowering
    for an abstract H200: its StableHLO text."""
    def loss(q, k, v, la, beta):
        return jnp.sum(gated_delta_rule_ssd(q, k, v, la, beta, scale=0.125, config=cfg, device_kind="NVIDIA H200",
                                            backward="pallas"))

    x = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.float32)
    g = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(x, x, x, g, g).lower(
            lowering_platforms=("cuda",)).as_text()


def test_wy_pack_matches_and_lowers():
    """SSDConfig.wy_pack: the wy kernel pairs dw with du and w with u column by column (Triton join / split), so
    T^T [dw | du] and [d_bgk | d_bv] [w | u]^T are one product per sub-block pair each. dk == dv (24, padded to
    32: one width) on 16-row sub-blocks with store_kg, a partial last chunk and an initial state: every
    gradient matches the float64 recurrence and the unpacked kernel; dk != dv falls back to the unpacked
    products (the same function); the backward lowers through Pallas' Triton lowering for an H200 at dk 64."""
    from flashlax.kernels import ssd_bwd
    base = dataclasses.replace(ssd_config(24, 24, jnp.float32, "cpu"), transition=True, block=64,
                               blocks=(("wy", 16),), store_kg=True)
    cfg = dataclasses.replace(base, wy_pack=True)
    inputs = make_inputs(37, 1, 2, 150, 24, 24, la_lo=-0.3, with_state=True)
    st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], scale=1.0, chunk_size=64,
                                interpret=True, config=cfg, device_kind="cpu")
    assert ssd_bwd.wy_packs(st)
    got = errors(ssd(64, scale=24 ** -0.5, config=cfg), inputs, seed=37)
    ref = errors(ssd(64, scale=24 ** -0.5, config=base), inputs, seed=37)
    assert_close(got, TOLERANCES["float32"])
    assert all(got[n] <= 2 * ref[n] + 1e-6 for n in ref), (got, ref)
    odd = make_inputs(38, 1, 2, 70, 24, 16, la_lo=-0.3, with_state=True)
    st_odd = ssd_module.make_static(odd["q"], odd["k"], odd["v"], odd["beta"], scale=1.0, chunk_size=64,
                                    interpret=True, config=cfg, device_kind="cpu")
    assert not ssd_bwd.wy_packs(st_odd)
    assert_close(errors(ssd(64, scale=24 ** -0.5, config=cfg), odd, seed=38), TOLERANCES["float32"])
    h200 = dataclasses.replace(ssd_config(64, 64, jnp.float32, "NVIDIA H200"), store_kg=True, store_p=True,
                               wy_pack=True, dqk_pack=True, dqk_pair_do=True)
    # the static shared-memory estimate counts the paired operands (two [64, 128] float32 tiles)
    assert ssd_smem_bytes(h200, 64, 64, 64, jnp.float32) >= 2 * 64 * 128 * 4
    check_ssd_config(h200, 64, 64, 64, jnp.float32, "NVIDIA H200")

    text = _h200_backward_lowered(h200)
    assert "ssd_wy_bwd" in text and "ssd_dqk" in text


@pytest.mark.parametrize("with_beta, option", [(True, "dqk_pack"), (False, "dqk_pack"), (True, "dqk_pair_do"),
                                               (False, "both")])
def test_dqk_pack_matches(with_beta, option):
    """SSDConfig.dqk_pack: the dqk kernel forms dk = e_last D dh^T + dQK^T q as one product over paired columns
    and log_alpha's gradient through e_last from D and k_dec dh (formed for dD). One chunk-wide sub-block of 32,
    dv 32 in one block (dk = dv = 24, padded to 32), a partial last chunk, an initial state, with and without
    beta (the transition form forms dD, or dv, in this kernel either way): every gradient matches the float64
    recurrence and the unpacked kernel. ``dqk_pair_do``: dP = dO D^T and dO h^T as one product, dO [D^T |
    h^T] (dk padded to the chunk, 32)."""
    from flashlax.kernels import ssd_bwd
    base = dataclasses.replace(ssd_config(24, 24, jnp.float32, "cpu"), transition=True, block=64, block_v=64,
                               store_p=True)
    cfg = dataclasses.replace(base, dqk_pack=option in ("dqk_pack", "both"),
                              dqk_pair_do=option in ("dqk_pair_do", "both"))
    inputs = make_inputs(41, 1, 2, 150, 24, 24, la_lo=-0.3, with_state=True, with_beta=with_beta)
    st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=1.0,
                                chunk_size=32, interpret=True, config=cfg, device_kind="cpu")
    assert ssd_bwd.dqk_packs(st, {"ddl": None}) == cfg.dqk_pack and ssd_bwd.dqk_pairs_do(st) == cfg.dqk_pair_do
    got = errors(ssd(32, scale=24 ** -0.5, config=cfg), inputs, seed=41)
    ref = errors(ssd(32, scale=24 ** -0.5, config=base), inputs, seed=41)
    assert_close(got, TOLERANCES["float32"])
    assert all(got[n] <= 2 * ref[n] + 1e-6 for n in ref), (got, ref)


def _assert_matches_float64_and(fn, other, inputs, seed):
    """fn's output, final state and gradients match the float64 recurrence, and its gradients match other's
    element by element (2e-6 of each gradient's largest magnitude)."""
    assert_close(errors(fn, inputs, seed=seed), TOLERANCES["float32"])
    cot = random_cotangents(inputs, seed)
    names = tuple(inputs)
    got = _jitted_grads(fn, names)(tuple(inputs[n] for n in names), cot)[2]
    want = _jitted_grads(other, names)(tuple(inputs[n] for n in names), cot)[2]
    for name in want:
        scale = float(jnp.max(jnp.abs(want[name])))
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=0, atol=2e-6 * scale,
                                   err_msg=name)


@pytest.mark.parametrize("with_beta, transition, store_p", [(True, True, True), (True, False, False),
                                                        (False, True, False), (False, False, True)])
def test_dqk_lean_matches(with_beta, transition, store_p):
    """SSDConfig.dqk_lean: the one-tile dqk kernel with its steps reordered (inputs loaded at first use). Every
    path it has: dD formed here (transition) or read, D formed from u and w or stored, P read (store_p) or
    q k^T formed, with and without beta (without: dv formed here or by the reverse pass). dk = dv = 24 (padded
    to 32), one chunk-wide sub-block of 32, a partial last chunk, an initial state: every gradient matches the
    float64 recurrence and, element by element, the general dqk kernel's."""
    from flashlax.kernels import ssd_bwd
    base = dataclasses.replace(ssd_config(24, 24, jnp.float32, "cpu"), transition=transition, block=64,
                               block_v=64, store_p=store_p)
    cfg = dataclasses.replace(base, dqk_lean=True)
    inputs = make_inputs(43, 1, 2, 150, 24, 24, la_lo=-0.3, with_state=True, with_beta=with_beta)
    st = ssd_module.make_static(inputs["q"], inputs["k"], inputs["v"], inputs.get("beta"), scale=1.0,
                                chunk_size=32, interpret=True, config=cfg, device_kind="cpu")
    assert ssd_bwd.dqk_lean(st) and not ssd_bwd.dqk_lean(dataclasses.replace(st, config=base))
    _assert_matches_float64_and(ssd(32, config=cfg), ssd(32, config=base), inputs, seed=43)
    if with_beta and transition and store_p:    # the H200 entry with dqk_lean lowers through Pallas' Triton lowering
        assert "ssd_dqk" in _h200_backward_lowered(
            dataclasses.replace(ssd_config(64, 64, jnp.float32, "NVIDIA H200"), dqk_lean=True))


def _residuals(fn, inputs, with_beta=True):
    """(bytes, shapes) that ``fn``'s forward saves for its backward beyond the inputs (with an initial state;
    with or without beta), from abstract inputs shaped like ``inputs``."""
    from flashlax._residuals import residual_bytes
    args = [jax.ShapeDtypeStruct(inputs[n].shape, inputs[n].dtype)
            for n in ("q", "k", "v", "log_alpha", "beta", "initial_state")]
    if with_beta:
        return residual_bytes(lambda q, k, v, la, b, s: fn(q, k, v, la, b, initial_state=s), *args)
    return residual_bytes(lambda q, k, v, la, s: fn(q, k, v, la, initial_state=s), *args[:4], args[5])


@pytest.mark.parametrize("transition, store_kg, kdec", [(True, True, False), (False, False, True)])
def test_save_t_matches_and_saves_t(transition, store_kg, kdec):
    """SSDConfig.save_t: the forward under differentiation saves T and the backward forms w, u (and M, H, KG,
    k_dec as the config asks) from it in one kernel instead of inverting again. A partial last chunk and an
    initial state: every gradient matches the float64 recurrence and, element by element, the backward that
    inverts again; the residuals are the inputs and T alone (one [B, H, T, C] array in the input dtype), and
    without beta nothing is saved. The H200 entry with save_t lowers through Pallas' Triton lowering."""
    base = dataclasses.replace(ssd_config(24, 24, jnp.float32, "cpu"), transition=transition, store_kg=store_kg,
                               kdec=kdec, block=64, blocks=(("wy", 16),))
    cfg = dataclasses.replace(base, save_t=True)
    inputs = make_inputs(45, 1, 2, 150, 24, 24, la_lo=-0.3, with_state=True)
    saving = ssd(32, config=cfg)
    _assert_matches_float64_and(saving, ssd(32, config=base), inputs, seed=45)
    assert _residuals(saving, inputs) == (1 * 2 * 150 * 32 * 4, ["float32[1,2,150,32]"])
    assert _residuals(ssd(32, config=base), inputs) == (0, [])
    assert _residuals(saving, inputs, with_beta=False) == (0, [])
    # the static shared-memory estimate counts the wu kernel's chunk-wide tiles (k k^T: two [64, 256] float32)
    assert ssd_smem_bytes(dataclasses.replace(cfg, max_chunk=64), 256, 256, 64, jnp.float32) >= 2 * 64 * 256 * 4
    if transition:
        text = _h200_backward_lowered(dataclasses.replace(ssd_config(64, 64, jnp.float32, "NVIDIA H200"),
                                                          save_t=True, dqk_lean=True))
        assert "ssd_wu" in text and "ssd_dqk" in text


@pytest.mark.parametrize("transition, save_t, fuse_out", [(True, True, False), (False, False, False),
                                                         (False, False, True)])
def test_save_h_matches_and_saves_h(transition, save_t, fuse_out):
    """SSDConfig.save_h: the forward under differentiation keeps the chunk-start states h it wrote for its
    output kernel and the backward runs no state pass (the two-product form's dqk then forms D from u and w).
    A partial last chunk and an initial state: every gradient matches the float64 recurrence and, element by
    element, the backward that runs the state pass again; the residuals are the inputs, T where save_t, and
    h ([B, H, N dk, dv], dk = dv = 24 padded to 32, five chunks of 32); nothing without beta or where the
    state pass forms the output (fuse_out, which writes no states). For the H200 entry the lowered backward
    has one state pass (the forward's) instead of two."""
    base = dataclasses.replace(ssd_config(24, 24, jnp.float32, "cpu"), transition=transition, save_t=save_t,
                               fuse_out=fuse_out, block=64, blocks=(("wy", 16),))
    cfg = dataclasses.replace(base, save_h=True)
    inputs = make_inputs(47, 1, 2, 150, 24, 24, la_lo=-0.3, with_state=True)
    _assert_matches_float64_and(ssd(32, config=cfg), ssd(32, config=base), inputs, seed=47)
    t_bytes, t_shapes = _residuals(ssd(32, config=base), inputs)
    assert t_shapes == (["float32[1,2,150,32]"] if save_t else [])
    h_shapes = [] if fuse_out else ["float32[1,2,160,32]"]
    got_bytes, got_shapes = _residuals(ssd(32, config=cfg), inputs)
    assert (got_bytes, sorted(got_shapes)) == (t_bytes + (0 if fuse_out else 2 * 160 * 32 * 4),
                                               sorted(t_shapes + h_shapes))
    assert _residuals(ssd(32, config=cfg), inputs, with_beta=False) == (0, [])
    if transition:
        h200 = ssd_config(64, 64, jnp.float32, "NVIDIA H200")
        passes = [_h200_backward_lowered(dataclasses.replace(h200, save_h=on)).count('"ssd_state') for on in
                  (False, True)]
        assert passes[1] > 0 and passes[0] == 2 * passes[1], passes


def test_small_f32_dot_lowers_and_matches():
    """small_f32_dot (the UT transform's 16 x 16 x 16 float32 products through f32_dot as well, a candidate
    for the float32 backward): forward and backward go through the Pallas Triton lowering for an abstract
    H200 with tf32x3 on every product, inside a mesh with Explicit axes (where a reduction over two axes
    in a kernel failed to lower: the kernels reduce one axis at a time), and the interpreter (full float32
    products) still matches the float64 recurrence, outputs and every gradient."""
    cfg = dataclasses.replace(ssd_config(64, 64, jnp.float32, "NVIDIA H200"), small_f32_dot=True,
                              warps=(("wy", 8), ("state", 8)))
    inputs = make_inputs(21, 1, 2, 70, 16, 16)
    assert_close(errors(ssd(32, config=dataclasses.replace(cfg, f32_dot="ieee")), inputs, seed=21),
                 TOLERANCES["float32"])
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)   # Explicit axes

    def loss(q, k, v, la, beta):
        return jnp.sum(gated_delta_rule_ssd(q, k, v, la, beta, scale=0.125, config=cfg, device_kind="NVIDIA H200",
                                            backward="pallas"))

    x = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.float32)
    g = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(x, x, x, g, g).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call") >= 5
    # the per-kernel warp counts (SSDConfig.warps) reach the launches
    launches = {m.group(1): int(m.group(2)) for m in re.finditer(
        r'name = "(ssd_\w+)".*?num_warps = (\d+) : i32', text)}
    assert launches.get("ssd_wy_bwd") == 8 and launches.get("ssd_state") == 8 and launches.get("ssd_out") == cfg.num_warps


# ---------------------------------------------------------------------------------------------------
# GPU (pytest -m gpu on the device machine)
# ---------------------------------------------------------------------------------------------------

# Six compiles (each fwd+bwd compiles about ten Triton kernels): the H200's transition form with beta
# (dk 64) and without (dk 64, its without_beta launch), the two-step form without beta and dk != dv (dk 128),
# float32 dk 128 with beta, bf16 at dk 128, and head dims 256.

@pytest.mark.gpu
def test_gpu_float32_deterministic_and_matches_chunked():
    inputs = make_inputs(11, 2, 2, 1000, 64, 64, la_lo=-2.0)
    assert_close(errors(ssd(64), inputs, seed=11), TOLERANCES["float32"])
    first, cot = deterministic_results(ssd(64), inputs, 11)
    chunked = run_with_grads(functools.partial(gated_delta_rule, impl="chunked"), inputs, cot)
    for a, b in zip(first, jax.tree_util.tree_leaves(chunked)):
        assert rel_err(a, b) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dk, dv, with_beta, seq_len", [(64, 64, False, 1000), (128, 64, False, 1000),
                                                          (128, 128, True, 700), (256, 256, True, 300)])
def test_gpu_float32(dk, dv, with_beta, seq_len):
    inputs = make_inputs(12, 2, 2, seq_len, dk, dv, with_beta=with_beta, la_lo=-2.0)
    assert_close(errors(ssd(64), inputs, seed=12), TOLERANCES["float32"])


@pytest.mark.gpu
@pytest.mark.parametrize("with_beta", [True, False])
def test_gpu_default_matches_chunked(with_beta):
    """The GPU default (impl=None: ssd, backward "auto") against chunked, output and every gradient."""
    inputs = make_inputs(14, 2, 2, 1000, 64, 64, la_lo=-2.0, with_beta=with_beta)
    assert dispatch.default_impl("gated_delta_rule", "gpu") == "ssd"
    cot = random_cotangents(inputs, 14)
    got = run_with_grads(gated_delta_rule, inputs, cot)
    want = run_with_grads(functools.partial(gated_delta_rule, impl="chunked"), inputs, cot)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert rel_err(a, b) < 1e-5


@pytest.mark.gpu
def test_gpu_bfloat16():
    """bf16 inputs: fla's bounds, 5e-3 relative for outputs and 2e-2 for dbeta and d log_alpha (q, k, v
    gradients 1e-2 as tests/test_linear.py's bf16 table)."""
    inputs = make_inputs(13, 2, 2, 1024, 128, 128, dtype=jnp.bfloat16)
    errs = errors(ssd(64), inputs, seed=13)
    bounds = {"o": 5e-3, "final_state": 5e-3, "dbeta": 2e-2, "dlog_alpha": 2e-2}
    bad = {n: e for n, e in errs.items() if not e <= bounds.get(n, 1e-2)}
    assert not bad, (bad, errs)
