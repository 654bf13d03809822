#!/usr/bin/env bash
# A check of the merged tree on the H200, in one device call: the GPU tests of the kernels, the
# emulator and the studies' GPU paths; `validate` through the study protocol; the command-line
# Table 3's wall time and phases (benchmarks/bench_cli.py --gpu).
# Device tool: run(command="bash tools/device/check_h200.sh", carry=[".whl"], timeout_s=590)
set -o pipefail
source tools/device/setup_device.sh
OUT=${OUT:-/tmp/check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, typer, rich, importlib.metadata as m; print('torch', torch.__version__, 'triton', triton.__version__, 'typer', m.version('typer'), 'rich', m.version('rich'))" | tee -a "$OUT/gpu.txt"
fa3-numerics backends --device cuda 2>&1 | tee "$OUT/backends.txt"
# GPU tests: what skips on the CPU runs here (the rest of the suite is the CPU's).
timeout ${CHECK_TEST_S:-300} python3 -m pytest -q -p no:cacheprovider --maxfail=5 --durations=8 -m "not slow" \
  ${CHECK_TESTS:-tests/kernels/test_kernels_fa3.py tests/kernels/test_kernels_sage.py tests/kernels/test_kernels_triton.py tests/numerics/test_mma.py \
  tests/kernels/test_mma_triton.py tests/engine/test_backends.py} 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
timeout 120 fa3-numerics validate --grid small --backend fa3 --device cuda --out /tmp/val 2>&1 | tail -25 | tee "$OUT/validate.txt"
cp /tmp/val/validation.nc "$OUT/" 2>/dev/null
timeout 150 python3 benchmarks/bench_cli.py --gpu --repeat 3 2>&1 | tee "$OUT/bench_cli_gpu.txt"
