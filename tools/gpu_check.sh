#!/usr/bin/env bash
# On the GPU machine (device tool, carry [".gpu"]): the parity suite with CUDA tensors, then the
# benchmark table. Logs go to $OUT. Usage: bash tools/gpu_check.sh [bench args...]
set -o pipefail
source .gpu/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton, torchrec, fbgemm_gpu; print('torch', torch.__version__, 'triton', triton.__version__, 'torchrec', torchrec.__version__)" | tee -a "$OUT/device.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  RECOM_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_parity_torchrec.py tests/test_kernels_reference.py tests/test_bad_input.py tests/test_compile_and_fx.py} 2>&1 | tee "$OUT/tests.log"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m recom_rec.bench --out "$OUT/bench" "$@" 2>&1 | grep -v "is_fx_tracing" | tee "$OUT/bench.log"
fi
