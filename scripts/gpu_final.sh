#!/usr/bin/env bash
# One device call: the gpu-marked tests and the benchmark suites on the GPU, in the order given as
# arguments (default: tests prefill decode linear), each step time-boxed (T_<STEP> seconds), every log and
# JSON written under $OUT as it goes, so a cut-off run still returns what finished.
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
step() { local secs=$1 name=$2; shift 2; echo "=== $name"; timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 30 "$OUT/$name.log"; }
steps=${*:-tests prefill decode linear}
for s in $steps; do
  case $s in
    tests) step "${T_TESTS:-90}" gpu_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests ;;
    prefill) step "${T_PREFILL:-190}" prefill python3 -m flashlax.bench --suite prefill --device gpu \
               --impls flex_native jax_cudnn torch_sdpa --repeats 5 --output "$OUT/prefill.json" ;;
    decode) step "${T_DECODE:-45}" decode python3 -m flashlax.bench --suite decode --device gpu --repeats 5 \
              --output "$OUT/decode.json" ;;
    linear) step "${T_LINEAR:-30}" linear python3 -m flashlax.bench --suite linear --device gpu --lengths 2048 \
              --impls chunked chunked_fat ssd --repeats 3 --output "$OUT/linear.json" ;;
  esac
done
