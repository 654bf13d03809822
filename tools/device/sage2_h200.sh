#!/usr/bin/env bash
# `fa3-numerics validate --backend sage2` on the H200: SageAttention 2's sm90 kernel against the
# sage2-sm90 preset on the small and stress grids, datasets and reports back under $OUT/<grid>/.
#
# The kernel comes from the package that tools/device/sage2_build.sh returned (sage2-sm90.tar.gz),
# placed by the lead under .sage2build/, or, with SAGE2_BUILD=1, is built in this same call first
# (then carry .sage2src instead; the build takes most of the call's time).
# Device tool, prebuilt:  run(command="bash tools/device/sage2_h200.sh", carry=[".whl", ".sage2build"])
# Device tool, one call:  run(command="SAGE2_BUILD=1 bash tools/device/sage2_h200.sh",
#                             carry=[".whl", ".sage2src"], timeout_s=600)
# .whl/ as for every device call (setup_device.sh: h5netcdf for the .nc files). Env: SAGE2_GRIDS
# (default "small stress"; "captured" reads .capture/smollm2.safetensors, carried), SAGE2_VAL_TIMEOUT (s per grid, default 85), SAGE2_TESTS=1 also runs
# tests/kernels/test_kernels_sage2.py on the GPU. First, tools/device/sage2_scales.py checks the Triton
# quantizer's scales and codes against the emulator's (a few seconds; SAGE2_SCALES=0 skips it).
set -o pipefail
OUT=${OUT:-/tmp/sage2-out}
mkdir -p "$OUT"
T0=$(date +%s)
PKG=/tmp/sage2/pkg
if [ -n "${SAGE2_BUILD:-}" ]; then
  OUT="$OUT/build" bash tools/device/sage2_build.sh || { echo "sage2 build failed: see $OUT/build/build.log"; exit 3; }
elif [ ! -d "$PKG" ]; then
  # a warm machine keeps /tmp: a package an earlier call unpacked serves this one (then .sage2build
  # need not be carried again)
  timeout 60 python3 tools/device/sage2_build.py unpack --tar "${SAGE2_TAR:-.sage2build/sage2-sm90.tar.gz}" --pkg "$PKG" || exit 3
fi
echo "== package ready at +$(( $(date +%s) - T0 ))s"
source tools/device/setup_device.sh
export FA3N_SAGE2_PATH="$PKG" TRITON_CACHE_DIR=/tmp/tcache
fa3-numerics backends --device cuda 2>&1 | grep -i -E "sage2|name"
if [ "${SAGE2_SCALES:-1}" != 0 ]; then
  timeout 90 python3 tools/device/sage2_scales.py 2>&1 | tee "$OUT/scales.txt" | tail -n 8
  echo "== scales rc=${PIPESTATUS[0]} (elapsed $(( $(date +%s) - T0 ))s)"
fi
for g in ${SAGE2_GRIDS:-small stress}; do
  t=$(date +%s)
  if [ "$g" = captured ]; then args=(--dist "captured:.capture/smollm2.safetensors"); else args=(--grid "$g"); fi
  timeout -k 5 "${SAGE2_VAL_TIMEOUT:-85}" fa3-numerics validate --backend sage2 --device cuda "${args[@]}" \
    --out "/tmp/val-$g" 2>&1 | tail -n 40
  echo "== validate $g rc=${PIPESTATUS[0]} in $(( $(date +%s) - t ))s (elapsed $(( $(date +%s) - T0 ))s)"
  mkdir -p "$OUT/$g" && cp /tmp/val-$g/validation.nc /tmp/val-$g/validation.md "$OUT/$g/" 2>/dev/null
done
if [ -n "${SAGE2_TESTS:-}" ]; then
  timeout 120 python3 -m pytest -q tests/kernels/test_kernels_sage2.py 2>&1 | tail -n 15
fi
echo "== total $(( $(date +%s) - T0 ))s"; ls -lR "$OUT"
