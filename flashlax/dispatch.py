"""The one table from (op, backend) to implementations, and the one place that branches on the backend.

Every op front end calls :func:`resolve`; nothing else looks at ``jax.default_backend()``.
Implementations are named by ``module:function`` and imported lazily, so importing flashlax never
imports Pallas or a kernel module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import jax

OPS = ("flex_attention", "decode_attention", "gated_delta_rule")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    kind: "xla" runs on every backend; "pallas" is a GPU kernel that runs on CPU only in the Pallas
    interpreter (``interpret=True``).
    target: ``"module:function"``; the function takes the op's arguments (without ``impl``) and, for
    pallas kinds, ``interpret``.
    """

    name: str
    kind: str
    target: str | None  # None: registered in the contract but not written yet
    note: str = ""
    # ((backend family, keyword, value), ...): keyword arguments the function gets on that backend family
    # (how it runs there, never what it computes).
    options: tuple = ()


_F = "flashlax.fallbacks"
_K = "flashlax.kernels"

TABLE: dict[str, dict[str, Impl]] = {
    "flex_attention": {
        "xla": Impl("xla", "xla", f"{_F}.attention:flex_attention_xla"),
        "repeat": Impl("repeat", "xla", f"{_F}.attention:flex_attention_repeat",
                       "K/V repeated to Hq heads: the old baseline, kept for benchmarks"),
        "pallas": Impl("pallas", "pallas", f"{_K}.flash_attention:flex_attention_pallas"),
    },
    "decode_attention": {
        "xla": Impl("xla", "xla", f"{_F}.decode:decode_attention_xla"),
        "pallas": Impl("pallas", "pallas", f"{_K}.decode:decode_attention_pallas"),
    },
    "gated_delta_rule": {
        "recurrent": Impl("recurrent", "xla", f"{_F}.linear:gated_delta_rule_recurrent"),
        "chunked": Impl("chunked", "xla", f"{_F}.linear:gated_delta_rule_chunked",
                        options=(("cpu", "sequential_heads", True),)),
        "chunked_fat": Impl("chunked_fat", "xla", f"{_F}.linear:gated_delta_rule_chunked_fat"),
        "ssd": Impl("ssd", "pallas", f"{_K}.ssd:gated_delta_rule_ssd"),
    },
}

# Default implementation per (op, backend family).
DEFAULTS: dict[str, dict[str, str]] = {
    "flex_attention": {"cpu": "xla", "gpu": "pallas"},
    "decode_attention": {"cpu": "xla", "gpu": "pallas"},
    # ssd (Pallas forward; the Pallas backward, or the chunked XLA backward for float32 with beta above head
    # dim 64) was faster than chunked forward and forward+backward in every case timed on the H200
    # (docs/PERF_NOTES.md, sessions 8 and 11).
    "gated_delta_rule": {"cpu": "chunked", "gpu": "ssd"},
}


def backend_family(backend: str | None = None) -> str:
    """'gpu' for CUDA/ROCm backends, otherwise the backend name ('cpu', 'tpu')."""
    backend = backend or jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def _check_op(op: str) -> dict[str, Impl]:
    if op not in TABLE:
        raise ValueError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
    return TABLE[op]


def available_impls(op: str, backend: str | None = None) -> tuple[str, ...]:
    """Implementations of ``op`` that run natively on ``backend`` (default: the current one).

    Pallas kernels are listed only on GPU backends; on CPU they still run with ``interpret=True``.
    """
    impls = _check_op(op)
    family = backend_family(backend)
    return tuple(name for name, impl in impls.items()
                 if impl.target is not None and (impl.kind == "xla" or family == "gpu"))


def default_impl(op: str, backend: str | None = None) -> str:
    _check_op(op)
    family = backend_family(backend)
    return DEFAULTS[op].get(family, DEFAULTS[op]["cpu"])


def resolve_name(op: str, impl: str | None, *, interpret: bool = False, backend: str | None = None) -> str:
    """Validates ``impl`` for ``op`` on the backend and returns the implementation name to run."""
    impls = _check_op(op)
    if impl is None:
        return default_impl(op, backend)
    if impl not in impls:
        raise ValueError(f"{op}: unknown impl {impl!r}; valid: {', '.join(impls)}")
    if impls[impl].kind == "pallas" and not interpret and backend_family(backend) != "gpu":
        raise RuntimeError(f"{impl} requires an accelerator backend.")
    return impl


def resolve(op: str, impl: str | None, *, interpret: bool = False,
            backend: str | None = None) -> tuple[Impl, Callable]:
    """Returns ``(Impl, function)`` for ``op``; raises ValueError/RuntimeError as the contract says."""
    name = resolve_name(op, impl, interpret=interpret, backend=backend)
    entry = TABLE[op][name]
    if entry.target is None:
        raise RuntimeError(f"{name} is not implemented yet in this version of flashlax ({entry.note}).")
    module, _, attr = entry.target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    family = backend_family(backend)
    options = {key: value for fam, key, value in entry.options if fam == family}
    if options:
        fn = functools.update_wrapper(functools.partial(fn, **options), fn)
    return entry, fn
