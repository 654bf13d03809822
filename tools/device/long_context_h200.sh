#!/usr/bin/env bash
# One device call for `fa3-numerics run long-context` on the H200: needle retrieval at 8K..128K (and
# 256K while time is left) in prefill, decode and split-KV decode, for the FA3 kernel (fa3-fwd, with
# num_splits) beside the emulator's fp22, fp32, two-level and flush=2/4/16.
# Device tool, from the checkout's root:
#   run(command="bash tools/device/long_context_h200.sh", carry=[".whl"], timeout_s=360)
# .whl/ (git-ignored): fa3_fwd-0.0.3 (the FA3 kernel), h5netcdf (the .nc file).
# Expected (estimated from the emulator's ~260 PyTorch ops per KV tile at ~7 us each on the GPU and
# the tile counts): setup ~40 s, stage 1 ~25 s, stage 2 ~50 s, stage 3 (256K) ~160 s: about 4.5 min.
# The study runs in stages into one cache (/tmp/lc/.cells), so each stage computes only its new
# lengths; after every stage the dataset and report are copied to $OUT/long-context (7 files:
# long_context.nc, report.md, report.html, needle_share.png/.svg, run.log; and cells.tgz, the cell cache). A stage cut by the time
# budget (LC_BUDGET seconds for the whole call, default 330) leaves the previous stage's files.
# CPU rehearsal (no GPU, a stand-in kernel, tiny sizes): LC_DRY=1 bash tools/device/long_context_h200.sh
set -o pipefail
OUT=${OUT:-/tmp/lc-out}
DEST="$OUT/long-context"
mkdir -p "$DEST"
exec > >(tee "$DEST/run.log") 2>&1
T0=$(date +%s)
BUDGET=${LC_BUDGET:-330}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() { echo; echo "== [long-context +$(( $(date +%s) - T0 ))s] $*"; }

if [ "${LC_DRY:-0}" != 0 ]; then
  FA3N=(python3 -m fa3_numerics.cli)
  COMMON=(--device cpu --kernel fa3-mock --weights 0.05,0.2 --depths 0.1,0.9 --seeds 0 --sinks 0,0.4
          --heads 1 --head-dim 64 --flush 4)
  STAGES=("1024,2048" "1024,2048,4096" "1024,2048,4096,8192")
else
  step "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  step "setup (carried wheels, the project)"
  source tools/device/setup_device.sh || exit 3
  export TRITON_CACHE_DIR=/tmp/tcache
  # the FP8 K and V of one cell (1.2 GB each at 128K x 36 configurations) shared by every recipe
  export FA3N_PREP_CACHE_MB=8192
  if command -v fa3-numerics >/dev/null; then FA3N=(fa3-numerics); else FA3N=(python3 -m fa3_numerics.cli); fi
  # 36 configurations (3 weights x 3 depths x 4 seeds) in one batch up to 128K keys (9.7 GB per
  # float64 K or V), two batches at 256K.
  COMMON=(--device cuda --kernel fa3 --weights 0.02,0.05,0.2 --depths 0.1,0.5,0.9 --seeds 0,1,2,3
          --sinks 0,0.4 --heads 2 --head-dim 128 --rows 8 --flush 2,4,16 --batch-keys 4718592)
  STAGES=("8192,32768" "8192,32768,131072" "8192,32768,131072,262144")
fi
# Overrides: LC_STAGES="8192,32768 8192,32768,131072" (space between stages), LC_ARGS (extra options).
if [ -n "${LC_STAGES:-}" ]; then read -r -a STAGES <<< "$LC_STAGES"; fi
# shellcheck disable=SC2206
COMMON+=(${LC_ARGS:-})
# the seconds a stage must have left to start: the last (256K) needs about twice the 128K stage
NEED=(30 60 150)

if [ -n "${LC_CELLS:-}" ] && [ -f "$LC_CELLS" ]; then
  mkdir -p /tmp/lc && tar -xzf "$LC_CELLS" -C /tmp/lc && echo "[long-context] resumed the cell cache of $LC_CELLS"
fi
for i in "${!STAGES[@]}"; do
  t=$(left)
  if [ "$t" -lt "${NEED[$i]}" ]; then echo "[long-context] ${t}s left: stage ${STAGES[$i]} skipped"; break; fi
  step "stage $((i + 1)): lengths ${STAGES[$i]} (limit ${t}s)"
  timeout "$t" "${FA3N[@]}" run long-context "${COMMON[@]}" --lengths "${STAGES[$i]}" --out /tmp/lc --format html,md
  rc=$?
  echo "[long-context] exit $rc"
  if [ "$rc" != 0 ] && [ "$rc" != 3 ]; then break; fi
  cp /tmp/lc/long_context.nc /tmp/lc/report.md /tmp/lc/report.html "$DEST/" 2>/dev/null
  cp /tmp/lc/figures/needle_share.png /tmp/lc/figures/needle_share.svg "$DEST/" 2>/dev/null
done
# the copied report.md points at figures/: the figure lies beside it in $DEST
sed -i 's#(figures/needle_share#(needle_share#; s#`figures/needle_share#`needle_share#' "$DEST/report.md" 2>/dev/null
# The cell cache comes back too (when it fits one returned file): cells a stage finished before the
# time budget cut it are then not lost with the machine. To resume from it in a later call, carry it
# and unpack it first: tar -xzf cells.tgz -C /tmp/lc (LC_CELLS=path/cells.tgz does that).
if [ -d /tmp/lc/.cells ]; then
  tar -C /tmp/lc -czf /tmp/lc-cells.tgz .cells && size=$(stat -c %s /tmp/lc-cells.tgz) && \
    if [ "$size" -lt $((15 * 1024 * 1024)) ]; then cp /tmp/lc-cells.tgz "$DEST/cells.tgz"; \
    else echo "[long-context] the cell cache is $((size / 1048576)) MiB: over what a returned file may be, not copied"; fi
fi
step "done"
ls -la "$DEST"
