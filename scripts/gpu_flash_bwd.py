"""Checks and times the flex_attention Pallas backward kernels on a GPU (one script, one device call).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 scripts/gpu_flash_bwd.py --out $OUT/bwd.json

1. correctness: gradients of flex_attention_pallas (forward kernel + custom_vjp + these backward kernels)
   against jax.grad of the float32 (HIGHEST) materialised reference on the GPU, bf16 and f32 (f32 within
   ~1e-5 shows there is no tf32): GQA groups, odd lengths, head dims 64/96/128/192, masks, mods with
   captured arrays (slopes / table gradients), fully masked rows; determinism (same bits twice).
2. timing (bf16, Hq32 Hkv8 D128, the ANCHORS.md shapes): fwd+bwd through jax.vjp in one jit (the
   benchmark's fwd_bwd), the forward alone, and the backward alone for a sweep of BwdConfigs on a
   128x128-tile block mask; jax cuDNN fwd+bwd as the in-run peer. Median of timed loops after warm-up.
Prints a table at the end; ``--budget`` seconds bounds the run (later timings are skipped past it).
``--smoke`` runs everything tiny in interpret mode (CPU).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from flashlax import masks, score_mods
from flashlax.kernels import flash_attention_bwd as fab
from flashlax.kernels.flash_attention import flex_attention_pallas
from flashlax.reference import attention_reference

from _gpu_common import T0, attention_inputs, bench as _bench, log, rel, rnd  # noqa: E402 (scripts/ is on sys.path)

ROWS: list[dict] = []
ANCHORS = {  # fwd+bwd ms, H200 bf16 (shared/ANCHORS.md): cudnn, torch flex, torch sdpa, jax in-tree pallas
    "B2 T4096 causal": (2.42, 2.97, 2.12, 7.35),
    "B2 T4096 full": (3.95, 4.73, 3.65, 13.5),
    "B1 T16384 causal": (14.9, 19.4, 14.2, 51.7),
}


def check(args, names=None, dtypes=(jnp.bfloat16, jnp.float32), determinism=True):
    fails = 0
    interp = args.smoke
    L = 64 if args.smoke else 333
    seg = jnp.asarray(np.repeat(np.arange(4), -(-L // 4))[None, :L].repeat(2, 0), jnp.int32)
    slopes = rnd(7, (8,), jnp.float32) * 0.1
    table = rnd(8, (8, 2 * 64 - 1), jnp.float32) * 0.5
    cases = [
        # name, B, Hq, Hkv, Lq, Lkv, D, Dv, score_mod builder, mask_mod, captured-for-grad
        ("causal d128 g4", 2, 8, 2, L, L, 128, 128, None, masks.causal, None),
        ("full d64 g4 Lq!=Lkv", 1, 8, 2, L - 33, L, 64, 64, None, None, None),
        ("window d96 g3", 1, 6, 2, L, L, 96, 96, None, masks.sliding_window(40), None),
        ("doc d192/128 g1", 2, 4, 4, L, L, 192, 128, None, masks.document(seg), None),
        ("prefix+alibi d64 g2", 1, 8, 4, L, L, 64, 64, score_mods.alibi, masks.prefix_lm(40), slopes),
        ("relbias+causal d128 g4", 1, 8, 2, L, L, 128, 128, score_mods.relative_bias, masks.causal, table),
        ("softcap d128 g8", 1, 8, 1, L, L, 128, 128, lambda _: score_mods.softcap(5.0), masks.causal, None),
        ("masked rows d64", 1, 4, 2, L, L, 64, 64, None, lambda b, h, i, j: (j <= i) & (i >= 50), None),
    ]
    for dtype in dtypes:
        tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
        for n, (name, B, hq, hkv, lq, lkv, d, dv, smb, mm, cap) in enumerate(cases):
            if (names is not None and name not in names) or time.perf_counter() - T0 > args.budget + 40:
                continue
            q, k = rnd(4 * n, (B, hq, lq, d), dtype), rnd(4 * n + 1, (B, hkv, lkv, d), dtype)
            v, w = rnd(4 * n + 2, (B, hkv, lkv, dv), dtype), rnd(4 * n + 3, (B, hq, lq, dv), jnp.float32)
            cap_in = jnp.zeros(()) if cap is None else cap

            def loss(fn, q, k, v, c):
                sm = None if smb is None else smb(c)
                return (fn(q, k, v, sm) * w).sum()

            pal = lambda q, k, v, sm: flex_attention_pallas(q, k, v, score_mod=sm, mask_mod=mm,
                                                            interpret=interp).astype(jnp.float32)
            ref = lambda q, k, v, sm: attention_reference(q, k, v, score_mod=sm, mask_mod=mm)[0]
            try:
                g = jax.jit(jax.grad(lambda *a: loss(pal, *a), argnums=(0, 1, 2, 3)))(q, k, v, cap_in)
                up = [x.astype(jnp.float32) for x in (q, k, v)]
                gr = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3)))(*up, cap_in)
                errs = [rel(a, b) for a, b in zip(g[:3], gr[:3])]
                if cap is not None:
                    errs.append(rel(g[3], gr[3]))
                nan = any(bool(np.isnan(np.asarray(x, np.float32)).any()) for x in g)
                ok = max(errs) < tol and not nan
            except Exception as ex:  # report and continue
                errs, nan, ok = [float("nan")], True, False
                log("  EXC", name, type(ex).__name__, str(ex)[:400])
            fails += not ok
            log(f"check {jnp.dtype(dtype).name:8s} {name:24s} rel_err dq/dk/dv(/dcap) "
                f"{' '.join('%.1e' % e for e in errs)} nan {nan} -> {'ok' if ok else 'FAIL'}")
            ROWS.append(dict(kind="check", dtype=jnp.dtype(dtype).name, case=name, rel_err=errs, ok=ok))
    if not determinism:
        return fails
    # determinism of the gradients
    q, k, v = (rnd(i, s, jnp.bfloat16) for i, s in enumerate([(2, 8, L, 128), (2, 2, L, 128), (2, 2, L, 128)]))
    f = jax.jit(jax.grad(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=masks.causal,
                                                               interpret=interp).astype(jnp.float32).sum(),
                         argnums=(0, 1, 2)))
    a, b = f(q, k, v), f(q, k, v)
    det = all(bool((np.asarray(x, np.float32) == np.asarray(y, np.float32)).all()) for x, y in zip(a, b))
    fails += not det
    log("check determinism of dq, dk, dv (same bits twice):", det)
    return fails


ALL_CASES = ("causal d128 g4", "full d64 g4 Lq!=Lkv", "window d96 g3", "doc d192/128 g1", "prefix+alibi d64 g2",
             "relbias+causal d128 g4", "softcap d128 g8", "masked rows d64")
C = fab.BwdConfig
SWEEP = [  # first: the session-2 H200 bf16 D128 default (session 3 ships dK/dV 64/128 w8 s3 + dQ 128/128 w8,
    # see --only ab-config); then one pass changed at a time (dK/dV or dQ), so the
    # difference to the first row is that pass's (run 2 in docs/PERF_NOTES.md)
    ("64/64 64/64 w4 s2", C(64, 64, 64, 64, 4, 4, 2, 2)),
    ("dkv 64/128 w8 s2", C(64, 128, 64, 64, 8, 4, 2, 2)),
    ("dkv 128/64 w4 s2", C(128, 64, 64, 64, 4, 4, 2, 2)),
    ("dkv 128/128 w8 s2", C(128, 128, 64, 64, 8, 4, 2, 2)),
    ("dkv 64/128 w8 s3", C(64, 128, 64, 64, 8, 4, 3, 2)),
    ("dkv 64/64 w4 s3", C(64, 64, 64, 64, 4, 4, 3, 2)),
    ("dq 128/64 w8 s2", C(64, 64, 128, 64, 4, 8, 2, 2)),
    ("dq 128/128 w8 s2", C(64, 64, 128, 128, 4, 8, 2, 2)),
    ("dq 64/128 w4 s2", C(64, 64, 64, 128, 4, 4, 2, 2)),
    ("dq 64/64 w4 s3", C(64, 64, 64, 64, 4, 4, 2, 3)),
]


def bench(f, *a, target_ms=80.0, reps=7):
    return _bench(f, *a, target_ms=target_ms, reps=reps, min_iters=2)


def _bwd_sweep(q, k, v, dout, mm, configs, row, *, interpret=False, budget=None):
    """Times the backward alone on a 128x128 block mask for each (name, config), reporting through
    ``row(impl, ms, compile_s)``. budget: skip configs once T0 + budget passed."""
    L, D = q.shape[2], q.shape[3]
    out, lse = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=mm, return_lse=True,
                                                            interpret=interpret))(q, k, v)
    bm = masks.create_block_mask(mm, None, None, L, L, block_q=128, block_kv=128)
    for name, cfg in configs:
        impl = f"bwd {name}"
        if budget is not None and time.perf_counter() - T0 > budget:
            log("  budget reached: skipping", impl)
            continue
        f = jax.jit(lambda q, k, v, out, lse, dout, bm, cfg=cfg: fab.flash_attention_bwd(
            q, k, v, out, lse, dout, block_mask=bm, score_mod=None, mask_mod=mm, captured=(),
            scale=D ** -0.5, config=cfg, interpret=interpret)[:3])
        try:
            ms, cs = bench(f, q, k, v, out, lse, dout, bm)
            row(impl, ms, cs)
        except Exception as ex:
            log("  EXC", impl, type(ex).__name__, str(ex)[:400])


def time_shape(label, B, L, causal, args, sweep):
    H, HKV, D = (32, 8, 128) if not args.smoke else (4, 2, 32)
    it = args.smoke
    q, k, v, dout = attention_inputs(B, H, HKV, L, D)
    mm = masks.causal if causal else None
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    res = {}

    def row(impl, ms, cs, mult):
        tf = flops * mult / ms / 1e9
        log(f"time {label:17s} {impl:34s} {ms:8.3f} ms  {tf:6.1f} TFLOP/s  (compile {cs:.1f}s)")
        ROWS.append(dict(kind="time", shape=label, impl=impl, ms=ms, tflops=tf, compile_s=cs))
        res[impl] = ms

    fwd = jax.jit(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=mm, interpret=it))

    @jax.jit
    def fwd_bwd(q, k, v, dout):
        out, pull = jax.vjp(lambda q, k, v: flex_attention_pallas(q, k, v, mask_mod=mm, interpret=it), q, k, v)
        return out, pull(dout)

    for name, f, a, mult in (("pallas fwd", fwd, (q, k, v), 1.0), ("pallas fwd+bwd", fwd_bwd, (q, k, v, dout), 3.5)):
        try:
            ms, cs = bench(f, *a)
            row(name, ms, cs, mult)
        except Exception as ex:
            log("  EXC", name, type(ex).__name__, str(ex)[:400])
    # backward alone on 128x128 tiles, sweep of configs
    _bwd_sweep(q, k, v, dout, mm, sweep, lambda impl, ms, cs: row(impl, ms, cs, 2.5), interpret=it,
               budget=args.budget)
    # jax cuDNN fwd+bwd (BTNH), the in-run peer
    try:
        t = lambda x: jnp.swapaxes(x, 1, 2)
        qt, kt, vt, dt_ = t(q), t(k), t(v), t(dout)

        @jax.jit
        def cudnn_fb(q, k, v, dout):
            out, pull = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)
            return out, pull(dout)

        ms, cs = bench(cudnn_fb, qt, kt, vt, dt_)
        row("jax cudnn fwd+bwd", ms, cs, 3.5)
    except Exception as ex:
        log("  EXC cudnn", type(ex).__name__, str(ex)[:300])
    return res


D256_SWEEP = [  # D256 bf16: the shipped entry first
    ("d256 32/64 64/32 w8 s2", C(32, 64, 64, 32, 8, 8, 2, 2)),
    ("d256 64/64 64/64 w8 s2", C(64, 64, 64, 64, 8, 8, 2, 2)),
    ("d256 64/32 32/64 w4 s2", C(64, 32, 32, 64, 4, 4, 2, 2)),
    ("d256 32/32 32/32 w4 s2", C(32, 32, 32, 32, 4, 4, 2, 2)),
    ("d256 64/64 64/64 w8 s1", C(64, 64, 64, 64, 8, 8, 1, 1)),
    ("d256 32/64 64/32 w4 s2", C(32, 64, 64, 32, 4, 4, 2, 2)),
    ("d256 16/64 64/16 w4 s2", C(16, 64, 64, 16, 4, 4, 2, 2)),
]


def time_bwd_only(label, B, L, D, causal, configs, interpret=False):
    """Backward alone (Hq32 Hkv8 bf16) for each config."""
    mm = masks.causal if causal else None
    flops = 4 * B * 32 * L * L * D * (0.5 if causal else 1.0) * 2.5

    def row(impl, ms, cs):
        log(f"time {label:22s} {impl:44s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  (compile {cs:.1f}s)")
        ROWS.append(dict(kind="time", shape=label, impl=impl, ms=ms, tflops=flops / ms / 1e9, compile_s=cs))

    _bwd_sweep(*attention_inputs(B, 32, 8, L, D), mm, configs, row, interpret=interpret)


SHIPPED_D128 = ("dkv 64/128 w8 s3 dq 128/128 w8", C(64, 128, 128, 128, 8, 8, 3, 2))   # session 3 default


def _ab_config():
    """The session-2 default, the session-3 one and its two halves, B2 T4096 causal and full, twice."""
    for _ in range(2):
        for label, causal in (("B2 T4096 D128 causal", True), ("B2 T4096 D128 full", False)):
            time_bwd_only(label, 2, 4096, 128, causal, [SWEEP[0], SHIPPED_D128, SWEEP[4], SWEEP[7]])


ONLY = {  # --only: backward-alone timings (bf16 Hq32 Hkv8), rows in docs/PERF_NOTES.md runs 2-4
    "d256": lambda: time_bwd_only("B2 T4096 D256 causal", 2, 4096, 256, True, D256_SWEEP),
    "full": lambda: time_bwd_only("B2 T4096 D128 full", 2, 4096, 128, False, SWEEP),
    "long": lambda: [time_bwd_only(f"B1 T16384 D128 {m}", 1, 16384, 128, m == "causal", SWEEP + [SHIPPED_D128])
                     for m in ("full", "causal")],
    "ab-config": _ab_config,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--budget", type=float, default=240.0)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--sweep", type=int, default=len(SWEEP), help="configs of the sweep to time")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU: interpret=True, tiny shapes, no timing")
    p.add_argument("--only", choices=sorted(ONLY), help="run just this backward-alone timing (see ONLY)")
    args = p.parse_args()
    if args.only:
        ONLY[args.only]()
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(dict(rows=ROWS, device=jax.devices()[0].device_kind, jax=jax.__version__), fh, indent=1)
        return
    log("jax", jax.__version__, "devices", jax.devices(), "kind", jax.devices()[0].device_kind)
    quick = ("causal d128 g4", "prefix+alibi d64 g2", "relbias+causal d128 g4")
    fails = 0 if args.skip_check else check(args, names=quick, determinism=False)
    results = {}
    if args.smoke and not args.skip_time:
        results["B2 T4096 causal"] = time_shape("B2 T4096 causal", 1, 256, True, args, SWEEP[:1])
        time_bwd_only("bwd-only smoke", 1, 64, 32, True, SWEEP[:1], interpret=True)
    if not args.skip_time and not args.smoke:
        shapes = [("B2 T4096 causal", 2, 4096, True, SWEEP[:args.sweep]),
                  ("B2 T4096 full", 2, 4096, False, SWEEP[:max(1, args.sweep // 3)]),
                  ("B1 T16384 causal", 1, 16384, True, SWEEP[:max(1, args.sweep // 4)])]
        for label, B, L, causal, sweep in shapes:
            if time.perf_counter() - T0 > args.budget:
                log("budget reached: skipping", label)
                continue
            results[label] = time_shape(label, B, L, causal, args, sweep)
    if not args.skip_check:       # the remaining checks, after the timings (budget permitting)
        fails += check(args, names=[c for c in ALL_CASES if c not in quick])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(rows=ROWS, fails=fails, device=jax.devices()[0].device_kind,
                           jax=jax.__version__), fh, indent=1)
    print("\n=== flex_attention Pallas backward: summary (ms, H200 bf16 Hq32 Hkv8 D128) ===")
    print(f"correctness failures: {fails}")
    for label, res in results.items():
        an = ANCHORS[label]
        bwd = {k: v for k, v in res.items() if k.startswith("bwd ")}
        best = min(bwd.items(), key=lambda kv: kv[1]) if bwd else ("-", float("nan"))
        fb = res.get("pallas fwd+bwd", float("nan"))
        print(f"{label:17s} fwd {res.get('pallas fwd', float('nan')):7.3f} fwd+bwd {fb:7.3f} "
              f"cudnn(run) {res.get('jax cudnn fwd+bwd', float('nan')):7.3f} | anchors cudnn {an[0]} "
              f"flex {an[1]} sdpa {an[2]} in-tree {an[3]} | best bwd {best[1]:.3f} [{best[0]}]")


if __name__ == "__main__":
    main()

