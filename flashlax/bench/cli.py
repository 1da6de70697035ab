"""Command line of ``python -m flashlax.bench`` (see ``--help``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

# Before any backend starts: torch and jax share the GPU in one process, so jax must not grab 75% of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

SUITE_CHOICES = ("linear", "gqa", "decode", "prefill", "all", "sharding")


def _list(kind):
    def parse(text: str):
        return [kind(part) for part in text.split(",") if part]

    return parse


def _flatten(values):
    return None if values is None else [v for group in values for v in group]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlax.bench", description=(
        "Microbenchmarks and parity report of flashlax against jax_xla, jax_cudnn (GPU) and torch_sdpa "
        "(when torch is installed). List flags take space- or comma-separated values."))
    p.add_argument("--suite", choices=SUITE_CHOICES, default=None)
    p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="backend to run on (default: the present one; cpu forces JAX onto the CPU)")
    p.add_argument("--output", help="results JSON file (schema: docs/API.md, Benchmarks)")
    p.add_argument("--batch", nargs="+", type=_list(int))
    p.add_argument("--heads", nargs="+", type=_list(int), help="heads (linear) or query heads (attention)")
    p.add_argument("--kv-heads", nargs="+", type=_list(int))
    p.add_argument("--lengths", nargs="+", type=_list(int),
                   help="sequence lengths (linear, gqa, prefill) or KV cache lengths (decode)")
    p.add_argument("--q-lens", nargs="+", type=_list(int), help="decode: new tokens per step (1..16)")
    p.add_argument("--dims", nargs="+", type=_list(int), help="dk = dv (linear) or head dim (attention)")
    p.add_argument("--dtypes", nargs="+", type=_list(str))
    p.add_argument("--impls", nargs="+", type=_list(str),
                   help="the dispatcher's names and the peers: linear: recurrent chunked chunked_fat ssd; gqa / "
                        "prefill: xla repeat pallas jax_xla jax_cudnn torch_sdpa torch_flex jax_pallas_mha; "
                        "decode: xla pallas repeat jax_xla jax_cudnn torch_sdpa, and paged caches (issue 18): "
                        "pallas_paged64 pallas_paged16 xla_paged16 jax_paged")
    p.add_argument("--modes", nargs="+", type=_list(str), help="fwd fwd_bwd")
    p.add_argument("--masks", nargs="+", type=_list(str), help="gqa/prefill: full causal sliding_window document")
    p.add_argument("--chunk-sizes", nargs="+", type=_list(int))
    p.add_argument("--repeats", type=int, default=5, help="timed samples per row (median and quartiles)")
    p.add_argument("--min-sample-s", type=float, default=None,
                   help="target length of one timed sample; sets `inner` (default 0.05 s CPU, 0.02 s GPU)")
    p.add_argument("--ref-max-seq", type=int, default=None,
                   help="largest (query) length with a float64 reference; above it rel_err is null "
                        "(0: no reference, for timing-only runs; the decode reference at KV 65536 takes seconds)")
    p.add_argument("--ref-dtype", choices=("float64", "float32"), default="float64",
                   help="linear reference precision (float32 when float64 is too slow)")
    p.add_argument("--max-dense-gb", type=float, default=16.0,
                   help="jax_xla rows whose dense logits exceed this become error rows instead of running")
    p.add_argument("--max-recurrent-seq", type=int, default=None, help="linear: skip recurrent above this")
    p.add_argument("--report", metavar="RESULTS_JSON", help="print a markdown table and write a PNG plot")
    p.add_argument("--plot", metavar="PNG", help="plot path for --report (default: RESULTS_JSON with .png)")
    p.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"), help="ratio per row b/a between runs")
    p.add_argument("--quick", action="store_true",
                   help="the main job: all ops at small shapes, error vs reference, timings, GPU-vs-CPU parity")
    p.add_argument("--matmul-precision", default=None, metavar="PRECISION",
                   help="run every row under jax.default_matmul_precision(PRECISION), e.g. tensorfloat32: "
                        "float32 products as one tf32 pass (flashlax and jax peers; default: full float32)")
    p.add_argument("--no-interpret", action="store_true",
                   help="--quick: skip Pallas kernels in the interpreter on CPU")
    return p


def suite_config(suite: str, args, gpu: bool) -> dict[str, Any]:
    from flashlax.bench import harness, suites  # noqa: PLC0415

    cfg = suites.suite_defaults(suite, gpu)
    overrides = {"batch": _flatten(args.batch), "heads": _flatten(args.heads), "kv_heads": _flatten(args.kv_heads),
                 "q_lens": _flatten(args.q_lens), "dims": _flatten(args.dims), "dtypes": _flatten(args.dtypes),
                 "impls": _flatten(args.impls), "modes": _flatten(args.modes), "masks": _flatten(args.masks),
                 "chunk_sizes": _flatten(args.chunk_sizes), "ref_max_seq": args.ref_max_seq,
                 "max_recurrent_seq": args.max_recurrent_seq}
    overrides["kv_lens" if suite == "decode" else "seq_lens"] = _flatten(args.lengths)
    for key, value in overrides.items():
        if value is not None and key in cfg:
            cfg[key] = value
    if suite == "decode" and cfg.get("shapes") and (args.batch or args.lengths or args.q_lens):
        cfg["shapes"] = None  # explicit batch/lengths/q-lens: their product instead of the GPU shapes
    if suite == "prefill" and (args.batch or args.lengths):
        cfg["shapes"] = None  # explicit batch/lengths: their product instead of the ANCHORS pairs
        cfg["batch"] = _flatten(args.batch) or [1]
        cfg["seq_lens"] = _flatten(args.lengths) or [4096]
    if args.masks is not None and "flex_masks" in cfg:
        cfg["flex_masks"] = []  # explicit masks replace the default flex-only extras
    for mode in cfg["modes"]:
        if mode not in ("fwd", "fwd_bwd"):
            raise SystemExit(f"--modes: unknown mode {mode!r}; valid: fwd fwd_bwd")
    from flashlax.bench import peers  # noqa: PLC0415

    cfg["impls"] = [peers.canonical_impl(i, suites.suite_op(suite), "gpu" if gpu else "cpu") for i in cfg["impls"]]
    unknown = [i for i in cfg["impls"] if i not in suites.valid_impls(suite)]
    if unknown:
        raise SystemExit(f"--impls: unknown impl(s) {', '.join(unknown)} for the {suite} suite; valid: "
                         f"{' '.join(suites.valid_impls(suite))}")
    cfg["repeats"] = args.repeats
    cfg["min_sample_s"] = args.min_sample_s if args.min_sample_s is not None else (0.02 if gpu else 0.05)
    cfg["max_dense_gb"] = args.max_dense_gb
    cfg["ref_dtype"] = args.ref_dtype
    missing_torch = [i for i in cfg["impls"] if i in ("torch_sdpa", "torch_flex")]
    if missing_torch and harness.torch_module() is None:
        cfg["impls"] = [i for i in cfg["impls"] if i not in missing_torch]
        print(f"[{suite}] torch is not installed: no {' / '.join(missing_torch)} rows.", file=sys.stderr)
    if "shapes" in cfg and cfg["shapes"] is not None:
        cfg["shapes"] = [list(s) for s in cfg["shapes"]]
    return cfg


def _select_device(device: str | None) -> str:
    if device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        return "cpu"
    from flashlax.bench.harness import on_gpu  # noqa: PLC0415

    present = "gpu" if on_gpu() else jax.default_backend()
    if device == "gpu" and present != "gpu":
        raise SystemExit(f"--device gpu: no GPU backend here (backend is {present!r})")
    return present


def run(args) -> dict[str, Any]:
    from flashlax.bench import harness, report, suites  # noqa: PLC0415

    device = _select_device(args.device)
    gpu = device == "gpu"
    names = list(suites.SUITES) if args.suite == "all" else [args.suite]
    configs = {name: suite_config(name, args, gpu) for name in names}
    try:
        import flashlax._residuals  # noqa: F401, PLC0415
        residual_source = "flashlax._residuals.residual_bytes"
    except ImportError:
        residual_source = "flashlax.bench.harness (vjp closure leaves, inputs excluded)"
    config: dict[str, Any] = {"device": device, "suite": args.suite, "repeats": args.repeats,
                              "min_sample_s": configs[names[0]]["min_sample_s"], "residual_source": residual_source}
    if len(names) == 1:
        config.update(configs[names[0]])
    else:
        config["suites"] = configs
    if args.matmul_precision is not None:
        config["matmul_precision"] = args.matmul_precision
    data = {"device": harness.device_info(), "config": config, "results": []}
    harness.clock_up()
    for name in names:
        print(f"[{name}] running on {device} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with jax.default_matmul_precision(args.matmul_precision):
            rows = suites.run_suite(name, configs[name])
        if args.matmul_precision is not None:
            for row in rows:
                row["matmul_precision"] = args.matmul_precision
        data["results"].extend(rows)
        print(f"\n## {name} ({len(rows)} rows, {time.perf_counter() - start:.0f} s, {data['device']['device_kind']})\n")
        print(report.summary_table(rows), flush=True)
        if args.output:  # write after every suite so a long `all` run keeps what it has
            write(data, args.output)
    return data


def failed_rows(rows: list[dict]) -> list[dict]:
    """Rows whose implementation raised, except where it is merely unavailable here (no GPU, no torch,
    a dense peer too large for memory)."""
    from flashlax.bench.report import UNAVAILABLE  # noqa: PLC0415

    return [r for r in rows if "error" in r and not r["error"].startswith(UNAVAILABLE)]


def write(data: dict, path: str) -> None:
    from flashlax.bench.harness import json_safe  # noqa: PLC0415

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(data), f, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        from flashlax.bench import report  # noqa: PLC0415

        if not os.path.isfile(args.report):
            print(f"python -m flashlax.bench: error: --report: no such results file: {args.report}", file=sys.stderr)
            return 2
        try:
            data = report.load(args.report)
        except ValueError as exc:
            print(f"python -m flashlax.bench: error: --report: {exc}", file=sys.stderr)
            return 2
        print(report.report_table(data))
        png = args.plot or os.path.splitext(args.report)[0] + ".png"
        print(f"\nplot: {report.plot(data, png)}")
        return 0
    if args.compare:
        from flashlax.bench import report  # noqa: PLC0415

        a, b = args.compare
        for path in (a, b):
            if not os.path.isfile(path):
                print(f"python -m flashlax.bench: error: --compare: no such results file: {path}", file=sys.stderr)
                return 2
        print(report.compare_table(report.load(a), report.load(b), os.path.basename(a), os.path.basename(b)))
        return 0
    if args.quick:
        from flashlax.bench import quick  # noqa: PLC0415

        _select_device(args.device)
        return quick.main(args)
    if args.suite is None:
        build_parser().error("give --suite (or --quick, --report, --compare)")
    if args.suite == "sharding":    # its own rows and device setup (flashlax/bench/sharding.py)
        from flashlax.bench import sharding  # noqa: PLC0415

        lengths = _flatten(args.lengths)
        return sharding.main((["--length", str(lengths[0])] if lengths else []) + ["--repeats", str(args.repeats)]
                             + (["--output", args.output] if args.output else []))
    failed = failed_rows(run(args)["results"])
    if failed:
        names = ", ".join(sorted({f"{r['impl']} ({r['error'].split(':')[0]})" for r in failed}))
        print(f"python -m flashlax.bench: {len(failed)} row(s) failed: {names}", file=sys.stderr)
        return 1
    return 0
