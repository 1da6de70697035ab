"""GPU check: the Pallas kernels inside the caller's jax.shard_map with check_vma=True (the default), on a
one-device mesh, values and gradients against the same call outside shard_map. (The interpreter cannot run
this: its padding constants do not vary like the blocks, see tests/multidevice/md_shard_map.py.)"""

import json
import sys
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

import flashlax
from flashlax import masks
from _gpu_common import log, rel, rnd

B, HQ, HKV, L, D = 2, 4, 2, 256, 64
MESH = jax.make_mesh((1, 1), ("b", "h"), axis_types=(AxisType.Auto,) * 2)
BH = P("b", "h")
TABLE = 0.1 * rnd(9, (2 * L,), jnp.float32)


def _bias(t):
    return lambda s, b, h, qi, ki: s + t[qi - ki + L]


def _gdr_args():
    q, k, v = rnd(4, (B, HQ, L, D), jnp.float32), rnd(5, (B, HQ, L, D), jnp.float32), rnd(6, (B, HQ, L, D), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, v, -jax.nn.softplus(rnd(7, (B, HQ, L), jnp.float32)), jax.nn.sigmoid(rnd(8, (B, HQ, L), jnp.float32))


def _att_args(dtype=jnp.bfloat16):
    return rnd(0, (B, HQ, L, D), dtype), rnd(1, (B, HKV, L, D), dtype), rnd(2, (B, HKV, L, D), dtype)


CASES = {
    "flex_pallas": (lambda t, q, k, v: flashlax.flex_attention(q, k, v, score_mod=_bias(t), mask_mod=masks.causal,
                                                               impl="pallas"), _att_args, True),
    "decode_pallas": (lambda t, q, k, v: flashlax.decode_attention(q[:, :, :2], k, v, score_mod=_bias(t),
                                                                   kv_lens=jnp.full((q.shape[0],), 200), impl="pallas"),
                      _att_args, False),
    "gdr_ssd": (lambda t, q, k, v, la, beta: flashlax.gated_delta_rule(q, k, v, la, beta, impl="ssd"), _gdr_args, True),
    "gdr_ssd_nobeta": (lambda t, q, k, v, la, beta: flashlax.gated_delta_rule(q, k, v, la, None, impl="ssd"),
                       _gdr_args, True),
}


def main():
    results = {}
    for name, (fn, make, differentiable) in CASES.items():
        try:
            args = make()
            mapped = lambda t, *a, fn=fn: jax.shard_map(lambda *x: fn(t, *x), mesh=MESH, in_specs=BH,
                                                        out_specs=BH)(*a)
            r = {"value_rel": rel(jax.jit(mapped)(TABLE, *args), jax.jit(fn)(TABLE, *args))}
            if differentiable:
                loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))))
                argn = tuple(range(len(args) + 1))
                g1 = jax.jit(jax.grad(loss(mapped), argnums=argn))(TABLE, *args)
                g0 = jax.jit(jax.grad(loss(fn), argnums=argn))(TABLE, *args)
                r["grad_rel"] = max(rel(a, b) for a, b in zip(g1, g0))
            r["ok"] = all(v < 1e-5 for k, v in r.items() if k.endswith("rel"))
        except Exception as e:  # noqa: BLE001 - the report names what failed
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        log(name, r)
        results[name] = r
    if len(sys.argv) > 1:
        json.dump(results, open(sys.argv[1], "w"), indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
