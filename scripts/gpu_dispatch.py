"""Where a Pallas call's host time goes (issue 14, B1 L16384: the decode kernel's GPU time is shorter than jax
xla's, 21.6 vs 29.0 us chained, yet a jitted call of it costs ~15-20 us more host time than jax xla's five
fusions). Host microseconds per call with nothing waiting for the GPU (``dispatch_us``: 200 calls, no sync,
median of 5 loops) for: an almost empty jit; trivial Pallas kernels (one or 128 programs); the decode kernel
alone (split partials, no merge) at configs of different shared memory (Triton allocates (stages - 1) K/V
tile buffers: 64/4/4 ~134 KB, 64/4/2 ~66 KB, 32/4/2 ~33 KB, 16/4/2 ~17 KB); and XLA's own fusions.

  PYTHONPATH=$PWD python3 scripts/gpu_dispatch.py --out $OUT/dispatch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax.kernels import decode as dk
from flashlax.kernels.configs import decode_config
from _gpu_common import dispatch_us, log, rnd, timed




def trivial(programs: int, warps: int = 4):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    n = 128 * programs
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(programs,),
                          in_specs=[pl.BlockSpec((128,), lambda i: (i,))], out_specs=pl.BlockSpec((128,), lambda i: (i,)),
                          compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1), name="trivial")
    return jax.jit(call), (jnp.ones((n,), jnp.float32),)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="dispatch.json")
    args = p.parse_args()
    rows = []
    q, k, v = rnd(1, (1, 32, 1, 128), jnp.bfloat16), rnd(2, (1, 8, 16384, 128), jnp.bfloat16), rnd(3, (1, 8, 16384, 128), jnp.bfloat16)
    lens = jnp.full((1,), 16384, jnp.int32)
    cfg = dataclasses.replace(decode_config(128, 128, jnp.bfloat16, jax.devices()[0].device_kind), merge_in_kernel_kb=0)
    variants = {"empty_jit": (jax.jit(lambda x: x + 1), (jnp.ones((128,), jnp.float32),)),
                "xla_5_fusions": (jax.jit(lambda x: jnp.sin(jnp.cumsum(jnp.exp(x) @ x.T, 0)).sum(1) / x.sum()),
                                  (jnp.ones((64, 64), jnp.float32),)),
                "pallas_trivial_1": trivial(1), "pallas_trivial_128": trivial(128)}
    for spec in ("64/4/4", "64/4/2", "32/4/2", "16/4/2", "16/4/1"):
        bkv, warps, stages = map(int, spec.split("/"))
        c = dataclasses.replace(cfg, block_kv=bkv, num_warps=warps, num_stages=stages)
        variants[f"decode_kernel_{spec}"] = (jax.jit(lambda q, k, v, c=c: dk.kernel_outputs(
            q, k, v, lens, scale=128 ** -0.5, num_splits=16, config=c)[:2]), (q, k, v))
    for name, (fn, a) in variants.items():
        try:
            d = dispatch_us(fn, a)
            thr, lat = timed(fn, [a], calls=100, reps=5, singles=10)
            row = dict(variant=name, dispatch_us=d, thr_ms=thr, lat_ms=lat)
        except Exception as exc:  # noqa: BLE001
            row = dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:300])
        log(row)
        rows.append(row)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
