"""Registers and spills of the ssd kernels for an H200 (sm_90a) without a GPU: lowers the float32 dk 64 forward +
backward (Pallas backward) of the H200 entry, with SSDConfig overrides, to Triton IR through Pallas' Triton
lowering under an abstract H200, then compiles each kernel with pip's Triton (its own pass pipeline, not
XLA's: a proxy, compare variants with it, not absolute numbers) and runs its bundled ptxas -v.

Needs a second Python with ``triton==3.6.0`` (``python3.12 -m venv /tmp/tv && /tmp/tv/bin/pip install
triton==3.6.0``; no GPU needed):

  PYTHONPATH=$PWD .venv/bin/python scripts/offline_ptxas.py --triton-python /tmp/tv/bin/python \
      [--overrides '{"dqk_lean": true, "warps": [["dqk", 8]]}'] [--only dqk]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

COMPILE = r'''
import glob, json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.ttir"))):
    meta = json.load(open(f + ".json"))
    row = dict(kernel=meta["name"], warps=meta["warps"], stages=meta["stages"])
    try:
        k = triton.compile(f, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": meta["warps"], "num_stages": meta["stages"]})
        open(f + ".ptx", "w").write(k.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f + ".ptx", "-o", os.devnull],
                             capture_output=True, text=True)
        text = out.stdout + out.stderr
        regs = re.search(r"Used (\d+) registers", text)
        sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        row.update(registers=int(regs.group(1)), spill_stores=int(sp.group(1)), spill_loads=int(sp.group(2)),
                   shared=k.metadata.shared)
    except Exception as exc:  # noqa: BLE001
        row["error"] = str(exc)[:300]
    print(json.dumps(row))
'''


def dump(out_dir: str, overrides: dict, only: str | None):
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering, pallas_call_registration as reg

    from flashlax.kernels.configs import ssd_config
    from flashlax.kernels.ssd import gated_delta_rule_ssd

    over = {k: tuple(tuple(x) for x in v) if isinstance(v, list) else v for k, v in overrides.items()}
    cfg = dataclasses.replace(ssd_config(64, 64, jnp.float32, "NVIDIA H200"), **over)
    orig = lowering.lower_jaxpr_to_triton_module
    seen = []

    def capture(jaxpr, grid_mapping, *args, **kw):
        res = orig(jaxpr, grid_mapping, *args, **kw)
        text = res.module.operation.get_asm(enable_debug_info=False)
        name = text.split("module @", 1)[1].split(" ", 1)[0]
        if (only is None or only in name) and name not in seen:     # each kernel once (the backward recomputes)
            seen.append(name)
            sequential = name in ("ssd_state", "ssd_reverse")
            warps = dict(cfg.warps).get(name.removeprefix("ssd_").removesuffix("_bwd"),
                                        cfg.state_warps if sequential else cfg.num_warps)
            path = os.path.join(out_dir, f"{len(seen):02d}.ttir")
            open(path, "w").write(text)
            json.dump(dict(name=name, warps=warps, stages=cfg.state_stages if sequential else 1),
                      open(path + ".json", "w"))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture

    def loss(q, k, v, la, beta):
        return jnp.sum(gated_delta_rule_ssd(q, k, v, la, beta, scale=0.125, config=cfg, device_kind="NVIDIA H200",
                                            backward="pallas"))

    x = jax.ShapeDtypeStruct((2, 8, 8192, 64), jnp.float32)
    g = jax.ShapeDtypeStruct((2, 8, 8192), jnp.float32)
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(x, x, x, g, g).lower(lowering_platforms=("cuda",))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--triton-python", required=True)
    p.add_argument("--overrides", default="{}")
    p.add_argument("--only", default=None, help="kernels whose name contains this")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        dump(d, json.loads(args.overrides), args.only)
        sys.stdout.flush()
        subprocess.run([args.triton_python, "-c", COMPILE, d], check=True)


if __name__ == "__main__":
    main()
