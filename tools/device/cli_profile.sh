#!/usr/bin/env bash
# Where the command-line Table 3's time goes on the device: phase and per-variant timings of
# repeated runs (FA3N_TIMINGS, which synchronizes the GPU at each step); the report written by a
# forked process (default), in this process with its imports in a thread (FA3N_FORKS=0)
# or after the runs (and FA3N_PREFETCH=0); import times; CUDA's start.
# Device tool: run(command="bash tools/device/cli_profile.sh", carry=[".whl"], timeout_s=300)
source tools/device/setup_device.sh
OUT=${OUT:-/tmp/cliprof}; mkdir -p "$OUT"
ARGS="run outliers --p 0.001 --device cuda --rows 0 --batch 2 --heads 16 --seqlen 8192 --out /tmp/t3cli --fresh"
fa3-numerics $ARGS >/dev/null 2>&1  # first run: cold caches, bytecode
runs() {  # $1: label; the rest: environment
  local label=$1; shift
  for i in 1 2 3; do
    s=$(date +%s.%N); env "$@" fa3-numerics $ARGS 2>&1 >/dev/null | grep timings | sed "s/^/[$label] /"; e=$(date +%s.%N)
    python3 -c "print('[$label] wall %.2f s' % ($e - $s))"
  done
}
{ runs plain FA3N_X=1; runs timings FA3N_TIMINGS=1; runs one-process FA3N_TIMINGS=1 FA3N_FORKS=0; runs no-prefetch FA3N_TIMINGS=1 FA3N_FORKS=0 FA3N_PREFETCH=0; } | tee "$OUT/phases.txt"
python3 -X importtime -c "import fa3_numerics.cli as c; c.app" 2> "$OUT/importtime.txt"
python3 - <<'PY' | tee "$OUT/cuda_start.txt"
import time, threading
from fa3_numerics.engine.cuda_start import start_cuda_early
t0 = time.perf_counter(); th = start_cuda_early(["--device", "cuda"]); import torch; t1 = time.perf_counter()
th.join(); t2 = time.perf_counter(); torch.empty(1, device="cuda"); torch.cuda.synchronize(); t3 = time.perf_counter()
print(f"driver start beside torch's import: import {t1-t0:.3f}  then waited {t2-t1:.3f}  first tensor {t3-t2:.3f}")
PY
python3 - <<'PY' | tee -a "$OUT/cuda_start.txt"
import time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
torch.empty(1, device="cuda"); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"no early start: import {t1-t0:.3f}  first tensor {t2-t1:.3f}")
PY
