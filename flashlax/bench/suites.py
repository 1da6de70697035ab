"""The suites: linear, gqa, prefill, decode (and all). Each builds cases (one shape, shared inputs and one
reference) and measures every implementation x mode on them, one row per measurement.

Implementations are named as the dispatcher names them (``xla``, ``repeat``, ``pallas``, ``chunked``, ...;
each row's ``op`` field says whose), peers by their own names (``jax_xla``, ``jax_cudnn``, ``torch_sdpa``,
``torch_flex``, ``jax_pallas_mha``). Defaults (``suite_defaults``): linear from seed 000 (B2 H8 T512/2048
dk=dv 64/128 float32 chunk 64), gqa from seed 004 (B1 L1024 Hq32 Hkv8 D64/128 float32 on CPU, bf16 on GPU),
prefill the ANCHORS.md GPU shapes (Hq32 Hkv8 D128, B2 T4096 and B1 T16384, bf16, plus sliding-window-1024
and 8-document masks at T16384 for flex_attention and torch_flex), decode Hq32 Hkv8 D128: on CPU B1 x Lq
1/4/16 x KV 4096/16384/65536, on GPU the six (B, Lq, KV) shapes of DECODE_GPU_SHAPES, with the Pallas kernel also
on paged caches (``pallas_paged64`` / ``pallas_paged16``: pages of 64 / 16 keys in shuffled order) and JAX's
in-tree Pallas ``paged_attention`` (``jax_paged``, Lq 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import flashlax
from flashlax import dispatch, masks
from flashlax._mods import apply_mod
from flashlax.bench import harness, peers

SUITES = ("linear", "gqa", "decode", "prefill")
MODES = ("fwd", "fwd_bwd")
LINEAR_GRAD_NAMES = ("q", "k", "v", "log_alpha", "beta")
ATTENTION_GRAD_NAMES = ("q", "k", "v")
# The flex-only masks of the prefill suite (only flex_* and torch_flex get rows for them).
SLIDING_WINDOW = 1024
NUM_DOCUMENTS = 8
# Decode on GPU: (batch, new tokens, KV length), Hq32 Hkv8 D128 bf16.
DECODE_GPU_SHAPES = [(1, 1, 16384), (1, 1, 65536), (8, 1, 16384), (32, 1, 4096), (1, 16, 65536), (4, 4, 32768)]
# Decode rows also time this many calls queued with one sync (throughput_ms) and single calls (latency_ms).
DECODE_THROUGHPUT_CALLS = 50


def suite_defaults(suite: str, gpu: bool) -> dict[str, Any]:
    """The default config of a suite on a device family; CLI flags override any key."""
    if suite == "linear":
        return dict(batch=[2], heads=[8], seq_lens=[2048, 8192] if gpu else [512, 2048], dims=[64, 128],
                    dtypes=["float32"], chunk_sizes=[64], modes=list(MODES),
                    impls=["recurrent", "chunked", "chunked_fat", "ssd"], ref_max_seq=2048,
                    max_recurrent_seq=8192 if gpu else 2048)
    family = "gpu" if gpu else "cpu"
    attention_impls = ([dispatch.default_impl("flex_attention", family), "repeat", "jax_xla"]
                       + (["jax_cudnn"] if gpu else []) + ["torch_sdpa"])
    if suite == "gqa":
        return dict(batch=[1], heads=[32], kv_heads=[8], seq_lens=[1024], dims=[64, 128],
                    dtypes=["bfloat16"] if gpu else ["float32"], modes=list(MODES), masks=["causal", "full"],
                    impls=attention_impls, ref_max_seq=1024)
    if suite == "prefill":  # on CPU a scaled-down version (the GPU shapes would take hours on 2 cores)
        return dict(shapes=[(2, 4096), (1, 16384)] if gpu else [(1, 2048), (1, 4096)], heads=[32], kv_heads=[8],
                    dims=[128], dtypes=["bfloat16"] if gpu else ["float32"], modes=list(MODES),
                    masks=["causal", "full"], flex_masks=["sliding_window", "document"],
                    flex_masks_min_seq=16384 if gpu else 4096, ref_max_seq=1024,
                    impls=attention_impls + (["torch_flex", "jax_pallas_mha"] if gpu else []))
    if suite == "decode":
        # GPU: the (batch, new tokens, KV length) shapes of ANCHORS.md / issue 14 and the decode kernel;
        # CPU: the product of batch x q_lens x kv_lens (shapes None).
        return dict(batch=[1], heads=[32], kv_heads=[8], q_lens=[1, 4, 16], kv_lens=[4096, 16384, 65536],
                    shapes=DECODE_GPU_SHAPES if gpu else None, dims=[128],
                    dtypes=["bfloat16"] if gpu else ["float32"], modes=["fwd"],
                    impls=(["pallas", "xla", "jax_xla", "jax_cudnn", "torch_sdpa", "pallas_paged64", "pallas_paged16",
                            "jax_paged"] if gpu
                           else ["xla", "repeat", "jax_xla", "torch_sdpa"]),
                    ref_max_seq=1024, throughput_calls=DECODE_THROUGHPUT_CALLS)
    raise ValueError(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}, all")


@dataclasses.dataclass
class Case:
    """One shape: identity fields, fresh random input sets (inputs..., cotangent), and a lazy reference."""

    suite: str
    ident: dict[str, Any]
    arg_sets: list[tuple]
    grad_names: tuple[str, ...]
    reference: Callable[[tuple, bool], tuple[Any, dict | None]] | None
    ref_note: str | None = None
    want_grads: bool = False  # set when a fwd_bwd row will ask: the reference then computes both at once
    _ref: tuple | None = None
    _ref_grads_done: bool = False

    def ref(self, with_grads: bool):
        """(out, grads or None) of the reference on arg_sets[0], computed once (float64 numpy)."""
        if self.reference is None:
            return None
        if self._ref is None or (with_grads and not self._ref_grads_done):
            with_grads = with_grads or self.want_grads
            start = time.perf_counter()
            self._ref = self.reference(self.arg_sets[0], with_grads)
            self._ref_grads_done = with_grads
            print(f"  (float64 reference{' with gradients' if with_grads else ''}: "
                  f"{time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
        return self._ref


# ----------------------------------------------------------------------------------------------------------
# Measurement of one (case, runner, mode)


def _start_jax(case: Case, runner: peers.Runner, mode: str, min_sample_s: float):
    n_inputs = len(case.grad_names)
    sets = [tuple(runner.prepare(x) for x in s) for s in case.arg_sets]
    if mode == "fwd":
        fields, out, timer = harness.compile_for_timing(runner.fn, [s[:n_inputs] for s in sets],
                                                        min_sample_s=min_sample_s)
        fields.update(residual_mb=None, residual_shapes=None)
        return fields, runner.finish(out), None, timer

    def fwd_bwd(*args):
        out, vjp = jax.vjp(runner.fn, *args[:n_inputs])
        return out, vjp(args[n_inputs])

    fields, (out, grads), timer = harness.compile_for_timing(fwd_bwd, sets, min_sample_s=min_sample_s)
    try:
        residual_mb, residual_shapes, _ = harness.residuals(runner.fn, *sets[0][:n_inputs])
        fields.update(residual_mb=residual_mb, residual_shapes=residual_shapes)
    except Exception as exc:  # a measurement failure must not lose the timing
        fields.update(residual_mb=None, residual_shapes=None, residual_note=harness.error_text(exc))
    grads = {name: runner.finish(g) for name, g in zip(case.grad_names, grads)}
    return fields, runner.finish(out), grads, timer


def _start_torch(case: Case, runner: peers.Runner, mode: str, min_sample_s: float):
    torch = harness.torch_module()
    n_inputs = len(case.grad_names)
    sync = peers.torch_sync(runner.extra.get("torch_device", "cpu"))
    sets = [tuple(runner.prepare(x) for x in s) for s in case.arg_sets]
    if mode == "fwd":
        def call(args):
            with torch.no_grad():
                return runner.fn(*args[:n_inputs])
    else:
        sets = [tuple(x.requires_grad_(True) if i < n_inputs else x for i, x in enumerate(s)) for s in sets]

        def call(args):
            out = runner.fn(*args[:n_inputs])
            return out, torch.autograd.grad(out, args[:n_inputs], args[n_inputs])
    start = time.perf_counter()  # torch is eager: the first call (kernel selection, lazy init) stands in
    result = sync(call(sets[0]))
    fields: dict[str, Any] = {"compile_s": time.perf_counter() - start}
    fields.update(dict.fromkeys(harness.XLA_MEMORY_KEYS))
    fields.update(residual_mb=None, residual_shapes=None)
    timer = harness.Timer(call, sets, sync=sync, min_sample_s=min_sample_s)
    if mode == "fwd":
        return fields, runner.finish(result), None, timer
    out, grads = result
    return fields, runner.finish(out), {name: runner.finish(g) for name, g in zip(case.grad_names, grads)}, timer


def _start(case: Case, runner: peers.Runner, mode: str, min_sample_s: float):
    """Compiles, checks against the reference and sets up timing: ``(row, timer)``; on an exception of the
    implementation ``(row with error, None)``."""
    row: dict[str, Any] = {"suite": case.suite, **({"op": runner.extra["op"]} if "op" in runner.extra else {}),
                           "impl": runner.name, "mode": mode, **case.ident}
    try:
        start_fn = _start_torch if runner.kind == "torch" else _start_jax
        fields, out, grads, timer = start_fn(case, runner, mode, min_sample_s)
    except Exception as exc:
        row["error"] = harness.error_text(exc)
        return row, None
    row.update(fields)
    row.update({k: v for k, v in runner.extra.items() if k != "torch_device"})
    row["kv_mb"] = case.ident.get("kv_mb")  # K+V bytes for attention suites; null for linear
    try:
        ref = case.ref(mode == "fwd_bwd")
    except Exception as exc:
        ref, case.reference, case.ref_note = None, None, f"reference failed: {harness.error_text(exc)}"
    if ref is None:
        row.update(rel_err=None, rel_err_grads=None, note=case.ref_note)
    else:
        ref_out, ref_grads = ref
        row.update(harness.errors_against(out, grads, ref_out, ref_grads if mode == "fwd_bwd" else None))
    return row, timer


def measure_case(case: Case, jobs: list[tuple[peers.Runner, str]], *, repeats: int,
                 min_sample_s: float, throughput_calls: int | None = None,
                 copy_ceiling: Callable | None = None) -> list[dict]:
    """One row per (runner, mode) of one shape. All are compiled and checked first, then their timed
    samples are interleaved round-robin, so ratios between peers survive load changes on a shared machine.
    ``throughput_calls`` (decode): each round also takes a throughput sample of that many queued calls and
    single-call latency samples (``harness.Timer.sample_decode``). Any exception of an implementation
    becomes that row's ``error``; the run goes on. ``copy_ceiling`` (decode, with ``throughput_calls``): a
    function of one input set that copies its K and V (``harness.kv_copy``), timed as throughput in the same
    rounds: the rows get ``copy_tbps`` (bytes read + written / its time) and ``copy_frac`` (kv_tbps / that);
    if the copy raises, the rows go without them and their ``note`` says why."""
    case.want_grads = any(mode == "fwd_bwd" for _, mode in jobs)
    started = [_start(case, runner, mode, min_sample_s) for runner, mode in jobs]
    ceiling, ceiling_error = None, None
    if copy_ceiling is not None and throughput_calls:
        try:   # the ceiling is a yardstick: if it fails (e.g. out of memory) the rows go on without it
            fn = jax.jit(copy_ceiling)
            ceiling = harness.Timer(lambda args: fn(*args), case.arg_sets, min_sample_s=min_sample_s)
        except Exception as exc:
            ceiling_error = harness.error_text(exc)
    for _ in range(max(1, repeats)):
        if ceiling is not None:
            try:
                ceiling.sample_decode(throughput_calls, singles=0)
            except Exception as exc:
                ceiling, ceiling_error = None, harness.error_text(exc)
        for i, (row, timer) in enumerate(started):
            if timer is None:
                continue
            try:
                timer.sample()
                if throughput_calls:
                    timer.sample_decode(throughput_calls)
            except Exception as exc:
                error_row = {k: row[k] for k in ("suite", "op", "impl", "mode", *case.ident) if k in row}
                error_row["error"] = harness.error_text(exc)
                started[i] = (error_row, None)
    copy_ms = statistics.median(ceiling.queued_ms) if ceiling is not None else None
    rows = []
    for row, timer in started:
        if timer is not None:
            row.update(timer.fields())
            if "throughput_ms" in row and row.get("kv_mb"):
                row["kv_tbps"] = row["kv_mb"] * harness.MB / (row["throughput_ms"] * 1e-3) / 1e12
                if copy_ms is not None:   # the copy reads and writes the KV bytes once each
                    row["copy_tbps"] = 2 * row["kv_mb"] * harness.MB / (copy_ms * 1e-3) / 1e12
                    row["copy_frac"] = row["kv_tbps"] / row["copy_tbps"]
                elif ceiling_error is not None:
                    row["note"] = "; ".join(filter(None, [row.get("note"), f"copy ceiling failed: {ceiling_error}"]))
        rows.append({k: row[k] for k in _ordered_keys(row)})
    return rows


def measure(case: Case, runner: peers.Runner, mode: str, *, repeats: int, min_sample_s: float) -> dict:
    """One row for one implementation (see :func:`measure_case`)."""
    return measure_case(case, [(runner, mode)], repeats=repeats, min_sample_s=min_sample_s)[0]


def _ordered_keys(row: dict) -> list[str]:
    last = harness.MEASURE_KEYS + harness.DECODE_TIMING_KEYS
    first = [k for k in row if k not in last and k != "note"]
    return first + [k for k in last if k in row] + (["note"] if "note" in row else [])


# ----------------------------------------------------------------------------------------------------------
# References (float64 on the host CPU)


def _cpu_f64(x):
    return jax.device_put(np.asarray(jax.device_get(x), dtype=np.float64), jax.devices("cpu")[0])


def _dense_attention(q, k, v, allowed, scale):
    """Dense softmax attention with GQA by head index h // group; fully masked rows give 0."""
    group = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bhkd->bhqd", weights / jnp.where(denom > 0, denom, 1.0), v)


def dense_mask(mask_mod, lq: int, lkv: int) -> np.ndarray | None:
    if mask_mod is None:
        return None
    q_idx = jnp.arange(lq, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(lkv, dtype=jnp.int32)[None, :]
    zero = jnp.zeros((), jnp.int32)
    return np.asarray(apply_mod(mask_mod, zero, zero, q_idx, kv_idx))


def attention_reference(mask_mod, scale: float | None, *, decode: bool = False):
    """Reference callable for a case, float64 on the host CPU: flashlax.reference.attention_reference
    (decode_reference for the decode suite, cache full) when the package has it, else the dense softmax
    above with the mask evaluated densely from mask_mod."""

    def reference(args, with_grads):
        import flashlax.reference as package  # noqa: PLC0415

        q, k, v, cot = args
        scale_ = q.shape[-1] ** -0.5 if scale is None else scale
        package_ref = getattr(package, "decode_reference" if decode else "attention_reference", None)
        allowed = None if package_ref is not None else dense_mask(mask_mod, q.shape[2], k.shape[2])
        with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            q64, k64, v64, cot64 = map(_cpu_f64, (q, k, v, cot))
            if package_ref is not None and decode:
                def fn(q_, k_, v_):
                    return package_ref(q_, k_, v_, scale=scale_)[0]
            elif package_ref is not None:
                def fn(q_, k_, v_):
                    return package_ref(q_, k_, v_, mask_mod=mask_mod, scale=scale_)[0]
            else:
                def fn(q_, k_, v_):
                    return _dense_attention(q_, k_, v_, None if allowed is None else jnp.asarray(allowed),
                                            scale_)
            fn = jax.jit(fn)
            if not with_grads:
                return np.asarray(fn(q64, k64, v64)), None
            out, vjp = jax.vjp(fn, q64, k64, v64)
            grads = vjp(cot64)
            return np.asarray(out), {n: np.asarray(g) for n, g in zip(ATTENTION_GRAD_NAMES, grads)}

    return reference


def linear_reference(ref_dtype: str):
    """flashlax.reference.gated_delta_rule_reference (the recurrent scan) in ``ref_dtype`` on the host,
    one (batch, head) slice at a time under lax.map so the scan's saved states fit in memory."""

    def reference(args, with_grads):
        from flashlax.reference import gated_delta_rule_reference  # noqa: PLC0415

        q, k, v, log_alpha, beta, cot = args
        dtype = np.float64 if ref_dtype == "float64" else np.float32
        with jax.enable_x64(dtype == np.float64), jax.default_device(jax.devices("cpu")[0]):
            host = [jax.device_put(np.asarray(jax.device_get(x), dtype=dtype), jax.devices("cpu")[0])
                    for x in (q, k, v, log_alpha, beta, cot)]
            b, h = q.shape[:2]
            flat = [x.reshape((b * h, 1, 1) + x.shape[2:]) for x in host]

            def one(slices):
                q_, k_, v_, a_, beta_, cot_ = slices
                fn = lambda *xs: gated_delta_rule_reference(*xs, scale=q.shape[-1] ** -0.5)  # noqa: E731
                if not with_grads:
                    return fn(q_, k_, v_, a_, beta_), ()
                out, vjp = jax.vjp(fn, q_, k_, v_, a_, beta_)
                return out, vjp(cot_)

            out, grads = jax.jit(lambda xs: jax.lax.map(one, xs))(tuple(flat))
            unflat = lambda x, like: np.asarray(x).reshape(like.shape)  # noqa: E731
            out = unflat(out, v)
            if not with_grads:
                return out, None
            return out, {n: unflat(g, x) for n, g, x in zip(LINEAR_GRAD_NAMES, grads, (q, k, v, log_alpha, beta))}

    return reference


# ----------------------------------------------------------------------------------------------------------
# Inputs


def _key(seed: int, salt: int):
    return jax.random.fold_in(jax.random.PRNGKey(seed), salt)


def linear_inputs(seed: int, b: int, h: int, t: int, dk: int, dv: int, dtype) -> tuple:
    """Fresh random q, k (unit-norm rows, as gated-delta models normalise them), v, log_alpha in
    (-inf, 0) (log-sigmoid gates, mostly near 0), beta in (0, 1), and the output cotangent."""
    keys = [_key(seed, i) for i in range(6)]
    q = jax.random.normal(keys[0], (b, h, t, dk), jnp.float32)
    k = jax.random.normal(keys[1], (b, h, t, dk), jnp.float32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (b, h, t, dv), jnp.float32)
    log_alpha = jax.nn.log_sigmoid(jax.random.normal(keys[3], (b, h, t), jnp.float32) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, h, t), jnp.float32))
    cot = jax.random.normal(keys[5], (b, h, t, dv), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, log_alpha, beta, cot))


def attention_inputs(seed: int, b: int, hq: int, hkv: int, lq: int, lkv: int, d: int, dtype) -> tuple:
    keys = [_key(seed, i) for i in range(4)]
    shapes = [(b, hq, lq, d), (b, hkv, lkv, d), (b, hkv, lkv, d), (b, hq, lq, d)]
    return tuple(harness.random_normal(key, shape, dtype) for key, shape in zip(keys, shapes))


def _copies(make, one_set_bytes: int):
    return harness.input_copies(make, one_set_bytes, gpu=harness.on_gpu())


# ----------------------------------------------------------------------------------------------------------
# Suites


def _print_progress(row: dict, stream) -> None:
    shape = ", ".join(f"{k}={row[k]}" for k in ("batch", "heads", "hq", "hkv", "seq", "lq", "lkv", "dk",
                                                    "head_dim", "mask", "dtype") if k in row)
    if "error" in row:
        status = row["error"]
    else:
        err = row.get("rel_err")
        status = f"{row['median_ms']:.3f} ms, rel_err {err:.2e}" if isinstance(err, float) else \
            f"{row['median_ms']:.3f} ms"
    print(f"  {row['impl']:<12} {row['mode']:<7} {shape}: {status}", file=stream, flush=True)


def _run_jobs(case: Case, jobs: list, cfg: dict, stream) -> list[dict]:
    rows = measure_case(case, jobs, repeats=cfg["repeats"], min_sample_s=cfg["min_sample_s"],
                        throughput_calls=cfg.get("throughput_calls"),
                        copy_ceiling=harness.kv_copy if case.suite == "decode" else None)
    for row in rows:
        _print_progress(row, stream)
    return rows


def run_linear(cfg: dict, stream=sys.stderr) -> list[dict]:
    rows = []
    for b, h, t, d, dtype, chunk in itertools.product(cfg["batch"], cfg["heads"], cfg["seq_lens"], cfg["dims"],
                                                     cfg["dtypes"], cfg["chunk_sizes"]):
        ident = dict(batch=b, heads=h, seq=t, dk=d, dv=d, dtype=dtype, chunk_size=chunk)
        one_set = (3 * b * h * t * d + 2 * b * h * t + b * h * t * d) * jnp.dtype(dtype).itemsize
        arg_sets = _copies(lambda seed: linear_inputs(seed, b, h, t, d, d, jnp.dtype(dtype)), one_set)
        use_ref = t <= cfg["ref_max_seq"]
        case = Case("linear", ident, arg_sets, LINEAR_GRAD_NAMES,
                    linear_reference(cfg.get("ref_dtype", "float64")) if use_ref else None,
                    None if use_ref else f"no reference: seq {t} > ref_max_seq {cfg['ref_max_seq']}")
        jobs = []
        for mode, impl in itertools.product(cfg["modes"], cfg["impls"]):
            if impl == "recurrent" and t > cfg["max_recurrent_seq"]:
                print(f"  skip recurrent at seq {t} > max_recurrent_seq {cfg['max_recurrent_seq']}", file=stream)
                continue
            jobs.append((peers.linear_runner(impl, chunk_size=chunk,
                                             interpret=_interpret(cfg, "gated_delta_rule", impl)), mode))
        rows += _run_jobs(case, jobs, cfg, stream)
    return rows


def _document_ids(lq: int, batch: int) -> np.ndarray:
    """[B, L] int32: NUM_DOCUMENTS equal documents per row."""
    bounds = np.linspace(0, lq, NUM_DOCUMENTS + 1).astype(np.int32)[1:-1]
    one_row = np.searchsorted(bounds, np.arange(lq), side="right").astype(np.int32)
    return np.tile(one_row, (batch, 1))


def _mask_mod(mask: str, lq: int, batch: int):
    """(mask_mod or None, causal flag for peers, extra ident fields)."""
    if mask == "full":
        return None, False, {}
    if mask == "causal":
        return masks.causal, True, {}
    if mask == "sliding_window":
        return masks.sliding_window(SLIDING_WINDOW), False, {"window": SLIDING_WINDOW}
    if mask == "document":
        segment_ids = jnp.asarray(_document_ids(lq, batch))
        return masks.and_masks(masks.causal, masks.document(segment_ids, segment_ids)), False, \
            {"documents": NUM_DOCUMENTS}
    raise ValueError(f"unknown mask {mask!r}; valid: full, causal, sliding_window, document")


ATTENTION_PEERS = ("jax_xla", "jax_cudnn", "torch_sdpa", "torch_flex", "jax_pallas_mha")


def valid_impls(suite: str) -> tuple[str, ...]:
    """The implementation names a suite takes (the dispatcher's, then the peers')."""
    if suite == "linear":
        return tuple(dispatch.TABLE["gated_delta_rule"])
    if suite == "decode":  # decode_attention's impls, and flex_attention's K/V-repeat baseline
        return tuple(dispatch.TABLE["decode_attention"]) + ("repeat", "jax_xla", "jax_cudnn", "torch_sdpa") \
            + tuple(peers.PAGED_IMPLS) + (peers.JAX_PAGED,)
    return tuple(dispatch.TABLE["flex_attention"]) + ATTENTION_PEERS


def suite_op(suite: str) -> str:
    return {"linear": "gated_delta_rule", "decode": "decode_attention"}.get(suite, "flex_attention")


def _interpret(cfg: dict, op: str, impl: str) -> bool:
    """Pallas kernels run in the Pallas interpreter on CPU when the config asks (--quick does)."""
    entry = dispatch.TABLE[op].get(impl)
    return bool(cfg.get("interpret")) and entry is not None and entry.kind == "pallas" and not harness.on_gpu()


def _attention_runner(impl: str, *, mask_mod, causal: bool, batch: int, lq: int, lkv: int, mask: str,
                      interpret: bool):
    if impl in dispatch.TABLE["flex_attention"]:
        block_mask = None
        if mask_mod is not None:
            try:  # built once, outside timing, as a FlexAttention user does
                block_mask = flashlax.create_block_mask(mask_mod, batch if mask == "document" else None, None,
                                                        lq, lkv)
            except Exception:
                block_mask = None
        return peers.flex_runner(impl, mask_mod=mask_mod, block_mask=block_mask, interpret=interpret)
    if impl == "torch_flex":  # expresses every mask of the suite, block-sparse like flex_attention
        return peers.torch_flex(batch=batch, lq=lq, lkv=lkv, mask=mask, window=SLIDING_WINDOW,
                                segment_ids=_document_ids(lq, batch) if mask == "document" else None)
    if mask not in ("full", "causal"):
        return None  # flex-only masks
    if impl in peers.JAX_PEERS:
        return peers.jax_sdpa(impl, causal=causal)
    if impl == "torch_sdpa":
        return peers.torch_sdpa(causal=causal)
    if impl == peers.PALLAS_MHA:
        return peers.jax_pallas_mha(causal=causal)
    return peers.unavailable(impl, ValueError(f"unknown impl {impl!r} for attention suites"))


def _dense_too_big(impl: str, b: int, hq: int, lq: int, lkv: int, max_dense_gb: float) -> bool:
    return impl == "jax_xla" and b * hq * lq * lkv * 4 / 1024**3 > max_dense_gb


def run_attention(suite: str, cfg: dict, stream=sys.stderr) -> list[dict]:
    """gqa and prefill: flex_attention's impls and the peers, causal and full (and the flex-only masks)."""
    rows = []
    shapes = cfg.get("shapes") or list(itertools.product(cfg["batch"], cfg["seq_lens"]))
    for (b, t), hq, hkv, d, dtype in itertools.product(shapes, cfg["heads"], cfg["kv_heads"], cfg["dims"],
                                                       cfg["dtypes"]):
        one_set = (2 * b * hq * t * d + 2 * b * hkv * t * d) * jnp.dtype(dtype).itemsize
        arg_sets = _copies(lambda seed: attention_inputs(seed, b, hq, hkv, t, t, d, jnp.dtype(dtype)), one_set)
        mask_list = list(cfg["masks"])
        if t >= cfg.get("flex_masks_min_seq", 0):
            mask_list += [m for m in cfg.get("flex_masks", []) if m not in mask_list]
        for mask in mask_list:
            mask_mod, causal, extra = _mask_mod(mask, t, b)
            ident = dict(batch=b, lq=t, lkv=t, hq=hq, hkv=hkv, head_dim=d, mask=mask, dtype=dtype,
                         kv_mb=2 * b * hkv * t * d * jnp.dtype(dtype).itemsize / harness.MB, **extra)
            use_ref = t <= cfg["ref_max_seq"]
            case = Case(suite, ident, arg_sets, ATTENTION_GRAD_NAMES,
                        attention_reference(mask_mod, None) if use_ref else None,
                        None if use_ref else f"no reference: seq {t} > ref_max_seq {cfg['ref_max_seq']}")
            jobs = []
            for mode, impl in itertools.product(cfg["modes"], cfg["impls"]):
                runner = _attention_runner(impl, mask_mod=mask_mod, causal=causal, batch=b, lq=t, lkv=t, mask=mask,
                                           interpret=_interpret(cfg, "flex_attention", impl))
                if runner is None:
                    continue
                if _dense_too_big(impl, b, hq, t, t, cfg["max_dense_gb"]):
                    runner = peers.unavailable(impl, MemoryError(
                        f"dense logits {b * hq * t * t * 4 / 1024**3:.1f} GB > max_dense_gb {cfg['max_dense_gb']}"))
                jobs.append((runner, mode))
            rows += _run_jobs(case, jobs, cfg, stream)
    return rows


def decode_mask_mod(lq: int, lkv: int):
    """New token i sits at position lkv - lq + i and sees the cache up to itself."""
    offset = lkv - lq

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask_mod


def run_decode(cfg: dict, stream=sys.stderr) -> list[dict]:
    rows = []
    shapes = cfg.get("shapes") or list(itertools.product(cfg["batch"], cfg["q_lens"], cfg["kv_lens"]))
    for (b, lq, lkv), hq, hkv, d, dtype in itertools.product(shapes, cfg["heads"], cfg["kv_heads"], cfg["dims"],
                                                             cfg["dtypes"]):
        itemsize = jnp.dtype(dtype).itemsize
        kv_bytes = 2 * b * hkv * lkv * d * itemsize
        arg_sets = _copies(lambda seed: attention_inputs(seed, b, hq, hkv, lq, lkv, d, jnp.dtype(dtype)),
                           kv_bytes + 2 * b * hq * lq * d * itemsize)
        mask_mod = decode_mask_mod(lq, lkv) if lq > 1 else None
        allowed = dense_mask(mask_mod, lq, lkv)
        ident = dict(batch=b, lq=lq, lkv=lkv, hq=hq, hkv=hkv, head_dim=d, dtype=dtype, kv_mb=kv_bytes / harness.MB)
        use_ref = lq <= cfg["ref_max_seq"]
        case = Case("decode", ident, arg_sets, ATTENTION_GRAD_NAMES,
                    attention_reference(mask_mod, None, decode=True) if use_ref else None,
                    None if use_ref else f"no reference: lq {lq} > ref_max_seq {cfg['ref_max_seq']}")
        jobs = []
        for mode, impl in itertools.product(cfg["modes"], cfg["impls"]):
            if impl in peers.PAGED_IMPLS:
                base = peers.PAGED_IMPLS[impl][0]
                runner = peers.paged_decode_runner(impl, (b, hkv, lkv, d),
                                                   interpret=_interpret(cfg, "decode_attention", base))
                runner.extra["num_splits"] = peers.chosen_num_splits(base, b, hkv, lkv)
            elif impl == peers.JAX_PAGED:
                runner = peers.jax_paged_runner((b, hkv, lkv, d), lq)
            elif impl in dispatch.TABLE["decode_attention"]:
                runner = peers.decode_runner(impl, interpret=_interpret(cfg, "decode_attention", impl))
                runner.extra["num_splits"] = peers.chosen_num_splits(impl, b, hkv, lkv)
            elif impl in dispatch.TABLE["flex_attention"]:
                runner = peers.flex_runner(impl, mask_mod=mask_mod, interpret=_interpret(cfg, "flex_attention", impl))
            elif impl in peers.JAX_PEERS:
                runner = peers.jax_sdpa(impl, dense_mask=allowed)
            elif impl == "torch_sdpa":
                runner = peers.torch_sdpa(dense_mask=allowed)
            else:
                runner = peers.unavailable(impl, ValueError(f"unknown impl {impl!r} for the decode suite"))
            jobs.append((runner, mode))
        rows += _run_jobs(case, jobs, cfg, stream)
    return rows


def run_suite(suite: str, cfg: dict, stream=sys.stderr) -> list[dict]:
    if suite == "linear":
        return run_linear(cfg, stream)
    if suite in ("gqa", "prefill"):
        return run_attention(suite, cfg, stream)
    if suite == "decode":
        return run_decode(cfg, stream)
    raise ValueError(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}, all")

