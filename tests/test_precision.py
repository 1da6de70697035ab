"""float32 products follow the caller's ``jax.default_matmul_precision`` (flashlax/_precision.py): full float32
unless it asks for less ("tensorfloat32" and below), then one tf32 pass, in every op and impl, forward and
backward; 16-bit inputs and float64 never change. On CPU the traced programs are inspected (every dot_general
of every kernel, Pallas kernel bodies included); on a GPU (``gpu`` marker) the errors against float64 show
that the setting reaches the hardware: tf32-sized under it, float32-sized without.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import on_gpu, rel_err, sub_jaxprs
from flashlax import _precision, decode_attention, flex_attention, gated_delta_rule, masks
from flashlax.kernels.ssd import gated_delta_rule_ssd

INTERPRET = not on_gpu()
FULL = {"HIGHEST", "TF32_TF32_F32_X3"}
ONE_PASS = {"DEFAULT", "HIGH"}


def dot_precisions(fn, *args) -> collections.Counter:
    """Counter of (operand dtype, precision) over every dot_general traced by ``fn(*args)``, nested jaxprs
    (pallas_call kernel bodies, scans, custom_vjp rules) included."""
    counts = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                prec = eqn.params["precision"]
                name = "None" if prec is None else (
                    prec.name if isinstance(prec, lax.DotAlgorithmPreset) else str(prec[0]))
                counts[str(eqn.invars[0].aval.dtype), name] += 1
            for param in eqn.params.values():
                for sub in sub_jaxprs(param):
                    walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


def f32_kinds(counts) -> set:
    return {prec for (dtype, prec), _ in counts.items() if dtype == "float32"}


def _attention_inputs(dtype, lq=40, lkv=72):
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (1, 4, lq, 32), dtype)
    k = jax.random.normal(ks[1], (1, 2, lkv, 32), dtype)
    v = jax.random.normal(ks[2], (1, 2, lkv, 32), dtype)
    return q, k, v


def _linear_inputs(dtype, t=40, d=16):
    ks = jax.random.split(jax.random.key(4), 5)
    q, k, v = (jax.random.normal(ks[i], (1, 2, t, d), dtype) / (1.0 if i == 2 else d ** 0.5) for i in range(3))
    la = -jax.random.uniform(ks[3], (1, 2, t), jnp.float32, 0.01, 0.5)
    beta = jax.random.uniform(ks[4], (1, 2, t), jnp.float32, 0.1, 0.9)
    return q, k, v, la, beta


def _flex(impl):
    def loss(q, k, v):
        return jnp.sum(flex_attention(q, k, v, mask_mod=masks.causal, impl=impl, interpret=impl == "pallas") ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))


def _decode(impl):
    def run(q, k, v):
        return decode_attention(q[:, :, :3], k, v, impl=impl, interpret=impl == "pallas")
    return run


def _linear(impl):
    def loss(q, k, v, la, beta):
        return jnp.sum(gated_delta_rule(q, k, v, la, beta, impl=impl, chunk_size=16) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def _ssd_h200(q, k, v, la, beta):
    """The ssd kernels as traced for an H200 (not interpreted: the interpreter computes every product in IEEE
    float32 on CPU whatever the setting), forward and the Pallas backward."""
    def loss(*args):
        return jnp.sum(gated_delta_rule_ssd(*args, scale=0.25, device_kind="NVIDIA H200", backward="pallas") ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, la, beta)


CASES = {
    "flex_xla": (_flex("xla"), _attention_inputs),
    "flex_pallas": (_flex("pallas"), _attention_inputs),
    "decode_xla": (_decode("xla"), _attention_inputs),
    "decode_pallas": (_decode("pallas"), _attention_inputs),
    "linear_chunked": (_linear("chunked"), _linear_inputs),
    "linear_chunked_fat": (_linear("chunked_fat"), _linear_inputs),
    "linear_recurrent": (_linear("recurrent"), _linear_inputs),
    "ssd_h200": (_ssd_h200, _linear_inputs),
}


# Products that stay IEEE float32 under any setting: the ssd kernels' 16 x 16 x 16 UT-transform algebra, and
# the XLA flex path's block-mask tile counts (0/1 products, not data).
KEEP_HIGHEST = ("ssd_h200", "flex_xla")


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_products_follow_default_matmul_precision(case):
    """Unset, "default", "highest" and "float32": every float32 product in full float32 (IEEE or tf32x3).
    "tensorfloat32", "high", "bfloat16": the data-sized products as one tf32 pass (the ssd kernels keep their
    16 x 16 x 16 UT-transform products in IEEE float32), none dropped below it."""
    fn, make = CASES[case]
    args = make(jnp.float32)
    full = dot_precisions(fn, *args)
    assert f32_kinds(full) and f32_kinds(full) <= FULL, full
    for setting in ("default", "highest", "float32", "F32_F32_F32"):
        with jax.default_matmul_precision(setting):
            assert dot_precisions(fn, *args) == full, setting
    for setting in ("tensorfloat32", "high", "bfloat16", "TF32_TF32_F32"):
        with jax.default_matmul_precision(setting):
            reduced = dot_precisions(fn, *args)
        assert sum(reduced.values()) == sum(full.values()), (setting, reduced, full)
        kinds = f32_kinds(reduced)
        assert kinds & ONE_PASS and kinds <= ONE_PASS | {"HIGHEST"}, (setting, reduced)
        if case not in KEEP_HIGHEST:
            assert kinds <= ONE_PASS, (setting, reduced)


@pytest.mark.parametrize("case", ["flex_pallas", "decode_pallas", "ssd_h200"])
def test_16bit_inputs_keep_the_kernels_float32_algebra_full(case):
    """16-bit inputs in the Pallas kernels: the float32 products among them (the UT transform) stay full
    float32 under "tensorfloat32" (the 16-bit products run natively on the tensor cores either way). The XLA
    paths that compute 16-bit linear attention in float32 follow the setting there, as any float32 product
    in JAX does."""
    fn, make = CASES[case]
    args = make(jnp.bfloat16)
    f32 = lambda counts: {key: n for key, n in counts.items() if key[0] == "float32"}  # noqa: E731
    base = dot_precisions(fn, *args)
    assert any(dtype == "bfloat16" for dtype, _ in base)
    with jax.default_matmul_precision("tensorfloat32"):
        assert f32(dot_precisions(fn, *args)) == f32(base)


def test_one_pass_settings_are_exactly_the_ones_below_float32():
    """Every value JAX accepts is classified; the x3 / x6 / x9 presets and F32 / F64 are full precision."""
    with pytest.raises(ValueError) as info:
        with jax.default_matmul_precision("nonsense"):
            pass
    values = set(re.findall(r"'(\w+)'", str(info.value).split(" in ", 1)[1].split("got", 1)[0]))
    assert "tensorfloat32" in values and len(values) > 10, values
    full = {"default", "highest", "float32", "F32_F32_F32", "F64_F64_F64", "TF32_TF32_F32_X3",
            "BF16_BF16_F32_X3", "BF16_BF16_F32_X6", "BF16_BF16_F32_X9"}
    assert _precision._ONE_PASS <= values and full <= values
    assert values - _precision._ONE_PASS == full
    for value in values:
        with jax.default_matmul_precision(value):
            assert _precision.tf32_requested() == (value not in full), value
            assert _precision.xla_precision(jnp.float64) == lax.Precision.HIGHEST
            assert _precision.pallas_precision(jnp.bfloat16) is None


def test_changing_the_setting_retraces_a_jitted_op():
    """The setting is part of jit's cache key: a jitted op traced under one setting is not reused under the
    other (the traced programs differ), and results on CPU stay within float32 rounding of each other."""
    q, k, v, la, beta = _linear_inputs(jnp.float32)
    run = jax.jit(lambda *a: gated_delta_rule(*a, impl="chunked", chunk_size=16))
    full = run(q, k, v, la, beta)
    with jax.default_matmul_precision("tensorfloat32"):
        reduced = run(q, k, v, la, beta)
        text = run.trace(q, k, v, la, beta).jaxpr.pretty_print()
    assert "Precision.HIGH," in text and "HIGHEST" not in text
    assert "HIGHEST" in run.trace(q, k, v, la, beta).jaxpr.pretty_print()
    assert rel_err(reduced, full) < 1e-3


# ---------------------------------------------------------------------------------------------------
# GPU: the setting reaches the hardware
# ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op", ["ssd", "chunked", "flex_pallas", "decode_pallas"])
def test_gpu_tf32_when_asked_and_only_then(op):
    """float32 on the GPU: within 1e-5 of float64 without the setting; under "tensorfloat32" the error is
    tf32-sized (above 1e-5, so tf32 really ran, and under 5e-3)."""
    if op in ("ssd", "chunked"):
        ks = jax.random.split(jax.random.key(5), 5)
        b, h, t, d = 1, 2, 1000, 64
        q, k = (jax.random.normal(ks[i], (b, h, t, d)) / d ** 0.5 for i in range(2))
        v = jax.random.normal(ks[2], (b, h, t, d))
        la = -jax.random.uniform(ks[3], (b, h, t), minval=0.01, maxval=0.3)
        beta = jax.random.uniform(ks[4], (b, h, t), minval=0.1, maxval=0.9)
        args = (q, k, v, la, beta)
        run = jax.jit(lambda *a: gated_delta_rule(*a, impl=op))
        with jax.enable_x64():
            ref = gated_delta_rule(*(np.asarray(x, np.float64) for x in args), impl="recurrent")
    else:
        ks = jax.random.split(jax.random.key(6), 3)
        lq = 4 if op == "decode_pallas" else 1024
        q = jax.random.normal(ks[0], (1, 8, lq, 64))
        k, v = (jax.random.normal(ks[i], (1, 2, 2048, 64)) for i in (1, 2))
        args = (q, k, v)
        call = (lambda *a: decode_attention(*a, impl="pallas")) if op == "decode_pallas" else \
            (lambda *a: flex_attention(*a, impl="pallas"))
        run = jax.jit(call)
        with jax.enable_x64():
            ref = (decode_attention if op == "decode_pallas" else flex_attention)(
                *(np.asarray(x, np.float64) for x in args), impl="xla")
    full = rel_err(run(*args), ref)
    with jax.default_matmul_precision("tensorfloat32"):
        reduced = rel_err(run(*args), ref)
    assert full < 1e-5, full
    assert 1e-5 < reduced < 5e-3, reduced
