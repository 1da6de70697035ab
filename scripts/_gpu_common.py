"""Helpers shared by the GPU check-and-time scripts (gpu_ab.py, gpu_paged.py, gpu_ssd.py)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def rnd(key, shape, dtype):
    """Fresh standard-normal input (never zeros), drawn in float32 and cast."""
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


def attention_inputs(B, H, HKV, L, D, dtype=jnp.bfloat16):
    """q, k, v, dout: fresh random inputs, heads-first ([B, H, L, D], K/V with HKV heads)."""
    return (rnd(1, (B, H, L, D), dtype), rnd(2, (B, HKV, L, D), dtype), rnd(3, (B, HKV, L, D), dtype),
            rnd(4, (B, H, L, D), dtype))


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def bench(f, *a, target_ms=60.0, reps=7, min_iters=3):
    """(median ms per call, first-call seconds): one compile call, then `reps` samples of back-to-back calls
    sized so one sample lasts about `target_ms`."""
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    one = max(time.perf_counter() - t, 1e-5)
    iters = int(min(50, max(min_iters, target_ms / 1e3 / one)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*a)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(times), compile_s


def timed(fn, arg_sets, *, calls: int, reps: int, singles: int, sync=jax.block_until_ready):
    """(throughput ms per call, latency ms): THROUGHPUT = ``calls`` calls queued back to back rotating through
    ``arg_sets`` (input copies, so one pass is larger than L2), one sync, ms per call, median of ``reps``
    samples; LATENCY = median of ``singles`` single synchronised calls. Compiles/warms up first."""
    for args in arg_sets:
        sync(fn(*args))
    thr = []
    for _ in range(reps):
        sync(fn(*arg_sets[-1]))
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        sync(out)
        thr.append((time.perf_counter() - start) * 1e3 / calls)
    lat = []
    for i in range(singles):
        start = time.perf_counter()
        sync(fn(*arg_sets[i % len(arg_sets)]))
        lat.append((time.perf_counter() - start) * 1e3)
    return statistics.median(thr), statistics.median(lat)


def dispatch_us(fn, args, calls=200):
    """Host microseconds per call when nothing waits for the GPU (``calls`` calls, no sync; median of 5 loops).
    Where the GPU takes longer per call than the host, the queue fills and this is the GPU's pace instead."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        jax.block_until_ready(fn(*args))
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        samples.append((time.perf_counter() - t) / calls * 1e6)
        jax.block_until_ready(out)
    return statistics.median(samples)
