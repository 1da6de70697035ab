"""The GPU timeline of queued decode calls (issue 14, B1 L16384): ``jax.profiler`` traces ``--calls`` calls queued
back to back (one sync) of the shipped decode op, the kernel alone and jax xla's GQA attention, and reads the
Perfetto trace it writes: per kernel name the count and mean duration on the GPU, and per variant the span of
the queued calls on the GPU, the summed kernel time and the summed idle gaps between kernels (what the GPU
waits for the host); and the host side's events (XLA thunks, CUDA API calls) per call, to find which step of
the decode launch costs the ~11 us more host time than a trivial Pallas kernel. Writes the summary as JSON.

  PYTHONPATH=$PWD python3 scripts/gpu_trace.py --out $OUT/trace.json
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import tempfile

import jax
import jax.numpy as jnp

import flashlax
from flashlax.kernels import decode as dk
from flashlax.kernels.configs import decode_config
from _gpu_common import log, rnd
from gpu_dispatch import trivial

HQ, HKV, D = 32, 8, 128


def load_events(trace_dir):
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        return []
    with gzip.open(paths[0]) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gpu_pids(events):
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and any(s in str(e.get("args", {}).get("name", "")) for s in ("/device:GPU", "GPU"))}


def host_summary(events, calls, top=25):
    """Host-side complete events (XLA thunks, PjRt execute, CUDA API calls such as cuLaunchKernel) grouped by
    name: count and mean / total microseconds per queued call, the `top` by total. Where the host time of one
    call goes, event by event (nested events overlap: read them as a tree, not a sum)."""
    if not events:
        return {}
    gp = gpu_pids(events)
    by = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gp:
            name = re.sub(r"[0-9]+", "#", str(e.get("name")))[:80]
            by.setdefault(name, []).append(float(e.get("dur", 0.0)))
    rows = sorted(((n, len(d), statistics.mean(d), sum(d) / calls) for n, d in by.items() if len(d) >= calls // 2),
                  key=lambda r: -r[3])[:top]
    return {n: {"count": c, "mean_us": round(m, 2), "us_per_call": round(t, 2)} for n, c, m, t in rows}


def device_events(events):
    """Complete events ("ph": "X") of the trace's GPU tracks: [(name, ts_us, dur_us)] sorted by start."""
    if not events:
        return []
    gp = gpu_pids(events)
    out = [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
           if e.get("ph") == "X" and e.get("pid") in gp]
    if not out:   # for the log: which tracks there were
        return {"error": "no GPU events", "processes": sorted({str(e.get("args", {}).get("name")) for e in events
                                                                if e.get("name") == "process_name"})}
    return sorted(out, key=lambda e: e[1])


def summarize(events, calls):
    if not events:
        return {"error": "no GPU events in the trace"}
    if isinstance(events, dict):
        return events
    by_name = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur)
    start, end = events[0][1], max(ts + dur for _, ts, dur in events)
    busy = sum(dur for _, _, dur in events)
    gaps = [b[1] - (a[1] + a[2]) for a, b in zip(events, events[1:])]
    return {"span_us_per_call": (end - start) / calls, "kernel_us_per_call": busy / calls,
            "gap_us_per_call": sum(g for g in gaps if g > 0) / calls,
            "median_gap_us": statistics.median(gaps) if gaps else 0.0,
            "kernels": {n: {"count": len(d), "mean_us": statistics.mean(d)} for n, d in by_name.items()}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="trace.json")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--length", type=int, default=16384)
    args = p.parse_args()
    length = args.length
    sets = [(rnd(10 * i + 1, (1, HQ, 1, D), jnp.bfloat16), rnd(10 * i + 2, (1, HKV, length, D), jnp.bfloat16),
             rnd(10 * i + 3, (1, HKV, length, D), jnp.bfloat16)) for i in range(3)]
    lens = jnp.full((1,), length, jnp.int32)
    cfg = dataclasses.replace(decode_config(D, D, jnp.bfloat16, jax.devices()[0].device_kind), merge_in_kernel_kb=0)
    variants = {
        "full": jax.jit(lambda q, k, v: flashlax.decode_attention(q, k, v, impl="pallas")),
        "kernel_only": jax.jit(lambda q, k, v: dk.kernel_outputs(q, k, v, lens, scale=D ** -0.5, num_splits=None,
                                                                 config=cfg)[:2]),
        "jax_xla_gqa": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), implementation="xla")),
        "empty_jit": jax.jit(lambda q, k, v: q + 1),
    }
    trivial_fn, trivial_args = trivial(1)     # the host cost of a Pallas launch as such (its own input)
    variants["pallas_trivial"] = lambda q, k, v: trivial_fn(*trivial_args)
    results = {}
    for name, fn in variants.items():
        for s in sets:
            jax.block_until_ready(fn(*s))
        with tempfile.TemporaryDirectory() as tmp:
            jax.block_until_ready(fn(*sets[0]))
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                out = None
                for i in range(args.calls):
                    out = fn(*sets[i % len(sets)])
                jax.block_until_ready(out)
            events = load_events(tmp)
            results[name] = summarize(device_events(events), args.calls)
            results[name]["host"] = host_summary(events, args.calls)
        log(name, json.dumps(results[name])[:3000])
    json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
