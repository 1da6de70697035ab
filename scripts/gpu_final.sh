#!/usr/bin/env bash
# One device call: the benchmark suites on the GPU and the gpu-marked tests, in priority order, each step
# time-boxed, every log and JSON written under $OUT as it goes (so a cut-off run still returns results).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
step() { local secs=$1 name=$2; shift 2; echo "=== $name"; timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 25 "$OUT/$name.log"; }
step ${T_PREFILL:-170} prefill python3 -m flashlax.bench --suite prefill --device gpu --impls flex_native jax_cudnn torch_sdpa --repeats 5 --output "$OUT/prefill.json"
step ${T_TESTS:-110} gpu_tests python3 -m pytest -m gpu -q -x -p no:cacheprovider tests
step ${T_DECODE:-60} decode python3 -m flashlax.bench --suite decode --device gpu --repeats 5 --output "$OUT/decode.json"
step ${T_LINEAR:-50} linear python3 -m flashlax.bench --suite linear --device gpu --lengths 2048 8192 --repeats 3 --output "$OUT/linear.json"
