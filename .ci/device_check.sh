#!/usr/bin/env bash
# GPU device check (run by hand through the device tool; CI has no GPU): CUDA paths of the
# Session ('ipu_hw' -> cuda, one CUDA graph per run), trainingModel (PopTorch's default
# device), dropout's kernels and the transformers benchmark on CUDA. Logs go to $OUT (the device tool's folder).
set -o pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 IPUXL_DATA=/nonexistent
OUT="${OUT:-/tmp/ipuxl_device_check}"; mkdir -p "$OUT"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-330}"
python3 -c "import torch, transformers, ipuxl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee "$OUT/env.log"
TESTS="${TESTS:-tests/device/test_cuda_graphs.py tests/device/test_retarget.py tests/kernels/test_attention.py tests/device/test_session.py \
  tests/kernels/test_var_updates.py tests/device/test_layout.py \
  tests/poptorch_compat/compile/test_memory_format.py tests/poptorch_compat/runtime/test_executor.py tests/ir/test_placement.py \
  tests/device/test_ipus.py tests/addons_compat/transforms/test_pipelining.py tests/reference/test_popxl_pipelining.py \
  tests/kernels/test_counter_random.py tests/kernels/test_counter_random_triton.py tests/poptorch_compat/runtime/test_weight_sync.py \
  tests/capture/test_custom_functions.py tests/capture/test_custom_ops.py tests/capture/test_flex_attention.py}"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 120 $TESTS > "$OUT/tests.log" 2>&1
tail -25 "$OUT/tests.log"
timeout 60 python3 benchmarks/bench_dropout.py --device cuda 2>&1 | tee "$OUT/bench_dropout_cuda.log"
timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_transformers.py --device cuda --repeats 5 --calls 4 ${BENCH_ARGS:-} 2>&1 \
  | grep -v Warning | tee "$OUT/bench_transformers_cuda.log"
