"""Registers and spills of the ssd kernels on the GPU (ptxas -v on XLA's PTX dump), one device call.

  cd <tree> && PYTHONPATH=$PWD python3 scripts/gpu_regs.py --shape f32 --kernels wy,dqk --variants

Compiles each named kernel of the shipped config at the shape (and with ``--variants`` the KERNEL_VARIANTS of
scripts/gpu_ssd.py), with XLA dumping its modules' PTX, then runs ``ptxas -v`` for sm_90a on every dumped
PTX file and prints, per kernel function: registers, spill stores / loads (bytes) and shared memory. A
kernel that spills is bound by local-memory traffic, not by its products or its HBM bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="xla_dump_")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_ssd import KERNEL_VARIANTS, inputs, kernel_args, kernel_fn  # noqa: E402
from flashlax.kernels import ssd  # noqa: E402

SHAPES = {"f32": ((2, 8, 8192, 64), jnp.float32), "bf16": ((2, 16, 8192, 128), jnp.bfloat16),
          "f32_128": ((2, 8, 8192, 128), jnp.float32)}


def find_ptxas():
    found = shutil.which("ptxas")
    if found:
        return found
    for pattern in ("/usr/local/cuda*/bin/ptxas", os.path.join(sys.prefix, "lib/python3*/site-packages/nvidia/*/bin/ptxas"),
                    os.path.join(sys.prefix, "lib/python3*/site-packages/triton/backends/nvidia/bin/ptxas")):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    for path in sys.path:
        hits = sorted(glob.glob(os.path.join(path, "triton/backends/nvidia/bin/ptxas"))
                      + glob.glob(os.path.join(path, "nvidia/*/bin/ptxas")))
        if hits:
            return hits[-1]
    return None


def ptxas_report(ptxas, path):
    """[(function, registers, spill stores, spill loads, smem)] of one PTX file."""
    proc = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull], capture_output=True,
                          text=True)
    text = proc.stdout + proc.stderr
    rows, fn = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            fn = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and fn:
            rows.append([fn, None, int(m.group(1)), int(m.group(2)), None])
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m and fn:
            if rows and rows[-1][0] == fn and rows[-1][1] is None:
                rows[-1][1] = int(m.group(1))
                rows[-1][4] = int(m.group(2)) if m.group(2) else None
            else:
                rows.append([fn, int(m.group(1)), None, None, int(m.group(2)) if m.group(2) else None])
    if proc.returncode and not rows:
        rows.append([f"ptxas failed: {text[-300:]}", None, None, None, None])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="f32", choices=sorted(SHAPES))
    ap.add_argument("--kernels", default="wy,dqk")
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    ptxas = find_ptxas()
    print("ptxas:", ptxas, flush=True)
    (b, h, t, d), dtype = SHAPES[args.shape]
    q, k, v, la, beta, do = inputs(b, h, t, d, d, dtype, seed=7, with_beta=True)
    base = ssd.make_static(q, k, v, beta, scale=d ** -0.5, chunk_size=64, interpret=False, config=None,
                           device_kind=None)
    all_args = kernel_args(base, q, k, v, la, beta, do)
    for name in args.kernels.split(","):
        configs = {"shipped": base}
        if args.variants:
            for label, over in KERNEL_VARIANTS.get(name, {}).items():
                configs[label] = dataclasses.replace(base, config=dataclasses.replace(base.config, **over))
        for label, st in configs.items():
            before = set(glob.glob(os.path.join(DUMP, "**", "*.ptx"), recursive=True))
            try:
                jax.block_until_ready(kernel_fn(name, st)(*all_args[name]))
            except Exception as exc:  # noqa: BLE001 - a failing variant is a result too
                print(f"{name} {label}: FAIL {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            new = sorted(set(glob.glob(os.path.join(DUMP, "**", "*.ptx"), recursive=True)) - before)
            if not new:
                print(f"{name} {label}: no new PTX in the dump", flush=True)
            for path in new:
                for fn, regs, st_b, ld_b, smem in ptxas_report(ptxas, path) if ptxas else []:
                    print(f"{args.shape} {name:14s} {label:12s} {fn[:40]:40s} regs {regs} spill st {st_b} "
                              f"ld {ld_b} smem {smem}", flush=True)


if __name__ == "__main__":
    main()
