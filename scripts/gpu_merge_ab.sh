#!/usr/bin/env bash
# One device call (session 38 plan, ~520 s): the Lq16 merge-launch A/B (DecodeConfig.merge_kernel_rows), the
# Lq1 merge variants, an A/A of host time at B1 L16384 (the repo tree and a copy of it in .aa/: first
# `mkdir .aa && git archive HEAD flashlax | tar -x -C .aa`, untracked; AA_PATHS="" skips it), then the gpu tests
# (TESTS, T4 seconds). Run from the repo root: `bash scripts/gpu_merge_ab.sh`.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
R=$PWD; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
show() { grep -o '"variant": "[a-z_0-9]*", "thr_ms": [0-9.]*' "$1"; grep -o '"fusions": [0-9]*, "custom_calls": [0-9]*' "$1" | head -3; grep -o '"error[^}]*' "$1" | head -3; }
t0=$SECONDS
PYTHONPATH=$R/scripts:$R timeout ${T1:-150} python3 scripts/gpu_decode_diag.py --shapes 1x65536x16 \
  --configs "merge_kernel_rows=4,merge_kernel_rows=2,merge_kernel_rows=8" --out $OUT/lq16.json > $OUT/lq16.log 2>&1
echo "lq16 rc=$? $((SECONDS-t0)) s"; show $OUT/lq16.log
t0=$SECONDS
PYTHONPATH=$R/scripts:$R timeout ${T2:-60} python3 scripts/gpu_decode_diag.py --shapes 1x65536x1 --only-configs \
  --configs "merge_in_kernel_kb=0+merge_kernel_rows=4,merge_in_kernel_kb=0" --out $OUT/lq1.json > $OUT/lq1.log 2>&1
echo "lq1 rc=$? $((SECONDS-t0)) s"; show $OUT/lq1.log
i=0
for p in ${AA_PATHS-$R $R/.aa $R $R/.aa}; do
  i=$((i+1)); t0=$SECONDS
  PYTHONPATH=$p:$R/scripts:$R timeout ${T3:-35} python3 scripts/gpu_decode_diag.py --shapes 1x16384x1 --only-configs --serving \
    --configs "merge_in_kernel_kb=0+merge_kernel_rows=4" --out $OUT/aa_$i.json > $OUT/aa_$i.log 2>&1
  echo "aa $i ($p) rc=$? $((SECONDS-t0)) s"; show $OUT/aa_$i.log
done
t0=$SECONDS
PYTHONPATH=$R timeout ${T4:-240} python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider ${TESTS:-tests} > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? $((SECONDS-t0)) s"; tail -8 $OUT/gpu_tests.log
