"""The cache of finished impact runs (``OUT/.cells/``), the output folder's lock, the code hash.

Exposed: ``CellStore``, ``code_version``, ``atomic_write_bytes``.

Every model pass of an impact study (a "cell": one plan of per-layer attention rules) is saved
as ``OUT/.cells/<key>.npz`` when it finishes, written to a temp file and renamed, so a file is
whole or absent. The key hashes everything that decides the numbers: the model's weights, the
token ids, the plan (full recipe specs, never labels), where the pass starts, backend, device
type, seed, the source of every module that computes a number, and the torch and transformers
versions. An interrupted study rerun with the same arguments loads its finished cells and
computes only the rest. A file that cannot be read (truncated by a kill, say) is recomputed
with a warning, never fatal.

One study at a time per folder: ``lock()`` takes an exclusive ``flock`` on ``OUT/.cells/.lock`` (inside
the git-ignored cache folder, so a report folder never gains a stray file) and a
second study into the same ``--out`` stops with a one-line error instead of mixing results.
Temp files that a killed run left behind are removed once the lock is held (nobody else can
be writing them then).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import UsageError


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the source of every module that decides an impact number: the numerics core, the
    capture code (it builds the model), the backends and kernels, and the model runner."""
    import importlib

    pkg = Path(__file__).resolve().parents[1]
    files = [*(pkg / "numerics").glob("*.py"), pkg / "data" / "capture.py", pkg / "engine" / "backends.py",
             pkg / "studies" / "impact_model.py"]
    try:
        files += list(Path(importlib.import_module("fa3_numerics.kernels").__file__).parent.glob("*.py"))
    except ImportError:  # the kernels package is optional for emulate-only installs
        pass
    h = hashlib.sha1()
    for f in sorted(files):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``path`` whole or not at all: temp file in the same folder, then rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class CellStore:
    """Finished cells on disk (``folder`` None: nothing is kept, every cell is computed)."""

    def __init__(self, folder: Path | None, context: dict, warn: Callable[[str], None] = print):
        self.dir = Path(folder) / ".cells" if folder is not None else None
        self.context = context
        self.warn = warn
        self._lock_fd = None

    def key(self, payload: dict) -> str:
        body = json.dumps({"context": self.context, "cell": payload, "v": 1}, sort_keys=True, default=str)
        return hashlib.sha1(body.encode()).hexdigest()[:24]

    def get(self, key: str) -> dict | None:
        if self.dir is None:
            return None
        path = self.dir / f"{key}.npz"
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except Exception as exc:  # noqa: BLE001 - any unreadable file is recomputed
            self.warn(f"warning: cached cell {path.name} is unreadable ({type(exc).__name__}); recomputing it")
            path.unlink(missing_ok=True)
            return None

    def put(self, key: str, arrays: dict) -> None:
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".npz.tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.replace(tmp, self.dir / f"{key}.npz")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def lock(self, out: Path) -> None:
        """Exclusive lock on ``out``/.cells/.lock for this process's lifetime (released by ``unlock``)."""
        import fcntl

        (out / ".cells").mkdir(parents=True, exist_ok=True)
        fd = os.open(out / ".cells" / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UsageError(f"another impact study is writing {out} (its .cells/.lock is held); wait for it to "
                             "finish or pass another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        # Holding the lock, any temp file here was left by a killed run: remove it.
        for stale in [*out.glob(".*.tmp"), *out.glob("figures/.*.tmp"), *(out / ".cells").glob(".*.tmp")]:
            stale.unlink(missing_ok=True)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            import fcntl

            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


__all__ = ["CellStore", "code_version", "atomic_write_bytes"]
