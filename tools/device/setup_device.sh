#!/usr/bin/env bash
# Shared set-up of every device call (sourced by h200.sh and triton_h200.sh): install the carried
# wheels (.whl/: fa3-fwd for the FA3 kernel, h5netcdf for .nc files, gguf for GGUF models) and the
# project itself, so that fa3_numerics.kernels and fa3_numerics.experiments resolve through
# pyproject's package-dir mapping exactly as on a user's machine.
# A warm machine keeps /tmp between back-to-back calls: the wheels are installed once per set of
# wheels (the stamp lists their names and sizes), which saves ~30 s of each later call.
# FA3N_WHEELS names another folder of wheels (a subset, when a call must carry less than .whl/).
WHEELS=${FA3N_WHEELS:-.whl}
stamp=$(ls -l "$WHEELS"/*.whl 2>/dev/null | awk '{print $5, $NF}' | md5sum | cut -c1-16)
if [ "$(cat /tmp/site/.fa3n-wheels 2>/dev/null)" != "$stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 3
  echo "$stamp" > /tmp/site/.fa3n-wheels
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# The device image sets PYTHONDONTWRITEBYTECODE and ships no .pyc files, so every process would
# recompile ~960 modules (2.6 s of each command-line run); a user's machine caches bytecode.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip-e.log 2>&1 || {
  cat /tmp/pip-e.log; echo "pip install -e . failed on the device"; exit 3; }
python3 -c "import fa3_numerics.kernels.fa3, fa3_numerics.experiments" || exit 3
