"""Decode kernel on a GPU in one call: correctness against jax's XLA attention, a sweep of kernel variants
(DecodeConfig x num_splits), the split merge alone, and the peers, on the decode shapes of issue 14.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 scripts/gpu_decode.py --out $OUT/decode.json
  --tiny: interpret mode on CPU at scaled-down shapes (a dry run of the whole script), no cuDNN / torch.
  --round 2 --no-peers: the second call's questions (ROUND2: the kernel without the merge, a Pallas merge
  kernel, other occupancies); results in docs/PERF_NOTES.md ("decode_attention Pallas kernel"). Kept while
  the merge question is open.

Timing (per variant): THROUGHPUT = ``--calls`` calls queued back to back rotating through input copies
(enough that one pass over them is > 3x the 50 MB L2), one block_until_ready, ms per call, median of
``--reps`` samples; LATENCY = median of single synchronised calls. TB/s = K+V bytes / throughput time;
"of copy" = that over the 4.3 TB/s device-copy ceiling (ANCHORS.md). Variants run until ``--deadline``
seconds after start; the table is printed as it goes and written to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _gpu_common import log, rel, rnd, timed  # noqa: E402 (scripts/ is on sys.path)
from flashlax.kernels.configs import DecodeConfig, decode_config  # noqa: E402
from flashlax.kernels.decode import (choose_num_splits, decode_attention_pallas, kernel_outputs,  # noqa: E402
                                    merge_splits)

HQ, HKV, D = 32, 8, 128
COPY_TBPS = 4.3
L2_BYTES = 50 * 2 ** 20
SHAPES = [(1, 1, 16384), (1, 1, 65536), (8, 1, 16384), (32, 1, 4096), (1, 16, 65536), (4, 4, 32768)]

# Variants per shape: (name, config overrides or None for the shipped config, num_splits or a factor
# string "x2" / "/2" of the automatic choice, or None for automatic).
BASE = [("shipped auto", None, None)]
CFG_SWEEP = [("bk64 w4 s4", dict(block_kv=64, num_stages=4), None),
             ("bk128 w4 s2", dict(block_kv=128, num_stages=2), None),
             ("bk128 w4 s3", dict(block_kv=128, num_stages=3), None)]
VARIANTS = {
    (1, 1, 16384): BASE + [("splits x2", None, "x2"), ("splits /2", None, "/2")] + CFG_SWEEP[:1] + CFG_SWEEP[2:],
    (1, 1, 65536): BASE + [("splits x2", None, "x2"), ("splits /2", None, "/2"), ("splits 16", None, 16)] + CFG_SWEEP,
    (8, 1, 16384): BASE + [("splits x2", None, "x2"), ("splits /2", None, "/2")] + CFG_SWEEP,
    (32, 1, 4096): BASE + [("splits 1", None, 1), ("splits 2", None, 2), ("splits 4", None, 4)] + CFG_SWEEP[:2],
    (1, 16, 65536): BASE + [("splits x2", None, "x2"), ("bk64 w8 s3", dict(num_warps=8), None)] + CFG_SWEEP[:2],
    (4, 4, 32768): BASE + [("splits /2", None, "/2")] + CFG_SWEEP[:1] + CFG_SWEEP[2:],
}
# Call 2 (after the split rule changed to one wave): where the rest of the time goes. "kernel only" is the
# kernel without the merge (partials out); "pallas merge" replaces the fused XLA merge by one small Pallas
# kernel (below); programs_per_sm 3 with 2 stages fits three programs per SM.
ROUND2 = {
    (1, 1, 65536): BASE + [("kernel only", "kernel", None), ("pallas merge", "pallas_merge", None),
                           ("bk64 s2 pps3", dict(num_stages=2, programs_per_sm=3), None),
                           ("bk32 s4", dict(block_kv=32, num_stages=4), None)],
    (1, 1, 16384): BASE + [("kernel only", "kernel", None), ("pallas merge", "pallas_merge", None)],
    (8, 1, 16384): BASE + [("kernel only", "kernel", None), ("bk64 s2 pps3", dict(num_stages=2, programs_per_sm=3),
                                                             None)],
    (1, 16, 65536): BASE + [("kernel only", "kernel", None), ("pallas merge", "pallas_merge", None),
                            ("splits 16", None, 16)],
}
RESULTS: list[dict] = []


def pallas_merge(parts, lse, out_dtype, block_d: int | None = None):
    """The split merge as one Pallas kernel: grid (B * Hkv, Dv / block_d), each program loads all splits'
    lse [S, rows] and partial outputs [S, rows, block_d] (padded to powers of two, masked) and writes
    out [B, Hkv, rows, Dv]."""
    from jax.experimental import pallas as pl  # noqa: PLC0415
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
    from flashlax.kernels._tiles import pow2  # noqa: PLC0415

    batch, heads, splits, rows, dv = parts.shape
    sp, rp = pow2(splits), pow2(rows)
    block_d = block_d or max(4, min(32, 4096 // (sp * rp)))   # at most 4096 float32 per [S, rows, d] tile

    def kernel(p_ref, l_ref, o_ref):
        d0 = pl.program_id(1) * block_d
        s_ok = jnp.arange(sp, dtype=jnp.int32) < splits
        r_ok = jnp.arange(rp, dtype=jnp.int32) < rows
        sr = s_ok[:, None] & r_ok[None, :]
        lse_t = plgpu.load(l_ref.at[pl.ds(0, sp), pl.ds(0, rp)], mask=sr, other=-jnp.inf)
        m = jnp.max(lse_t, axis=0)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        w = jnp.exp(lse_t - m[None, :])
        total = jnp.sum(w, axis=0)
        o = plgpu.load(p_ref.at[pl.ds(0, sp), pl.ds(0, rp), pl.ds(d0, block_d)],
                       mask=jnp.broadcast_to(sr[:, :, None], (sp, rp, block_d)), other=0.0)
        out = jnp.sum(o * w[:, :, None], axis=0) / jnp.where(total > 0, total, 1.0)[:, None]
        plgpu.store(o_ref.at[pl.ds(0, rp), pl.ds(d0, block_d)], out.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(r_ok[:, None], (rp, block_d)))

    return pl.pallas_call(
        kernel, grid=(batch * heads, dv // block_d),
        in_specs=[pl.BlockSpec((None, None, splits, rows, dv), lambda i, j: (i // heads, i % heads, 0, 0, 0)),
                  pl.BlockSpec((None, None, splits, rows), lambda i, j: (i // heads, i % heads, 0, 0))],
        out_specs=pl.BlockSpec((None, None, rows, dv), lambda i, j: (i // heads, i % heads, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, rows, dv), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=jax.default_backend() == "cpu", name="decode_merge")(parts, lse)


def dense_mask(lq: int, lkv: int):
    """bool [Lq, Lkv]: new token i sees the cache up to position Lkv - Lq + i (what peers are given)."""
    return (jnp.arange(lkv)[None, :] <= (lkv - lq + jnp.arange(lq))[:, None]) if lq > 1 else None


def record(shape, impl, kv_bytes, thr, lat, err, extra=None):
    b, lq, lkv = shape
    tbps = kv_bytes / (thr * 1e-3) / 1e12
    row = dict(batch=b, lq=lq, lkv=lkv, impl=impl, throughput_ms=thr, latency_ms=lat, kv_tbps=tbps,
               of_copy=tbps / COPY_TBPS, floor_ms=kv_bytes / (COPY_TBPS * 1e12) * 1e3, rel_err_vs_jax_xla=err,
               **(extra or {}))
    RESULTS.append(row)
    log(f"B{b} Lq{lq} L{lkv} | {impl:<34} | thr {thr:.4f} ms {tbps:.2f} TB/s ({tbps / COPY_TBPS:.0%}) | "
        f"lat {lat:.4f} ms | err {err if err is None else f'{err:.1e}'}")


def splits_for(shape, cfg: DecodeConfig, spec, rows: int) -> int | None:
    b, lq, lkv = shape
    if spec is None or isinstance(spec, int):
        return spec
    auto = choose_num_splits(b, HKV, lkv, config=cfg, row_blocks=math.ceil(rows / cfg.block_rows))
    return max(1, auto * 2 if spec == "x2" else auto // 2)


def run_shape(shape, args, deadline: float, torch):
    b, lq, lkv = shape
    itemsize = 2
    kv_bytes = 2 * b * HKV * lkv * D * itemsize
    copies = 1 if args.tiny else max(2, min(4, math.ceil(3 * L2_BYTES / kv_bytes)))
    dtype = jnp.bfloat16
    sets = [(rnd(10 * c + 1, (b, HQ, lq, D), dtype), rnd(10 * c + 2, (b, HKV, lkv, D), dtype),
             rnd(10 * c + 3, (b, HKV, lkv, D), dtype)) for c in range(copies)]
    timing = dict(calls=args.calls, reps=args.reps, singles=args.singles)
    mask = dense_mask(lq, lkv)
    btnh = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    peer_sets = [tuple(btnh(x) for x in s) for s in sets]

    def jax_peer(impl):
        m = None if mask is None else mask[None, None]
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=m, implementation=impl))

    ref = jax.jit(jax_peer("xla"))(*peer_sets[0])
    ref = np.asarray(btnh(ref), np.float32)
    thr, lat = timed(jax_peer("xla"), peer_sets, **timing)
    record(shape, "jax_xla", kv_bytes, thr, lat, 0.0)
    if not (args.tiny or args.no_peers):
        try:
            out = jax_peer("cudnn")(*peer_sets[0])
            err = rel(np.asarray(btnh(out), np.float32), ref)
            thr, lat = timed(jax_peer("cudnn"), peer_sets, **timing)
            record(shape, "jax_cudnn", kv_bytes, thr, lat, err)
        except Exception as exc:  # noqa: BLE001
            log(f"jax_cudnn failed: {type(exc).__name__}: {str(exc)[:200]}")
    if torch is not None:
        try:
            tsets = [tuple(torch.from_dlpack(x) for x in s) for s in sets]
            tmask = None if mask is None else torch.from_dlpack(mask)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def tfn(q, k, v):
                with torch.no_grad():
                    return sdpa(q, k, v, attn_mask=tmask, enable_gqa=True)

            out = tfn(*tsets[0])
            err = rel(out.float().cpu().numpy(), ref)
            thr, lat = timed(tfn, tsets, sync=lambda o: (torch.cuda.synchronize(), o)[1], **timing)
            record(shape, "torch_sdpa", kv_bytes, thr, lat, err)
            del tsets
        except Exception as exc:  # noqa: BLE001
            log(f"torch_sdpa failed: {type(exc).__name__}: {str(exc)[:200]}")
    if args.round == 1:
        run_xla_path(shape, sets, ref, kv_bytes, timing)
    run_variants(shape, sets, ref, kv_bytes, timing, args, deadline)
    del sets, peer_sets


def run_xla_path(shape, sets, ref, kv_bytes, timing):
    from flashlax.fallbacks.decode import decode_attention_xla  # noqa: PLC0415
    b, lq, lkv = shape
    xla_fn = jax.jit(lambda q, k, v: decode_attention_xla(q, k, v, kv_lens=jnp.full((b,), lkv, jnp.int32),
                                                          scale=D ** -0.5))
    with jax.numpy_rank_promotion("allow"):
        err = rel(np.asarray(xla_fn(*sets[0]), np.float32), ref)
        thr, lat = timed(xla_fn, sets, **timing)
    record(shape, "decode_xla (flashlax xla path)", kv_bytes, thr, lat, err)


def run_variants(shape, sets, ref, kv_bytes, timing, args, deadline):
    b, lq, lkv = shape
    dtype = jnp.bfloat16
    shipped = decode_config(D, D, dtype, "NVIDIA H200" if args.tiny else None)
    lens = jnp.full((b,), lkv, jnp.int32)
    for name, overrides, split_spec in VARIANTS[shape]:
        if time.perf_counter() > deadline:
            log(f"deadline: skipping {name} and the rest of B{b} Lq{lq} L{lkv}")
            break
        stage = overrides if isinstance(overrides, str) else None
        cfg = dataclasses.replace(shipped, **(overrides if isinstance(overrides, dict) else {}))
        splits = splits_for(shape, cfg, split_spec, HQ // HKV * lq)
        kind = "NVIDIA H200" if args.tiny else None
        if stage is None:
            fn = jax.jit(lambda q, k, v, cfg=cfg, splits=splits: decode_attention_pallas(
                q, k, v, kv_lens=lens, num_splits=splits, config=cfg, interpret=args.tiny, device_kind=kind))
        else:
            def fn(q, k, v, cfg=cfg, splits=splits, stage=stage):
                parts, lse, used = kernel_outputs(q, k, v, lens, scale=D ** -0.5, num_splits=splits, config=cfg,
                                                  interpret=args.tiny, device_kind=kind)
                if stage == "kernel" or used == 1:   # partials (or one split's final output)
                    return parts
                return pallas_merge(parts, lse, dtype).reshape(b, HQ, lq, D)
            fn = jax.jit(fn)
        try:
            start = time.perf_counter()
            out = np.asarray(fn(*sets[0]), np.float32)
            compile_s = time.perf_counter() - start
            err = rel(out, ref) if out.shape == ref.shape else None
            thr, lat = timed(fn, sets, **timing)
        except Exception as exc:  # noqa: BLE001
            log(f"pallas {name} failed: {type(exc).__name__}: {str(exc)[:400]}")
            continue
        used = splits or choose_num_splits(b, HKV, lkv, config=cfg,
                                           row_blocks=math.ceil(HQ // HKV * lq / cfg.block_rows))
        record(shape, f"pallas {name} (S={used})", kv_bytes, thr, lat, err,
               dict(config=dataclasses.asdict(cfg), num_splits=used, compile_s=compile_s))
    if shape in ((1, 1, 65536), (1, 1, 16384)) and time.perf_counter() < deadline:
        # The merge alone, on partials of the automatic split count's shape.
        splits = choose_num_splits(b, HKV, lkv, config=shipped)
        parts = [(jnp.ones((b, HKV, splits, HQ // HKV * lq, D), jnp.float32),
                  jnp.zeros((b, HKV, splits, HQ // HKV * lq), jnp.float32))]
        thr, lat = timed(jax.jit(merge_splits), parts, **timing)
        record(shape, f"merge alone (S={splits})", kv_bytes, thr, lat, None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="decode_gpu.json")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--deadline", type=float, default=100.0, help="seconds after start: stop starting variants")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--singles", type=int, default=20)
    p.add_argument("--round", type=int, default=1, help="1: the first call's sweep; 2: ROUND2")
    p.add_argument("--no-peers", action="store_true", help="skip jax_cudnn and torch_sdpa")
    args = p.parse_args()
    global SHAPES, VARIANTS
    if args.round == 2:
        VARIANTS = ROUND2
        SHAPES = list(ROUND2)
    if args.tiny:
        jax.config.update("jax_platforms", "cpu")
        scaled = {s: (min(s[0], 2), s[1], s[2] // 256) for s in SHAPES}
        VARIANTS = {scaled[s]: v for s, v in VARIANTS.items()}
        SHAPES = [scaled[s] for s in SHAPES]
        args.calls, args.reps, args.singles = 2, 1, 1
    deadline = time.perf_counter() + args.deadline
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, core_count {getattr(dev, 'core_count', None)}, jax {jax.__version__}")
    torch = None
    if not (args.tiny or args.no_peers):
        try:
            import torch  # noqa: PLC0415
            log(f"torch {torch.__version__}")
        except Exception:  # noqa: BLE001
            torch = None
    for shape in SHAPES:
        try:
            run_shape(shape, args, deadline, torch)
        except Exception as exc:  # noqa: BLE001
            log(f"shape {shape} failed: {type(exc).__name__}: {str(exc)[:400]}")
        with open(args.out, "w") as f:
            json.dump({"device": dev.device_kind, "results": RESULTS}, f, indent=1)
    log("summary (throughput ms / TB/s / latency ms):")
    for r in RESULTS:
        print(f"B{r['batch']} Lq{r['lq']} L{r['lkv']:<6} {r['impl']:<36} {r['throughput_ms']:.4f} "
              f"{r['kv_tbps']:.2f} {r['latency_ms']:.4f} err {r['rel_err_vs_jax_xla']}")


if __name__ == "__main__":
    sys.exit(main())
