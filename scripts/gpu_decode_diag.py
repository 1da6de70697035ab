"""Where the time of a decode call goes (one device call): the full jitted decode_attention with the splits
merged in the kernel (the default) and by the fused XLA step, the kernel alone (split partials), the XLA
merge alone, jax's xla attention, and an almost empty jit (the dispatch floor), each as throughput (calls
queued, one sync) and as host dispatch time (the same loop without the sync); plus the number of kernels
(fusions / custom calls) in each compiled program. Every full variant is checked against the XLA decode path
(max abs difference) and, for the in-kernel merge (an atomic arrival counter), for bitwise equal results
over 20 calls. ``--serving`` adds the call a serving step makes (kv_lens a traced argument) and jax xla
given the lengths.

  PYTHONPATH=$PWD python3 scripts/gpu_decode_diag.py --out $OUT/decode_diag.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp

import flashlax
from flashlax.bench.harness import clock_up
from flashlax.kernels import decode as dk
from flashlax.kernels.configs import decode_config
from _gpu_common import dispatch_us, log, rnd, timed

HQ, HKV, D = 32, 8, 128




def chain_us(step, sets, n=30, reps=7):
    """GPU microseconds per call without the host: ``n`` calls chained in ONE jitted program (each call's
    output is the next call's q; the K/V copies rotate so one pass is not served from L2), timed against the
    same program with one call: (t_n - t_1) / (n - 1), median of ``reps`` pairs."""
    def chained(count):
        def run(q, *kvs):
            for i in range(count):
                k, v = kvs[2 * (i % (len(kvs) // 2)): 2 * (i % (len(kvs) // 2)) + 2]
                q = step(q, k, v).astype(q.dtype).reshape(q.shape)
            return q
        return jax.jit(run)
    flat = (sets[0][0],) + tuple(x for s in sets for x in s[1:])
    one, many = chained(1), chained(n)
    jax.block_until_ready(one(*flat))
    jax.block_until_ready(many(*flat))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(one(*flat))
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready(many(*flat))
        tn = time.perf_counter() - t
        samples.append((tn - t1) / (n - 1) * 1e6)
    return statistics.median(samples)


def kernels(fn, args):
    text = fn.lower(*args).compile().as_text()
    entry = text[text.rfind("ENTRY"):]
    return {"fusions": len(re.findall(r"= \S+ fusion\(", entry)), "custom_calls": len(re.findall(r"custom-call\(", entry)),
            "entry_ops": entry.count("\n")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="decode_diag.json")
    p.add_argument("--shapes", default="", help="comma-separated BxLxLq entries to run (default: all), e.g. 1x65536x1")
    p.add_argument("--configs", default="",
                   help="also time the full call with these DecodeConfig overrides: comma-separated "
                        "block_kv/num_warps/num_stages[/programs_per_sm], or field=value pairs joined by '+' "
                        "(variants cfg_...)")
    p.add_argument("--only-configs", action="store_true", help="time the shipped full call and the --configs only")
    p.add_argument("--serving", action="store_true",
                   help="also the serving call: kv_lens a traced int32 argument (full_lens; its clip and NaN "
                        "guard are XLA ops around the kernel) and jax xla given key_value_seq_lengths")
    p.add_argument("--chain", type=int, default=0,
                   help="also the GPU time per call of the full variants and jax xla: this many calls chained in "
                        "one program (chain_us)")
    args = p.parse_args()
    rows = []
    clock_up()   # the GPU leaves its idle SM clock (345 MHz) before the first timed row
    cfg = decode_config(D, D, jnp.bfloat16, jax.devices()[0].device_kind)
    xla_merge = dataclasses.replace(cfg, merge_in_kernel_kb=0)
    shapes = [(1, 16384, 1), (1, 65536, 1), (1, 65536, 16), (8, 16384, 1), (4, 32768, 4)]
    if args.shapes:
        shapes = [tuple(int(x) for x in e.split("x")) for e in args.shapes.split(",")]
    for batch, length, lq in shapes:
        sets = [(rnd(10 * i + 1, (batch, HQ, lq, D), jnp.bfloat16), rnd(10 * i + 2, (batch, HKV, length, D), jnp.bfloat16),
                 rnd(10 * i + 3, (batch, HKV, length, D), jnp.bfloat16)) for i in range(3)]
        lens = jnp.full((batch,), length, jnp.int32)
        scale = D ** -0.5
        # n: kv_lens as an argument (--serving); None, each API's default, in every other variant
        full = jax.jit(lambda q, k, v, n=None: flashlax.decode_attention(q, k, v, kv_lens=n, impl="pallas"))
        kern = jax.jit(lambda q, k, v: dk.kernel_outputs(q, k, v, lens, scale=scale, num_splits=None,
                                                         config=xla_merge)[:2])
        parts = kern(*sets[0])
        merge = jax.jit(lambda o, l: dk.merge_splits(o, l)[0].astype(jnp.bfloat16))
        mask = None
        if lq > 1:
            mask = (jnp.arange(length)[None, :] <= jnp.arange(lq)[:, None] + length - lq)[None, None]
        jxla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q.swapaxes(1, 2), jnp.repeat(k, HQ // HKV, 1).swapaxes(1, 2), jnp.repeat(v, HQ // HKV, 1).swapaxes(1, 2),
            mask=mask, implementation="xla"))
        jxla_gqa = jax.jit(lambda q, k, v, n=None: jax.nn.dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), mask=mask, key_value_seq_lengths=n,
            implementation="xla"))
        empty = jax.jit(lambda q, k, v: q + 1)
        full_xla_merge = jax.jit(lambda q, k, v: dk.decode_attention_pallas(q, k, v, kv_lens=lens, config=xla_merge))
        variants = {"full": (full, sets), "full_xla_merge": (full_xla_merge, sets), "kernel_only": (kern, sets),
                    "merge_only": (merge, [parts]), "jax_xla_gqa": (jxla_gqa, sets)}
        if batch == 1 and lq == 1:
            variants |= {"jax_xla_repeat": (jxla, sets), "empty_jit": (empty, sets)}
        if length == 16384 and batch == 1:
            for splits in (8, 16, 32, 64):
                variants[f"full_splits{splits}"] = (jax.jit(lambda q, k, v, s=splits: flashlax.decode_attention(
                    q, k, v, impl="pallas", num_splits=s)), sets)
        if args.only_configs:
            variants = {"full": (full, sets)}
        if args.serving:   # the lengths an argument of the jitted call, as a serving step passes them
            lens_sets = [(*s, lens) for s in sets]
            variants |= {"full_lens": (full, lens_sets), "jax_xla_gqa_lens": (jxla_gqa, lens_sets)}
        for spec in filter(None, args.configs.split(",")):
            if "=" in spec:   # field=value pairs joined by "+", e.g. block_rows=32+merge_in_kernel_kb=0
                fields = {k: int(v) for k, v in (f.split("=") for f in spec.split("+"))}
            else:
                fields = dict(zip(("block_kv", "num_warps", "num_stages", "programs_per_sm"), map(int, spec.split("/"))))
            vcfg = dataclasses.replace(cfg, **fields)
            variants["full_cfg_" + re.sub(r"[/+=]", "_", spec)] = (jax.jit(
                lambda q, k, v, c=vcfg: dk.decode_attention_pallas(q, k, v, kv_lens=lens, config=c)), sets)
        want = jax.jit(lambda q, k, v: flashlax.decode_attention(q, k, v, impl="xla"))(*sets[0])
        for name, (fn, arg_sets) in variants.items():
            try:
                thr, lat = timed(fn, arg_sets, calls=100, reps=7, singles=10)
                row = dict(batch=batch, lkv=length, lq=lq, variant=name, thr_ms=thr, lat_ms=lat,
                           dispatch_us=dispatch_us(fn, arg_sets[0]), **kernels(fn, arg_sets[0]))
                if args.chain and name.startswith(("full", "jax_xla_gqa")) and not name.endswith("_lens"):
                    step = fn
                    if name.startswith("jax_xla"):   # [B, Lq, Hq, D] out -> q's [B, Hq, Lq, D]
                        step = lambda q, k, v, f=fn: f(q, k, v).swapaxes(1, 2)  # noqa: E731
                    row["gpu_chain_us"] = chain_us(step, arg_sets, n=args.chain)
                if name.startswith("full"):
                    got = fn(*arg_sets[0])
                    row["max_abs_vs_xla"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                    row["finite"] = bool(jnp.isfinite(got.astype(jnp.float32)).all())
                    if name == "full" or name.startswith(("full_splits", "full_cfg")):
                        again = [fn(*arg_sets[0]) for _ in range(20)]
                        row["bitwise_repeat"] = all(bool((a == got).all()) for a in again)
            except Exception as exc:  # noqa: BLE001
                row = dict(batch=batch, lkv=length, lq=lq, variant=name, error=f"{type(exc).__name__}: {exc}"[:400])
            log(row)
            rows.append(row)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
