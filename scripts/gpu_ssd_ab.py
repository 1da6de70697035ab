"""ssd config A/B in one process (issue 15): for each shape, the shipped H200 config and variants of it (SSDConfig
overrides), end to end (forward, and forward + backward with the backward "auto" picks) and per kernel (the
precompute and the state pass, each alone on its own inputs), with the largest relative difference of each
variant's output (and, with the backward, every gradient) from the shipped one's.

  PYTHONPATH=$PWD python3 scripts/gpu_ssd_ab.py --out $OUT/ssd_ab.json [--shapes bf16_128,f32_128]
      [--kernels precompute,state,dout,dqk,precompute_bwd,wy]
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
          "bf16_256": ((2, 8, 4096, 256), jnp.bfloat16), "f32_64": ((2, 8, 8192, 64), jnp.float32),
          "f32_64nb": ((2, 8, 8192, 64), jnp.float32)}      # nb: without beta
VARIANTS = {"shipped": {}, "kdec": dict(kdec=True), "s3": dict(state_stages=3),
            "kdec s3": dict(kdec=True, state_stages=3), "nokdec": dict(kdec=False),
            "pw4": dict(warps=(("wy", 4), ("dqk", 4), ("out", 4), ("precompute", 4))),
            "out w8": dict(warps=(("wy", 4), ("dqk", 4), ("precompute", 2))),
            "subst": dict(ut_subst=True), "nosubst": dict(ut_subst=False),
            "fuse": dict(fuse_out=True), "nofuse": dict(fuse_out=False),
            "fuse s3": dict(fuse_out=True, state_stages=3), "fuse w8": dict(fuse_out=True, state_warps=8),
            "fuse bv16": dict(fuse_out=True, state_block_v=16), "fuse bv64": dict(fuse_out=True, state_block_v=64),
            "subst pw4": dict(ut_subst=True, warps=(("wy", 4), ("dqk", 4), ("out", 4), ("precompute", 4))),
            # session 24: the backward's stored P (dout -> dqk) and k k^T * G_strict (precompute -> wy)
            "sp": dict(store_p=True), "skg": dict(store_kg=True), "sp skg": dict(store_p=True, store_kg=True),
            "sp skg wy64": dict(store_p=True, store_kg=True, blocks=(("wy", 64),)),
            "sp skg pack": dict(store_p=True, store_kg=True, wy_pack=True),
            "sp skg pack wy32": dict(store_p=True, store_kg=True, wy_pack=True, blocks=(("wy", 32),)),
            "sp skg pack wy64": dict(store_p=True, store_kg=True, wy_pack=True, blocks=(("wy", 64),)),
            "sp skg pack wy32 w8": dict(store_p=True, store_kg=True, wy_pack=True, blocks=(("wy", 32),),
                                        warps=(("wy", 8),)),
            "skg pack wy32": dict(store_kg=True, wy_pack=True, blocks=(("wy", 32),)),
            "skg wy32": dict(store_kg=True, blocks=(("wy", 32),)),
            "dqkpack": dict(dqk_pack=True), "dqkpairdo": dict(dqk_pair_do=True),
            "dqkpack pairdo": dict(dqk_pack=True, dqk_pair_do=True),
            "dqkpack pairdo w8": dict(dqk_pack=True, dqk_pair_do=True, warps=(("dqk", 8),)),
            "lean": dict(dqk_lean=True), "lean w8": dict(dqk_lean=True, warps=(("dqk", 8),)),
            "lean savet w8": dict(dqk_lean=True, save_t=True, warps=(("dqk", 8),)),
            "savet": dict(save_t=True), "lean savet": dict(dqk_lean=True, save_t=True),
            "lean savet wu8": dict(dqk_lean=True, save_t=True, warps=(("wu", 8),)),
            # session 29, on top of the shipped lean + save_t entry: one knob each
            "wu8": dict(warps=(("wu", 8),)), "wu2": dict(warps=(("wu", 2),)), "dqk2": dict(warps=(("dqk", 2),)),
            "wy8": dict(warps=(("wy", 8),)), "dout8": dict(warps=(("dout", 8),)), "out8": dict(warps=(("out", 8),)),
            "pre2": dict(warps=(("precompute", 2),)), "s2": dict(state_stages=2), "sw8": dict(state_warps=8),
            "sbv32": dict(state_block_v=32), "nolean": dict(dqk_lean=False),
            "saveh": dict(save_h=True), "saveh wu8": dict(save_h=True, warps=(("wu", 8),)),
            "saveh dqk2": dict(save_h=True, warps=(("dqk", 2),)),
            # without beta (shape f32_64nb): the shipped entry runs block_v 32 there, so dqk is not one tile
            "lean nbv64": dict(dqk_lean=True, without_beta=(("store_p", False),)),
            "lean nbv64 sp": dict(dqk_lean=True, without_beta=()),
            "sp skg wy32": dict(store_p=True, store_kg=True, blocks=(("wy", 32),)),
            # chunks of 128 (the same function, other roundings): half the chunk programs and sequential steps
            "c128": dict(chunk=128), "c128 w8": dict(chunk=128, num_warps=8),
            "c128 b128 w8": dict(chunk=128, block=128, num_warps=8, blocks=()),
            "c128 b128 w8 sp skg": dict(chunk=128, block=128, num_warps=8, blocks=(), store_p=True, store_kg=True),
            "c128 wy64 sp skg": dict(chunk=128, blocks=(("wy", 64),), store_p=True, store_kg=True),
            "c128 sp skg": dict(chunk=128, store_p=True, store_kg=True),
            "c128 sp skg w8": dict(chunk=128, store_p=True, store_kg=True, num_warps=8)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ssd_ab.json")
    p.add_argument("--shapes", default="bf16_128,f32_128")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--deadline", type=float, default=240.0)
    p.add_argument("--no-bwd", action="store_true")
    p.add_argument("--kernels", default="precompute,state", help="kernels timed alone per variant")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in the Pallas interpreter (CPU; timings meaningless)")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    for shape_name in args.shapes.split(","):
        (b, h, t, d), dtype = SHAPES[shape_name]
        if args.smoke:
            b, h, t, d = 1, 2, 100, 32
            gpu_ssd.BENCH_KW.update(target_ms=1.0, reps=1, min_iters=1)
        q, k, v, la, beta, do = gpu_ssd.inputs(b, h, t, d, d, dtype, seed=7, with_beta=not shape_name.endswith("nb"))
        base = ssd.make_static(q, k, v, beta, scale=d ** -0.5, chunk_size=64, interpret=args.smoke, config=None,
                               device_kind="NVIDIA H200" if args.smoke else None)
        want = want_grads = None
        for name in args.variants.split(","):
            if time.perf_counter() - t0 > args.deadline:
                log(f"{shape_name} {name}: skipped (deadline)")
                continue
            over = dict(VARIANTS[name])
            chunk = over.pop("chunk", 64)      # a variant key of its own: the kernels' chunk size
            cfg = dataclasses.replace(base.config, **over)
            row = dict(shape=shape_name, variant=name, config=str(cfg))
            try:
                fwd = jax.jit(lambda q, k, v, la, beta, c=cfg: ssd.gated_delta_rule_ssd(
                    q, k, v, la, beta, scale=d ** -0.5, config=c, backward="auto", interpret=args.smoke, chunk_size=chunk))
                out = fwd(q, k, v, la, beta)
                if want is None:
                    want = np.asarray(out, np.float32)
                got = np.asarray(out, np.float32)
                row["max_rel_vs_shipped"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                row["fwd_ms"] = gpu_ssd.timed(fwd, q, k, v, la, beta)[0]
                if not args.no_bwd:
                    fb = gpu_ssd.fwd_bwd(lambda q, k, v, la, beta, c=cfg: ssd.gated_delta_rule_ssd(
                        q, k, v, la, beta, scale=d ** -0.5, config=c, backward="auto", interpret=args.smoke, chunk_size=chunk))
                    grads = [np.asarray(g, np.float32) for g in fb(q, k, v, la, beta, do)[1] if g is not None]
                    if want_grads is None:
                        want_grads = grads
                    row["max_rel_grads_vs_shipped"] = max(
                        float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)) for g, w in zip(grads, want_grads))
                    row["fwd_bwd_ms"] = gpu_ssd.timed(fb, q, k, v, la, beta, do)[0]
                st = dataclasses.replace(base, config=cfg, chunk=chunk)
                kargs = gpu_ssd.kernel_args(st, q, k, v, la, beta, do)
                for kern in args.kernels.split(","):
                    if kern in kargs:
                        row[f"{kern}_ms"] = gpu_ssd.timed(gpu_ssd.kernel_fn(kern, st), *kargs[kern])[0]
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(json.dumps({k_: (round(v_, 4) if k_.endswith("_ms") else f"{v_:.2e}" if isinstance(v_, float) else v_)
                            for k_, v_ in row.items() if k_ != "config"}))
            rows.append(row)
            json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
