#!/usr/bin/env bash
# The one device call of the FA3 measurement: Table 3 on the kernel, the small, stress and captured
# validation grids, the command-line Table 3 timing, the MMA model's speed, the kernel tests.
# Device tool: run(command="bash tools/device/h200.sh", carry=[".whl", ".capture"], timeout_s=590)
# .whl/ (git-ignored): fa3_fwd-0.0.3-*.whl and h5netcdf-1.8.2-py3-none-any.whl (pip download);
# .capture/ (git-ignored, optional): a capture file for `validate --dist captured:` (see h200.py).
set -o pipefail
source tools/device/setup_device.sh
OUT=${OUT:-reports/h200}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 tools/device/h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
