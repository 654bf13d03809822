#!/usr/bin/env bash
# The device calls of the sage1 backend: dumps of SageAttention 1's kernel for fitting the sage1
# preset (sage_h200.py), then `fa3-numerics validate --backend sage1` on the grids given in
# SAGE_GRIDS (small,stress and, with a capture in .capture/, captured) and the GPU tests.
# Device tool: run(command="bash tools/device/sage_h200.sh", carry=[".whl", ".capture"]) from this
# checkout's root. .whl/ (git-ignored): sageattention-1.0.6, h5netcdf-1.8.2, gguf-0.19.0
# (pip download --no-deps); .capture/smollm2.safetensors from
# `fa3-numerics capture --model smollm2 --tokens 512 --layers 0,3,7,12,19,24,29`.
set -o pipefail
source tools/device/setup_device.sh
OUT=${OUT:-reports/h200/sage1}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/tcache
CAP=.capture/smollm2.safetensors
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fa3-numerics backends --device cuda 2>&1 | grep -i -E "sage1|name"
if [ -n "${SAGE_DUMP:-}" ]; then
  python3 tools/device/sage_h200.py --out "$OUT" --capture "$CAP" --parts "$SAGE_DUMP" 2>&1 | tee /tmp/sage-dump.log
fi
# The measured reciprocal of Triton's division joins the emulator's model (numerics/sage_quant.py).
if [ -f "$OUT/rcp.npz" ] && [ -n "${SAGE_RCP:-}" ]; then
  cp "$OUT/rcp.npz" fa3_numerics/numerics/sage_rcp.npz
fi
for g in ${SAGE_GRIDS:-}; do
  if [ "$g" = captured ]; then args=(--dist "captured:$CAP"); else args=(--grid "$g"); fi
  timeout "${SAGE_TIMEOUT:-200}" fa3-numerics validate --backend sage1 --device cuda "${args[@]}" \
    --out "/tmp/val-$g" 2>&1 | tail -n 40
  # at most 8 files come back: the grids' datasets and reports only where asked (SAGE_KEEP=1)
  if [ -n "${SAGE_KEEP:-}" ]; then mkdir -p "$OUT/$g" && cp /tmp/val-$g/validation.nc /tmp/val-$g/validation.md "$OUT/$g/"; fi
done
if [ -n "${SAGE_TESTS:-}" ]; then
  python3 -m pytest -q tests/kernels/test_kernels_sage.py 2>&1 | tail -n 15
fi
