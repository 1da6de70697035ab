"""ssd config A/B in one process (issue 15): for each shape, the shipped H200 config and variants of it (SSDConfig
overrides), end to end (forward, and forward + backward with the backward "auto" picks) and per kernel (the
precompute and the state pass, each alone on its own inputs), with the largest relative difference of each
variant's output from the shipped one's.

  PYTHONPATH=$PWD python3 scripts/gpu_ssd_ab.py --out $OUT/ssd_ab.json [--shapes bf16_128,f32_128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_ssd  # noqa: E402
from _gpu_common import log  # noqa: E402

from flashlax.kernels import ssd  # noqa: E402

SHAPES = {"bf16_128": ((2, 16, 8192, 128), jnp.bfloat16), "f32_128": ((2, 8, 8192, 128), jnp.float32),
          "bf16_256": ((2, 8, 4096, 256), jnp.bfloat16), "f32_64": ((2, 8, 8192, 64), jnp.float32)}
VARIANTS = {"shipped": {}, "kdec": dict(kdec=True), "s3": dict(state_stages=3),
            "kdec s3": dict(kdec=True, state_stages=3), "nokdec": dict(kdec=False),
            "pw4": dict(warps=(("wy", 4), ("dqk", 4), ("out", 4), ("precompute", 4))),
            "out w8": dict(warps=(("wy", 4), ("dqk", 4), ("precompute", 2))),
            "subst": dict(ut_subst=True), "nosubst": dict(ut_subst=False),
            "fuse": dict(fuse_out=True), "nofuse": dict(fuse_out=False),
            "fuse s3": dict(fuse_out=True, state_stages=3), "fuse w8": dict(fuse_out=True, state_warps=8),
            "fuse bv16": dict(fuse_out=True, state_block_v=16), "fuse bv64": dict(fuse_out=True, state_block_v=64),
            "subst pw4": dict(ut_subst=True, warps=(("wy", 4), ("dqk", 4), ("out", 4), ("precompute", 4)))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ssd_ab.json")
    p.add_argument("--shapes", default="bf16_128,f32_128")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--deadline", type=float, default=240.0)
    p.add_argument("--no-bwd", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    for shape_name in args.shapes.split(","):
        (b, h, t, d), dtype = SHAPES[shape_name]
        q, k, v, la, beta, do = gpu_ssd.inputs(b, h, t, d, d, dtype, seed=7, with_beta=True)
        base = ssd.make_static(q, k, v, beta, scale=d ** -0.5, chunk_size=64, interpret=False, config=None,
                               device_kind=None)
        want = None
        for name in args.variants.split(","):
            if time.perf_counter() - t0 > args.deadline:
                log(f"{shape_name} {name}: skipped (deadline)")
                continue
            cfg = dataclasses.replace(base.config, **VARIANTS[name])
            row = dict(shape=shape_name, variant=name, config=str(cfg))
            try:
                fwd = jax.jit(lambda q, k, v, la, beta, c=cfg: ssd.gated_delta_rule_ssd(
                    q, k, v, la, beta, scale=d ** -0.5, config=c, backward="auto"))
                out = fwd(q, k, v, la, beta)
                if want is None:
                    want = np.asarray(out, np.float32)
                got = np.asarray(out, np.float32)
                row["max_rel_vs_shipped"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                row["fwd_ms"] = gpu_ssd.timed(fwd, q, k, v, la, beta)[0]
                if not args.no_bwd:
                    fb = gpu_ssd.fwd_bwd(lambda q, k, v, la, beta, c=cfg: ssd.gated_delta_rule_ssd(
                        q, k, v, la, beta, scale=d ** -0.5, config=c, backward="auto"))
                    row["fwd_bwd_ms"] = gpu_ssd.timed(fb, q, k, v, la, beta, do)[0]
                st = dataclasses.replace(base, config=cfg)
                kargs = gpu_ssd.kernel_args(st, q, k, v, la, beta, do)
                for kern in ("precompute", "state"):
                    row[f"{kern}_ms"] = gpu_ssd.timed(gpu_ssd.kernel_fn(kern, st), *kargs[kern])[0]
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                            if k_ != "config"}))
            rows.append(row)
            json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
