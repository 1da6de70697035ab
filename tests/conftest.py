"""Shared test set-up: hypothesis profiles, the tolerance table, float64 references, the gpu marker."""

import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# JAX's own test setting and a user option: no implicit rank promotion anywhere (API.md, Conventions).
jax.config.update("jax_numpy_rank_promotion", "raise")

# Profiles: "ci" (few examples, for the 2-core CI machine), "dev" (default), "thorough".
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=8, derandomize=True, **_common)
settings.register_profile("dev", max_examples=15, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Relative error (||out - ref|| / ||ref||) allowed against a float64 reference, by input dtype.
# float32: full-precision arithmetic, errors grow ~sqrt(length) * 2^-24; bf16/f16: inputs are rounded
# to 8/11 mantissa bits and outputs stored in that dtype, so one rounding (2^-8 / 2^-11) of each
# output plus accumulated rounding of intermediates stored in the input dtype.
TOLERANCES = {
    "float32": 1e-5,
    "float16": 5e-3,
    "bfloat16": 3e-2,
}


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.all(np.isfinite(x)), "non-finite values in output"
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    return float(num / denom) if denom > 0 else float(num)


def normal(rng, shape, dtype=np.float32):
    """Standard-normal test inputs drawn by numpy, as a jax array of ``dtype``. ``rng``: a numpy Generator
    or a seed. (jax.random compiles its threefry program once per shape, 0.2-3 s each on the 2-core CI
    machine: drawing inputs that way had been a tenth of the suite's time.)"""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    return jax.numpy.asarray(rng.standard_normal(shape, np.float32), dtype)


def sub_jaxprs(value):
    """The jaxprs an equation parameter holds (a Jaxpr, a ClosedJaxpr, or tuples / lists of them)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from sub_jaxprs(item)


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def pytest_collection_modifyitems(config, items):
    if on_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU backend (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
