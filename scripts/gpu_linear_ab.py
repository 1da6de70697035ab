"""gated_delta_rule on the GPU: which implementation the dispatcher should pick (issue 15), one device call.

  cd <tree> && PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/gpu_linear_ab.py --out $OUT

Times fwd and fwd+bwd (median ms of back-to-back calls, _gpu_common.bench) of chunked, chunked_fat,
ssd (Pallas forward and backward) and ssd_xbwd (Pallas forward, the chunked XLA backward on the same
residuals), most important shapes first, and the largest relative difference of ssd_xbwd's and ssd's output
and gradients from chunked's. Stops starting new shapes after ``--deadline`` seconds; writes
$OUT/linear_ab.json after every row. ``--smoke``: tiny shapes in the Pallas interpreter (timings meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from flashlax.bench.suites import linear_inputs

sys.path.insert(0, os.path.dirname(__file__))
from _gpu_common import T0, bench, log, rel  # noqa: E402
from gpu_ssd import fwd_bwd, impl_fn  # noqa: E402

# (B, H, T, dk=dv, dtype, with beta)
SHAPES = [(2, 8, 8192, 64, "float32", True), (2, 8, 2048, 64, "float32", True), (2, 8, 512, 64, "float32", True),
          (2, 8, 8192, 64, "float32", False), (2, 16, 8192, 128, "bfloat16", True),
          (2, 8, 8192, 128, "float32", True), (2, 8, 2048, 128, "float32", True),
          (2, 8, 4096, 256, "bfloat16", True), (2, 8, 4096, 256, "float32", True)]
SMOKE = [(1, 2, 100, 32, "float32", True), (1, 2, 100, 32, "float32", False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--deadline", type=float, default=200.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--first", type=int, default=0, help="start at this entry of SHAPES (skip measured ones)")
    ap.add_argument("--only", default="", help="comma-separated entries of SHAPES to run, in this order")
    ap.add_argument("--impls", default="chunked,ssd,ssd_xbwd,chunked_fat",
                    help="comma-separated, chunked first (the others' max_rel_vs_chunked)")
    args = ap.parse_args()
    rows, path = [], os.path.join(args.out, "linear_ab.json")
    timing = dict(target_ms=1.0, reps=1, min_iters=1) if args.smoke else dict(target_ms=40.0, reps=5)
    shapes = SHAPES[args.first:] if not args.only else [SHAPES[int(i)] for i in args.only.split(",")]
    for b, h, t, d, dtype, with_beta in (SMOKE if args.smoke else shapes):
        if time.perf_counter() - T0 > args.deadline:
            log("deadline: stop before", (b, h, t, d, dtype, with_beta))
            break
        q, k, v, la, beta, do = linear_inputs(0, b, h, t, d, d, jnp.float32)
        q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
        beta = beta if with_beta else None
        ref = None
        for impl in args.impls.split(","):
            kw = dict(interpret=args.smoke, backward="xla" if impl == "ssd_xbwd" else "pallas")
            fn = impl_fn("ssd", **kw) if impl.startswith("ssd") else impl_fn(impl)
            fwd, step = jax.jit(fn), fwd_bwd(fn)
            row = dict(batch=b, heads=h, seq=t, dk=d, dtype=dtype, beta=with_beta, impl=impl,
                       precision=str(jax.config.jax_default_matmul_precision))
            try:
                if impl != "ssd_xbwd":            # its forward is ssd's
                    row["fwd_ms"], _ = bench(fwd, q, k, v, la, beta, **timing)
                row["fwd_bwd_ms"], row["compile_s"] = bench(step, q, k, v, la, beta, do, **timing)
                out, grads = step(q, k, v, la, beta, do)
                flat = [out] + [g for g in grads if g is not None]
                if ref is None:
                    ref = flat
                else:
                    row["max_rel_vs_chunked"] = max(rel(x, y) for x, y in zip(flat, ref))
            except Exception as err:  # noqa: BLE001 - recorded, the next impl still runs
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            log(row)
            rows.append(row)
            with open(path, "w") as f:
                json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
