#!/usr/bin/env bash
# Several device measurements in one call, their files packed into one archive ($OUT/batch.tgz.aa, .ab, ... in 15 MiB pieces),
# since at most 8 files come back from a call. Parts run in the order given in PARTS, each under
# its own time limit, so one that hangs or fails leaves the others' results:
#   sage1      validate --backend sage1 on the small and stress grids (tools/device/sage_h200.sh)
#   sage1cap   the same on the captured grid (.capture/smollm2.safetensors)
#   sage2      validate --backend sage2, small and stress (sage2_h200.sh; the package in .sage2build/)
#   sage2cap   the same on the captured grid
#   sagedump   dump_sage.py for the cases in SAGE1_DUMP / SAGE2_DUMP ("grid=CASE:HEAD ...")
#   holdout    field_holdout.sh (cudnn-fp8, torchao-fp8, SDPA backward on unseen data)
#   gpus       benchmarks/bench_gpus.py --gpus 1 (the one pinned dask worker path; .whl/dask/), GPUS_ARGS added
#   cudnnbwd   tools/device/cudnn_bwd_h200.py (cuDNN's FP8 backward against cudnn-fp8-kernel)
#   sdpahold   field_holdout.sh's SDPA part (flash BF16 fwd+bwd against sdpa-flash-bf16, two unseen cases)
#   cudnnval   field_holdout.sh's cuDNN part (validate --backend cudnn-fp8 --grid small)
#   dumpfield  tools/device/dump_field.py --parts $DUMP_PARTS (default cudnn-more)
#   val        fa3-numerics validate for each BACKEND:GRID in VAL (fp22: the presets' accumulator; VAL_S seconds each)
#   valb       fa3-numerics validate --backward for each BACKEND:GRID in VALB (VALB_MAXN: --max-seqlen; VALB_S seconds each)
#   sdpa       backward_h200.py --checks sdpa per case of SDPA_CASES (N:H:HKV:D:CAUSAL:SEED)
#   cudnncase  tools/device/dump_cudnn_case.py: cuDNN's FP8 forward bytes on validate's cases in CUDNN_CASES (small grid)
#   dumpbwd    tools/device/dump_backward_case.py --backend $DUMPB_BACKEND --grid $DUMPB_GRID $DUMPB_CASES (DUMPB_GRADS; DUMPB_ARGS added, e.g. --repeat 4)
#   mufu       tools/device/mufu_probe.py (exact outputs of ex2/lg2.approx for bit-exact CPU models)
# Device tool, from the checkout's root, e.g.
#   run(command="PARTS='sage1 sage2 sagedump' bash tools/device/batch_h200.sh", carry=[".whl", ".sage2build"])
# A warm machine keeps what earlier calls carried and installed, so a later call may carry other paths.
set -o pipefail
OUT=${OUT:-/tmp/batch-out}
W=/tmp/batch
rm -rf "$W" && mkdir -p "$W" "$OUT"
exec > >(tee "$W/batch.log") 2>&1
T0=$(date +%s)
step() { echo; echo "== [batch +$(( $(date +%s) - T0 ))s] $*"; }
step "set-up"
source tools/device/setup_device.sh || exit 3
export TRITON_CACHE_DIR=/tmp/tcache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
git log -1 --format='commit %H %s' 2>/dev/null || true
SAGE2_PKG=/tmp/sage2/pkg  # where sage2_h200.sh unpacks it too
sage2_ready() {
  [ -d "$SAGE2_PKG" ] || timeout 60 python3 tools/device/sage2_build.py unpack \
    --tar "${SAGE2_TAR:-.sage2build/sage2-sm90.tar.gz}" --pkg "$SAGE2_PKG"
}
dump() {  # backend, "grid=CASE:HEAD ..."
  local b=$1; shift
  for g in $(for x in $*; do echo "${x%%=*}"; done | sort -u); do
    # shellcheck disable=SC2046
    timeout 120 python3 tools/device/dump_sage.py --backend "$b" --grid "$g" --out "$W/dumps" \
      $(for x in $*; do [ "${x%%=*}" = "$g" ] && echo "${x#*=}"; done)
    echo "[batch] dump $b $g exit $?"
  done
}
for part in ${PARTS:-sage1 sage2}; do
  t=$(date +%s)
  # BATCH_BUDGET: no part starts past this many seconds, so the packing still runs inside the call's limit
  if [ -n "${BATCH_BUDGET:-}" ] && [ $(( t - T0 )) -gt "$BATCH_BUDGET" ]; then
    echo "[batch] SKIPPED part $part: past BATCH_BUDGET=${BATCH_BUDGET}s"; continue; fi
  step "part $part"
  case $part in
    sage1) SAGE_GRIDS="small stress" SAGE_KEEP=1 SAGE_TIMEOUT=150 OUT="$W/sage1" bash tools/device/sage_h200.sh ;;
    sage1cap) SAGE_GRIDS=captured SAGE_KEEP=1 SAGE_TIMEOUT=200 OUT="$W/sage1" bash tools/device/sage_h200.sh ;;
    sage2) SAGE2_VAL_TIMEOUT=120 OUT="$W/sage2" bash tools/device/sage2_h200.sh ;;
    sage2cap) SAGE2_GRIDS=captured SAGE2_VAL_TIMEOUT=200 OUT="$W/sage2" bash tools/device/sage2_h200.sh ;;
    sagedump)
      [ -n "${SAGE1_DUMP:-}" ] && dump sage1 $SAGE1_DUMP
      [ -n "${SAGE2_DUMP:-}" ] && sage2_ready && FA3N_SAGE2_PATH=$SAGE2_PKG dump sage2 $SAGE2_DUMP ;;
    holdout) OUT="$W/holdout" bash tools/device/field_holdout.sh ;;
    gpus)
      if ! python3 -c "import distributed" 2>/dev/null; then
        # only the wheels whose module the image lacks, so the image's own packages are not shadowed
        python3 - <<'EOF' > /tmp/dask-wheels.txt
import glob, importlib.util, os
mods = {"pyyaml": "yaml", "importlib_metadata": "importlib_metadata", "lazy_importer": "lazy_importer"}
for w in sorted(glob.glob(os.environ.get("FA3N_WHEELS", ".whl") + "/dask/*.whl")):
    dist = os.path.basename(w).split("-")[0].lower()
    if importlib.util.find_spec(mods.get(dist, dist)) is None:
        print(w)
EOF
        echo "[batch] dask wheels to install: $(wc -l < /tmp/dask-wheels.txt)"
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(cat /tmp/dask-wheels.txt) || true
      fi
      timeout "${GPUS_S:-240}" python3 benchmarks/bench_gpus.py --gpus 1 --out "$W/gpus" ${GPUS_ARGS:-} ;;
    cudnnbwd) timeout 120 python3 tools/device/cudnn_bwd_h200.py --out "$W/cudnn-bwd" ${CUDNNBWD_ARGS:-} ;;
    sdpahold) HOLDOUT_PARTS=sdpa OUT="$W/sdpa-hold" bash tools/device/field_holdout.sh ;;
    cudnnval) HOLDOUT_PARTS=cudnn OUT="$W/cudnn-val" bash tools/device/field_holdout.sh ;;
    val)  # VAL="BACKEND:GRID ..." (GRID small, stress or captured: .capture/smollm2.safetensors); VAL_ACC: --acc
      # (default: the backend's own accumulator models)
      for bg in ${VAL:-torchao-fp8:stress}; do
        b=${bg%%:*}; g=${bg#*:}
        if [ "$g" = captured ]; then args=(--dist "captured:.capture/smollm2.safetensors"); else args=(--grid "$g"); fi
        [ -n "${VAL_ACC:-}" ] && args+=(--acc "$VAL_ACC")
        timeout "${VAL_S:-150}" python3 -m fa3_numerics.cli validate --backend "$b" --device cuda "${args[@]}" \
          --format md --out "$W/val/$b-$g" 2>&1 | grep -v "^\s*$" | tail -n 40
        echo "[batch] val $b $g exit ${PIPESTATUS[0]}"
      done ;;
    valb)  # VALB="BACKEND:GRID ..." validate --backward (GRID small, stress, or captured: .capture/smollm2-grads.safetensors,
      # the capture's own dO); VALB_MAXN: --max-seqlen; VALB_S seconds each
      for bg in ${VALB:-cudnn-fp8:small}; do
        b=${bg%%:*}; g=${bg#*:}
        if [ "$g" = captured ]; then args=(--dist "captured:.capture/smollm2-grads.safetensors"); else args=(--grid "$g"); fi
        [ -n "${VALB_MAXN:-}" ] && args+=(--max-seqlen "$VALB_MAXN")
        timeout "${VALB_S:-150}" python3 -m fa3_numerics.cli validate --backward --backend "$b" --device cuda "${args[@]}" \
          --format md --out "$W/valb/$b-$g" 2>&1 | grep -v "^\s*$" | tail -n 40
        echo "[batch] valb $b $g exit ${PIPESTATUS[0]}"
      done ;;
    sdpa)  # SDPA_CASES="N:H:HKV:D:CAUSAL(0|1):SEED ...": backward_h200.py's SDPA check against sdpa-flash-bf16
      for c in ${SDPA_CASES:-2048:8:8:128:0:4}; do
        IFS=: read -r n h hkv d causal seed <<< "$c"
        extra=(); [ "$causal" = 1 ] && extra=(--causal)
        mkdir -p "$W/sdpa/n$n-h$h-kv$hkv-d$d-c$causal-s$seed"
        timeout 90 python3 tools/device/backward_h200.py --checks sdpa --seqlen "$n" --heads "$h" --kv-heads "$hkv" \
          --head-dim "$d" "${extra[@]}" --seeds "$seed" --sdpa-recipe sdpa-flash-bf16 --out "$W/sdpa/n$n-h$h-kv$hkv-d$d-c$causal-s$seed"
        echo "[batch] sdpa $c exit $?"
      done ;;
    cudnncase) timeout 150 python3 tools/device/dump_cudnn_case.py --grid small --out "$W/cudnncase" \
      ${CUDNN_CASES:-fp8-n2048-d128-h8-causal-p0.001s10-head fp8-n1000-d128-h8-causal-p0.001s10-head} ;;
    dumpbwd) timeout 150 python3 tools/device/dump_backward_case.py --backend "${DUMPB_BACKEND:-cudnn-fp8}" \
      --grid "${DUMPB_GRID:-small}" --grads "${DUMPB_GRADS:-dq,dk,dv}" --out "$W/dumpbwd" ${DUMPB_ARGS:-} ${DUMPB_CASES:-fp8-n333-d128-h8-p0.001s10-head} ;;
    mufu) timeout 120 python3 tools/device/mufu_probe.py --out "$W/mufu" ;;
    dumpfield) timeout "${DUMP_S:-200}" python3 tools/device/dump_field.py --parts "${DUMP_PARTS:-cudnn-more}" --out "$W/field" ;;
    *) echo "[batch] unknown part $part" ;;
  esac
  echo "[batch] part $part rc=$? in $(( $(date +%s) - t ))s"
  # the folders each part wrote, in the order the parts ran (the packing below keeps that priority)
  for d in "$W"/*/; do [ -d "$d" ] || continue; d=$(basename "$d"); grep -qxF "$d" "$W/.order" 2>/dev/null || echo "$d" >> "$W/.order"; done
done
step "pack"
ls -lR "$W" | head -80
# A call brings back 64 MiB at most: folders are packed in the order their parts ran while they fit
# PACK_MAX_MB (raw size: FP8 dumps hardly compress); a folder left out is named in the log.
keep=(batch.log); total=0; max=$(( ${PACK_MAX_MB:-60} * 1048576 ))
while IFS= read -r d; do
  sz=$(du -sb "$W/$d" | cut -f1)
  if [ $(( total + sz )) -le $max ]; then keep+=("$d"); total=$(( total + sz )); else echo "[batch] LEFT OUT $d ($sz bytes): over ${PACK_MAX_MB:-60} MiB"; fi
done < <(cat "$W/.order" 2>/dev/null)
echo "[batch] packing ${keep[*]} ($total bytes)"
# split: a file over 16 MiB does not come back (cat batch.tgz.* | tar -xz)
tar -C "$W" -cz "${keep[@]}" | split -b 15m - "$OUT/batch.tgz." && ls -la "$OUT"
