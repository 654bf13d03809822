#!/usr/bin/env bash
# Re-validate the presets fitted on dump_field.py's dumps (cudnn-fp8-fwd, torchao-fp8, sdpa-flash-bf16) on data
# the fit never saw: validate's small grid on the GPU's own draw (Philox, 8 heads, n 333-2048, d 64-256, GQA,
# causal, Hadamard, other outlier strengths) for cuDNN and torchao, and SDPA's flash forward + backward on new
# seeds and shapes (GQA 8/2 at n=1024 d=128; causal d=64 at n=768) through backward_h200.py's check.
# Device tool, from the checkout's root (about 2 minutes):
#   run(command="bash tools/device/field_holdout.sh", carry=[".whl"], timeout_s=300)
# HOLDOUT_PARTS="cudnn torchao sdpa" (the default) or a subset runs only those parts.
# Returns 7 files: holdout.log, cudnn/validation.{md,nc}, torchao/validation.{md,nc}, bwd_gqa/backward_h200.json,
# bwd_causal/backward_h200.json.
set -o pipefail
OUT=${OUT:-/tmp/holdout-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/holdout.log") 2>&1
T0=$(date +%s)
step() { echo; echo "== [holdout +$(( $(date +%s) - T0 ))s] $*"; }
step "set-up"
source tools/device/setup_device.sh
export TRITON_CACHE_DIR=/tmp/tcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
WORK=/tmp/holdout-work
mkdir -p "$WORK"
# HOLDOUT_PARTS: a subset of "cudnn torchao sdpa" (default: all three)
PARTS=" ${HOLDOUT_PARTS:-cudnn torchao sdpa} "
for b in cudnn torchao; do
  [[ "$PARTS" == *" $b "* ]] || continue
  step "validate --backend $b-fp8 --grid small"
  timeout "${HOLDOUT_VALIDATE_S:-75}" python3 -m fa3_numerics.cli validate --backend "$b-fp8" --device cuda --grid small \
    --out "$WORK/$b" 2>&1 | grep -v "^\s*$" | tail -n 40
  echo "[holdout] exit ${PIPESTATUS[0]}"
  mkdir -p "$OUT/$b"
  cp "$WORK/$b/validation.md" "$WORK/$b/validation.nc" "$OUT/$b/" 2>/dev/null || echo "[holdout] no dataset for $b"
done
if [[ "$PARTS" == *" sdpa "* ]]; then
step "SDPA flash BF16 forward + backward against sdpa-flash-bf16: GQA 8/2, n 1024, d 128, seed 2"
mkdir -p "$OUT/bwd_gqa" "$OUT/bwd_causal"
timeout "${HOLDOUT_BWD_S:-60}" python3 tools/device/backward_h200.py --checks sdpa --seqlen 1024 --heads 8 --kv-heads 2 \
  --head-dim 128 --seeds 2 --sdpa-recipe sdpa-flash-bf16 --out "$OUT/bwd_gqa"
echo "[holdout] exit $?"
step "the same, causal, 4 heads, n 768, d 64, seed 3"
timeout "${HOLDOUT_BWD_S:-60}" python3 tools/device/backward_h200.py --checks sdpa --seqlen 768 --heads 4 --kv-heads 4 \
  --head-dim 64 --causal --seeds 3 --sdpa-recipe sdpa-flash-bf16 --out "$OUT/bwd_causal"
echo "[holdout] exit $?"
fi
step "done"
