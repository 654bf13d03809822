#!/usr/bin/env bash
# The Triton kernels' device measurement in one call.
# Device tool: run(command="bash tools/device/triton_h200.sh [--parts ...]", carry=[".whl"], timeout_s=...)
# .whl/ (git-ignored) holds fa3_fwd-0.0.3-*.whl (FA3 rows beside the Triton ones) and h5netcdf-1.8.2 (.nc files).
set -o pipefail
source tools/device/setup_device.sh
OUT=${OUT:-reports/h200/triton}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
python3 tools/device/triton_h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
