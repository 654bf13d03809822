"""Imports that a run's last steps need, done in a background thread while the run computes.

Exposed: ``SWITCH_INTERVAL``, ``prefetch``.

The caller names the modules (the command line: the report page of its study and what it imports).

Building and writing the dataset, the summary's BCa intervals and the report's figures import
xarray (with pandas), h5netcdf, scipy.stats and matplotlib: about 2 s on the 2-core CPU and on
the H200 machine, where the paper-shape Table 3 computes in about 2 s and so waits mostly on
imports. Torch releases the GIL inside its operations, so the imports proceed beside them (see
``SWITCH_INTERVAL``). A module that fails to import here (an optional
package missing) is left alone: the step that needs it imports it again and reports the error
with its fix. Not used when work is spread over forked processes (``--workers``): a fork while
this thread holds an import lock could leave the child waiting on it.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

# The interpreter's switch interval while the imports run. Torch releases the GIL around every
# operation; on a GPU a run is thousands of short launches, and with the default 5 ms each
# launch could wait that long for the importing thread to yield (the GPU Table 3 ran 0.5 s
# slower with it). At 0.2 ms that wait is negligible and the imports still proceed.
SWITCH_INTERVAL = 2e-4


# Prefetches running now, and the switch interval from before the first of them: a second
# prefetch started in the same process (commands called in-process, tests) must neither record
# the lowered interval as the one to restore nor restore it while the first still runs.
_ACTIVE = {"count": 0, "before": None}
_LOCK = threading.Lock()


def _load(modules: tuple[str, ...], interval: float) -> None:
    with _LOCK:
        if _ACTIVE["count"] == 0:
            _ACTIVE["before"] = sys.getswitchinterval()
        _ACTIVE["count"] += 1
        sys.setswitchinterval(min(_ACTIVE["before"], interval))
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the step that needs it raises with its own message
                pass
    finally:
        with _LOCK:
            _ACTIVE["count"] -= 1
            if _ACTIVE["count"] == 0:
                sys.setswitchinterval(_ACTIVE["before"])


def prefetch(modules: tuple[str, ...], interval: float = SWITCH_INTERVAL) -> threading.Thread:
    """Start importing ``modules`` in a daemon thread; return the thread (join it to wait). The
    switch interval is ``interval`` seconds until the imports end, then restored.
    ``FA3N_PREFETCH=0`` turns it off (the thread then imports nothing), to measure what it saves."""
    if os.environ.get("FA3N_PREFETCH", "1") == "0":
        modules = ()
    t = threading.Thread(target=_load, args=(tuple(modules), interval), name="fa3n-prefetch", daemon=True)
    t.start()
    return t


__all__ = ["SWITCH_INTERVAL", "prefetch"]
