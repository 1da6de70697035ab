"""Matmul precision for float32 inputs: full float32 unless the caller asks for less through JAX's own
setting, ``jax.default_matmul_precision`` (or the ``jax_default_matmul_precision`` config), read when an op
is traced (the setting is part of jit's cache key, so changing it retraces instead of reusing a kernel).

Settings below float32 ("tensorfloat32", "high", "bfloat16", "TF32_TF32_F32", the bf16 / f16 / f8 one-pass
presets) run float32 products as one tf32 tensor-core pass on the GPU: the fastest precision we offer, never
less than tf32 (10-bit mantissa), with float32 accumulation, statistics and states as always. Everything
else ("default", "highest", "float32", unset, the x3 / x6 / x9 presets) keeps full float32: no silent tf32.
16-bit inputs run on the tensor cores natively whatever the setting, and the Pallas kernels' float32 algebra
for them (the UT transform) stays full float32; the XLA paths that compute 16-bit linear attention in float32
follow the setting there, as every float32 product in JAX does. float64 always runs in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_ONE_PASS = frozenset({
    "tensorfloat32", "high", "bfloat16", "TF32_TF32_F32", "BF16_BF16_F32", "BF16_BF16_BF16",
    "F16_F16_F16", "F16_F16_F32", "ANY_F8_ANY_F8_F32", "ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_ANY",
    "ANY_F8_ANY_F8_ANY_FAST_ACCUM",
})


def tf32_requested() -> bool:
    """Whether the caller's ``jax.default_matmul_precision`` asks for less than float32 products."""
    return jax.config.jax_default_matmul_precision in _ONE_PASS


def uses_tf32(dtype) -> bool:
    """Whether float32 products of inputs of ``dtype`` run as one tf32 pass (float32 inputs, tf32 asked)."""
    return jnp.dtype(dtype) == jnp.float32 and tf32_requested()


def xla_precision(dtype) -> lax.Precision:
    """Precision of the XLA paths' products for inputs of ``dtype``: HIGHEST for float32 and float64 (HIGH,
    tf32 on the GPU, when the caller asks for it), DEFAULT (native tensor cores) for 16-bit inputs."""
    if jnp.dtype(dtype) not in (jnp.float32, jnp.float64):
        return lax.Precision.DEFAULT
    return lax.Precision.HIGH if uses_tf32(dtype) else lax.Precision.HIGHEST


def pallas_precision(dtype):
    """Precision of a Pallas (Triton) kernel's products for inputs of ``dtype``: HIGHEST (IEEE float32) for
    float32, DEFAULT (the Triton lowering's tf32) when the caller asks for tf32, None (native tensor-core
    path) for 16-bit inputs."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    return lax.Precision.DEFAULT if tf32_requested() else lax.Precision.HIGHEST
