"""The cache of finished impact runs (``OUT/.cells/``) and its code hash.

Exposed: ``CellStore``, ``code_version``, ``STUDY_MODULES``.

Every model pass of an impact study (a "cell": one plan of per-layer attention rules) is saved
as ``OUT/.cells/<key>.npz`` when it finishes, written to a temp file and renamed, so a file is
whole or absent. The key hashes everything that decides the numbers: the model's weights, the
token ids, the plan (full recipe specs, never labels), where the pass starts, backend, device
type, seed, and ``code_version`` (the run cache's ``code_key``: the sources that decide a
number, this study's modules, the backend's module, the text file's content, the library
versions and the GPU model). An interrupted study rerun with the same arguments loads its
finished cells and computes only the rest. A file that cannot be read (truncated by a kill,
say) is recomputed with a warning, never fatal.

The study holds its output folder as every command does (``engine.files.OutputFolder``, taken
in ``studies.impact``), so it never shares a folder with another command.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.cache import code_key
from ..engine.files import atomic_path

# The modules of this study that compute what a cell holds: the plan and passes, the model
# runner, the budget search's passes.
STUDY_MODULES = ("fa3_numerics.studies.impact", "fa3_numerics.studies.impact_model",
                 "fa3_numerics.studies.impact_budget")


def code_version(backend: str = "emulate", device: str = "cpu", text: str | os.PathLike | None = None) -> str:
    """The code part of every cell key of a study through ``backend`` on ``device``, with the
    ``--text`` file (if any) keyed by its content."""
    return code_key(backend=backend, device=device, study=STUDY_MODULES, inputs=[text] if text is not None else [])


class CellStore:
    """Finished cells on disk (``folder`` None: nothing is kept, every cell is computed)."""

    def __init__(self, folder: Path | None, context: dict, warn: Callable[[str], None] = print):
        self.dir = Path(folder) / ".cells" if folder is not None else None
        self.context = context
        self.warn = warn

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
        with atomic_path(self.dir / f"{key}.npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)

__all__ = ["CellStore", "code_version", "STUDY_MODULES"]
