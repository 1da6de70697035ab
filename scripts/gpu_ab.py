"""Interleaved A/B of flash-attention kernel variants on a GPU (one script, one device call).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 scripts/gpu_ab.py --out $OUT/ab.json

For each shape (bf16, Hq32 Hkv8 D128), every forward variant (FlashConfig) and every backward variant
(BwdConfig, the backward alone on the shipped forward's output) is compiled once and checked against the
first variant (max |difference|, and the float32 reference error at a small shape), then timed in
``--rounds`` interleaved rounds (variant order rotates each round) so that clock or power drift hits
every variant alike. Reported: the median of the per-round medians, and every round's value.
``--smoke``: interpret mode on CPU, tiny shapes, no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from flashlax import masks
from flashlax.kernels import flash_attention_bwd as fab
from flashlax.kernels.configs import FlashConfig
from flashlax.kernels.flash_attention import flex_attention_pallas
from flashlax.reference import attention_reference

from _gpu_common import attention_inputs as inputs, bench, log, rel  # noqa: E402 (scripts/ is on sys.path)

C = fab.BwdConfig
# Variants: edit these dicts for the next experiment (session 4 ran FMA-folded exp2 on/off, a fused
# dK/dV + dQ launch and flex's 128/64 tiles; session 5 tiles for two programs per SM, q-major, prefetched
# scores; docs/PERF_NOTES.md). The first entry of each is the baseline.
# Session 6: 128/64 w4 s2 for masked calls (64-key kernel tiles inside 128-key mask tiles) and where the
# unmasked 128/64 config stops winning:
#   --skip-check --shapes "B2 T4096 causal" "B1 T16384 causal" "B1 T8192 full" "B1 T16384 full"
FWD = {
    "fwd 128/128 w8 s3 (unmasked > 4096 keys)": FlashConfig(128, 128, 8, 3),
    "fwd 128/64 w4 s2 (shipped otherwise)": FlashConfig(128, 64, 4, 2),
}
# name -> (config, index_path): index_path=True gives an unmasked call an all-full 128x128 block mask, so it
# runs the block-mask loops (index arrays) instead of the dense static loops (session 4's A/B of those).
BWD: dict = {}
ROWS: list[dict] = []


def make_fns(mm, L, D, interp):
    fwd = {n: jax.jit(lambda q, k, v, c=c: flex_attention_pallas(q, k, v, mask_mod=mm, config=c, interpret=interp))
           for n, c in FWD.items()}
    bm = masks.create_block_mask(mm, None, None, L, L, block_q=128, block_kv=128)
    bwd = {n: jax.jit(lambda q, k, v, o, lse, do, c=c, ix=ix: fab.flash_attention_bwd(
        q, k, v, o, lse, do, block_mask=bm if (mm or ix) else None, mask_mod=mm, scale=D ** -0.5, config=c,
        interpret=interp)[:3]) for n, (c, ix) in BWD.items()}
    return fwd, bwd


def check(interp):
    """Every variant against the float32 materialised reference (f32 inputs, so no bf16 noise), B1 Hq8
    Hkv2 L333 D128 (odd length: edge masks), causal and full."""
    L, D = (45 if interp else 333), (32 if interp else 128)
    q, k, v, do = inputs(1, 8, 2, L, D, jnp.float32)
    fails = 0
    for mm in (masks.causal, None):
        fwd, bwd = make_fns(mm, L, D, interp)
        ref_fn = lambda q, k, v: attention_reference(q, k, v, mask_mod=mm)[0]
        with jax.default_matmul_precision("highest"):       # no tf32 in the reference on the GPU
            ref_out, pull = jax.vjp(ref_fn, q, k, v)
            ref_g = pull(do)
        for n, f in fwd.items():
            cfg = FWD[n]
            small = dataclasses.replace(cfg, block_q=min(cfg.block_q, 64), block_kv=min(cfg.block_kv, 64),
                                        num_stages=2)
            out = flex_attention_pallas(q, k, v, mask_mod=mm, config=small, interpret=interp)
            e = rel(out, ref_out)
            fails += e > 2e-5
            log(f"check {'causal' if mm else 'full':6s} {n:40s} out rel err {e:.2e}")
        out, lse = flex_attention_pallas(q, k, v, mask_mod=mm, return_lse=True, interpret=interp)
        for n, (c, ix) in BWD.items():
            bm = masks.create_block_mask(mm, None, None, L, L, block_q=64, block_kv=64) if (mm or ix) else None
            small = C(16, 32, 32, 16, 4, 4, min(c.num_stages_dkv, 2), min(c.num_stages_dq, 2))
            g = fab.flash_attention_bwd(q, k, v, out, lse, do, block_mask=bm, mask_mod=mm, scale=D ** -0.5,
                                        config=small, interpret=interp)[:3]
            errs = [rel(a, b) for a, b in zip(g, ref_g)]
            fails += max(errs) > 2e-5
            log(f"check {'causal' if mm else 'full':6s} {n:40s} grad rel err " + " ".join(f"{x:.2e}" for x in errs))
    return fails


def time_shape(label, B, L, causal, rounds):
    D = 128
    q, k, v, do = inputs(B, 32, 8, L, D)
    mm = masks.causal if causal else None
    fwd, bwd = make_fns(mm, L, D, False)
    out, lse = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=mm, return_lse=True))(q, k, v)
    flops = 4 * B * 32 * L * L * D * (0.5 if causal else 1.0)
    jobs = [(n, f, (q, k, v), 1.0) for n, f in fwd.items()] + \
           [(n, f, (q, k, v, out, lse, do), 2.5) for n, f in bwd.items()]
    base = {}
    for n, f, a, _ in jobs:       # compile + agreement with the first variant of its kind
        try:
            t = time.perf_counter()
            r = jax.block_until_ready(f(*a))
            kind = n.split()[0]
            if kind not in base:
                base[kind] = r
            diff = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                       for x, y in zip(jax.tree.leaves(r), jax.tree.leaves(base[kind])))
            log(f"compile {label} {n:40s} {time.perf_counter() - t:5.1f}s  max|diff| vs first {diff:.3e}")
        except Exception as ex:  # noqa: BLE001 (a variant that does not compile is a result)
            log(f"EXC {label} {n}: {type(ex).__name__}: {str(ex)[:300]}")
            ROWS.append(dict(shape=label, impl=n, error=f"{type(ex).__name__}: {str(ex)[:300]}"))
            jobs = [j for j in jobs if j[0] != n]
    samples = {n: [] for n, *_ in jobs}
    for r in range(rounds):
        order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
        for n, f, a, _ in order:
            samples[n].append(bench(f, *a, target_ms=40.0, reps=5)[0])
    for n, f, a, mult in jobs:
        ms = statistics.median(samples[n])
        tf = flops * mult / ms / 1e9
        log(f"time {label:20s} {n:40s} {ms:8.3f} ms {tf:6.1f} TFLOP/s  rounds " +
            " ".join(f"{x:.3f}" for x in samples[n]))
        ROWS.append(dict(shape=label, impl=n, ms=ms, tflops=tf, rounds=samples[n]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--shapes", nargs="*", default=["B2 T4096 full", "B2 T4096 causal"])
    args = p.parse_args()
    fails = 0 if args.skip_check else check(args.smoke)
    log(f"check failures: {fails}")
    if not args.smoke:
        for s in args.shapes:
            b, t, m = s.split()
            time_shape(s, int(b[1:]), int(t[1:]), m == "causal", args.rounds)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(rows=ROWS, fails=int(fails), device=jax.devices()[0].device_kind), fh, indent=1)


if __name__ == "__main__":
    main()
