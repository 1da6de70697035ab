"""Checks and times the flex_attention Pallas forward kernel on a GPU (one script, one device call).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 scripts/gpu_flash.py --out $OUT/gpu_flash.json

1. correctness: rel. error against the float32 (HIGHEST) materialised reference on the GPU, bf16 and f32
   (f32 within 1e-5 shows there is no tf32), GQA groups, odd lengths, head dims 64/96/128/192/256, masks,
   mods with captured arrays, fully masked rows, both GQA strategies, determinism, one gradient check;
2. timing: median of timed calls after warm-up (jit, block_until_ready) for several configs
   (block sizes / warps / stages / GQA strategy) and shapes, with jax.nn.dot_product_attention (cuDNN)
   as the in-run peer; TFLOP/s from 4*B*Hq*Lq*Lkv*D (halved when causal).
Prints a table at the end; ``--budget`` seconds bounds the run (later timings are skipped past it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flashlax import masks, score_mods
from flashlax.kernels.configs import FlashConfig, device_family, flash_config
from flashlax.kernels.flash_attention import flex_attention_pallas
from flashlax.reference import attention_reference

from _gpu_common import T0, bench as _bench, log, rel, rnd  # noqa: E402 (scripts/ is on sys.path)

ROWS: list[dict] = []








# ----------------------------------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------------------------------

def check(args):
    fails = 0
    seg = jnp.asarray(np.repeat(np.arange(4), 90)[None, :333].repeat(2, 0), jnp.int32)
    slopes = rnd(7, (8,), jnp.float32)
    table = rnd(8, (8, 2 * 512 - 1), jnp.float32) * 0.5
    cases = [
        # (name, B, Hq, Hkv, Lq, Lkv, D, Dv, score_mod, mask_mod, config)
        ("full d64 g4", 2, 8, 2, 300, 333, 64, 64, None, None, None),
        ("causal d128 g4", 2, 8, 2, 333, 333, 128, 128, None, masks.causal, None),
        ("causal d128 g4 pack", 2, 8, 2, 333, 333, 128, 128, None, masks.causal,
         FlashConfig(128, 64, 8, 3, pack_gqa=True)),
        ("causal d96 g3", 1, 6, 2, 257, 257, 96, 96, None, masks.causal, None),
        ("window d192/128 g1", 1, 4, 4, 333, 300, 192, 128, None, masks.sliding_window(64), None),
        ("doc d256 g8", 2, 8, 1, 333, 333, 256, 256, None, masks.document(seg), None),
        ("prefix+alibi d64 g2", 1, 8, 4, 300, 333, 64, 64, score_mods.alibi(slopes), masks.prefix_lm(40), None),
        ("relbias+causal d128 g4", 1, 8, 2, 333, 333, 128, 128, score_mods.relative_bias(table), masks.causal,
         None),
        ("softcap d128 g4", 1, 8, 2, 200, 333, 128, 128, score_mods.softcap(5.0), None, None),
        ("masked rows d64", 1, 4, 2, 200, 200, 64, 64, None, lambda b, h, i, j: (j <= i) & (i >= 50), None),
    ]
    if args.smoke or args.small_check:
        cases = [c for c in cases if c[0] in ("window d192/128 g1", "relbias+causal d128 g4", "masked rows d64")]
    for dtype in (jnp.bfloat16, jnp.float32):
        tol = 3e-2 if dtype == jnp.bfloat16 else 1e-5
        for n, (name, B, hq, hkv, lq, lkv, d, dv, sm, mm, cfg) in enumerate(cases):
            q = rnd(3 * n, (B, hq, lq, d), dtype)
            k = rnd(3 * n + 1, (B, hkv, lkv, d), dtype)
            v = rnd(3 * n + 2, (B, hkv, lkv, dv), dtype)
            try:
                out, lse = jax.jit(lambda q, k, v: flex_attention_pallas(
                    q, k, v, score_mod=sm, mask_mod=mm, return_lse=True, config=cfg))(q, k, v)
                ro, rl = attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                             v.astype(jnp.float32), score_mod=sm, mask_mod=mm)
                e = rel(out, ro)
                fin = np.isfinite(np.asarray(rl))
                le = float(np.abs(np.asarray(lse)[fin] - np.asarray(rl)[fin]).max()) if fin.any() else 0.0
                ok_inf = bool((np.asarray(lse)[~fin] == -np.inf).all() and
                              (np.asarray(out, np.float32)[~fin] == 0).all())
                nan = bool(np.isnan(np.asarray(out, np.float32)).any())
                ok = e < tol and le < (1e-2 if dtype == jnp.bfloat16 else 1e-4) and ok_inf and not nan
            except Exception as ex:  # report and continue
                e, le, ok_inf, nan, ok = float("nan"), float("nan"), False, True, False
                log("  EXC", name, type(ex).__name__, str(ex)[:300])
            fails += not ok
            log(f"check {jnp.dtype(dtype).name:8s} {name:26s} rel_err {e:.2e} lse_err {le:.2e} "
                f"masked_rows_ok {ok_inf} nan {nan} -> {'ok' if ok else 'FAIL'}")
            ROWS.append(dict(kind="check", dtype=jnp.dtype(dtype).name, case=name, rel_err=e, lse_err=le,
                             ok=ok))
    # determinism
    L = 1000 if not args.smoke else 40
    q, k, v = (rnd(i, s, jnp.bfloat16) for i, s in enumerate([(2, 8, L, 128), (2, 2, L, 128), (2, 2, L, 128)]))
    f = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=masks.causal))
    a, b = np.asarray(f(q, k, v), np.float32), np.asarray(f(q, k, v), np.float32)
    det = bool((a == b).all())
    fails += not det
    log("check determinism (same bits twice):", det)
    # gradient through the custom_vjp (backward kernels of flash_attention_bwd)
    if args.small_check:
        return fails
    try:
        q, k, v = (x.astype(jnp.float32) for x in (q[:1, :, :300], k[:1, :, :300], v[:1, :, :300]))
        w = rnd(99, q.shape, jnp.float32)
        g1 = jax.jit(jax.grad(lambda q, k, v: (flex_attention_pallas(q, k, v, mask_mod=masks.causal) * w).sum(),
                              argnums=(0, 1, 2)))(q, k, v)
        g2 = jax.grad(lambda q, k, v: (attention_reference(q, k, v, mask_mod=masks.causal)[0] * w).sum(),
                      argnums=(0, 1, 2))(q, k, v)
        ge = [rel(x, y) for x, y in zip(g1, g2)]
        log("check grads f32 causal (dq, dk, dv) rel_err", ["%.1e" % x for x in ge])
        ROWS.append(dict(kind="check", case="grad f32 causal", rel_err=max(ge), ok=max(ge) < 1e-4))
    except Exception as ex:
        log("  EXC grads", type(ex).__name__, str(ex)[:300])
    return fails


# ----------------------------------------------------------------------------------------------------
# 2. timing
# ----------------------------------------------------------------------------------------------------



def equal_docs(B, L, n):
    return jnp.asarray(np.repeat(np.arange(n), -(-L // n))[None, :L].repeat(B, 0), jnp.int32)


def time_shape(label, B, hq, hkv, L, d, mask, variants, budget, dtype=jnp.bfloat16, cudnn=True):
    q = rnd(1, (B, hq, L, d), dtype)
    k = rnd(2, (B, hkv, L, d), dtype)
    v = rnd(3, (B, hkv, L, d), dtype)
    causal_like = mask in ("causal",)
    flops = 4 * B * hq * L * L * d / (2 if causal_like else 1)
    mask_mod = {"full": None, "causal": masks.causal, "window1024": masks.sliding_window(1024),
                "doc8": masks.document(equal_docs(B, L, 8)),
                "doc8+causal": masks.and_masks(masks.causal, masks.document(equal_docs(B, L, 8)))}[mask]
    res = {}
    if cudnn and jax.default_backend() == "gpu" and mask in ("full", "causal", "window1024"):
        qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        kw = dict(is_causal=mask != "full")
        if mask == "window1024":
            kw["local_window_size"] = (1024, 0)
        try:
            f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw))
            ms, cs = bench(f, qt, kt, vt)
            res["cudnn"] = ms
            _row(label, mask, "jax_cudnn", ms, flops, cs)
        except Exception as ex:
            log("  cudnn EXC", type(ex).__name__, str(ex)[:200])
    for name, cfg in variants:
        if time.perf_counter() - T0 > budget:
            log("  budget reached; skipping", label, name)
            continue
        try:
            bm = None
            if isinstance(cfg, str):          # "allfull": no-mask attention through the block-mask index path
                cfg = None
                c = flash_config(d, d, dtype)
                bm = masks.create_block_mask(lambda b, h, i, j: i >= 0, None, None, L, L, block_q=c.block_q,
                                             block_kv=c.block_kv)
            elif mask_mod is not None:
                c = cfg or flash_config(d, d, dtype)
                groups = hq // hkv
                pack = groups if (c.pack_gqa and c.block_q // groups >= 16) else 1
                bm = masks.create_block_mask(mask_mod, None, None, L, L, block_q=c.block_q // pack,
                                             block_kv=c.block_kv)
            kk, vv = k, v
            if name == "repeat_kv":
                kk, vv = jnp.repeat(k, hq // hkv, axis=1), jnp.repeat(v, hq // hkv, axis=1)
            f = jax.jit(lambda q, k, v, bm: flex_attention_pallas(q, k, v, mask_mod=None if bm is None else
                                                                    bm.mask_mod, block_mask=bm, config=cfg))
            ms, cs = bench(f, q, kk, vv, bm)
            res[name] = ms
            _row(label, mask, name, ms, flops, cs, cfg)
        except Exception as ex:
            log("  EXC", label, name, type(ex).__name__, str(ex)[:300])
    return res


def _row(label, mask, impl, ms, flops, compile_s, cfg=None):
    tf = flops / ms / 1e9
    log(f"time {label:22s} {mask:11s} {impl:26s} {ms:8.3f} ms {tf:7.1f} TFLOP/s (compile {compile_s:.1f}s)")
    ROWS.append(dict(kind="time", shape=label, mask=mask, impl=impl, ms=ms, tflops=tf, compile_s=compile_s,
                     config=None if cfg is None else cfg.__dict__))


def timing(args):
    C = FlashConfig
    sweep = [
        ("default", None),
        ("128x128 w8 s2", C(128, 128, 8, 2)),
        ("128x128 w8 s3", C(128, 128, 8, 3)),
        ("128x64 w4 s3", C(128, 64, 4, 3)),
        ("128x64 w8 s4", C(128, 64, 8, 4)),
        ("64x64 w4 s3", C(64, 64, 4, 3)),
        ("64x128 w4 s2", C(64, 128, 4, 2)),
        ("pack 128x128 w8 s2", C(128, 128, 8, 2, pack_gqa=True)),
        ("pack 256x64 w8 s3", C(256, 64, 8, 3, pack_gqa=True)),
    ]
    if args.quick:
        sweep = sweep[:3]
    if args.final:
        return timing_final(args)
    top = sweep[:4]
    b = args.budget
    T, T2, H, HKV = (4096, 16384, 32, 8) if not args.smoke else (64, 128, 4, 2)
    out = {}
    out["B2 T4096 causal"] = time_shape("B2 T4096 d128", 2, H, HKV, T, 128, "causal", sweep, b)
    out["B1 T16384 causal"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "causal", top, b)
    out["B1 T16384 window"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "window1024", top[:2], b)
    out["B1 T16384 doc8"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "doc8", top[:2], b, cudnn=False)
    out["B1 T16384 doc8c"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "doc8+causal", top[:2], b,
                                        cudnn=False)
    out["B2 T4096 full"] = time_shape("B2 T4096 d128", 2, H, HKV, T, 128, "full", top + [("all-full block mask",
                                      "allfull")], b)
    out["B2 T4096 d64 causal"] = time_shape("B2 T4096 d64", 2, H, HKV, T, 64, "causal",
                                            [("default", None), ("128x64 w4 s3", C(128, 64, 4, 3)),
                                             ("128x128 w8 s3", C(128, 128, 8, 3)),
                                             ("128x128 w4 s3", C(128, 128, 4, 3)), ("64x64 w4 s3", C(64, 64, 4, 3))],
                                            b)
    out["B2 T4096 d256 causal"] = time_shape("B2 T4096 d256", 2, H, HKV, T, 256, "causal",
                                             [("default", None), ("64x64 w4 s3", C(64, 64, 4, 3)),
                                              ("128x32 w8 s2", C(128, 32, 8, 2)), ("64x128 w8 s2", C(64, 128, 8, 2))],
                                             b)
    out["B2 T4096 f32 causal"] = time_shape("B2 T4096 d128 f32", 2, H, HKV, T, 128, "causal",
                                            [("default", None), ("64x32 w4 s3", C(64, 32, 4, 3)),
                                             ("128x32 w8 s2", C(128, 32, 8, 2))], b, dtype=jnp.float32, cudnn=False)
    return out


def timing_final(args):
    """The confirming run: shipped defaults against cuDNN and the previous defaults."""
    C = FlashConfig
    b = args.budget
    T, T2, H, HKV = (4096, 16384, 32, 8) if not args.smoke else (64, 128, 4, 2)
    d_ = [("default", None)]
    old = [("128x64 w8 s3 (old default)", C(128, 64, 8, 3))]
    out = {}
    out["B2 T4096 causal"] = time_shape("B2 T4096 d128", 2, H, HKV, T, 128, "causal",
                                        d_ + old + [("128x128 w8 s2", C(128, 128, 8, 2))], b)
    out["B1 T16384 causal"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "causal",
                                         d_ + [("128x128 w8 s2", C(128, 128, 8, 2))], b)
    out["B1 T16384 window"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "window1024", d_, b)
    out["B1 T16384 doc8"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "doc8", d_ + old, b, cudnn=False)
    out["B1 T16384 doc8c"] = time_shape("B1 T16384 d128", 1, H, HKV, T2, 128, "doc8+causal", d_, b, cudnn=False)
    out["B2 T4096 full"] = time_shape("B2 T4096 d128", 2, H, HKV, T, 128, "full",
                                      d_ + [("all-full block mask", "allfull")], b)
    out["B2 T4096 d64 causal"] = time_shape("B2 T4096 d64", 2, H, HKV, T, 64, "causal",
                                            d_ + [("128x64 w4 s3", C(128, 64, 4, 3))], b)
    out["B2 T4096 d256 causal"] = time_shape("B2 T4096 d256", 2, H, HKV, T, 256, "causal", d_, b)
    out["B2 T4096 f32 causal"] = time_shape("B2 T4096 d128 f32", 2, H, HKV, T, 128, "causal",
                                            d_ + [("32x32 w4 s2", C(32, 32, 4, 2)), ("64x16 w4 s3", C(64, 16, 4, 3))],
                                            b, dtype=jnp.float32, cudnn=False)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--budget", type=float, default=270.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--small-check", action="store_true")
    p.add_argument("--final", action="store_true", help="confirming run of the shipped defaults")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU smoke test: interpret=True, tiny shapes")
    args = p.parse_args()
    if args.smoke:
        global flex_attention_pallas
        import functools
        flex_attention_pallas = functools.partial(flex_attention_pallas, interpret=True)
    dev = jax.devices()[0]
    versions = {"jax": jax.__version__, "device": dev.device_kind, "family": device_family(dev.device_kind)}
    try:
        import triton
        versions["triton"] = triton.__version__
    except Exception:
        pass
    log("versions", versions)
    fails = 0 if args.skip_check else check(args)
    res = {} if args.skip_time else timing(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(versions=versions, rows=ROWS, fails=fails), f, indent=1)
    print("\n==== summary (bf16 unless noted; ms, median) ====")
    for r in ROWS:
        if r["kind"] == "check" and not r["ok"]:
            print(f"CHECK FAIL {r}")
    print(f"checks failed: {fails}")
    for r in ROWS:
        if r["kind"] == "time":
            print(f"{r['shape']:20s} {r['mask']:11s} {r['impl']:22s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s")
    c, w, dc = (res.get(k, {}).get("default") for k in ("B1 T16384 causal", "B1 T16384 window", "B1 T16384 doc8"))
    if c and w and dc:
        print(f"T16384: causal/window1024 = {c / w:.2f}x, causal/doc8 = {c / dc:.2f}x")
    print(f"total {time.perf_counter() - T0:.0f}s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())


def bench(f, *a, target_ms=60.0, reps=7):
    return _bench(f, *a, target_ms=target_ms, reps=reps, min_iters=3)
