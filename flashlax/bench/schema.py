"""The results-file schema of ``python -m flashlax.bench`` (docs/API.md, Benchmarks, describes the same
fields): ``{"device": {...}, "config": {...}, "results": [row, ...]}`` (the main job adds ``"parity"``).
:func:`validate` lists what a file breaks; the tests run it on files the benchmark writes."""

from __future__ import annotations

from typing import Any

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))

# Every row.
ROW_REQUIRED: dict[str, tuple] = {
    "suite": (str,),          # linear | gqa | prefill | decode
    "impl": (str,),           # the dispatcher's name (xla, pallas, chunked, ...) or a peer (jax_xla, ...)
    "mode": (str,),           # fwd | fwd_bwd
    "dtype": (str,),          # input dtype
}
# Shape fields by suite.
SHAPE_FIELDS: dict[str, dict[str, tuple]] = {
    "linear": {"batch": (int,), "heads": (int,), "seq": (int,), "dk": (int,), "dv": (int,), "chunk_size": (int,)},
    "gqa": {"batch": (int,), "lq": (int,), "lkv": (int,), "hq": (int,), "hkv": (int,), "head_dim": (int,),
            "mask": (str,)},
    "decode": {"batch": (int,), "lq": (int,), "lkv": (int,), "hq": (int,), "hkv": (int,), "head_dim": (int,)},
}
SHAPE_FIELDS["prefill"] = SHAPE_FIELDS["gqa"]
# Rows that measured something (rows with "error" have none of these).
MEASURED: dict[str, tuple] = {
    "compile_s": _NUM,        # seconds: jit lower + compile (torch: its first call)
    "inner": (int,),          # calls per timed sample
    "median_ms": _NUM,        # milliseconds per call: median of the samples
    "q1_ms": _NUM,            # first quartile
    "q3_ms": _NUM,            # third quartile
    "xla_temp_mb": _OPT_NUM,  # MB (2^20 bytes) from XLA's memory analysis; null for torch
    "xla_arg_mb": _OPT_NUM,
    "xla_out_mb": _OPT_NUM,
    "residual_mb": _OPT_NUM,  # MB saved for the backward, inputs excluded (fwd_bwd rows; null for fwd)
    "residual_shapes": (list, type(None)),
    "kv_mb": _OPT_NUM,        # MB of K and V (attention suites; null for linear)
    "rel_err": _OPT_NUM,      # ||out - ref|| / ||ref|| against the float64 reference (null: no reference)
    "rel_err_grads": (dict, type(None)),   # the same per input gradient (fwd_bwd rows)
}
# Present on some rows.
OPTIONAL: dict[str, tuple] = {
    "op": (str,),             # the flashlax op of a flashlax row (peers have none)
    "interpret": (bool,),     # a Pallas kernel run in the interpreter: a correctness check, not a timing
    "error": (str,),          # "ExceptionType: message" when the implementation raised
    "note": (str,), "residual_note": (str,),
    "num_splits": (int, type(None)),       # decode: the split count the op chose
    "page_size": (int,),      # decode on a paged cache (impl pallas_paged64, ...; jax_paged)
    "paged_impl": (str,),     # the dispatcher's impl a paged row runs (pallas, xla)
    "window": (int,), "documents": (int,),  # prefill's flex-only masks
    "throughput_ms": _NUM,    # decode: ms per call with `throughput_calls` calls queued and one sync
    "throughput_calls": (int,),
    "latency_ms": _NUM,       # decode: median of single synchronised calls
    "kv_tbps": _NUM,          # decode: KV bytes / throughput_ms, TB/s
    "copy_tbps": _NUM,        # decode: a device copy of the shape's K and V in the same rounds, (read + written) / time
    "copy_frac": _NUM,        # decode: kv_tbps / copy_tbps, the fraction of the copy ceiling
    "matmul_precision": (str,),  # the run's --matmul-precision (jax.default_matmul_precision), when given
}
DEVICE_REQUIRED = {"jax": (str,), "backend": (str,), "device_kind": (str,)}


def validate(data: Any) -> list[str]:
    """Problems of a results file (an empty list when it follows the schema)."""
    problems: list[str] = []
    if not isinstance(data, dict):
        return ["top level is not an object"]
    for key in ("device", "config", "results"):
        if key not in data:
            problems.append(f"missing top-level key {key!r}")
    for key, kinds in DEVICE_REQUIRED.items():
        if not isinstance((data.get("device") or {}).get(key), kinds):
            problems.append(f"device.{key} missing or not {kinds}")
    known = set(ROW_REQUIRED) | set(MEASURED) | set(OPTIONAL) | {k for f in SHAPE_FIELDS.values() for k in f}
    for i, row in enumerate(data.get("results") or []):
        where = f"results[{i}] ({row.get('impl')}, {row.get('suite')})"
        expected = dict(ROW_REQUIRED, **SHAPE_FIELDS.get(row.get("suite"), {}))
        if "error" not in row:
            expected.update(MEASURED)
        for key, kinds in expected.items():
            if key not in row:
                problems.append(f"{where}: missing {key!r}")
            elif not isinstance(row[key], kinds):
                problems.append(f"{where}: {key!r} is {type(row[key]).__name__}, want {kinds}")
        for key, kinds in OPTIONAL.items():
            if key in row and not isinstance(row[key], kinds):
                problems.append(f"{where}: {key!r} is {type(row[key]).__name__}, want {kinds}")
        unknown = set(row) - known
        if unknown:
            problems.append(f"{where}: undocumented fields {sorted(unknown)}")
        if row.get("mode") not in ("fwd", "fwd_bwd"):
            problems.append(f"{where}: mode {row.get('mode')!r}")
    return problems
