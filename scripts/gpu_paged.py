"""Paged KV caches on a GPU in one call (issue 18): correctness of the paged decode kernel against the same
kernel on the contiguous cache, and its time against the contiguous kernel and JAX's in-tree Pallas
``paged_attention``, on the decode shapes (Hq32 Hkv8 D128 bf16); then a correctness check of the flash
forward (flex_attention) with paged K/V.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 scripts/gpu_paged.py --out $OUT/paged.json
  (or scripts/gpu_final.sh paged); the log goes next to the JSON ($OUT/paged_run.log). --tiny: interpret
  mode on CPU at scaled-down shapes.

Variants per shape: "contiguous" (the shipped decode kernel), then VARIANTS below: the shipped paged
kernel on pages of 64 / 16 keys shuffled in the pool (64-key tiles: one table read per tile at p64, a
per-row page lookup at p16; the next tile's pages read one loop step ahead), the same kernel with other
DecodeConfig paging fields, 16-key tiles, and "jax_paged p64" / "jax_paged p16"
(``jax.experimental.pallas.ops.gpu.paged_attention``, Lq = 1 only; its pool layout [Hkv, pages, ...] is
prepared outside the timing; 128 keys per compute block). Timing as scripts/gpu_decode.py
(``_gpu_common.timed``): throughput = 50 calls queued rotating over input copies (> 3x the 50 MB L2), one
sync, ms per call, median of ``--reps``; latency = median single synchronised call. Full caches (kv_lens
= L) for timing; the correctness check uses ragged kv_lens. Variants start until ``--deadline`` seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _gpu_common import log, rel, rnd, timed  # noqa: E402 (scripts/ is on sys.path)
from flashlax.bench.harness import clock_up  # noqa: E402
from flashlax.bench.peers import jax_paged_blocks, page_pool  # noqa: E402
from flashlax.kernels.configs import decode_config  # noqa: E402
from flashlax.kernels.decode import decode_attention_pallas  # noqa: E402

HQ, HKV, D = 32, 8, 128
L2_BYTES = 50 * 2 ** 20
SHAPES = [(1, 1, 65536), (8, 1, 16384), (32, 1, 4096), (1, 16, 65536)]      # (B, Lq, L)
# Relative error of the bf16 output against the contiguous call: the same kernel config must agree to the
# last bit but for page order (1e-3); another block_kv splits and sums in another order, and jax's paged
# kernel scales q in bf16 first, both within a few bf16 roundings (2^-8 each).
TOL = {None: 1e-3, "block_kv": 1e-2, "jax": 2e-2, "splits": 1e-2}   # splits: another split count, see run_shape
TINY = dict(hq=4, hkv=2, d=32, shapes=[(1, 1, 512), (2, 1, 256), (1, 4, 512)], dtype=jnp.float32)
RESULTS: list[dict] = []
# (name, page size, DecodeConfig overrides of the shipped config | "jax"); --variants picks by name.
# Triton's pipeliner gives loads fed by a pipelined (vector) table read in the same loop step (stages - 1) // 2
# steps of lead, and waits on a scalar table read every step; the shipped config reads the pages
# `page_prefetch` steps ahead (carried values): "nopf" reads them in the step (session 14's kernel), "pf<n>"
# n steps ahead (more than one: Triton's pipeliner then gives up on the loop, 2x slower), "st5" 5 stages,
# "scalars" one scalar table read per page, "s3x2" / "s4x1" the paged launch at 3 stages and two programs
# per SM (the H200's shipped paged config) / at the contiguous kernel's 4 stages and one per SM.
S3X2 = (("num_stages", 3), ("programs_per_sm", 2))
VARIANTS = [
    ("paged p64", 64, {}), ("paged p16", 16, {}),
    ("p64 nopf", 64, dict(page_prefetch=0)), ("p16 nopf", 16, dict(page_prefetch=0)),
    ("p16 pf2", 16, dict(page_prefetch=2)), ("p16 pf3", 16, dict(page_prefetch=3)),
    ("p64 pf2", 64, dict(page_prefetch=2)), ("p64 pf3", 64, dict(page_prefetch=3)),
    ("p16 s3x2", 16, dict(paged=S3X2)), ("p64 s3x2", 64, dict(paged=S3X2)),
    ("p16 s4x1", 16, dict(paged=())), ("p64 s4x1", 64, dict(paged=())),
    ("p16 s3x2 pf2", 16, dict(paged=S3X2, page_prefetch=2)),
    ("p16 st5 nopf", 16, dict(paged=(("num_stages", 5), ("programs_per_sm", 2)), page_prefetch=0)),
    # one program per SM, the table read in the step: 7 / 5 stages give K/V 3 / 2 steps of lead (session 16)
    ("p16 st7x1 nopf", 16, dict(paged=(("num_stages", 7),), page_prefetch=0)),
    ("p16 st5x1 nopf", 16, dict(paged=(("num_stages", 5),), page_prefetch=0)),
    ("p16 st9x1 nopf", 16, dict(paged=(("num_stages", 9),), page_prefetch=0)),
    ("p16 st6x1 nopf", 16, dict(paged=(("num_stages", 6),), page_prefetch=0)),
    ("p16 scalars", 16, dict(page_lookup="scalars")), ("p64 rows", 64, dict(page_lookup="rows")),
    ("paged p16 bk16", 16, dict(block_kv=16)), ("jax_paged p64", 64, "jax"), ("jax_paged p16", 16, "jax"),
]


def to_pool(cache, page_size: int, perm):
    """Contiguous [B, H, L, D] -> (pool [B * L / page_size, H, page_size, D] with logical page n of the
    batch-major page order stored at slot perm[n], block_table int32 [B, L / page_size])."""
    batch, _, length, _ = cache.shape
    return page_pool(cache, page_size, perm), perm.reshape(batch, length // page_size).astype(jnp.int32)


def jax_paged_fn(page_size: int, pages_per_sequence: int, interpret: bool):
    """JAX's in-tree Pallas paged_attention (q [B, Hq, D] already scaled: it applies no 1/sqrt(D); pool
    [Hkv, pages, page_size, D]), with its default 16 splits and 8 warps and 128 keys per compute block
    (both cut to divisors of the sequence's pages, as it requires), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import paged_attention as mod  # noqa: PLC0415
    except ImportError as err:
        log(f"jax paged_attention unavailable: {err}")
        return None
    k_splits, per_block = jax_paged_blocks(pages_per_sequence, page_size)

    def fn(q_scaled, k_pool_t, v_pool_t, table, lens):
        return mod.paged_attention(q_scaled[:, :, 0], k_pool_t, v_pool_t, table, lens, k_splits=k_splits,
                                   pages_per_compute_block=per_block, interpret=interpret)[:, :, None]

    return jax.jit(fn)


def record(shape, variant, kv_bytes, thr=None, lat=None, err=None, **extra):
    row = dict(shape=dict(B=shape[0], Lq=shape[1], L=shape[2], Hq=HQ, Hkv=HKV, D=D), variant=variant,
               throughput_ms=thr, latency_ms=lat, kv_tbps=(kv_bytes / (thr * 1e-3) / 1e12) if thr else None,
               rel_err_vs_contiguous=err, **extra)
    RESULTS.append(row)
    contiguous = next((r["throughput_ms"] for r in RESULTS if r["shape"] == row["shape"]
                       and r["variant"] == "contiguous" and r["throughput_ms"]), None)
    ratio = f" ({thr / contiguous:.3f}x contiguous)" if thr and contiguous else ""
    tbps = f"{row['kv_tbps']:.2f} TB/s" if thr else ""
    log(f"  {variant:16s} thr {thr if thr is None else round(thr, 4)} ms {tbps}{ratio}  lat "
        f"{lat if lat is None else round(lat, 4)} ms  err {err}  {extra or ''}")


def run_shape(shape, args, deadline: float):
    batch, q_len, length = shape
    hq, hkv, dim = (TINY["hq"], TINY["hkv"], TINY["d"]) if args.tiny else (HQ, HKV, D)
    dtype = TINY["dtype"] if args.tiny else jnp.bfloat16
    kv_bytes = 2 * batch * hkv * length * dim * jnp.dtype(dtype).itemsize
    copies = 1 if args.tiny else max(2, min(4, math.ceil(3 * L2_BYTES / kv_bytes)))
    log(f"shape B{batch} Lq{q_len} L{length}: KV {kv_bytes / 1e6:.0f} MB, {copies} copies")
    interp = dict(interpret=True, device_kind="NVIDIA H200") if args.tiny else {}
    full = jnp.full((batch,), length, jnp.int32)
    sets = [(rnd(10 * c + 1, (batch, hq, q_len, dim), dtype), rnd(10 * c + 2, (batch, hkv, length, dim), dtype),
             rnd(10 * c + 3, (batch, hkv, length, dim), dtype)) for c in range(copies)]
    ragged = jnp.asarray(np.random.default_rng(0).integers(q_len, length + 1, batch), jnp.int32).at[0].set(length - 3)

    contiguous = jax.jit(lambda q, k, v, lens: decode_attention_pallas(q, k, v, kv_lens=lens, **interp))
    want = contiguous(*sets[0], ragged)
    thr, lat = timed(contiguous, [s + (full,) for s in sets], calls=args.calls, reps=args.reps, singles=args.singles)
    record(shape, "contiguous", kv_bytes, thr, lat, 0.0)

    base = decode_config(dim, dim, dtype, "NVIDIA H200" if args.tiny else None)   # what "contiguous" ran
    variants = [(name, ps, how) for name, ps, how in VARIANTS if how != "jax" or q_len == 1]
    if args.variants:
        variants = [v for v in variants if v[0] in args.variants.split(",")]
    pools = {}
    for name, page_size, how in variants:
        if time.perf_counter() > deadline:
            log(f"  {name}: skipped (deadline)")
            record(shape, name, kv_bytes, skipped="deadline")
            continue
        try:
            if page_size not in pools:
                pages = batch * length // page_size
                perm = jax.random.permutation(jax.random.PRNGKey(page_size), pages)
                pools[page_size] = [(q,) + to_pool(k, page_size, perm) + (to_pool(v, page_size, perm)[0],)
                                    for q, k, v in sets]          # (q, k_pool, table, v_pool)
            psets = pools[page_size]
            if how == "jax":
                fn = jax_paged_fn(page_size, length // page_size, args.tiny)
                if fn is None:
                    record(shape, name, kv_bytes, error="jax paged_attention unavailable")
                    continue
                tsets = [((q * dim ** -0.5).astype(q.dtype), jnp.swapaxes(kp, 0, 1), jnp.swapaxes(vp, 0, 1), t)
                         for q, kp, t, vp in psets]
                got = fn(*tsets[0], ragged)
                thr, lat = timed(fn, [s + (full,) for s in tsets], calls=args.calls, reps=args.reps,
                                 singles=args.singles)
            else:
                cfg = dataclasses.replace(base, **how) if how else None

                def fn(q, kp, vp, table, lens, cfg=cfg):
                    return decode_attention_pallas(q, kp, vp, kv_lens=lens, block_table=table, config=cfg, **interp)

                fn = jax.jit(fn)
                tsets = [(q, kp, vp, t) for q, kp, t, vp in psets]
                got = fn(*tsets[0], ragged)
                thr, lat = timed(fn, [s + (full,) for s in tsets], calls=args.calls, reps=args.reps,
                                 singles=args.singles)
            err = rel(np.asarray(got, np.float32), np.asarray(want, np.float32))
            tol = TOL["jax"] if how == "jax" else TOL["block_kv" if how and "block_kv" in how else None]
            if how != "jax":    # another split count than the contiguous call (programs_per_sm): another sum order
                if (cfg or base).for_paged(page_size).programs_per_sm != base.programs_per_sm:
                    tol = max(tol, TOL["splits"])
            record(shape, name, kv_bytes, thr, lat, err, page_size=page_size, config=how, ok=bool(err < tol))
        except Exception as exc:  # noqa: BLE001 (one failing variant must not lose the others)
            log(f"  {name}: {type(exc).__name__}: {str(exc)[:500]}")
            record(shape, name, kv_bytes, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    del sets, pools


def check_flex(args):
    """The flash forward with paged K/V (p64 and p16, causal, ragged kv_lens) against the contiguous call:
    correctness only (B1 Hq32 Hkv8 L4096 D128 bf16; tiny: scaled down, interpreted)."""
    from flashlax import flex_attention, masks  # noqa: PLC0415

    batch, length = (2, 128) if args.tiny else (2, 4096)
    hq, hkv, dim = (TINY["hq"], TINY["hkv"], TINY["d"]) if args.tiny else (HQ, HKV, D)
    dtype = TINY["dtype"] if args.tiny else jnp.bfloat16
    q, k, v = (rnd(100 + i, (batch, h, length, dim), dtype) for i, h in enumerate((hq, hkv, hkv)))
    lens = jnp.asarray([length, length - length // 3], jnp.int32)
    kw = dict(mask_mod=masks.causal, kv_lens=lens, impl="pallas", interpret=args.tiny)
    want = jax.jit(lambda q, k, v: flex_attention(q, k, v, **kw))(q, k, v)
    for page_size in (64, 16):
        perm = jax.random.permutation(jax.random.PRNGKey(page_size), batch * length // page_size)
        (kp, table), (vp, _) = to_pool(k, page_size, perm), to_pool(v, page_size, perm)
        got = jax.jit(lambda q, kp, vp, t: flex_attention(q, kp, vp, block_table=t, **kw))(q, kp, vp, table)
        err = rel(np.asarray(got, np.float32), np.asarray(want, np.float32))
        RESULTS.append(dict(check="flex_attention paged forward", page_size=page_size, B=batch, L=length,
                            rel_err_vs_contiguous=err, ok=bool(err < 1e-3)))
        log(f"flex paged p{page_size} vs contiguous: rel err {err:.2e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="paged_gpu.json")
    p.add_argument("--tiny", action="store_true", help="interpret mode on CPU, scaled-down shapes")
    p.add_argument("--deadline", type=float, default=75.0,
                   help="seconds after start: stop starting variants (gpu_final.sh's paged step allows 100 s)")
    p.add_argument("--variants", default="", help="comma-separated VARIANTS names (default: all)")
    p.add_argument("--shapes", default="", help="comma-separated BxLqxL shapes (default: SHAPES), e.g. 1x16x65536")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--singles", type=int, default=20)
    args = p.parse_args()
    if args.tiny:
        args.calls, args.reps, args.singles = 2, 1, 1
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.splitext(args.out)[0] + "_run.log"     # not <stem>.log: gpu_final.sh writes that one
    log_file = open(log_path, "w")  # noqa: SIM115 (closed at exit)
    real_stdout = sys.stdout

    class Tee:
        def write(self, text):
            real_stdout.write(text)
            log_file.write(text)

        def flush(self):
            real_stdout.flush()
            log_file.flush()

    sys.stdout = Tee()
    deadline = time.perf_counter() + args.deadline
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}")
    shapes = TINY["shapes"] if args.tiny else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in e.split("x")) for e in args.shapes.split(",")]
    if not args.tiny:
        clock_up()   # the first timed row otherwise runs at the idle clock

    def write():       # after every step, so a cut-off run keeps what finished
        with open(args.out, "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "tiny": args.tiny, "results": RESULTS},
                      f, indent=1)

    try:
        for shape in shapes:
            if time.perf_counter() > deadline:
                log(f"shape {shape}: skipped (deadline)")
                continue
            run_shape(shape, args, deadline)
            write()
        if time.perf_counter() < deadline:
            try:
                check_flex(args)
            except Exception as exc:  # noqa: BLE001
                log(f"flex paged check: {type(exc).__name__}: {str(exc)[:500]}")
                RESULTS.append(dict(check="flex_attention paged forward", error=str(exc)[:300], ok=False))
            write()
        else:
            log("flex paged check: skipped (deadline)")
    finally:
        sys.stdout = real_stdout
        log_file.close()
    failed = [r for r in RESULTS if r.get("ok") is False]
    print(f"wrote {args.out} and {log_path}; {len(RESULTS)} rows, {len(failed)} failed checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
