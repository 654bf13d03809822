#!/usr/bin/env bash
# --device-map on one GPU (the N = 1 run of the sharding path): impact on the staged SmolLM2 with
# every layer's attention emulated on the H200, once as one model on cuda and once dispatched by
# accelerate (`--device-map auto`: every layer on cuda:0, through the hooks a multi-GPU map uses);
# the two datasets must hold the same numbers bit for bit (benchmarks/check_outputs.py).
# Needs the model staged by impact_h200.py stage (/tmp/stage/files) and the wheels in .whl.
# Device tool: run(command="bash tools/device/device_map_h200.sh", timeout_s=300)
set -o pipefail
source tools/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/device-map"
MODEL=/tmp/stage/files/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || { echo "error: $MODEL is not staged (impact_h200.py stage)"; exit 2; }
ARGS=(impact --model "$MODEL" --tokens 256 --variants exact,fa3-fp8-kernel,fa3-fp8-kernel-hadamard --no-sweep
      --decode head --no-baselines --device cuda --format md --fresh)
for run in plain map; do
  extra=(); [ $run = map ] && extra=(--device-map auto)
  s=$(date +%s.%N)
  fa3-numerics "${ARGS[@]}" "${extra[@]}" --out /tmp/dm-$run 2>&1 | tail -n 4
  echo "[$run] wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s"
done 2>&1 | tee "$OUT/device-map/log.txt"
python3 benchmarks/check_outputs.py /tmp/dm-plain/impact.nc /tmp/dm-map/impact.nc --ignore-attr device_map \
  --ignore-attr kind --ignore-attr findings 2>&1 | tee -a "$OUT/device-map/log.txt"
echo "check_outputs rc=${PIPESTATUS[0]}" | tee -a "$OUT/device-map/log.txt"
