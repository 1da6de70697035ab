"""Check and time the gated_delta_rule ssd kernels on a GPU in one device call (issue 15).

  cd <tree> && PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/gpu_ssd.py --out $OUT \
      --steps check,e2e,bf16,kernels,variants

Steps (``--steps``, in this order):
  check      ssd (shipped config, and f32_dot="tf32x3") against the float64 recurrence on the host CPU at
             B1 H2 T1000 dk=dv=64: output and every gradient;
  e2e        B2 H8 T8192 dk=dv=64 float32, fwd and fwd+bwd, with and without beta: chunked, ssd, ssd/alt
             (the other form of the sequential passes) and ssd+tf32x3, each with its largest relative
             difference from chunked over the output and every gradient;
  f32nobeta  the same without beta, chunked and ssd only;
  bf16       B2 H16 T8192 dk=dv=128 bfloat16 forward with beta: chunked and ssd;
  o4         bf16: chunked, ssd and ssd+o4 (the out kernel at 4 warps), fwd and fwd+bwd;
  alt        ssd, ssd/alt and ssd/alt+mh (SSDConfig.mh_kernel) fwd and fwd+bwd (float32), fwd (bf16), one process;
  kernels    each kernel of the forward and backward alone, both forms (float32 and bf16 shapes);
  variants   each kernel of both forms again, then the KERNEL_VARIANTS (config overrides) of the kernels
             named by ``--variant-kernels`` (wy first), until ``--deadline`` seconds;
  e2e_best   f32 fwd+bwd (with and without beta) of the shipped config and of the two fastest dqk variants
             the variants step found (each under 0.97x the shipped dqk), with their difference from shipped.
Writes $OUT/ssd_results.json as it goes. ``--smoke``: the same code in the Pallas interpreter on CPU at tiny
shapes (timings meaningless). Session 7 ran "e2e,bf16,kernels,variants" (cut off during e2e) and
"f32nobeta,bf16,alt"; docs/PERF_NOTES.md has the numbers.
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

from flashlax import gated_delta_rule
from flashlax.bench.suites import linear_inputs
from flashlax.kernels import ssd, ssd_bwd
from flashlax.kernels.configs import ssd_config
from flashlax.reference import gated_delta_rule_reference

sys.path.insert(0, os.path.dirname(__file__))
from _gpu_common import T0, bench, log, rel  # noqa: E402

RESULTS: dict = {"errors": {}, "kernels": [], "end_to_end": [], "failures": []}
OUT_DIR: list = [None]
BENCH_KW: dict = {}          # --smoke: one short sample
KERNELS_ONLY: set = set()    # --kernels: time only these kernels in the kernels / variants steps
SHIPPED_ONLY: list = [False]  # --shipped-only: not the other form of the sequential passes


def timed(fn, *a):
    return bench(fn, *a, **BENCH_KW)


def inputs(b, h, t, dk, dv, dtype, seed=0, with_beta=True):
    """The benchmark's inputs (flashlax.bench.suites.linear_inputs), log_alpha and beta kept in float32."""
    q, k, v, la, beta, do = linear_inputs(seed, b, h, t, dk, dv, jnp.float32)
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), la, beta if with_beta else None, cast(do)


def fwd_bwd(fn):
    def run(q, k, v, la, beta, do):
        out, pullback = jax.vjp(lambda *a: fn(*a), q, k, v, la, beta)
        return out, pullback(do)
    return jax.jit(run)


def impl_fn(impl, chunk=64, **kw):
    """impl through the front end, or "ssd" through the kernel entry with ``kw`` (the Pallas backward, which
    this script measures, unless ``backward`` says otherwise)."""
    if impl == "ssd":
        kw.setdefault("backward", "pallas")
        return lambda q, k, v, la, beta: ssd.gated_delta_rule_ssd(q, k, v, la, beta, scale=q.shape[-1] ** -0.5,
                                                                  chunk_size=chunk, **kw)
    return lambda q, k, v, la, beta: gated_delta_rule(q, k, v, la, beta, impl=impl, chunk_size=chunk)


def save(out_dir=None):
    RESULTS["elapsed_s"] = time.perf_counter() - T0
    out_dir = out_dir or OUT_DIR[0]
    if out_dir:
        with open(os.path.join(out_dir, "ssd_results.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def guarded(name, fn, *a):
    try:
        return fn(*a)
    except Exception as exc:  # keep going: a failing variant is a result too
        msg = f"{type(exc).__name__}: {str(exc)[:400]}"
        log(f"FAIL {name}: {msg}")
        RESULTS["failures"].append({"name": name, "error": msg})
        return None


# ----------------------------------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------------------------------

def check_reference(shape, kw_variants, interpret, with_betas=(True, False)):
    b, h, t, d = shape
    for with_beta in with_betas:
        q, k, v, la, beta, do = inputs(b, h, t, d, d, jnp.float32, seed=3, with_beta=with_beta)
        cpu = jax.devices("cpu")[0]
        with jax.enable_x64(), jax.default_device(cpu):
            args64 = [None if x is None else jax.device_put(np.asarray(x, np.float64), cpu)
                      for x in (q, k, v, la, beta, do)]
            ref_out, ref_grads = fwd_bwd(lambda *a: gated_delta_rule_reference(*a, scale=d ** -0.5))(*args64)
            ref_out, ref_grads = np.asarray(ref_out), [None if g is None else np.asarray(g) for g in ref_grads]
        for label, kw in kw_variants.items():
            def one():
                kw1 = {n: x for n, x in kw.items() if x is not None}
                out, grads = fwd_bwd(impl_fn("ssd", interpret=interpret, **kw1))(q, k, v, la, beta, do)
                errs = {"o": rel(out, ref_out)}
                for n, g, r in zip(("dq", "dk", "dv", "dlog_alpha", "dbeta"), grads, ref_grads):
                    if r is not None:
                        errs[n] = rel(g, r)
                return errs
            errs = guarded(f"reference {label}", one)
            key = f"vs float64, B{b} H{h} T{t} d{d} {'beta' if with_beta else 'no beta'} {label}"
            RESULTS["errors"][key] = errs
            log(key, errs)


# ----------------------------------------------------------------------------------------------------
# 2. per-kernel variants
# ----------------------------------------------------------------------------------------------------

def kernel_fn(name, st):
    """The jitted kernel ``name`` at ``st`` (arguments as :func:`kernel_args` builds them)."""
    bwd = ssd_bwd
    return jax.jit({
        "precompute": lambda k, v, la, b: ssd.precompute_call(st, k, v, la, b),
        "precompute_bwd": lambda k, v, la, b: ssd.precompute_call(st, k, v, la, b, emit_t=True),
        "mh": lambda k, la, pre: ssd.mh_call(st, k, la, pre),
        "state": lambda k, v, la, s0, pre: ssd.state_call(st, k, v, la, s0, pre, emit_delta=True),
        "out": lambda q, k, v, la, pre, sts: ssd.output_call(st, q, k, v, la, pre, sts),
        "dout": lambda q, k, la, do, pre: bwd.dout_call(st, q, k, la, do, pre),
        "reverse": lambda q, k, la, do, pre, dout, df: bwd.reverse_call(st, q, k, la, do, pre, dout, df),
        "dqk": lambda q, k, v, la, do, pre, sts, dout, rev: bwd.dqk_call(st, q, k, v, la, do, pre, sts, dout, rev),
        "wy": lambda k, v, la, b, pre, dd, dqk: bwd.wy_call(st, k, v, la, b, pre, dd, dqk),
    }[name])


def kernel_args(st, q, k, v, la, beta, do):
    """name -> arguments of each kernel of the forward and backward at ``st`` (running the chain once)."""
    s0 = jnp.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), jnp.float32)
    args = {}
    pre = kernel_fn("precompute", st)(k, v, la, beta)
    if pre:
        args["precompute"] = (k, v, la, beta)          # with SSDConfig.mh_kernel: the mh kernel included
    if st.mh_kernel:
        args["mh"] = (k, la, pre)
    args["state"] = (k, v, la, s0, pre)
    states = kernel_fn("state", st)(*args["state"])
    args["out"] = (q, k, v, la, pre, states)
    args["dout"] = (q, k, la, do, pre)
    dout = kernel_fn("dout", st)(*args["dout"])
    args["reverse"] = (q, k, la, do, pre, dout, s0)
    rev = kernel_fn("reverse", st)(*args["reverse"])
    args["dqk"] = (q, k, v, la, do, pre, states, dout, rev)
    if st.has_beta:
        dqk = kernel_fn("dqk", st)(*args["dqk"])
        args["precompute_bwd"] = (k, v, la, beta)             # the backward's precompute also stores T
        pre_bwd = kernel_fn("precompute_bwd", st)(k, v, la, beta)
        args["wy"] = (k, v, la, beta, pre_bwd, rev["dd"] if "dd" in rev else dqk["dd_out"], dqk)
    return args


KERNEL_VARIANTS = {
    # kernel -> {label: config overrides}
    # shipped H200 float32 dk64: state_block_v 16, 4 warps, 2 stages, tf32x3
    "state": {"bv16 w4 s3": dict(state_block_v=16, state_warps=4, state_stages=3),
              "bv16 w2 s3": dict(state_block_v=16, state_warps=2, state_stages=3),
              "bv16 w4 s4": dict(state_block_v=16, state_warps=4, state_stages=4),
              # bf16 dk128 ships bv32 w4 s2 (0.401 ms; session 13: bv16 w4 s3 0.533, w2 s3 0.572, w4 s4 0.617)
              "bv32 w4 s3": dict(state_block_v=32, state_warps=4, state_stages=3),
              "bv32 w8 s2": dict(state_block_v=32, state_warps=8, state_stages=2),
              "bv64 w4 s2": dict(state_block_v=64, state_warps=4, state_stages=2),
              "bv64 w8 s2": dict(state_block_v=64, state_warps=8, state_stages=2)},
    # (session 11, f32 dk64 two-product form: state bv16 w4 s2 0.573 ms, s3 0.511, s1 0.670, bv32 w4 0.610,
    # w8 0.91-1.12; reverse bv16 w4 s2 0.732, bv32 w4 0.859, s1 0.905, w8 1.13-1.28)
    "reverse": {"rinc": dict(reverse_rinc=True), "rinc s2": dict(reverse_rinc=True, state_stages=2),
                "bv16 w4 s3": dict(state_block_v=16, state_warps=4, state_stages=3),
                "bv16 w2 s2": dict(state_block_v=16, state_warps=2, state_stages=2),
                "bv16 w2 s3": dict(state_block_v=16, state_warps=2, state_stages=3)},
    "precompute": {"transition": dict(transition=True), "transition mh": dict(transition=True, mh_kernel=True),
                   "w4": dict(num_warps=4), "w2": dict(num_warps=2), "w8": dict(num_warps=8),
                   "w4 tf32x3": dict(num_warps=4, f32_dot="tf32x3")},
    "mh": {"b16": dict(blocks=(("mh", 16),)), "b32": dict(blocks=(("mh", 32),)), "w8": dict(warps=(("mh", 8),)),
           "w2": dict(warps=(("mh", 2),))},
    "out": {"b16 w4": dict(block=16, num_warps=4), "b32 w4": dict(block=32, num_warps=4),
            "b64 w4": dict(block=64, num_warps=4), "b32 w8": dict(block=32, num_warps=8),
            "b64 w8": dict(block=64, num_warps=8), "b16 w8": dict(block=16, num_warps=8)},
    "dout": {"rinc": dict(reverse_rinc=True), "b16 w4": dict(block=16, num_warps=4), "b32 w4": dict(block=32, num_warps=4),
             "b64 w4": dict(block=64, num_warps=4), "b16 w8": dict(block=16, num_warps=8)},
    # (session 11, f32 dk64: b64 w4 1.39 ms, b16 w4 5.81, b32 w4 9.72)
    "dqk": {"bk64 w8": dict(dqk_block_k=64, num_warps=8), "bk64 w4": dict(dqk_block_k=64, num_warps=4),
            "bk32 w4": dict(dqk_block_k=32, num_warps=4), "b64 w8": dict(block=64, num_warps=8),
            "b64 w4 bv32": dict(block=64, block_v=32),
            # session 23 (f32 dk64 transition form, after the cumulative sums): dk in two passes, dv in halves,
            # 32-row sub-blocks, each at 4 and 8 warps
            "bk32 w8": dict(dqk_block_k=32, num_warps=8), "bv32 w8": dict(block_v=32, num_warps=8),
            "bk32 bv32 w4": dict(dqk_block_k=32, block_v=32, num_warps=4),
            "b32 w4": dict(blocks=(("dqk", 32),), num_warps=4), "b32 w8": dict(blocks=(("dqk", 32),), num_warps=8)},
    # (session 11, f32 dk64: wy_block 64 w4 1.21 ms, w8 2.22, block_v 32 1.49 / 2.38 w8, block 32 w8 18.4)
    # (bf16 dk128: wb16 w4 0.924, wb32 w4 2.04, wb64 w4 2.31, w8 1.35 / 3.35 / 3.20; f32 dk128: wb64 w4 2.80,
    # w8 3.19, wb32 w4 20.4)
    "wy": {"wb64 w4": dict(blocks=(("wy", 64),), num_warps=4), "wb16 w4": dict(blocks=(("wy", 16),), num_warps=4),
           "wb16 w2": dict(blocks=(("wy", 16),), num_warps=2), "wb16 w8": dict(blocks=(("wy", 16),), num_warps=8)},
}


VARIANT_MATCH = [""]      # --variant-match: only the KERNEL_VARIANTS labels containing it
WARP_SWEEP: list = []     # --warp-sweep: per-kernel warp counts ("kw<n>" variants, SSDConfig.warps overrides)


def kernel_warps(cfg, kernel, n):
    """cfg's SSDConfig.warps with ``kernel`` (precompute_bwd: the precompute kernel's backward form, which
    shares its entry) at n warps."""
    entry = "precompute" if kernel == "precompute_bwd" else kernel
    return tuple(w for w in cfg.warps if w[0] != entry) + ((entry, n),)


def kernel_variants(name, cfg):
    """KERNEL_VARIANTS[name], plus a "kw<n>" variant per --warp-sweep count: that kernel alone at n warps."""
    return {**KERNEL_VARIANTS.get(name, {}), **{f"kw{n}": dict(warps=kernel_warps(cfg, name, n)) for n in WARP_SWEEP}}


CHAIN_FIELDS = {"reverse_rinc", "transition"}     # config fields that change what the kernels pass each other


def time_kernels(label, shape, dtype, with_beta, interpret, variants=(), deadline=1e9):
    """Each kernel of the shipped config (those in KERNELS_ONLY when set), of the shipped config with the other
    state form (``transition`` flipped; not with SHIPPED_ONLY), and the KERNEL_VARIANTS of the kernels named
    in ``variants`` (overrides of the shipped config)."""
    b, h, t, d = shape
    q, k, v, la, beta, do = inputs(b, h, t, d, d, dtype, seed=7, with_beta=with_beta)
    base = ssd.make_static(q, k, v, beta, scale=d ** -0.5, chunk_size=64, interpret=interpret, config=None,
                           device_kind=None)
    forms = {"shipped": base}
    if not SHIPPED_ONLY[0]:
        forms[f"transition={not base.transition}"] = dataclasses.replace(
            base, config=dataclasses.replace(base.config, transition=not base.transition))
    all_args = {}
    for form, st in forms.items():
        all_args[form] = guarded(f"kernels {label} {form}", kernel_args, st, q, k, v, la, beta, do) or {}
        for name, args in all_args[form].items():
            if KERNELS_ONLY and name not in KERNELS_ONLY:
                continue
            res = guarded(f"kernel {name} {form}", timed, kernel_fn(name, st), *args)
            if res is not None:
                RESULTS["kernels"].append(dict(shape=label, beta=with_beta, kernel=name, variant=form, ms=res[0],
                                               compile_s=res[1]))
                log(f"kernel {label} beta={with_beta} {name:10s} {form:18s} {res[0]:.4f} ms (compile {res[1]:.1f} s)")
    for name in variants:
        for form, st0 in forms.items():
            if name not in all_args[form]:
                continue
            for vlabel, over in kernel_variants(name, st0.config).items():
                if VARIANT_MATCH[0] and VARIANT_MATCH[0] not in vlabel:
                    continue
                if time.perf_counter() - T0 > deadline:
                    log("deadline: skipping the remaining kernel variants")
                    return
                st = dataclasses.replace(st0, config=dataclasses.replace(st0.config, **over))
                args = all_args[form][name]
                if set(over) & CHAIN_FIELDS:      # the kernel's inputs differ: run this variant's own chain
                    key = (form, tuple(sorted((f, over[f]) for f in set(over) & CHAIN_FIELDS)))
                    if key not in all_args:
                        all_args[key] = guarded(f"kernels {label} {key}", kernel_args, st, q, k, v, la, beta, do) or {}
                    if name not in all_args[key]:
                        continue
                    args = all_args[key][name]
                res = guarded(f"kernel {name} {form} {vlabel}", timed, kernel_fn(name, st), *args)
                if res is not None:
                    RESULTS["kernels"].append(dict(shape=label, beta=with_beta, kernel=name, variant=f"{form} {vlabel}",
                                                   ms=res[0], compile_s=res[1]))
                    log(f"kernel {label} beta={with_beta} {name:10s} {form} {vlabel:16s} {res[0]:.4f} ms")


# ----------------------------------------------------------------------------------------------------
# 3. end to end
# ----------------------------------------------------------------------------------------------------

def ssd_variant(label, dims, dtype, interpret, with_beta=True):
    """Keyword arguments of gated_delta_rule_ssd for an end-to-end label: "ssd" (shipped config), "ssd/alt"
    (shipped with the form of the sequential passes flipped), "+tf32x3" suffix (f32_dot="tf32x3"), "+mh" suffix
    (SSDConfig.mh_kernel: the transition form's M and H from their own kernel)."""
    cfg = ssd_config(dims, dims, dtype) if not interpret else None
    if cfg is None:
        from flashlax.kernels.configs import SSDConfig
        cfg = SSDConfig()
    if "/alt" in label:
        form = (not with_beta) if cfg.transition == "without_beta" else cfg.transition
        cfg = dataclasses.replace(cfg, transition=not form)
    if "tf32x3" in label:
        cfg = dataclasses.replace(cfg, f32_dot="tf32x3")
    if "+mh" in label:
        cfg = dataclasses.replace(cfg, mh_kernel=True)
    if "+o4" in label:
        cfg = dataclasses.replace(cfg, warps=kernel_warps(cfg, "out", 4))
    return dict(interpret=interpret, config=cfg)


def time_end_to_end(label, shape, dtype, with_beta, modes, impls, interpret):
    """Times every impl label in every mode, and reports each ssd variant's difference from chunked
    (output and gradients, from the timed functions' own results)."""
    b, h, t, d = shape
    q, k, v, la, beta, do = inputs(b, h, t, d, d, dtype, seed=9, with_beta=with_beta)
    for mode in modes:
        results = {}
        for impl in impls:
            fn = impl_fn("ssd", **ssd_variant(impl, d, dtype, interpret, with_beta)) if impl.startswith("ssd") else impl_fn(impl)
            run = jax.jit(fn) if mode == "fwd" else fwd_bwd(fn)
            args = (q, k, v, la, beta) if mode == "fwd" else (q, k, v, la, beta, do)
            res = guarded(f"{label} {impl} {mode}", lambda: timed(run, *args))
            if res is None:
                continue
            row = dict(shape=label, impl=impl, mode=mode, beta=with_beta, ms=res[0], compile_s=res[1])
            out = run(*args)
            results[impl] = jax.tree_util.tree_leaves(out)
            if impl != "chunked" and "chunked" in results:
                row["rel_diff_vs_chunked"] = max(rel(a, c) for a, c in zip(results[impl], results["chunked"]))
            RESULTS["end_to_end"].append(row)
            log(f"e2e {label} {'beta' if with_beta else 'no beta'} {impl:16s} {mode:7s} {res[0]:.4f} ms "
                f"(compile {res[1]:.1f} s) diff vs chunked {row.get('rel_diff_vs_chunked')}")
            save()


def best_dqk_override(with_beta, margin=0.97):
    """The KERNEL_VARIANTS["dqk"] / warp-sweep overrides whose dqk time in RESULTS (variants step) is under
    ``margin`` x the shipped dqk's, fastest first; a variant's ``num_warps`` becomes a dqk-only warps entry."""
    rows = [r for r in RESULTS["kernels"] if r["kernel"] == "dqk" and r["beta"] == with_beta]
    base = [r["ms"] for r in rows if r["variant"] == "shipped"]
    if not base:
        return []
    out = []
    for r in sorted(rows, key=lambda r: r["ms"]):
        label = r["variant"].removeprefix("shipped ").strip()
        if r["variant"] == "shipped" or r["ms"] > margin * base[0]:
            continue
        over = KERNEL_VARIANTS["dqk"].get(label)
        if over is None and label.startswith("kw"):
            over = {"num_warps": int(label[2:])}
        if over is not None:
            out.append((label, dict(over)))
    return out


def time_best_dqk(label, shape, with_beta, interpret, top=2, margin=0.97):
    """fwd+bwd of ssd (Pallas backward) with the shipped config and with its ``top`` fastest dqk variants (a
    variant's block_v applies to every chunk kernel end to end, as the config field does)."""
    b, h, t, d = shape
    q, k, v, la, beta, do = inputs(b, h, t, d, d, jnp.float32, seed=9, with_beta=with_beta)
    cfg = ssd_variant("ssd", d, jnp.float32, interpret, with_beta)["config"]
    cands = [("shipped", cfg)]
    for vlabel, over in best_dqk_override(with_beta, margin)[:top]:
        if "num_warps" in over:
            over["warps"] = kernel_warps(cfg, "dqk", over.pop("num_warps"))
        cands.append((f"dqk {vlabel}", dataclasses.replace(cfg, **over)))
    ref = None
    for clabel, c in cands:
        run = fwd_bwd(impl_fn("ssd", interpret=interpret, config=c))
        res = guarded(f"e2e best {clabel}", lambda: timed(run, q, k, v, la, beta, do))
        if res is None:
            continue
        leaves = jax.tree_util.tree_leaves(run(q, k, v, la, beta, do))
        row = dict(shape=label, impl=f"ssd {clabel}", mode="fwd_bwd", beta=with_beta, ms=res[0], compile_s=res[1])
        if ref is None:
            ref = leaves
        else:
            row["rel_diff_vs_shipped"] = max(rel(a, r) for a, r in zip(leaves, ref))
        RESULTS["end_to_end"].append(row)
        log(f"e2e {label} {'beta' if with_beta else 'no beta'} ssd {clabel:20s} fwd_bwd {res[0]:.4f} ms "
            f"(compile {res[1]:.1f} s) diff vs shipped {row.get('rel_diff_vs_shipped')}")


def table():
    lines = ["| shape | beta | mode | impl | ms | x chunked | max rel diff vs chunked |",
             "|---|---|---|---|---|---|---|"]
    for r in RESULTS["end_to_end"]:
        base = [x["ms"] for x in RESULTS["end_to_end"] if x["impl"] == "chunked" and
                (x["shape"], x["beta"], x["mode"]) == (r["shape"], r["beta"], r["mode"])]
        speed = f"{base[0] / r['ms']:.2f}" if base else "-"
        diff = r.get("rel_diff_vs_chunked")
        lines.append(f"| {r['shape']} | {r['beta']} | {r['mode']} | {r['impl']} | {r['ms']:.3f} | {speed} | "
                     f"{'' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--smoke", action="store_true", help="interpret on CPU at tiny shapes")
    p.add_argument("--deadline", type=float, default=150.0, help="start no new step after this many seconds")
    p.add_argument("--steps", default="check,e2e,bf16,kernels,variants",
                   help="comma-separated: check e2e f32nobeta bf16 alt kernels variants e2e_best")
    p.add_argument("--variant-kernels", default="wy,dqk,precompute,state,reverse,out,dout",
                   help="kernels whose KERNEL_VARIANTS the variants step times, in this order")
    p.add_argument("--variant-shapes", default="f32", help="comma-separated shapes of the variants step: "
                   "f32 (B2 H8 T8192 d64), f32nb (the same without beta), bf16 (B2 H16 T8192 d128), f32_128 (B2 H8 T8192 d128), "
                   "f32_256 / bf16_256 (B2 H8 T4096 d256)")
    p.add_argument("--kernels", default="", help="comma-separated kernel names to time (default: all)")
    p.add_argument("--shipped-only", action="store_true", help="time the shipped form only")
    p.add_argument("--variant-match", default="", help="variants step: only labels containing this")
    p.add_argument("--warp-sweep", default="", help="variants step: comma-separated warp counts, each kernel "
                   "alone at each (labels kw<n>)")
    args = p.parse_args()
    KERNELS_ONLY.update(x for x in args.kernels.split(",") if x)
    SHIPPED_ONLY[0] = args.shipped_only
    VARIANT_MATCH[0] = args.variant_match
    WARP_SWEEP.extend(int(x) for x in args.warp_sweep.split(",") if x)
    interp = args.smoke
    OUT_DIR[0] = args.out
    if interp:
        BENCH_KW.update(reps=1, min_iters=1, target_ms=0.0)
        for name in KERNEL_VARIANTS:             # one variant per kernel exercises the code path
            KERNEL_VARIANTS[name] = dict(list(KERNEL_VARIANTS[name].items())[-1:])
    steps = args.steps.split(",")
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.platform} {dev.device_kind}"
    RESULTS["jax"] = jax.__version__
    if not interp:
        RESULTS["config_f32_64"] = str(ssd_config(64, 64, jnp.float32))
        RESULTS["config_bf16_128"] = str(ssd_config(128, 128, jnp.bfloat16))
    log("device", RESULTS["device"], "jax", jax.__version__)
    small = (1, 2, 70, 16) if interp else (1, 2, 1000, 64)
    f32_shape = (1, 2, 100, 16) if interp else (2, 8, 8192, 64)
    bf16_shape = (1, 2, 100, 32) if interp else (2, 16, 8192, 128)
    f32_label = "B2 H8 T8192 d64 f32" if not interp else "smoke f32"
    bf16_label = "B2 H16 T8192 d128 bf16" if not interp else "smoke bf16"

    variants = ("ssd", "ssd/alt")
    if "check" in steps:
        tf = dataclasses.replace(ssd_config(64, 64, jnp.float32), f32_dot="tf32x3") if not interp else None
        check_reference(small, {"shipped": {}}, interp, with_betas=(True, False))
        check_reference(small, {"tf32x3": dict(config=tf)}, interp, with_betas=(True,))
        small_tf = dataclasses.replace(tf, small_f32_dot=True) if not interp else None
        check_reference(small, {"tf32x3 incl. 16x16": dict(config=small_tf)}, interp, with_betas=(True,))
        save(args.out)
    if "e2e" in steps:            # everything end to end (first call)
        for with_beta in (True, False):
            extra = ("ssd+tf32x3",) if with_beta else ()
            time_end_to_end(f32_label, f32_shape, jnp.float32, with_beta, ("fwd", "fwd_bwd"),
                            ("chunked",) + variants + extra, interp)
    if "f32nobeta" in steps:      # gated linear attention / SSD: the fla simple-GLA targets
        time_end_to_end(f32_label, f32_shape, jnp.float32, False, ("fwd", "fwd_bwd"), ("chunked", "ssd"), interp)
    if "bf16" in steps:           # the bf16 forward target (with beta)
        time_end_to_end(bf16_label, bf16_shape, jnp.bfloat16, True, ("fwd",), ("chunked", "ssd"), interp)
    if "o4" in steps:             # the out kernel at 4 warps (bf16 dk128), one process
        time_end_to_end(bf16_label, bf16_shape, jnp.bfloat16, True, ("fwd", "fwd_bwd"), ("chunked", "ssd", "ssd+o4"),
                        interp)
    if "alt" in steps:            # the other form of the sequential passes, same process
        time_end_to_end(f32_label, f32_shape, jnp.float32, True, ("fwd", "fwd_bwd"), variants + ("ssd/alt+mh",),
                        interp)
        time_end_to_end(bf16_label, bf16_shape, jnp.bfloat16, True, ("fwd",), variants + ("ssd/alt+mh",), interp)
    save(args.out)
    if "kernels" in steps:
        guarded("kernels f32 beta", time_kernels, f32_label, f32_shape, jnp.float32, True, interp, (),
                args.deadline)
        save(args.out)
        guarded("kernels bf16 beta", time_kernels, bf16_label, bf16_shape, jnp.bfloat16, True, interp, (),
                args.deadline)
        save(args.out)
    if "variants" in steps:
        shapes = {"f32": (f32_label, f32_shape, jnp.float32), "bf16": (bf16_label, bf16_shape, jnp.bfloat16)}
        for name, (t, d, dtype) in {"f32_128": (8192, 128, jnp.float32), "f32_256": (4096, 256, jnp.float32),
                                    "bf16_256": (4096, 256, jnp.bfloat16)}.items():
            tag = "f32" if dtype == jnp.float32 else "bf16"
            shapes[name] = ((f"smoke {tag} d32", (1, 2, 100, 32), dtype) if interp else
                            (f"B2 H8 T{t} d{d} {tag}", (2, 8, t, d), dtype))
        shapes["f32nb"] = shapes["f32"]          # the same shape without beta (the fla simple-GLA target)
        for name in args.variant_shapes.split(","):
            label, shape, dtype = shapes[name]
            with_beta = name != "f32nb"
            guarded(f"kernel variants {name}", time_kernels, label, shape, dtype, with_beta, interp,
                    tuple(args.variant_kernels.split(",")), args.deadline)
            save(args.out)
    if "e2e_best" in steps:       # end to end with the fastest dqk variant of the variants step, per beta
        for with_beta in (True, False):
            guarded(f"e2e best dqk beta={with_beta}", time_best_dqk, f32_label, f32_shape, with_beta, interp,
                    2, 1e9 if interp else 0.97)
            save(args.out)
    print("\n" + table())
    print("\nfailures:", json.dumps(RESULTS["failures"]))
    save(args.out)


if __name__ == "__main__":
    main()
