"""Tables and plots from result rows: the end-of-run table, ``--report`` (markdown impl x shape + PNG) and
``--compare`` (ratio per row between two runs)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any, Iterable

# Fields that belong to the measurement or the implementation, not to the shape of a row.
_NOT_SHAPE = {"impl", "op", "interpret", "window", "documents", "mode", "suite", "error", "note", "num_splits", "residual_note", "compile_s", "inner",
              "median_ms", "q1_ms", "q3_ms", "xla_temp_mb", "xla_arg_mb", "xla_out_mb", "residual_mb",
              "residual_shapes", "kv_mb", "rel_err", "rel_err_grads", "throughput_ms", "throughput_calls",
              "latency_ms", "kv_tbps", "copy_tbps", "copy_frac"}


# Error types of an implementation that is unavailable here (another backend, not written, no memory for a
# dense peer): listed in tables, never counted as a failure.
UNAVAILABLE = ("RuntimeError", "NotImplementedError", "ModuleNotFoundError", "ImportError", "MemoryError")


def load(path: str) -> dict[str, Any]:
    """A results file; rows of older files that name flashlax's impls the old way (``flex_native``,
    ``decode_pallas``, ...) get the dispatcher's names."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{path}: not a results file (no 'results' key)")
    from flashlax.bench.peers import LEGACY_NAMES, canonical_impl  # noqa: PLC0415

    backend = "gpu" if (data.get("device") or {}).get("backend") in ("gpu", "cuda", "rocm") else "cpu"
    for row in data["results"]:
        if row.get("impl") in LEGACY_NAMES:
            op = LEGACY_NAMES[row["impl"]][0] if row.get("suite") != "decode" or row["impl"] == "flex_repeat" \
                else "decode_attention"
            row.setdefault("op", op)
            row["impl"] = canonical_impl(row["impl"], op, backend)
    return data


def shape_label(row: dict) -> str:
    """A compact shape string, e.g. ``B2 H8 T512 dk64 float32 c64`` or ``B1 L1024 Hq32/8 D64 causal bf16``."""
    dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(row.get("dtype"), row.get("dtype"))
    if "seq" in row:  # linear
        dims = f"dk{row['dk']}" if row.get("dk") == row.get("dv") else f"dk{row['dk']} dv{row['dv']}"
        return f"B{row['batch']} H{row['heads']} T{row['seq']} {dims} {dtype} c{row.get('chunk_size')}"
    if row.get("suite") == "decode":
        return f"B{row['batch']} Lq{row['lq']} L{row['lkv']} Hq{row['hq']}/{row['hkv']} D{row['head_dim']} {dtype}"
    lengths = f"L{row['lq']}" if row.get("lq") == row.get("lkv") else f"Lq{row['lq']} L{row['lkv']}"
    return (f"B{row['batch']} {lengths} Hq{row['hq']}/{row['hkv']} D{row['head_dim']} "
            f"{row.get('mask', '')} {dtype}").replace("  ", " ")


def group_key(row: dict) -> tuple:
    """Rows with the same key are the same measurement by different implementations (peers)."""
    return (row.get("suite"), row.get("mode")) + tuple(
        sorted((k, json.dumps(v)) for k, v in row.items() if k not in _NOT_SHAPE))


def row_key(row: dict) -> tuple:
    return group_key(row) + (impl_label(row),)


def _ms(row: dict) -> float | None:
    value = row.get("median_ms")
    return value if isinstance(value, (int, float)) and "error" not in row else None


def _fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _fmt_err(value) -> str:
    return f"{value:.1e}" if isinstance(value, (int, float)) else "-"


def fastest_by_group(rows: Iterable[dict]) -> dict[tuple, float]:
    best: dict[tuple, float] = {}
    for row in rows:
        ms = _ms(row)
        if ms is not None:
            key = group_key(row)
            best[key] = min(best.get(key, math.inf), ms)
    return best


def impl_label(row: dict) -> str:
    return row["impl"] + (" (interpret)" if row.get("interpret") else "")


def summary_table(rows: list[dict]) -> str:
    """The end-of-run table: impl, shape, mode, median ms, ratio to the fastest peer, rel_err (or error).
    Rows run in the Pallas interpreter are listed but not counted as the fastest peer."""
    best = fastest_by_group([r for r in rows if not r.get("interpret")])
    decode = any("throughput_ms" in r for r in rows)  # decode rows: throughput, latency and KV TB/s too
    extra_head = " throughput ms | TB/s KV | of copy | latency ms |" if decode else ""
    lines = ["| impl | shape | mode | median ms | x fastest | rel_err |" + extra_head,
             "|---|---|---|---|---|---|" + "---|" * (4 if decode else 0)]
    for row in rows:
        ms = _ms(row)
        if ms is None:
            lines.append(f"| {impl_label(row)} | {shape_label(row)} | {row['mode']} | {row.get('error', '-')} | - | - |"
                         + " - | - | - | - |" * decode)
            continue
        ratio = f"{ms / best[group_key(row)]:.2f}" if group_key(row) in best else "-"
        extra = ""
        if decode:
            tbps = row.get("kv_tbps")
            frac = row.get("copy_frac")
            extra = (f" {_fmt_ms(row.get('throughput_ms'))} | {'-' if tbps is None else f'{tbps:.2f}'} | "
                     f"{'-' if frac is None else f'{frac:.0%}'} | {_fmt_ms(row.get('latency_ms'))} |")
        lines.append(f"| {impl_label(row)} | {shape_label(row)} | {row['mode']} | {_fmt_ms(ms)} | "
                     f"{ratio} | {_fmt_err(row.get('rel_err'))} |" + extra)
    return "\n".join(lines)


def report_table(data: dict) -> str:
    """Markdown, one table per suite: a line per (shape, mode), a column per impl, cells ``ms (x fastest)``."""
    rows = data["results"]
    best = fastest_by_group([r for r in rows if not r.get("interpret")])
    out = []
    device = data.get("device", {})
    out.append(f"Device: {device.get('gpu') or device.get('device_kind')} (backend {device.get('backend')}, "
               f"jax {device.get('jax')}, torch {device.get('torch')})")
    by_suite: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_suite[row.get("suite") or "linear"].append(row)
    for suite, suite_rows in by_suite.items():
        impls = list(dict.fromkeys(impl_label(r) for r in suite_rows))
        groups: dict[tuple, dict[str, dict]] = {}
        for row in suite_rows:
            groups.setdefault(group_key(row), {})[impl_label(row)] = row
        out.append(f"\n### {suite}: median ms (x fastest peer)\n")
        out.append("| shape | mode | " + " | ".join(impls) + " |")
        out.append("|---|---|" + "---|" * len(impls))
        for key, by_impl in groups.items():
            first = next(iter(by_impl.values()))
            cells = []
            for impl in impls:
                row = by_impl.get(impl)
                ms = None if row is None else _ms(row)
                if row is None:
                    cells.append("")
                elif ms is None:
                    cells.append("error" if "error" in row else "-")
                else:
                    cells.append(f"{_fmt_ms(ms)} ({ms / best[key]:.2f})" if key in best else _fmt_ms(ms))
            out.append(f"| {shape_label(first)} | {first['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _seq_of(row: dict) -> int | None:
    if "seq" in row:
        return row["seq"]
    return row.get("lkv")


def plot(data: dict, path: str) -> str:
    """PNG: median time vs sequence length (KV length for decode), one panel per (suite, mode), one line per
    impl and the other shape fields that vary; log-log."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels: dict[tuple, list[dict]] = defaultdict(list)
    for row in data["results"]:
        if _ms(row) is not None and _seq_of(row) is not None:
            panels[(row.get("suite"), row.get("mode"))].append(row)
    n = max(1, len(panels))
    cols = min(2, n)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(7 * cols, 4.5 * math.ceil(n / cols)),
                             squeeze=False)
    for ax, ((suite, mode), rows) in zip(axes.flat, sorted(panels.items(), key=str)):
        varying = [k for k in rows[0] if k not in _NOT_SHAPE and k not in ("seq", "lq", "lkv")
                   and len({json.dumps(r.get(k)) for r in rows}) > 1]
        if suite == "decode" and len({r.get("lq") for r in rows}) > 1:
            varying.append("lq")
        lines: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        for row in rows:
            variant = " ".join(f"{k}={row.get(k)}" for k in varying)
            lines[(impl_label(row), variant)].append((_seq_of(row), _ms(row)))
        impls = sorted({impl for impl, _ in lines})
        variants = sorted({variant for _, variant in lines})
        # colour = implementation, marker and line style = the other shape fields
        for (impl, variant), points in sorted(lines.items()):
            points.sort()
            v = variants.index(variant)
            ax.plot([p[0] for p in points], [p[1] for p in points], color=f"C{impls.index(impl) % 10}",
                    marker="os^vDP*X"[v % 8], linestyle=("-", "--", ":", "-.")[v % 4],
                    label=f"{impl} {variant}".strip())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("KV length" if suite == "decode" else "sequence length")
        ax.set_ylabel("median ms")
        ax.set_title(f"{suite} {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def compare_table(a: dict, b: dict, name_a: str = "a", name_b: str = "b") -> str:
    """Rows matched by (suite, mode, shape, impl); ratio = b / a of the median (below 1: b is faster)."""
    rows_b = {row_key(r): r for r in b["results"]}
    lines = [f"| impl | shape | mode | {name_a} ms | {name_b} ms | {name_b}/{name_a} |", "|---|---|---|---|---|---|"]
    matched = set()
    for row in a["results"]:
        key = row_key(row)
        other = rows_b.get(key)
        matched.add(key)
        ms_a, ms_b = _ms(row), None if other is None else _ms(other)
        ratio = f"{ms_b / ms_a:.2f}" if ms_a and ms_b else "-"
        lines.append(f"| {row['impl']} | {shape_label(row)} | {row['mode']} | {_fmt_ms(ms_a)} | "
                     f"{'missing' if other is None else _fmt_ms(ms_b)} | {ratio} |")
    for key, row in rows_b.items():
        if key not in matched:
            lines.append(f"| {row['impl']} | {shape_label(row)} | {row['mode']} | missing | "
                         f"{_fmt_ms(_ms(row))} | - |")
    return "\n".join(lines)
