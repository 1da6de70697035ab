#!/usr/bin/env bash
# One device call: the gpu-marked tests and the benchmark suites on the GPU, in the order given as arguments
# (default: tests decode linear quick; also: prefill4k, prefill16k, dims, paged, shardmap, decode_diag, linear_ab, ssd, trace, trace_nocb, dispatch, ssd_ab, linear_bf16, linear_f32, linear_tf32; PAGED_ARGS: extra gpu_paged.py flags, PAGED_VARIANTS: its --variants), each step time-boxed
# (T_<STEP> seconds; TEST_K: a pytest -k filter for the tests step), every log and JSON written under $OUT as it goes, so a cut-off run keeps what finished.
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
step() { local secs=$1 name=$2; shift 2; echo "=== $name"; local t0=$SECONDS
         timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? ($((SECONDS - t0)) s)"; tail -n 25 "$OUT/$name.log"; }
steps=${*:-tests decode linear quick}
for s in $steps; do
  case $s in
    # compiles dominate: 8 pytest workers share the GPU and the host's cores
    tests) step "${T_TESTS:-190}" gpu_tests python3 -m pytest -m gpu -q -n "${TEST_WORKERS:-8}" -p no:cacheprovider ${PYTEST_ARGS:-} ${TEST_K:+-k "$TEST_K"} tests ;;
    prefill|prefill4k|prefill16k)  # one process per shape, so a time-out keeps the shapes that finished
      for shape in "2 4096" "1 16384"; do
        set -- $shape
        case $s in prefill4k) [ "$2" = 4096 ] || continue ;; prefill16k) [ "$2" = 16384 ] || continue ;; esac
        step "${T_PREFILL:-300}" "prefill_$2" python3 -m flashlax.bench --suite prefill --device gpu --batch "$1" \
          --lengths "$2" --impls ${PREFILL_IMPLS:-pallas jax_cudnn torch_sdpa torch_flex jax_pallas_mha} \
          --repeats 5 --output "$OUT/prefill_$2.json"
      done ;;
    dims) step "${T_DIMS:-150}" dims python3 -m flashlax.bench --suite prefill --device gpu --batch 2 --lengths 4096 \
            --dims 64 256 --masks causal full --impls pallas jax_cudnn torch_sdpa torch_flex --repeats 5 \
            --output "$OUT/dims.json" ;;
    quick) step "${T_QUICK:-240}" quick python3 -m flashlax.bench --quick --output "$OUT/quick.json" ;;
    decode) step "${T_DECODE:-60}" decode python3 -m flashlax.bench --suite decode --device gpu --repeats 5 \
              --output "$OUT/decode.json" ;;
    linear)  # one process per length (LIN_LENGTHS), so a time-out keeps the lengths that finished
      for t in ${LIN_LENGTHS:-512 2048 8192}; do
        step "${T_LINEAR:-200}" "linear_$t" python3 -m flashlax.bench --suite linear --device gpu --lengths "$t" \
          --dims 64 128 --impls $([ "$t" -le 2048 ] && echo recurrent) chunked chunked_fat ssd \
          --ref-max-seq 2048 --repeats 3 --output "$OUT/linear_$t.json"
      done ;;
    shardmap) step "${T_SHARDMAP:-120}" shardmap python3 scripts/gpu_shardmap.py "$OUT/shardmap.json" ;;
    decode_diag) step "${T_DECODE_DIAG:-90}" decode_diag python3 scripts/gpu_decode_diag.py --out "$OUT/decode_diag.json" ;;
    linear_ab) step "${T_LINEAR_AB:-240}" linear_ab python3 scripts/gpu_linear_ab.py --out "$OUT" \
                 --deadline "${LINEAR_AB_DEADLINE:-200}" --first "${LINEAR_AB_FIRST:-0}" ;;
    trace) step "${T_TRACE:-90}" trace python3 scripts/gpu_trace.py --out "$OUT/trace.json" ;;
    trace_nocb) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" step "${T_TRACE:-90}" trace_nocb \
                  python3 scripts/gpu_trace.py --out "$OUT/trace_nocb.json" ;;  # XLA's CUDA graphs off
    dispatch) step "${T_DISPATCH:-90}" dispatch python3 scripts/gpu_dispatch.py --out "$OUT/dispatch.json" ;;
    ssd_ab) step "${T_SSD_AB:-150}" ssd_ab python3 scripts/gpu_ssd_ab.py --out "$OUT/ssd_ab.json" \
              --shapes "${SSD_AB_SHAPES:-bf16_128}" --variants "${SSD_AB_VARIANTS:-shipped,subst,pw4,subst pw4}" ${SSD_AB_FLAGS:---no-bwd} ;;
    paged) step "${T_PAGED:-100}" paged python3 scripts/gpu_paged.py --out "$OUT/paged.json" ${PAGED_ARGS:-} \
             ${PAGED_VARIANTS:+--variants "$PAGED_VARIANTS"} ;;
    linear_bf16)  # issue 15's bf16 shape: B2 H16 T8192 dk=dv=128, ssd (and LIN_BF16_IMPLS) fwd and fwd+bwd
      step "${T_LINEAR_BF16:-120}" linear_bf16 python3 -m flashlax.bench --suite linear --device gpu --batch 2 \
        --heads 16 --lengths 8192 --dims 128 --dtypes bfloat16 --impls ${LIN_BF16_IMPLS:-ssd} --repeats 5 \
        --output "$OUT/linear_bf16.json" ;;
    linear_f32|linear_tf32)  # issue 15's float32 bars (B2 H8 T8192 dk64, with and without beta) at full float32
      # and at tf32 products (fla's float32 precision: its tl.dot defaults to tf32), chunked and ssd
      mkdir -p "$OUT/$s"
      step "${T_LINEAR_F32:-150}" "$s" env $([ $s = linear_tf32 ] && echo JAX_DEFAULT_MATMUL_PRECISION=tensorfloat32) python3 scripts/gpu_linear_ab.py --out "$OUT/$s" --only 0,3 \
        --impls "${LIN_F32_IMPLS:-chunked,ssd}" --deadline "${T_LINEAR_F32:-150}" ;;
    ssd) step "${T_SSD:-300}" ssd python3 scripts/gpu_ssd.py --out "$OUT" --steps "${SSD_STEPS:-check,kernels,variants}" \
           --deadline "${SSD_DEADLINE:-240}" ;;
  esac
done
