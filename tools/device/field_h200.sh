#!/usr/bin/env bash
# One device call for the cudnn-fp8 and torchao-fp8 backends: install the carried wheels, list the
# backends, run `fa3-numerics validate` on the small grid for each (then the stress grid while the
# time budget lasts), and the GPU tests of tests/kernels/test_kernels_cudnn.py and tests/kernels/test_kernels_torchao.py.
# Everything goes to $OUT (field.log, one folder per validation: cudnn-small/, torchao-small/).
# Device tool, from the checkout's root:
#   run(command="bash tools/device/field_h200.sh", carry=[".whl"], timeout_s=600)
# .whl/ (git-ignored): fa3_fwd-0.0.3 (FA3 kernel), nvidia_cudnn_frontend-1.32.0 (cp312), torchao-0.18.0
# (abi3), h5netcdf, gguf. Time limits (seconds): FIELD_SMALL_S per small grid (default 100),
# FIELD_TESTS_S for the GPU tests (70); FIELD_STRESS=1 adds the stress grids within FIELD_BUDGET
# (the whole call, default 540). A validation cut by its limit writes no dataset, but each finished
# case's F is in the log.
set -o pipefail
OUT=${OUT:-/tmp/field-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/field.log") 2>&1
T0=$(date +%s)
BUDGET=${FIELD_BUDGET:-540}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() { echo; echo "== [field +$(( $(date +%s) - T0 ))s] $*"; }

step "machine"
python3 -V
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"

step "wheels (one at a time: a wheel this Python cannot take is reported, not fatal)"
for w in .whl/*.whl; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
    || echo "[field] could not install $w"
done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
# kernels/ installs as fa3_numerics.kernels (pyproject's package-dir): an editable install resolves it.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip-e.log 2>&1 \
  || { cat /tmp/pip-e.log; echo "[field] pip install -e . failed"; exit 3; }
if command -v fa3-numerics >/dev/null; then FA3N=(fa3-numerics); else FA3N=(python3 -m fa3_numerics.cli); fi

step "imports"
python3 -c "import cudnn; print('cudnn-frontend', cudnn.__version__, 'backend', cudnn.backend_version())" 2>&1 | tail -n 3
python3 -c "import torchao, triton; print('torchao', torchao.__version__, 'triton', triton.__version__)" 2>&1 | tail -n 3
"${FA3N[@]}" backends --device cuda 2>&1 | grep -A2 -E "^  (fa3|cudnn-fp8|torchao-fp8) " | cut -c1-400

run_grid() {  # backend grid seconds
  local b=$1 g=$2 t=$3
  if [ "$t" -lt 20 ]; then echo "[field] no time left for $b $g"; return; fi
  step "validate --backend $b --grid $g (limit ${t}s)"
  timeout "$t" "${FA3N[@]}" validate --backend "$b" --device cuda --grid "$g" --out "$OUT/${b%%-*}-$g" 2>&1 \
    | grep -v "^\s*$" | tail -n 45
  echo "[field] exit ${PIPESTATUS[0]}"
}
# The GPU tests first: they say quickly whether each path runs, with tracebacks where not.
step "GPU tests"
timeout "${FIELD_TESTS_S:-70}" python3 -m pytest -q -rs -s -p no:cacheprovider \
  tests/kernels/test_kernels_cudnn.py tests/kernels/test_kernels_torchao.py 2>&1 | tail -n 60
run_grid cudnn-fp8 small "${FIELD_SMALL_S:-100}"
run_grid torchao-fp8 small "${FIELD_SMALL_S:-100}"

if [ "${FIELD_STRESS:-0}" != 0 ]; then
  run_grid cudnn-fp8 stress $(( $(left) / 2 - 10 ))
  run_grid torchao-fp8 stress $(( $(left) - 15 ))
fi
step "done"
ls -R "$OUT" | head -n 40
