"""The benchmark (python -m flashlax.bench): results schema on a tiny run of every suite, error rows for GPU
kernels on CPU, the timing/error helpers, --report (table + PNG) and --compare."""

import copy
import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from flashlax.bench import cli, harness, quick, report, schema

from conftest import TOLERANCES, rel_err as conftest_rel_err

DEVICE_TYPES = {"jax": str, "backend": str, "devices": list, "python": str, "device_kind": str,
                "gpu": (str, type(None)), "driver": (str, type(None)), "gpu_memory_gb": (float, type(None)),
                "torch": (str, type(None)), "torch_cuda": (str, type(None))}
IDENTITY = {
    "linear": {"batch": int, "heads": int, "seq": int, "dk": int, "dv": int, "chunk_size": int},
    "gqa": {"batch": int, "lq": int, "lkv": int, "hq": int, "hkv": int, "head_dim": int, "mask": str},
    "prefill": {"batch": int, "lq": int, "lkv": int, "hq": int, "hkv": int, "head_dim": int, "mask": str},
    "decode": {"batch": int, "lq": int, "lkv": int, "hq": int, "hkv": int, "head_dim": int},
}
GRAD_NAMES = {"linear": {"q", "k", "v", "log_alpha", "beta"}}
SHAPE_RE = re.compile(r"^[a-z0-9]+\[[0-9, ]*\]$")

TINY = ["--batch", "1", "--heads", "2", "--dims", "8", "--repeats", "2", "--min-sample-s", "0.002"]
SUITE_ARGS = {
    "linear": ["--lengths", "40", "--impls", "recurrent", "chunked", "ssd"],
    "gqa": ["--kv-heads", "1", "--lengths", "40", "--impls", "xla", "jax_xla", "pallas", "--masks", "causal"],
    "prefill": ["--kv-heads", "1", "--lengths", "48", "--impls", "xla", "jax_xla", "--masks", "full",
                "document", "--modes", "fwd"],
    "decode": ["--kv-heads", "1", "--lengths", "96", "--q-lens", "3", "--impls", "xla", "jax_xla", "xla_paged16"],
}


def _op_works(suite: str) -> bool:
    """True when flashlax's default path for the suite's op runs (ops still being written raise)."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (1, 2, 8, 8))
    try:
        if suite == "linear":
            gate = -jnp.abs(jax.random.normal(key, (1, 2, 8)))
            jax.jit(flashlax.gated_delta_rule)(x, x, x, gate, jax.nn.sigmoid(gate))
        elif suite == "decode":
            jax.jit(flashlax.decode_attention)(x[:, :, :2], x[:, :1], x[:, :1])
        else:
            jax.jit(lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=flashlax.masks.causal))(
                x, x[:, :1], x[:, :1])
    except (NotImplementedError, ImportError):
        return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One tiny run of every suite through the CLI entry point (in process), results loaded back."""
    out = {}
    for suite, extra in SUITE_ARGS.items():
        path = tmp_path_factory.mktemp("bench") / f"{suite}.json"
        assert cli.main(["--suite", suite, *TINY, *extra, "--output", str(path)]) == 0
        with open(path) as f:
            out[suite] = json.load(f)
    return out


def _check_row(suite: str, row: dict) -> None:
    assert row["suite"] == suite
    assert isinstance(row["impl"], str) and row["mode"] in ("fwd", "fwd_bwd")
    assert row["dtype"] in ("float32", "bfloat16", "float16")
    for key, kind in IDENTITY[suite].items():
        assert isinstance(row[key], kind), (key, row)
    if "error" in row:
        assert re.match(r"^[A-Za-z_][\w.]*: ", row["error"]), row["error"]
        for key in harness.TIMING_KEYS:
            assert key not in row, (key, row)
        return
    for key in harness.MEASURE_KEYS:
        assert key in row, (key, row)
    assert isinstance(row["compile_s"], float) and row["compile_s"] > 0
    assert isinstance(row["inner"], int) and row["inner"] >= 1
    assert 0 < row["q1_ms"] <= row["median_ms"] <= row["q3_ms"]
    if row["impl"] != "torch_sdpa":
        for key in harness.XLA_MEMORY_KEYS:
            assert isinstance(row[key], float) and row[key] >= 0
    if row["mode"] == "fwd":
        assert row["residual_mb"] is None and row["residual_shapes"] is None and row["rel_err_grads"] is None
    else:
        assert isinstance(row["residual_mb"], float) and row["residual_mb"] >= 0
        assert all(SHAPE_RE.match(s) for s in row["residual_shapes"]), row["residual_shapes"]
        assert set(row["rel_err_grads"]) == GRAD_NAMES.get(suite, {"q", "k", "v"})
    assert isinstance(row["rel_err"], float) and row["rel_err"] <= 10 * TOLERANCES[row["dtype"]], row
    if suite == "linear":
        assert row["kv_mb"] is None
    else:
        itemsize = np.dtype(jnp.dtype(row["dtype"])).itemsize
        expect = 2 * row["batch"] * row["hkv"] * row["lkv"] * row["head_dim"] * itemsize / harness.MB
        assert row["kv_mb"] == pytest.approx(expect)


@pytest.mark.parametrize("suite", list(SUITE_ARGS))
def test_schema(runs, suite):
    data = runs[suite]
    assert set(data) >= {"device", "config", "results"}
    for key, kind in DEVICE_TYPES.items():
        assert isinstance(data["device"][key], kind), (key, data["device"])
    assert data["device"]["backend"] == "cpu"
    assert data["config"]["suite"] == suite and data["config"]["device"] == "cpu"
    rows = data["results"]
    assert rows
    for row in rows:
        _check_row(suite, row)
        if row["impl"] not in ("jax_xla", "jax_cudnn", "torch_sdpa", "torch_flex", "jax_pallas_mha"):
            # the dispatcher's own names (a paged decode row names its cache too: xla_paged16 runs xla)
            assert row.get("paged_impl", row["impl"]) in flashlax.dispatch.TABLE[row["op"]], row
    assert schema.validate(data) == []
    # The jax peer always runs; flashlax's own default path must run once its op is written.
    working = {"jax_xla"} if suite != "linear" else {"recurrent"}
    if _op_works(suite):
        working |= {"xla"} if suite != "linear" else {"chunked"}
    for row in rows:
        if row["impl"] in working:
            assert "error" not in row, row
    modes = set(data["config"]["modes"])
    assert {r["mode"] for r in rows} == modes


def test_linear_rows_shapes_and_arg_bytes(runs):
    """XLA's argument size of a forward is exactly the inputs: q, k, v, log_alpha, beta."""
    rows = [r for r in runs["linear"]["results"] if "error" not in r and r["mode"] == "fwd"]
    assert rows
    for row in rows:
        b, h, t, dk, dv = row["batch"], row["heads"], row["seq"], row["dk"], row["dv"]
        assert (b, h, t, dk, dv) == (1, 2, 40, 8, 8)
        assert row["xla_arg_mb"] * harness.MB == pytest.approx(4 * (2 * b * h * t * dk + b * h * t * dv + 2 * b * h * t))


def test_gpu_kernels_give_error_rows_on_cpu(runs):
    ssd = [r for r in runs["linear"]["results"] if r["impl"] == "ssd"]
    pallas = [r for r in runs["gqa"]["results"] if r["impl"] == "pallas"]
    assert len(ssd) == 2 and len(pallas) == 2
    for row in ssd:
        assert row["error"] == "RuntimeError: ssd requires an accelerator backend."
    for row in pallas:
        assert row["error"].startswith("RuntimeError: ") and "accelerator" in row["error"]


def test_prefill_flex_masks_and_decode_num_splits(runs):
    prefill = runs["prefill"]["results"]
    assert {r["mask"] for r in prefill if r["impl"] == "xla"} == {"full", "document"}
    assert {r["mask"] for r in prefill if r["impl"] == "jax_xla"} == {"full"}  # flex-only mask: no peer row
    for row in runs["decode"]["results"]:
        assert row["lq"] == 3 and row["lkv"] == 96
        if row["impl"] == "xla" and "error" not in row:  # the split count the op chose
            assert isinstance(row["num_splits"], int) and 1 <= row["num_splits"] <= row["lkv"], row


def test_decode_paged_rows(runs):
    """The paged row (pages of 16 in shuffled order, the XLA path) is checked against the same reference
    as the contiguous rows."""
    [row] = [r for r in runs["decode"]["results"] if r["impl"] == "xla_paged16"]
    assert "error" not in row, row
    assert row["page_size"] == 16 and row["paged_impl"] == "xla"
    assert row["rel_err"] is not None and row["rel_err"] < 1e-5, row


@pytest.mark.parametrize("name", ["pallas_paged64", "pallas_paged16"])
def test_paged_decode_runner_matches_contiguous(name):
    """The bench's paged runner (pool built by its prepare, the interpreted kernel) gives what decode_attention
    gives on the contiguous cache."""
    from flashlax.bench import peers, suites

    q, k, v = suites.attention_inputs(3, 2, 4, 2, 1, 128, 16, jnp.float32)[:3]
    runner = peers.paged_decode_runner(name, k.shape, interpret=True)
    got = runner.fn(*(runner.prepare(x) for x in (q, k, v)))
    want = flashlax.decode_attention(q, k, v, impl="xla")
    assert conftest_rel_err(np.asarray(got), np.asarray(want)) < 1e-5


def test_decode_rows_time_throughput_and_latency(runs):
    """Decode rows also carry throughput (calls queued, one sync), single-call latency and KV TB/s."""
    timed = [row for row in runs["decode"]["results"] if "error" not in row]
    assert timed
    for row in timed:
        assert row["throughput_calls"] == 50 and row["throughput_ms"] > 0 and row["latency_ms"] > 0, row
        assert row["kv_tbps"] == pytest.approx(row["kv_mb"] * harness.MB / (row["throughput_ms"] * 1e-3) / 1e12)
        assert row["copy_tbps"] > 0 and row["copy_frac"] == pytest.approx(row["kv_tbps"] / row["copy_tbps"]), row
    by_shape = {}
    for row in timed:   # one copy ceiling per shape, measured once in the shape's rounds
        by_shape.setdefault((row["batch"], row["lq"], row["lkv"]), set()).add(row["copy_tbps"])
    assert all(len(values) == 1 for values in by_shape.values()), by_shape


def test_kv_copy_copies_the_caches():
    """The copy ceiling's function returns K and V themselves, in fresh buffers under jit."""
    k = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 64, 16))
    v = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 64, 8))
    q = jax.random.normal(jax.random.PRNGKey(3), (2, 6, 1, 16))
    ck, cv = jax.jit(harness.kv_copy)(q, k, v, q)
    np.testing.assert_array_equal(np.asarray(ck), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(cv), np.asarray(v))
    assert ck.unsafe_buffer_pointer() != k.unsafe_buffer_pointer()
    assert cv.unsafe_buffer_pointer() != v.unsafe_buffer_pointer()


def test_failing_copy_ceiling_leaves_the_rows_timed():
    """A copy ceiling that raises (e.g. out of memory) drops only the ceiling: the rows keep their times
    and say why they have no copy fraction."""
    from flashlax.bench import peers, suites

    q, k, v = suites.attention_inputs(4, 1, 2, 1, 1, 64, 8, jnp.float32)[:3]
    case = suites.Case("decode", {"batch": 1, "kv_mb": 2 * k.nbytes / harness.MB}, [(q, k, v)],
                       suites.ATTENTION_GRAD_NAMES, None)

    def bad_copy(*args):
        raise MemoryError("no room for the copy")

    rows = suites.measure_case(case, [(peers.decode_runner("xla"), "fwd")], repeats=2, min_sample_s=0.0,
                               throughput_calls=3, copy_ceiling=bad_copy)
    (row,) = rows
    assert "error" not in row and row["throughput_ms"] > 0 and row["kv_tbps"] > 0, row
    assert "copy_tbps" not in row and "copy ceiling failed: MemoryError" in row["note"], row


def test_error_row_from_raising_impl():
    """An implementation that raises gives a row with `error`, not a crash; the run goes on."""
    from flashlax.bench import peers, suites

    case = suites.Case("gqa", {"batch": 1}, [suites.attention_inputs(0, 1, 2, 1, 8, 8, 4, jnp.float32)],
                       suites.ATTENTION_GRAD_NAMES, None)
    row = suites.measure(case, peers.unavailable("x", ValueError("bad q shape (1, 2)")), "fwd", repeats=1,
                         min_sample_s=0.0)
    assert row["error"] == "ValueError: bad q shape (1, 2)" and "median_ms" not in row


def test_time_calls_inner_and_quartiles():
    def sleep_5ms(_):
        time.sleep(0.005)

    timing = harness.time_calls(sleep_5ms, [None], repeats=3, sync=lambda x: x, min_sample_s=0.05)
    assert 2 <= timing["inner"] <= 10  # one sample spans ~50 ms of >= 5 ms calls (fewer if the probe was slow)
    assert 5.0 <= timing["median_ms"] < 100
    assert timing["q1_ms"] <= timing["median_ms"] <= timing["q3_ms"]
    assert harness.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (3.0, 2.0, 4.0)


def test_rel_err_and_errors_against():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((3, 5))
    x = ref + 1e-3 * rng.standard_normal((3, 5))
    assert harness.rel_err(x, ref) == pytest.approx(conftest_rel_err(x, ref))
    assert harness.rel_err(np.full_like(ref, np.nan), ref) == math.inf
    grads = {"q": x, "k": ref}
    got = harness.errors_against(x, grads, ref, {"q": ref, "k": ref})
    assert got["rel_err_grads"]["k"] == 0.0
    assert got["rel_err"] == pytest.approx(harness.rel_err(x, ref))
    assert harness.json_safe({"a": [np.float32(1.5), math.inf]}) == {"a": [1.5, "inf"]}


def test_residuals_fallback_excludes_inputs():
    """sin(x) * y keeps cos(x) (or sin and cos) for the backward, never y itself."""
    n = 7

    def fn(x, y):
        return jnp.sin(x) * y

    total, shapes = harness._residuals_from_vjp_closure(fn, jnp.ones(n), jnp.ones(n))
    assert total >= 4 * n and total % (4 * n) == 0
    assert all(s == f"float32[{n}]" for s in shapes)
    big = harness._residuals_from_vjp_closure(lambda x: jnp.sum(jnp.exp(x) ** 2), jnp.ones((64, 64)))
    assert big[0] >= 64 * 64 * 4


def _synthetic(times: dict[str, float], scale: float = 1.0) -> dict:
    rows = []
    for seq in (128, 256):
        for impl, ms in times.items():
            rows.append({"suite": "gqa", "impl": impl, "mode": "fwd", "batch": 1, "lq": seq, "lkv": seq, "hq": 4,
                         "hkv": 2, "head_dim": 16, "mask": "causal", "dtype": "float32", "compile_s": 0.1,
                         "inner": 1, "median_ms": ms * scale * seq / 128, "q1_ms": ms, "q3_ms": ms,
                         "xla_temp_mb": 0.0, "xla_arg_mb": 0.0, "xla_out_mb": 0.0, "residual_mb": None,
                         "residual_shapes": None, "kv_mb": 0.1, "rel_err": 1e-7, "rel_err_grads": None})
    rows.append({"suite": "gqa", "impl": "flex_pallas", "mode": "fwd", "batch": 1, "lq": 128, "lkv": 128,
                 "hq": 4, "hkv": 2, "head_dim": 16, "mask": "causal", "dtype": "float32",
                 "error": "RuntimeError: pallas requires an accelerator backend."})
    return {"device": {"backend": "cpu", "device_kind": "cpu", "jax": jax.__version__}, "config": {},
            "results": rows}


def test_report_table_and_png(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_synthetic({"flex_native": 2.0, "jax_xla": 5.0})))
    assert cli.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| xla | jax_xla | pallas |" in out     # legacy names of an old file read as the dispatcher's
    assert "2 (1.00) | 5 (2.50) | error |" in out  # ratio to the fastest peer of that shape
    png = tmp_path / "r.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_compare_ratio_per_row(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_synthetic({"flex_native": 2.0, "jax_xla": 5.0})))
    b.write_text(json.dumps(_synthetic({"flex_native": 2.0, "jax_xla": 5.0}, scale=0.5)))
    assert cli.main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    ratios = [line.rsplit("|", 2)[-2].strip() for line in out.splitlines() if "| fwd |" in line]
    assert ratios == ["0.50"] * 4 + ["-"]


def test_module_entry_point_writes_file(tmp_path):
    """`python -m flashlax.bench --device cpu ...` in a fresh process: exit 0, JSON written, table printed."""
    path = tmp_path / "d.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "flashlax.bench", "--suite", "decode", "--device", "cpu", *TINY,
                           "--kv-heads", "1", "--lengths", "64", "--q-lens", "1", "--impls", "jax_xla",
                           "--output", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| jax_xla | B1 Lq1 L64 Hq2/1 D8 f32 | fwd |" in proc.stdout
    rows = json.loads(path.read_text())["results"]
    assert len(rows) == 1 and rows[0]["rel_err"] < TOLERANCES["float32"]


def test_exit_status_and_one_line_reasons(tmp_path, capsys):
    """Unknown impls are refused before running; a missing or malformed results file is exit 2 with one
    line (no traceback); a row whose implementation raised makes the run exit 1."""
    with pytest.raises(SystemExit, match="unknown impl"):
        cli.main(["--suite", "decode", *TINY, "--lengths", "64", "--q-lens", "1", "--impls", "nope"])
    assert cli.main(["--report", str(tmp_path / "missing.json")]) == 2
    assert "no such results file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(["--report", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "not JSON" in err and "Traceback" not in err
    rows = [{"impl": "xla", "error": "TypeError: broken"}, {"impl": "pallas", "error": "RuntimeError: needs a GPU"}]
    assert [r["impl"] for r in cli.failed_rows(rows)] == ["xla"]


_QUICK_CONFIGS = quick.configs


def _tiny_quick_configs(gpu, interpret, torch_available):
    """The main job's suites at the smallest shapes (for a fast end-to-end test)."""
    cfgs = _QUICK_CONFIGS(gpu, interpret, torch_available)
    cfgs["linear"].update(seq_lens=[40], dims=[8], heads=[1], impls=["chunked", "recurrent"])
    cfgs["gqa"].update(seq_lens=[24], dims=[8], impls=["xla", "pallas", "jax_xla"], masks=["causal"])
    cfgs["decode"].update(kv_lens=[64], dims=[8], q_lens=[2], impls=["xla", "jax_xla"])
    return cfgs


_QUICK_ROWS: dict = {}


def _run_suite_once(suite, cfg):
    """quick.suites.run_suite, run once per (suite, config) in this process and replayed after: the two main
    job tests below run the same tiny suites (each real run takes tens of seconds on the 2-core CI box)."""
    key = (suite, repr(sorted(cfg.items())))
    if key not in _QUICK_ROWS:
        _QUICK_ROWS[key] = _REAL_RUN_SUITE(suite, cfg)
    return copy.deepcopy(_QUICK_ROWS[key])


_REAL_RUN_SUITE = quick.suites.run_suite


def test_main_job_writes_json_md_png(tmp_path, monkeypatch, capsys):
    """The main job (--quick) on CPU writes the results JSON (valid schema), the markdown report and the
    PNG next to --output and names them; interpreted Pallas rows are marked, not timed."""
    monkeypatch.setattr(quick, "configs", _tiny_quick_configs)
    monkeypatch.setattr(quick.suites, "run_suite", _run_suite_once)
    path = tmp_path / "quick-cpu.json"
    assert cli.main(["--quick", "--output", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert schema.validate(data) == []
    assert {r["suite"] for r in data["results"]} == {"linear", "gqa", "decode"}
    interpreted = [r for r in data["results"] if r.get("interpret")]
    assert interpreted and all(r["impl"] == "pallas" for r in interpreted)
    md = (tmp_path / "quick-cpu.md").read_text()
    assert "pallas (interpreted: correctness only)" in md and "| pallas |" not in md.split("## Timing")[1]
    assert (tmp_path / "quick-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in out
    assert quick.default_output("cpu").startswith(os.path.join("results", "quick-cpu-"))


def test_main_job_exits_nonzero_on_a_failing_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quick, "configs", _tiny_quick_configs)

    def with_wrong_row(suite, cfg):
        rows = _run_suite_once(suite, cfg)
        if suite == "linear":
            rows[0] = dict(rows[0], rel_err=0.5)       # a wrong result of flashlax's chunked path
        return rows

    monkeypatch.setattr(quick.suites, "run_suite", with_wrong_row)
    assert cli.main(["--quick", "--output", str(tmp_path / "q.json")]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert (tmp_path / "q.json").exists()


@pytest.mark.slow
def test_quick_main_job(tmp_path):
    """The main job end to end at its real shapes (about a minute on 2 cores)."""
    path = tmp_path / "quick.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "flashlax.bench", "--quick", "--output", str(path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Error against the float64 reference" in proc.stdout
    data = json.loads(path.read_text())
    assert {r["suite"] for r in data["results"]} == {"linear", "gqa", "decode"}
    assert schema.validate(data) == []


def test_quick_verdicts():
    """--quick fails the job on a wrong flashlax result or crash, not on unavailable kernels or peers."""
    base = {"suite": "gqa", "mode": "fwd", "dtype": "float32"}
    assert quick._verdict({**base, "impl": "xla", "rel_err": 1e-7}) == "ok"
    assert quick._verdict({**base, "impl": "xla", "rel_err": 1e-3}) == "FAIL"
    assert quick._verdict({**base, "impl": "xla", "rel_err": "inf"}) == "FAIL"
    assert quick._verdict({**base, "impl": "jax_xla", "rel_err": 1e-3}) == "peer above tolerance"
    assert quick._verdict({**base, "impl": "ssd", "error": "RuntimeError: ssd requires an accelerator backend."}) \
        == "unavailable"
    assert quick._verdict({**base, "impl": "xla", "error": "TypeError: bad"}) == "FAIL"
    assert quick._verdict({**base, "impl": "torch_sdpa", "error": "TypeError: bad"}) == "peer error"


def test_input_rotation_exceeds_l2_on_gpu():
    """On GPU the timed loop rotates through copies whose total is > 2x L2 (at most 4); one set on CPU."""
    made = []

    def make(seed):
        made.append(seed)
        return (seed,)

    assert len(harness.input_copies(make, 16 * 2**20, gpu=False)) == 1
    sets = harness.input_copies(make, 16 * 2**20, gpu=True)
    assert len(sets) == 4 and [s[0] for s in sets] == [0, 1, 2, 3]  # fresh inputs per copy
    assert len(harness.input_copies(make, 50 * 2**20, gpu=True)) * 50 * 2**20 > 2 * harness.L2_BYTES
    assert len(harness.input_copies(make, 500 * 2**20, gpu=True)) == 1


def test_quick_parity_includes_ssd():
    """--quick on a GPU compares ssd with the CPU fallback whether or not it is the GPU default."""
    from flashlax import dispatch
    from flashlax.bench import quick
    pairs = quick.parity_pairs("gated_delta_rule")
    assert ("ssd", "chunked") in pairs or ("ssd", dispatch.default_impl("gated_delta_rule", "cpu")) in pairs
    assert pairs[0] == (dispatch.default_impl("gated_delta_rule", "gpu"), dispatch.default_impl("gated_delta_rule", "cpu"))
    assert len(set(pairs)) == len(pairs)
