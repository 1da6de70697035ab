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


def trivial_like_decode(q, k, v, splits=16, rows=16):
    """A trivial Pallas kernel with the decode kernel's operands and outputs (q, k, v in; [B, Hkv, splits, rows,
    D] and [B, Hkv, splits, rows] float32 out) and its (splits, Hkv) grid, each program reading one 16-row
    tile of k: what the launch costs on the host when the kernel body costs nothing."""
    b, hkv, _, d = k.shape

    def kernel(q_ref, k_ref, v_ref, o_ref, l_ref):
        x = k_ref[0, 0, pl.ds(0, rows), :].astype(jnp.float32)
        o_ref[0, 0, 0, :, :] = x
        l_ref[0, 0, 0, :] = jnp.sum(x, axis=1)

    full = lambda shape: pl.BlockSpec(shape, lambda s, h: (0,) * len(shape))
    return pl.pallas_call(
        kernel, grid=(splits, hkv),
        out_shape=(jax.ShapeDtypeStruct((b, hkv, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32)),
        in_specs=[full(q.shape), pl.BlockSpec((1, 1, k.shape[2], d), lambda s, h: (0, h, 0, 0)),
                  pl.BlockSpec((1, 1, v.shape[2], d), lambda s, h: (0, h, 0, 0))],
        out_specs=(pl.BlockSpec((1, 1, 1, rows, d), lambda s, h: (0, h, s, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda s, h: (0, h, s, 0))),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), name="trivial_like_decode")(q, k, v)


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
                "pallas_trivial_1": trivial(1), "pallas_trivial_128": trivial(128),
                "pallas_trivial_decode_io": (jax.jit(trivial_like_decode), (q, k, v)),
                "pallas_trivial_decode_io_1out": (jax.jit(lambda q, k, v: trivial_like_decode(q, k, v)[0]), (q, k, v)),
                "xla_3in_2out": (jax.jit(lambda q, k, v: (k[0, :, :16].astype(jnp.float32) + q[0, :8, :1],
                                                          v[0, :, :16, 0].astype(jnp.float32))), (q, k, v))}
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
