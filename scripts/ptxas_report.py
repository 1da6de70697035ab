"""Registers and spills of the Pallas (Triton) kernels in an XLA dump (``XLA_FLAGS=--xla_dump_to=DIR``): runs
ptxas -v on every dumped .ptx file, in the order the files were written, and prints one JSON line per kernel
entry whose name contains the filter (diagnosis only: which kernels spill).

  python3 scripts/ptxas_report.py DIR [--filter ssd] [--arch sm_90a] [--out report.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess


def find_ptxas() -> str | None:
    cands = [shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"]
    try:
        import triton
        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
    except Exception:  # noqa: BLE001
        pass
    try:
        import nvidia.cuda_nvcc as nv
        cands += glob.glob(os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas"))
    except Exception:  # noqa: BLE001
        pass
    cands += glob.glob("/usr/local/lib/python3*/*-packages/nvidia/cu*/bin/ptxas")
    return next((c for c in cands if c and os.path.exists(c)), None)


def run_ptxas(ptxas: str, path: str, arch: str) -> str:
    out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o", os.devnull], capture_output=True,
                         text=True)
    text = out.stdout + out.stderr
    m = re.search(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'", text)
    if m:    # a newer PTX ISA than this ptxas: retry with its version (diagnosis only)
        src = open(path).read().replace(f".version {m.group(1)}", f".version {m.group(2)}")
        tmp = path + ".downgraded.ptx"
        open(tmp, "w").write(src)
        return run_ptxas(ptxas, tmp, arch)
    return text


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dump")
    p.add_argument("--filter", default="ssd")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--out")
    args = p.parse_args()
    ptxas = find_ptxas()
    rows = []
    if ptxas is None:
        print(json.dumps({"error": "no ptxas found"}))
        return
    files = sorted((f for f in glob.glob(os.path.join(args.dump, "**", "*.ptx"), recursive=True)
                    if not f.endswith(".downgraded.ptx")), key=os.path.getmtime)
    for f in files:
        text = run_ptxas(ptxas, f, args.arch)
        entry = None
        for line in text.splitlines():
            m = re.search(r"Compiling entry function '([^']+)'", line)
            if m:
                entry = m.group(1)
                continue
            if entry and args.filter in entry:
                if "spill stores" in line:
                    nums = re.findall(r"(\d+) bytes (stack frame|spill stores|spill loads)", line)
                    rows.append(dict(file=os.path.basename(f), entry=entry, **{k.replace(" ", "_"): int(v)
                                                                              for v, k in nums}))
                m = re.search(r"Used (\d+) registers", line)
                if m and rows and rows[-1]["entry"] == entry:
                    rows[-1]["registers"] = int(m.group(1))
        if "error" in text.lower() and not rows:
            rows.append(dict(file=os.path.basename(f), error=text[-400:]))
    for r in rows:
        print(json.dumps(r))
    if args.out:
        json.dump(dict(ptxas=ptxas, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
