"""Sharding benchmark: ``python -m flashlax.bench --suite sharding`` (or ``python -m flashlax.bench.sharding``).

On CPU it runs on 8 virtual devices (``--xla_force_host_platform_device_count=8``; it re-runs itself in a
subprocess with that flag when jax started with fewer). Rows, all timed in one process, interleaved:

- per shard: each op with inputs sharded over batch and heads on a (4, 2) mesh against the same op on one
  device with the whole batch (the same total work; on a CPU the 8 virtual devices share its cores, so
  ratio ~1 means the sharded program adds nothing, no gather and no copies);
- ring: flex_attention with ``context_axis`` over 8 devices at T = 8 x L causal (GQA), against one device
  at T = L, against the all-gather baseline (each device gathers all of K/V and attends its queries,
  sequence in contiguous order), and against the same ring with its ``ppermute`` replaced by the
  identity (compute only: the difference is the collective time not hidden behind compute).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable
from unittest import mock

DEVICES = 8


def _timers(jobs: dict[str, tuple[Callable, tuple]], repeats: int, min_sample_s: float) -> dict[str, dict]:
    """Compiles each job, then samples them round robin (load changes on a shared box hit all alike)."""
    from flashlax.bench import harness  # noqa: PLC0415

    fields, timers = {}, {}
    for name, (fn, args) in jobs.items():
        print(f"[sharding] compiling {name} ...", file=sys.stderr, flush=True)
        fields[name], _, timers[name] = harness.compile_for_timing(fn, [args], min_sample_s=min_sample_s)
    for _ in range(max(1, repeats)):
        for timer in timers.values():
            timer.sample()
    return {name: {**fields[name], **timers[name].fields()} for name in jobs}


def _normal(seed: int, shape):
    import jax  # noqa: PLC0415

    return jax.random.normal(jax.random.key(seed), shape)


def _per_shard_jobs(seq_len: int):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    import flashlax  # noqa: PLC0415
    from flashlax import masks  # noqa: PLC0415

    mesh = jax.make_mesh((4, 2), ("b", "h"))
    one = jax.devices()[0]
    b, hq, hkv, d = 8, 8, 2, 64
    q, k, v = _normal(0, (b, hq, seq_len, d)), _normal(1, (b, hkv, seq_len, d)), _normal(2, (b, hkv, seq_len, d))
    kn = _normal(3, (b, hq, seq_len, d))
    kn = kn / jnp.linalg.norm(kn, axis=-1, keepdims=True)
    la, beta = -jax.nn.softplus(_normal(4, (b, hq, seq_len))), jax.nn.sigmoid(_normal(5, (b, hq, seq_len)))
    flex = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal)
    decode = lambda q, k, v: flashlax.decode_attention(q[:, :, :4], k, v)
    gdr = lambda q, k, v, la, beta: flashlax.gated_delta_rule(q, k, v, la, beta)
    loss = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))
    ops = {"flex_attention causal fwd": (flex, (q, k, v)), "flex_attention causal fwd_bwd": (loss(flex), (q, k, v)),
           "decode_attention Lq4 fwd": (decode, (q, k, v)),
           "gated_delta_rule chunked fwd": (gdr, (q, kn, q, la, beta)),
           "gated_delta_rule chunked fwd_bwd": (loss(gdr), (q, kn, q, la, beta))}
    jobs = {}
    for name, (fn, args) in ops.items():
        jobs[f"{name} | 1 device"] = (fn, tuple(jax.device_put(x, one) for x in args))
        jobs[f"{name} | 8 devices b x h"] = (fn, tuple(jax.device_put(x, NamedSharding(mesh, P("b", "h")))
                                                       for x in args))
    return jobs


def _ring_jobs(local_len: int):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    import flashlax  # noqa: PLC0415
    from flashlax import masks  # noqa: PLC0415

    mesh = jax.make_mesh((DEVICES,), ("sp",))
    seq = DEVICES * local_len
    b, hq, hkv, d = 1, 4, 1, 64
    q, k, v = _normal(0, (b, hq, seq, d)), _normal(1, (b, hkv, seq, d)), _normal(2, (b, hkv, seq, d))
    split = NamedSharding(mesh, P(None, None, "sp"))
    ring = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal, context_axis="sp")

    def gather_kv(q, k, v):
        # The baseline: every device gathers K/V whole and attends its (contiguous) queries to them.
        def local(q, k, v):
            first = lax.axis_index("sp") * q.shape[2]
            mask = lambda b_, h, q_idx, kv_idx: q_idx + first >= kv_idx
            k, v = lax.all_gather(k, "sp", axis=2, tiled=True), lax.all_gather(v, "sp", axis=2, tiled=True)
            return flashlax.flex_attention(q, k, v, mask_mod=mask)
        return jax.shard_map(local, mesh=mesh, in_specs=P(None, None, "sp"), out_specs=P(None, None, "sp"))(q, k, v)

    loss = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))
    sharded = tuple(jax.device_put(x, split) for x in (q, k, v))
    one = tuple(jax.device_put(x[:, :, :local_len], jax.devices()[0]) for x in (q, k, v))
    single = lambda q, k, v: flashlax.flex_attention(q, k, v, mask_mod=masks.causal)
    jobs = {}
    for mode, wrap in (("fwd", lambda f: f), ("fwd_bwd", loss)):
        jobs[f"ring {mode} | 8 devices T={seq}"] = (wrap(ring), sharded)
        jobs[f"ring compute only {mode} | 8 devices T={seq}"] = (_compute_only(wrap(ring)), sharded)
        jobs[f"all-gather baseline {mode} | 8 devices T={seq}"] = (wrap(gather_kv), sharded)
        jobs[f"one device {mode} | T={local_len}"] = (wrap(single), one)
    return jobs


def _compute_only(fn: Callable) -> Callable:
    """``fn`` traced with the ring's ppermute replaced by the identity: the same compute, no transfers
    (the values are wrong; only the time is of interest)."""
    import jax  # noqa: PLC0415

    from flashlax.parallel import ring  # noqa: PLC0415

    def traced(*args):
        with mock.patch.object(ring.lax, "ppermute", lambda x, axis_name, perm: x):
            return fn(*args)

    return jax.jit(traced)


def run(args) -> dict[str, Any]:
    import jax  # noqa: PLC0415

    from flashlax.bench import harness  # noqa: PLC0415

    results = []
    # The meshes travel in the inputs' types (Explicit shardings): no context mesh, so the one-device rows
    # run where their inputs are.
    for name, jobs in (("per_shard", _per_shard_jobs(args.length)), ("ring", _ring_jobs(args.length))):
        for row, fields in _timers(jobs, args.repeats, args.min_sample_s).items():
            results.append({"suite": f"sharding/{name}", "impl": row, **fields})
    data = {"device": harness.device_info(), "config": {"devices": jax.device_count(), "length": args.length,
                                                        "repeats": args.repeats}, "results": results}
    print(table(results))
    return data


def table(rows) -> str:
    """Markdown table: median ms, and ratios to the reference row of each group."""
    out = ["| row | median ms (q1-q3) | ratio |", "|---|---|---|"]
    by_name = {r["impl"]: r for r in rows}
    for r in rows:
        name = r["impl"]
        ref = None
        if "| 8 devices b x h" in name:
            ref = by_name.get(name.replace("| 8 devices b x h", "| 1 device"))
        elif name.startswith(("ring compute only", "all-gather baseline")):
            mode = name.split("|")[0].split()[-1]
            ref = next(v for k, v in by_name.items() if k.startswith(f"ring {mode} |"))
        ratio = f"{r['median_ms'] / ref['median_ms']:.2f} x" if ref else ""
        out.append(f"| {name} | {r['median_ms']:.1f} ({r['q1_ms']:.1f}-{r['q3_ms']:.1f}) | {ratio} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashlax.bench.sharding", description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048, help="per-device sequence length (ring: T = 8 x this)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-sample-s", type=float, default=0.05)
    p.add_argument("--output", help="results JSON file")
    args = p.parse_args(argv)
    import jax  # noqa: PLC0415

    if jax.default_backend() == "cpu" and jax.device_count() < DEVICES:
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                         f"--xla_force_host_platform_device_count={DEVICES}".strip())
        return subprocess.call([sys.executable, "-m", "flashlax.bench.sharding", *(argv or sys.argv[1:])], env=env)
    data = run(args)
    if args.output:
        from flashlax.bench.harness import json_safe  # noqa: PLC0415

        with open(args.output, "w") as f:
            json.dump(json_safe(data), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
