"""``--quick``: the project's main job (ci/main.sh). All three ops at small shapes on the present backend:
every implementation's error against the float64 reference (forward and gradients) and a short timing
table; on a GPU machine also the GPU-vs-CPU parity (the same inputs through the GPU kernels and through
the CPU fallbacks on ``jax.devices('cpu')``). On CPU, Pallas kernels run in the Pallas interpreter
(``interpret=True``) so their numerics are checked too (``--no-interpret`` skips them).

It writes ``results/quick-<backend>-<date>.json`` (the benchmark schema), ``.md`` (the tables) and
``.png`` (error against the reference per op and impl with the tolerance line, and time per impl), or next
to ``--output`` when given, and names them at the end. Rows of Pallas kernels run in the interpreter are
correctness checks: their time is the interpreter's, so they are marked and left out of timings and ratios.

Exit status 1 when an implementation that ran has an error above the tolerance (or parity fails); error
rows of implementations that are unavailable here (``RuntimeError``, ``NotImplementedError``) are listed
but do not fail the job (nor do kernels not written yet: ``ModuleNotFoundError``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flashlax
from flashlax import dispatch, masks
from flashlax.bench import harness, report, suites

# Smoke-test bounds on rel_err against float64: 10x the test suite's table (tests/conftest.py TOLERANCES),
# since these are single random draws at shapes that are not multiples of any block or chunk.
# Error types of an implementation that is not available here (not written yet, or needs another backend).
UNAVAILABLE = report.UNAVAILABLE
TOLERANCE = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 3e-1}

LINEAR = dict(batch=[1], heads=[2], seq_lens=[200], dims=[32], dtypes=["float32"], chunk_sizes=[64],
              modes=["fwd", "fwd_bwd"], ref_max_seq=10**9, max_recurrent_seq=10**9)
GQA = dict(batch=[1], heads=[4], kv_heads=[2], seq_lens=[200], dims=[32], dtypes=["float32"],
           modes=["fwd", "fwd_bwd"], masks=["causal", "full"], ref_max_seq=10**9)
DECODE = dict(batch=[2], heads=[4], kv_heads=[2], q_lens=[1, 3], kv_lens=[1000], dims=[32], dtypes=["float32"],
              modes=["fwd"], ref_max_seq=10**9)


def _impls(op: str, gpu: bool, interpret: bool) -> list[str]:
    return [name for name, entry in dispatch.TABLE[op].items() if entry.kind == "xla" or gpu or interpret]


def configs(gpu: bool, interpret: bool, torch_available: bool) -> dict[str, dict[str, Any]]:
    # float32 inputs, so no jax_cudnn (cuDNN attention takes bf16/fp16 only); the suites time it in bf16.
    peers = ["jax_xla"] + (["torch_sdpa"] if torch_available else [])
    common = dict(repeats=3, min_sample_s=0.01, max_dense_gb=4.0, ref_dtype="float64", interpret=interpret)
    return {
        "linear": dict(LINEAR, impls=_impls("gated_delta_rule", gpu, interpret), **common),
        "gqa": dict(GQA, impls=_impls("flex_attention", gpu, interpret) + peers, **common),
        "decode": dict(DECODE, impls=_impls("decode_attention", gpu, interpret) + ["repeat"] + peers, **common),
    }


PEERS = ("jax_xla", "jax_cudnn", "torch_sdpa")


def _verdict(row: dict) -> str:
    """ok / FAIL for flashlax's implementations; a peer's trouble is reported ("peer ...") but is not ours."""
    peer = row["impl"] in PEERS
    if "error" in row:
        if row["error"].startswith(UNAVAILABLE):
            return "unavailable"
        return "peer error" if peer else "FAIL"
    err = row.get("rel_err")
    if err is None:
        return "no ref"
    if isinstance(err, float) and err <= TOLERANCE[row["dtype"]]:
        return "ok"
    return "peer above tolerance" if peer else "FAIL"


def _ms_cell(row: dict) -> str:
    return "interpreted" if row.get("interpret") else report._fmt_ms(row.get("median_ms"))


def error_table(rows: list[dict]) -> str:
    lines = ["| op | impl | shape | mode | rel_err out | rel_err grads (max) | median ms | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        impl = row["impl"] + (" (interpreted: correctness only)" if row.get("interpret") else "")
        if "error" in row:
            lines.append(f"| {row['suite']} | {impl} | {report.shape_label(row)} | {row['mode']} | "
                         f"{row['error']} | | | {_verdict(row)} |")
            continue
        grads = row.get("rel_err_grads") or {}
        grad_max = max(grads.values()) if grads else None
        out_err = row.get("rel_err") if not grads else None
        lines.append(f"| {row['suite']} | {impl} | {report.shape_label(row)} | {row['mode']} | "
                     f"{report._fmt_err(out_err if out_err is not None else row.get('rel_err'))} | "
                     f"{report._fmt_err(grad_max)} | {_ms_cell(row)} | {_verdict(row)} |")
    return "\n".join(lines)


def default_output(backend: str) -> str:
    return os.path.join("results", f"quick-{backend}-{datetime.date.today().isoformat()}.json")


def _title(data: dict) -> str:
    """Device, dtype and the shapes of each suite, from the run's config."""
    device = data["device"]
    cfgs = data["config"]["suites"]
    lin, gqa, dec = cfgs["linear"], cfgs["gqa"], cfgs["decode"]
    return (f"flashlax quick check on {device.get('gpu') or device.get('device_kind')} ({device['backend']}), "
            f"{'/'.join(gqa['dtypes'])}\n"
            f"gated_delta_rule B{lin['batch'][0]} H{lin['heads'][0]} T{lin['seq_lens'][0]} dk=dv {lin['dims'][0]}; "
            f"flex_attention B{gqa['batch'][0]} Hq{gqa['heads'][0]}/Hkv{gqa['kv_heads'][0]} L{gqa['seq_lens'][0]} "
            f"D{gqa['dims'][0]}; decode_attention B{dec['batch'][0]} Lq{','.join(map(str, dec['q_lens']))} "
            f"L{dec['kv_lens'][0]} Hq{dec['heads'][0]}/Hkv{dec['kv_heads'][0]} D{dec['dims'][0]}")


def plot(data: dict, path: str) -> str:
    """PNG: per suite, the error against the float64 reference of every (impl, mode, mask) row (log scale,
    with the tolerance line; peers in grey) over the median time of the rows that are timings."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    suite_names = list(dict.fromkeys(r["suite"] for r in data["results"]))
    fig, axes = plt.subplots(2, len(suite_names), figsize=(6.5 * len(suite_names), 9), squeeze=False,
                             layout="constrained")
    for col, suite in enumerate(suite_names):
        rows = [r for r in data["results"] if r["suite"] == suite]
        labels = [f"{r['impl']} {r['mode']}" + (f" {r['mask']}" if r.get("mask") else "")
                  + (f" Lq{r['lq']}" if suite == "decode" else "")
                  + (f" [{r['error'].split(':')[0]}]" if "error" in r else "") for r in rows]
        colors = ["0.6" if r["impl"] in PEERS else ("C1" if r.get("interpret") else "C0") for r in rows]
        errors = []
        for r in rows:
            grads = r.get("rel_err_grads") or {}
            values = [v for v in [r.get("rel_err"), *grads.values()] if isinstance(v, (int, float))]
            errors.append(max(values) if values else float("nan"))
        ax = axes[0, col]
        finite = [e for e in errors if e == e and e > 0]
        floor = min(finite) / 10 if finite else 1e-9
        ax.bar(range(len(rows)), [e if e == e and e > 0 else 0.0 for e in errors], color=colors, bottom=0)
        tolerances = {TOLERANCE[r["dtype"]] for r in rows}
        for tol in sorted(tolerances):
            ax.axhline(tol, color="C3", linestyle="--", label=f"tolerance {tol:.0e}")
        ax.set_yscale("log")
        ax.set_ylim(floor, max(tolerances | {max(finite, default=floor)}) * 10)
        ax.set_ylabel("relative error")
        ax.set_title(f"{suite}: error vs float64 reference\n(worst of output and gradients)", fontsize=9)
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
        ax.legend(fontsize=7)
        timed = [(label, r, c) for label, r, c in zip(labels, rows, colors)
                 if not r.get("interpret") and isinstance(r.get("median_ms"), (int, float))]
        ax = axes[1, col]
        ax.bar(range(len(timed)), [r["median_ms"] for _, r, _ in timed], color=[c for _, _, c in timed])
        ax.set_yscale("log")
        ax.set_ylabel("median ms")
        interpreted = sorted({r["impl"] for r in rows if r.get("interpret")})
        note = f" (not timed, interpreted: {', '.join(interpreted)})" if interpreted else ""
        ax.set_title(f"{suite}: time per impl{note}", fontsize=9)
        ax.set_xticks(range(len(timed)), [label for label, _, _ in timed], rotation=60, ha="right", fontsize=7)
    fig.suptitle(_title(data) + "\nblue: flashlax, grey: peers, orange: Pallas in the interpreter (correctness only)",
                 fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------------
# GPU-vs-CPU parity


def _parity_cases():
    """(op, fn(impl, *inputs) -> out, inputs, differentiable) at small shapes, float32."""
    lin = suites.linear_inputs(7, 1, 2, 300, 64, 64, jnp.float32)
    att = suites.attention_inputs(7, 1, 8, 2, 300, 300, 64, jnp.float32)
    dec = suites.attention_inputs(7, 2, 8, 2, 4, 2000, 64, jnp.float32)
    return [
        ("gated_delta_rule", lambda impl, q, k, v, a, b: flashlax.gated_delta_rule(q, k, v, a, b, impl=impl),
         lin[:5], lin[5]),
        ("flex_attention", lambda impl, q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, impl=impl),
         att[:3], att[3]),
        ("decode_attention", lambda impl, q, k, v: flashlax.decode_attention(q, k, v, impl=impl), dec[:3], None),
    ]


def _run_on(device, fn, impl, inputs, cot):
    inputs = [jax.device_put(x, device) for x in inputs]
    with jax.default_device(device):
        call = jax.jit(lambda *xs: fn(impl, *xs))
        if cot is None:
            return np.asarray(call(*inputs)), None
        out, vjp = jax.vjp(call, *inputs)
        grads = vjp(jax.device_put(cot, device))
        return np.asarray(out), [np.asarray(g) for g in grads]


def parity_pairs(op: str) -> list[tuple[str, str]]:
    """(GPU impl, CPU impl) pairs compared by :func:`parity`: the two defaults, and every Pallas kernel of
    the op that is not the GPU default against the CPU default (gated_delta_rule: ssd, the GPU default,
    against chunked)."""
    gpu_impl, cpu_impl = dispatch.default_impl(op, "gpu"), dispatch.default_impl(op, "cpu")
    kernels = [name for name, entry in dispatch.TABLE[op].items()
               if entry.kind == "pallas" and entry.target is not None and name != gpu_impl]
    return [(gpu_impl, cpu_impl)] + [(name, cpu_impl) for name in kernels]


def parity(gpu_device, cpu_device) -> list[dict]:
    rows = []
    for op, fn, inputs, cot in _parity_cases():
        for gpu_impl, cpu_impl in parity_pairs(op):
            row: dict[str, Any] = {"op": op, "gpu_impl": gpu_impl, "cpu_impl": cpu_impl}
            try:
                gpu_out, gpu_grads = _run_on(gpu_device, fn, gpu_impl, inputs, cot)
                cpu_out, cpu_grads = _run_on(cpu_device, fn, cpu_impl, inputs, cot)
                row["rel_diff"] = harness.rel_err(gpu_out, cpu_out)
                if gpu_grads is not None:
                    row["rel_diff_grads"] = max(harness.rel_err(g, c) for g, c in zip(gpu_grads, cpu_grads))
            except Exception as exc:
                row["error"] = harness.error_text(exc)
            rows.append(row)
    return rows


def parity_table(rows: list[dict]) -> str:
    lines = ["| op | GPU impl | CPU impl | rel diff out | rel diff grads (max) | verdict |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['op']} | {row['gpu_impl']} | {row['cpu_impl']} | {row['error']} | | "
                         f"{'unavailable' if row['error'].startswith(UNAVAILABLE) else 'FAIL'} |")
            continue
        worst = max(row["rel_diff"], row.get("rel_diff_grads", 0.0))
        lines.append(f"| {row['op']} | {row['gpu_impl']} | {row['cpu_impl']} | {row['rel_diff']:.1e} | "
                     f"{report._fmt_err(row.get('rel_diff_grads'))} | "
                     f"{'ok' if worst <= TOLERANCE['float32'] else 'FAIL'} |")
    return "\n".join(lines)


def main(args) -> int:
    from flashlax.bench import cli  # noqa: PLC0415

    start = time.perf_counter()
    gpu = harness.on_gpu()
    info = harness.device_info()
    interpret = not getattr(args, "no_interpret", False)
    torch_available = harness.torch_module() is not None
    print(f"flashlax quick check on {info['backend']} ({info['gpu'] or info['device_kind']}), jax {info['jax']}, "
          f"torch {info['torch']}", flush=True)
    if not torch_available:
        print("torch is not installed: no torch_sdpa rows.", flush=True)
    rows: list[dict] = []
    for suite, cfg in configs(gpu, interpret, torch_available).items():
        print(f"[{suite}]", file=sys.stderr, flush=True)
        rows.extend(suites.run_suite(suite, cfg))
    parity_rows = []
    if gpu:
        parity_rows = parity(jax.devices()[0], jax.devices("cpu")[0])
    sections = ["## Error against the float64 reference, and timings\n", error_table(rows),
                "\n## Timing (median ms, x fastest peer; interpreted rows are not timings)\n",
                report.summary_table([r for r in rows if "error" not in r and not r.get("interpret")])]
    if gpu:
        sections += ["\n## GPU vs CPU parity (same inputs; GPU default impl and other GPU kernels vs CPU fallback, float32)\n",
                     parity_table(parity_rows)]
    text = "\n".join(sections)
    print("\n" + text)
    failed = [r for r in rows if _verdict(r) == "FAIL"] + [
        r for r in parity_rows if ("error" in r and not r["error"].startswith(UNAVAILABLE))
        or max(r.get("rel_diff", 0.0), r.get("rel_diff_grads", 0.0)) > TOLERANCE["float32"]]
    data = {"device": info, "config": {"quick": True, "interpret": interpret,
                                       "suites": configs(gpu, interpret, torch_available)},
            "results": rows, "parity": parity_rows}
    json_path = getattr(args, "output", None) or default_output(info["backend"])
    base = os.path.splitext(json_path)[0]
    cli.write(data, json_path)
    with open(base + ".md", "w") as f:
        f.write(f"# flashlax quick check\n\n{_title(data)}\n\n{text}\n")
    written = [json_path, base + ".md"]
    try:
        written.append(plot(data, base + ".png"))
    except ImportError as exc:  # matplotlib is the bench extra
        print(f"no plot: {exc}", file=sys.stderr)
    print(f"\n{len(rows)} rows, {len(failed)} failing, {time.perf_counter() - start:.0f} s")
    print("wrote " + ", ".join(written))
    if failed:
        print("FAILED: " + json.dumps([{k: r.get(k) for k in ("suite", "op", "impl", "mode", "rel_err", "error")
                                         if k in r} for r in failed]))
        return 1
    return 0
