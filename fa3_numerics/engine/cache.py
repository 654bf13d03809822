"""The cache of finished results: one ``.npz`` per (task, variant), keyed by everything that
decides it.

Exposed: ``numerics_version``, ``cache_key``, ``save``, ``load``.

A key hashes the inputs' description, the cell, the seed, the recipe's full spec, the shape,
the rows, the backend, the device kind, and the source of every module that decides a number
(``numerics_version``), so a cache made by other numerics is never reused. Files are written
whole or not at all; an unreadable file (truncated by a full disk, or by hand) is reported and
recomputed, never trusted and never fatal.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .files import atomic_path


@functools.lru_cache(maxsize=1)
def numerics_version() -> str:
    """Hash of the source of every module that decides a number (editing a docstring also
    invalidates the cache, which is harmless)."""
    pkg = Path(__file__).resolve().parents[1]
    kernels = Path(importlib.import_module("fa3_numerics.kernels").__file__).parent
    files = sorted([*(pkg / "numerics").rglob("*.py"), *(pkg / "data").rglob("*.py"), pkg / "engine" / "backends.py",
                    pkg / "engine" / "inputs.py", *kernels.glob("*.py")])
    h = hashlib.sha1()
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def cache_key(dist: str, cell: dict, seed: int, spec: str, *, batch: int, heads: int, kv_heads: int, rows: int,
              backend: str, device: str, extra: dict | None = None) -> str:
    """Hash of everything that determines one (cell, seed, variant) result."""
    payload = {"dist": dist, "cell": cell, "seed": seed, "spec": spec, "batch": batch, "heads": heads,
               "kv_heads": kv_heads, "rows": rows, "backend": backend, "device": device.split(":")[0], "v": 1,
               "code": numerics_version()}
    if extra:
        payload["extra"] = extra
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def save(path: Path, arrays: dict) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def load(path: Path, names: Iterable[str], warn: Callable[[str], None] = _warn) -> dict | None:
    """The arrays ``names`` of a cache file, or None when it is missing or unreadable (then
    the caller recomputes it; an unreadable file is reported through ``warn``)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            return {m: z[m] for m in names}
    except KeyError:
        return None  # written before a metric was added: recompute, nothing is wrong with it
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        warn(f"cached result {path.name} is unreadable ({type(exc).__name__}); recomputing it")
        path.unlink(missing_ok=True)
        return None
