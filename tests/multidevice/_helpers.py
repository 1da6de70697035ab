"""Helpers of the multi-device tests (tests/multidevice/md_*.py).

Those tests need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax initialises, which
the default suite's process cannot promise (jax may already run there with one device). Their file names
do not match ``test_*.py``, so the suite does not collect them; tests/test_sharding.py runs each file in a
subprocess with that flag. By hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m pytest -q -o python_files='md_*.py' tests/multidevice
"""

import re

import jax
import numpy as np
from jax.sharding import NamedSharding

from conftest import rel_err  # tests/conftest.py

assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (see above)"

TOL = 2e-5      # float32, sharded against one device: same arithmetic up to reassociation of sums


def put(mesh, spec, *arrays):
    out = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays)
    return out[0] if len(out) == 1 else out


def assert_close(got, want, tol=TOL, what=""):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for n, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        err = rel_err(np.asarray(g), np.asarray(w))
        assert err < tol, f"{what} leaf {n}: rel err {err:.2e} > {tol:.0e}"


def run_and_gathers(fn, *args):
    """``(jax.jit(fn)(*args), shapes gathered by all-gathers in its compiled program)``, compiled once."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled(*args), re.findall(r"= (\S+) all-gather\(", compiled.as_text())


def all_gathers(fn, *args) -> list[str]:
    return run_and_gathers(fn, *args)[1]


def with_grads(fn, loss, argnums):
    """``*args -> (fn(*args), gradients of loss(fn(*args)) with respect to args[argnums])``: the outputs come
    out of the program that differentiates them, so one compile checks both (the forward's values, its
    shardings and collectives are those of the forward inside it: the same custom_vjp forward)."""
    def scalar(*args):
        out = fn(*args)
        return loss(out), out

    value_and_grad = jax.value_and_grad(scalar, argnums=argnums, has_aux=True)

    def run(*args):
        (_, out), grads = value_and_grad(*args)
        return out, grads
    return run


def specs(tree) -> list[tuple]:
    """The partition spec of every array in ``tree``."""
    return [tuple(x.sharding.spec) for x in jax.tree.leaves(tree)]
