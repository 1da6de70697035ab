"""Timing, memory analysis, residual sizes, errors and the device block: the measurement half of the benchmark.

One measurement is one *row* (a dict, JSON-serialisable). Rows follow the schema of the seed files in
``shared/seeds/``:

* identity keys (always present): ``suite``, ``impl``, ``mode`` (``fwd`` / ``fwd_bwd``), the shape keys of
  the suite and ``dtype``;
* a row that ran has all of :data:`MEASURE_KEYS` (``null`` where a field does not apply, e.g. XLA memory
  analysis of a torch peer, residuals of a ``fwd`` row, a reference too large to compute, with a ``note``);
* a row whose implementation raised has instead ``error: "<ExceptionType>: <message>"``.
"""

from __future__ import annotations

import math
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MB = 1024.0 * 1024.0

TIMING_KEYS = ("compile_s", "inner", "median_ms", "q1_ms", "q3_ms")
# Decode rows only: per-call time of `throughput_calls` calls queued with one sync, median of single
# synchronised calls, and the KV-cache read rate at the throughput time (TB/s).
DECODE_TIMING_KEYS = ("throughput_ms", "throughput_calls", "latency_ms", "kv_tbps", "copy_tbps", "copy_frac")
XLA_MEMORY_KEYS = ("xla_temp_mb", "xla_arg_mb", "xla_out_mb")
MEASURE_KEYS = TIMING_KEYS + XLA_MEMORY_KEYS + ("residual_mb", "residual_shapes", "kv_mb", "rel_err",
                                                "rel_err_grads")
# L2 of an H100/H200 is 50-60 MB: on GPU, inputs are rotated through enough copies that one pass over
# them is well above this, so a kernel is not timed reading its inputs from cache.
L2_BYTES = 60 * 1024 * 1024


def on_gpu(backend: str | None = None) -> bool:
    return (backend or jax.default_backend()) in ("gpu", "cuda", "rocm")


def clock_up(seconds: float = 2.0) -> None:
    """Keeps the GPU busy with bf16 matmuls for ``seconds`` so it leaves its idle clock (the H200 idles at
    345 MHz) before the first timed row; nothing on other backends."""
    if not on_gpu():
        return
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        jax.block_until_ready(x @ x)


def error_text(exc: BaseException) -> str:
    """The ``error`` field: ``"<ExceptionType>: <first line of the message>"`` (long messages cut)."""
    message = str(exc).strip().splitlines()
    first = message[0] if message else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(exc).__name__}: {first}"


# ----------------------------------------------------------------------------------------------------------
# Device block


def _nvidia_smi() -> tuple[str | None, str | None, float | None]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None, None
    if out.returncode != 0 or not out.stdout.strip():
        return None, None, None
    name, driver, memory = [part.strip() for part in out.stdout.strip().splitlines()[0].split(",")]
    try:
        memory_gb = round(float(memory) / 1024.0, 1)
    except ValueError:
        memory_gb = None
    return name, driver, memory_gb


def torch_module():
    """``torch`` when importable, else None (torch peers then produce no rows, with a one-line notice)."""
    try:
        import torch  # noqa: PLC0415
    except Exception:  # ImportError, or a broken install
        return None
    return torch


def device_info() -> dict[str, Any]:
    """The ``device`` block: jax/python versions, backend and devices, GPU name/driver/memory, torch."""
    devices = jax.devices()
    gpu, driver, gpu_memory_gb = _nvidia_smi()
    if gpu is None and on_gpu():
        gpu = devices[0].device_kind
    info: dict[str, Any] = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.id}" for d in devices],
        "python": platform.python_version(),
        "device_kind": devices[0].device_kind,
        "gpu": gpu,
        "driver": driver,
        "gpu_memory_gb": gpu_memory_gb,
        "torch": None,
        "torch_cuda": None,
    }
    torch = torch_module()
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_cuda"] = getattr(torch.version, "cuda", None)
    return info


# ----------------------------------------------------------------------------------------------------------
# Inputs


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def input_copies(make: Callable[[int], tuple], one_set_bytes: int, *, gpu: bool, max_copies: int = 4,
                 max_total_bytes: int = 8 * 1024**3) -> list[tuple]:
    """Input sets to rotate through while timing: one on CPU; on GPU enough that the sets together exceed
    2x L2, at most ``max_copies`` and ``max_total_bytes``. ``make(seed)`` builds one fresh random set."""
    copies = 1
    if gpu and one_set_bytes > 0:
        copies = min(max_copies, max(1, math.ceil(2 * L2_BYTES / one_set_bytes)),
                     max(1, max_total_bytes // one_set_bytes))
    return [make(seed) for seed in range(copies)]


# ----------------------------------------------------------------------------------------------------------
# Timing


def _block(tree):
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
    return tree


def quartiles(samples_ms: Sequence[float]) -> tuple[float, float, float]:
    """(median, q1, q3) of the samples (inclusive method: q1 = q3 = the sample when there is one)."""
    samples = sorted(samples_ms)
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q2, q1, q3


class Timer:
    """Times ``call(args)`` rotating through ``arg_sets``. On creation: one warm-up call per set (not used),
    then a probe that picks ``inner`` so one sample lasts about ``min_sample_s`` (well above timer
    resolution and launch jitter). Each :meth:`sample` makes one untimed settling call, then runs ``inner``
    calls back to back and synchronises once with ``sync``. Samples of several timers may be interleaved
    (suites do, round-robin over the implementations of one shape, so load changes on a shared machine
    hit every peer alike)."""

    def __init__(self, call: Callable[[Any], Any], arg_sets: Sequence[Any], *, sync: Callable = _block,
                 min_sample_s: float = 0.05, max_inner: int = 1000):
        self.call, self.arg_sets, self.sync = call, arg_sets, sync
        for args in arg_sets:
            sync(call(args))
        start = time.perf_counter()
        sync(call(arg_sets[0]))
        probe_s = max(time.perf_counter() - start, 1e-7)
        self.inner = int(min(max_inner, max(1, math.ceil(min_sample_s / probe_s))))
        self.samples_ms: list[float] = []
        self.queued_ms: list[float] = []     # sample_decode: throughput and latency samples
        self.single_ms: list[float] = []
        self.queued_calls = 0

    def sample(self) -> float:
        # One untimed call first: samples of several timers are interleaved, and the first call after
        # another implementation pays for that one's side effects (on CPU, re-faulting the memory a large
        # backward just released: seen as 1.4x on chunked fwd+bwd right after the recurrent one).
        self.samples_ms.append(self._queued_ms(self.inner))
        return self.samples_ms[-1]

    def _queued_ms(self, calls: int) -> float:
        """One untimed settling call, then ``calls`` calls back to back and one sync: ms per call."""
        self.sync(self.call(self.arg_sets[-1]))
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = self.call(self.arg_sets[i % len(self.arg_sets)])
        self.sync(out)
        return (time.perf_counter() - start) * 1e3 / calls

    def fields(self) -> dict[str, Any]:
        """``inner``, ``median_ms``, ``q1_ms``, ``q3_ms`` (per call); with :meth:`sample_decode` samples
        also ``throughput_ms``, ``throughput_calls`` and ``latency_ms``."""
        median, q1, q3 = quartiles(self.samples_ms)
        out = {"inner": self.inner, "median_ms": median, "q1_ms": q1, "q3_ms": q3}
        if self.queued_ms:
            out.update(throughput_ms=statistics.median(self.queued_ms), throughput_calls=self.queued_calls,
                       latency_ms=statistics.median(self.single_ms))
        return out

    def sample_decode(self, calls: int = 50, singles: int = 10) -> None:
        """One throughput sample (``calls`` calls queued back to back, rotating the input sets, one sync:
        ms per call, the device's rate with host overhead hidden) and ``singles`` latency samples (one
        call, then sync: what one synchronised step costs, host round trip included)."""
        self.queued_calls = calls
        self.queued_ms.append(self._queued_ms(calls))
        for i in range(singles):
            start = time.perf_counter()
            self.sync(self.call(self.arg_sets[i % len(self.arg_sets)]))
            self.single_ms.append((time.perf_counter() - start) * 1e3)


def kv_copy(q, k, v, *rest):
    """Copies of a decode input set's K and V caches (the bench's copy ceiling for the KV bytes: each is read
    and written once; under jit without donation XLA cannot alias them to the inputs)."""
    return jnp.copy(k), jnp.copy(v)


def time_calls(call: Callable[[Any], Any], arg_sets: Sequence[Any], *, repeats: int, sync: Callable = _block,
               min_sample_s: float = 0.05, max_inner: int = 1000) -> dict[str, Any]:
    """A :class:`Timer` and ``repeats`` samples in a row: ``inner``, ``median_ms``, ``q1_ms``, ``q3_ms``."""
    timer = Timer(call, arg_sets, sync=sync, min_sample_s=min_sample_s, max_inner=max_inner)
    for _ in range(max(1, repeats)):
        timer.sample()
    return timer.fields()


def compile_for_timing(fn: Callable, arg_sets: Sequence[tuple], *,
                       min_sample_s: float = 0.05) -> tuple[dict[str, Any], Any, Timer]:
    """jit-compiles ``fn`` (compile time measured on its own: lower + compile, no execution), reads XLA's
    memory analysis of the executable, runs it on the first input set and sets up a :class:`Timer`.
    Returns ``(fields, output of the first input set, timer)``."""
    jitted = jax.jit(fn)
    start = time.perf_counter()
    compiled = jitted.lower(*arg_sets[0]).compile()
    compile_s = time.perf_counter() - start
    fields: dict[str, Any] = {"compile_s": compile_s}
    fields.update(xla_memory(compiled))
    out = _block(compiled(*arg_sets[0]))
    timer = Timer(lambda args: compiled(*args), arg_sets, min_sample_s=min_sample_s)
    return fields, out, timer


def compile_and_time(fn: Callable, arg_sets: Sequence[tuple], *, repeats: int,
                     min_sample_s: float = 0.05) -> tuple[dict[str, Any], Any]:
    """:func:`compile_for_timing` and ``repeats`` samples in a row: ``(fields, output of the first set)``."""
    fields, out, timer = compile_for_timing(fn, arg_sets, min_sample_s=min_sample_s)
    for _ in range(max(1, repeats)):
        timer.sample()
    fields.update(timer.fields())
    return fields, out


def xla_memory(compiled) -> dict[str, float | None]:
    """``compiled.memory_analysis()`` as MB: temp (scratch), argument and output buffers."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        stats = None
    if stats is None:
        return dict.fromkeys(XLA_MEMORY_KEYS)
    return {"xla_temp_mb": stats.temp_size_in_bytes / MB, "xla_arg_mb": stats.argument_size_in_bytes / MB,
            "xla_out_mb": stats.output_size_in_bytes / MB}


# ----------------------------------------------------------------------------------------------------------
# Residuals


def _residuals_from_vjp_closure(fn: Callable, *args) -> tuple[int, list[str]]:
    """Bytes the backward keeps alive: the leaves of ``jax.vjp(fn, *args)``'s closure, traced abstractly,
    minus leaves that are the inputs themselves (those exist anyway), each buffer counted once."""
    closed = jax.make_jaxpr(lambda *a: jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1]))(*args)
    jaxpr = closed.jaxpr
    inputs = set(map(id, jaxpr.invars))
    seen: set[int] = set()
    total, shapes = 0, []
    for var in jaxpr.outvars:
        if not hasattr(var, "aval") or id(var) in inputs or id(var) in seen or type(var).__name__ == "Literal":
            continue
        seen.add(id(var))
        aval = var.aval
        size = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        total += size
        shapes.append(f"{np.dtype(aval.dtype).name}[{', '.join(map(str, aval.shape))}]")
    return total, shapes


def residuals(fn: Callable, *args) -> tuple[float, list[str], str]:
    """``(residual_mb, residual_shapes, source)``: flashlax._residuals.residual_bytes when the package has it,
    else :func:`_residuals_from_vjp_closure`. ``source`` names which one measured."""
    try:
        from flashlax._residuals import residual_bytes  # noqa: PLC0415
    except ImportError:
        residual_bytes = None
    if residual_bytes is not None:
        total, shapes = residual_bytes(fn, *args)
        return total / MB, list(shapes), "flashlax._residuals.residual_bytes"
    total, shapes = _residuals_from_vjp_closure(fn, *args)
    return total / MB, shapes, "flashlax.bench.harness (vjp closure leaves, inputs excluded)"


# ----------------------------------------------------------------------------------------------------------
# Errors against a reference


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (the tests' definition); inf when x has non-finite values."""
    x = np.asarray(jax.device_get(x), dtype=np.float64)
    ref = np.asarray(jax.device_get(ref), dtype=np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"rel_err: output shape {x.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(x)):
        return math.inf
    denom = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(x - ref))
    return num / denom if denom > 0 else num


def errors_against(out, grads: dict | None, ref_out, ref_grads: dict | None) -> dict[str, Any]:
    """``rel_err`` (of the output; with gradients, the largest of output and gradient errors, as in the
    seeds) and ``rel_err_grads`` ({input name: error} or None)."""
    out_err = rel_err(out, ref_out)
    if grads is None or ref_grads is None:
        return {"rel_err": out_err, "rel_err_grads": None}
    grad_errs = {name: rel_err(grads[name], ref_grads[name]) for name in ref_grads}
    return {"rel_err": max([out_err, *grad_errs.values()]), "rel_err_grads": grad_errs}


def json_safe(value):
    """inf/nan -> str (JSON has neither), numpy scalars -> Python numbers, recursively."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def random_normal(key, shape, dtype) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)
