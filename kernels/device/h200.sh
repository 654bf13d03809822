#!/usr/bin/env bash
# The one device call: Table 3 on the FA3 kernel, the validation grid, throughput, kernel tests.
# Device tool: run(command="bash kernels/device/h200.sh", carry=[".whl"], timeout_s=540)
# .whl/ (git-ignored) holds fa3_fwd-0.0.3-*.whl and h5netcdf-1.8.2-py3-none-any.whl (pip download).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-reports/h200}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 kernels/device/h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
