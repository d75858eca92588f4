#!/usr/bin/env bash
# GPU device check (run by hand through the device tool; CI has no GPU): CUDA paths of the
# Session ('ipu_hw' -> cuda), trainingModel (PopTorch's default device) and the benchmarks.
set -o pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 IPUXL_DATA=/nonexistent
OUT="${OUT:-/tmp/ipuxl_device_check}"; mkdir -p "$OUT"
python3 -c "import torch, ipuxl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee "$OUT/env.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider -x --timeout 120 tests/device/test_session.py tests/device/test_layout.py \
  tests/poptorch_compat/compile/test_memory_format.py tests/poptorch_compat/runtime/test_executor.py tests/ir/test_placement.py \
  tests/device/test_ipus.py tests/addons_compat/transforms/test_pipelining.py tests/reference/test_popxl_pipelining.py 2>&1 | tee "$OUT/tests.log"
timeout 120 python3 benchmarks/bench_mlp.py --device ipu_hw --quick 2>&1 | tee "$OUT/bench_mlp.log"
timeout 150 python3 benchmarks/bench_poptorch.py --quick 2>&1 | tee "$OUT/bench_poptorch.log"
