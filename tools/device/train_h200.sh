#!/usr/bin/env bash
# `fa3-numerics train` on the H200 in one call (<= 9 minutes): SmolLM2-135M, fa3-fp8-bwd-bf16
# against exact, as many of 300 steps as fit (train_h200.py measures the step time first and says
# how many it runs); results in $OUT/train, the resumable run folder in /tmp/train-run.
# Needs the staged model and wheels of impact_h200.py (its `split` here, its `stage` calls there,
# back to back on the warm machine), then:
# Device tool: run(command="bash tools/device/train_h200.sh", timeout_s=600)
set -o pipefail
if [ ! -d .whl ] && [ -d /tmp/stage/files ]; then mkdir -p .whl && cp /tmp/stage/files/*.whl .whl/; fi
source tools/device/setup_device.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # cuBLAS picks one reduction order: reruns and resumes compare bit for bit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/train"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/train/log.txt"
python3 tools/device/train_h200.py --out "$OUT/train" "$@" 2>&1 | grep -v "it/s]" | tee -a "$OUT/train/log.txt"
