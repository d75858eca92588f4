#!/usr/bin/env bash
# GPU device check (run by hand through the device tool; CI has no GPU): CUDA paths of the
# Session ('ipu_hw' -> cuda, one CUDA graph per run), trainingModel (PopTorch's default
# device), fused attention, dropout's kernels and the transformers benchmark on CUDA.
# Stages, each under its own timeout (seconds; 0 skips it), logs in $OUT (the device tool's folder):
#   TEST_TIMEOUT     the CUDA tests (tests.log)
#   DROPOUT_TIMEOUT  bench_dropout.py --device cuda (bench_dropout_cuda.log)
#   BENCH_TIMEOUT    bench_transformers.py --device cuda, no torch.compile, with peak memory (bench_transformers_cuda.log)
#   PLAIN_TIMEOUT    the same without fused attention (IPUXL_FUSED_ATTENTION=0), no memory (bench_plain_attention_cuda.log)
#   COMPILE_TIMEOUT  bench_transformers.py with torch.compile on COMPILE_MODELS, no memory (bench_compile_cuda.log)
set -o pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 IPUXL_DATA=/nonexistent
OUT="${OUT:-/tmp/ipuxl_device_check}"; mkdir -p "$OUT"
python3 -c "import torch, transformers, ipuxl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee "$OUT/env.log"
nproc | tee -a "$OUT/env.log"
TESTS="${TESTS:-tests/device/test_cuda_graphs.py tests/device/test_retarget.py tests/kernels/test_attention.py tests/kernels/test_fused_attention.py \
  tests/device/test_session.py tests/kernels/test_var_updates.py tests/device/test_layout.py tests/device/test_fp_exceptions.py \
  tests/poptorch_compat/compile/test_memory_format.py tests/poptorch_compat/runtime/test_executor.py tests/ir/test_placement.py \
  tests/device/test_ipus.py tests/addons_compat/transforms/test_pipelining.py tests/reference/test_popxl_pipelining.py \
  tests/kernels/test_counter_random.py tests/kernels/test_counter_random_triton.py tests/poptorch_compat/runtime/test_weight_sync.py \
  tests/capture/test_custom_functions.py tests/capture/test_custom_ops.py tests/capture/test_flex_attention.py}"
stage() {  # stage NAME TIMEOUT LOG COMMAND...: run COMMAND under TIMEOUT, log to $OUT/LOG, show its tail
  local name=$1 limit=$2 log=$3; shift 3
  [ "$limit" = 0 ] && return 0
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v Warning > "$OUT/$log"
  echo "== $name: rc ${PIPESTATUS[0]} in $((SECONDS - start)) s" | tee -a "$OUT/$log"
  tail -"${TAIL:-14}" "$OUT/$log"
}
PER_TEST=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
stage tests "${TEST_TIMEOUT:-150}" tests.log python3 -m pytest -q -p no:cacheprovider $PER_TEST -n "${TEST_WORKERS:-4}" --dist loadfile $TESTS
stage dropout "${DROPOUT_TIMEOUT:-45}" bench_dropout_cuda.log python3 benchmarks/bench_dropout.py --device cuda
stage transformers "${BENCH_TIMEOUT:-200}" bench_transformers_cuda.log \
  python3 benchmarks/bench_transformers.py --device cuda --repeats 5 --calls 4 --no-compile ${BENCH_ARGS:-}
IPUXL_FUSED_ATTENTION=0 stage plain_attention "${PLAIN_TIMEOUT:-60}" bench_plain_attention_cuda.log \
  python3 benchmarks/bench_transformers.py --device cuda --repeats 5 --calls 4 --no-compile --no-memory --models bert,vit
stage compile "${COMPILE_TIMEOUT:-0}" bench_compile_cuda.log \
  python3 benchmarks/bench_transformers.py --device cuda --repeats 3 --calls 4 --no-memory --models "${COMPILE_MODELS:-bert,gpt2}"
