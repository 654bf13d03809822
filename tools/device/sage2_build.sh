#!/usr/bin/env bash
# Build SageAttention 2's Hopper kernels on the device (the _qattn_sm90 and _fused extensions only,
# sm_90a only, MAX_JOBS=16, the two extensions at once), smoke-test `sageattn` against float64
# attention, and return the built package as $OUT/sage2-sm90.tar.gz for later calls to carry
# (tools/device/sage2_h200.sh). Every step is bounded by `timeout` so that the call ends within
# ~9 minutes even if the build hangs; the last lines say how far it got.
#
# Device tool: run(command="bash tools/device/sage2_build.sh", carry=[".sage2src"], timeout_s=600)
# .sage2src/ (git-ignored): csrc/, sageattention/ (no sageattention3_blackwell, assets, examples),
# setup.py and SOURCE exported from thu-ml/SageAttention (see SOURCE for the commit).
# Env: SAGE2_FULL=1 builds all 64 kernel instances instead of the 16 sageattn reaches on sm90;
# SAGE2_BUILD_TIMEOUT (s, default 390); SAGE2_DRY=1 prints the steps' flags without compiling.
set -o pipefail
OUT=${OUT:-/tmp/sage2-out}
WORK=${SAGE2_WORK:-/tmp/sage2}
SRC=${SAGE2_SRC:-.sage2src}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/build.log"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="$WORK/torch_ext" TRITON_CACHE_DIR=/tmp/tcache
T0=$(date +%s)
STAGE="start"
step() {  # step NAME TIMEOUT_S CMD...: run, log, time; the call's last line names the step reached
  local name=$1 lim=$2; shift 2
  local t=$(date +%s)
  echo "== $name (timeout ${lim}s) at +$((t - T0))s: $*" | tee -a "$LOG"
  timeout -k 5 "$lim" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t ))s (elapsed $(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo "== $name TIMED OUT after ${lim}s" | tee -a "$LOG"
  return $rc
}
finish() {
  echo "== reached: $STAGE; total $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
  grep -E "error|Error|FAILED|sage2_build" "$LOG" | grep -v -E "Xptxas|diag-suppress|0 error" | tail -n 40
  ls -l "$OUT"
  exit "${1:-0}"
}
[ -d "$SRC/csrc" ] || { echo "error: no $SRC/csrc: carry the exported SageAttention sources (.sage2src)"; exit 2; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -n 2;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  nproc; cat "$SRC/SOURCE"; } 2>&1 | tee -a "$LOG"
FULL=(); [ -n "${SAGE2_FULL:-}" ] && FULL=(--full)
DRY=(); [ -n "${SAGE2_DRY:-}" ] && DRY=(--dry)
BT=${SAGE2_BUILD_TIMEOUT:-390}

# the two extensions build at once (the sm90 kernel file is one translation unit: the long pole)
STAGE="build"
step ext-qattn_sm90 "$BT" python3 tools/device/sage2_build.py ext qattn_sm90 --src "$SRC" --work "$WORK" "${FULL[@]}" "${DRY[@]}" &
P1=$!
step ext-fused "$BT" python3 tools/device/sage2_build.py ext fused --src "$SRC" --work "$WORK" "${DRY[@]}" &
P2=$!
wait $P1; R1=$?
wait $P2; R2=$?
[ $R1 -eq 0 ] && [ $R2 -eq 0 ] || { grep -E -B2 -A8 "error" "$LOG" | head -n 80; finish 3; }
[ -n "${SAGE2_DRY:-}" ] && { STAGE="dry run (flags only)"; finish 0; }
STAGE="package"
step package 60 python3 tools/device/sage2_build.py package --src "$SRC" --work "$WORK" --out "$OUT" || finish 3
STAGE="smoke"
step smoke 120 python3 tools/device/sage2_build.py smoke --pkg "$WORK/pkg" --out "$OUT" || finish 3
STAGE="done (built, packaged, smoke-tested)"
finish 0
