"""The cache of finished results: one ``.npz`` per (task, variant), keyed by everything that
decides it.

Exposed: ``NUMBER_SOURCES``, ``VERSIONED``, ``code_key``, ``code_parts``, ``dist_key``, ``file_sha256``, ``numerics_version``,
``cache_key``, ``save``, ``load``, ``CellStore``.

A key hashes the inputs' description, the cell, the seed, the recipe's full spec, the shape,
the rows, the backend, the device kind, and ``code_key``: what else decides a number. Every
study's cache (``run``, ``run ablation``, ``impact``) takes its code part from ``code_key``:

- the source of ``NUMBER_SOURCES``, a declared list of package files and folders (declared,
  not found by following imports: many imports are lazy or found at run time), among them the
  C source of the compiled fast paths; the report (``report/``, its templates) is not in it;
- the study's own modules (the caller names them) and the backend's own module, or the whole
  package when the module lives in one of its own (``kernels/triton_/``), and no other
  backend's module;
- the content of input files (a capture, a text), never their path, so capturing again to
  the same path is a new key;
- the versions of the libraries that compute numbers (``VERSIONED``; an absent one is recorded
  as absent) and, on a GPU, the GPU's model (cuBLAS and the kernels pick code per model).

A cache made by other numerics is therefore never reused. Files are written whole or not at
all; an unreadable file (truncated by a full disk, or by hand) is reported and recomputed,
never trusted and never fatal.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .files import atomic_path

PACKAGE = "fa3_numerics"
KERNELS = f"{PACKAGE}.kernels"

# Sources that can decide a number, relative to the package folder: (folder, glob) pairs are
# searched recursively, plain names are one file. Add a module here when results depend on it.
NUMBER_SOURCES: tuple[str | tuple[str, str], ...] = (
    ("numerics", "*.py"), ("numerics", "*.c"), ("numerics", "*.h"),  # formats, recipes, keys/, metrics/, C
    ("data", "*.py"),  # distributions, captures, model loading
    "engine/sampling.py",  # which query rows are measured
    "engine/inputs.py",  # how inputs are drawn and checked
    "engine/backends.py",  # the backend registry and the emulate backend
    "engine/runner.py",  # the reference and the metrics of every job
)

# Distributions whose installed version decides numbers (the metadata name, not the module).
VERSIONED = ("torch", "numpy", "triton", "fa3-fwd", "flash_attn_3", "transformers")


# -- hashing ----------------------------------------------------------------------------------

_DIGESTS: dict[tuple, str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's content, read in chunks; remembered for the process by (path, inode,
    size, mtime), so a large capture is read once and a file replaced by a rename is read again."""
    st = os.stat(path)
    memo = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    digest = _DIGESTS.get(memo)
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        digest = _DIGESTS[memo] = h.hexdigest()
    return digest


def _roots(root: str | os.PathLike | None) -> tuple[Path, Path | None]:
    """(package folder, kernels folder or None). ``root`` holds ``fa3_numerics/`` and the
    kernels as ``kernels/`` (a checkout) or ``fa3_numerics/kernels/`` (an installed wheel)."""
    if root is not None:
        pkg = Path(root) / PACKAGE
        kernels = next((k for k in (Path(root) / "kernels", pkg / "kernels") if k.is_dir()), None)
        return pkg, kernels
    pkg = Path(__file__).resolve().parents[1]
    try:
        spec = importlib.util.find_spec(KERNELS)
    except ImportError:
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return pkg, (Path(locations[0]) if locations else None)  # emulate-only installs have no kernels


def _module_path(name: str, pkg: Path, kernels: Path | None) -> Path | None:
    """The source file of module ``name`` under the roots (a package: its ``__init__.py``);
    a module outside this package is looked up without importing it."""
    if name == KERNELS or name.startswith(KERNELS + "."):
        if kernels is None:
            return None
        base, rest = kernels, name[len(KERNELS):].lstrip(".")
    elif name == PACKAGE or name.startswith(PACKAGE + "."):
        base, rest = pkg, name[len(PACKAGE):].lstrip(".")
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        return Path(spec.origin) if spec is not None and spec.origin and os.path.isfile(spec.origin) else None
    stem = base.joinpath(*rest.split(".")) if rest else base
    for cand in (stem.with_suffix(".py"), stem / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _backend_files(backend: str, pkg: Path, kernels: Path | None) -> tuple[list[Path], str]:
    """The files of ``backend``'s module: the module alone, or its whole package when that is a
    package of its own (not the kernels folder, not the engine); and how the module was named."""
    from .backends import BACKENDS, names

    if backend not in names():
        return [], f"unregistered {backend}"
    module = BACKENDS[backend][1].partition(":")[0]
    path = _module_path(module, pkg, kernels)
    if path is None:
        return [], f"{module} (not found)"
    folder = path.parent
    shared = {pkg, pkg / "engine", *([kernels] if kernels is not None else [])}
    if folder not in shared and (folder / "__init__.py").is_file():
        return sorted(folder.rglob("*.py")), module
    return [path], module


def _declared_files(pkg: Path) -> list[Path]:
    files = []
    for item in NUMBER_SOURCES:
        if isinstance(item, tuple):
            files += (pkg / item[0]).rglob(item[1])
        else:
            files.append(pkg / item)
    return files


def _sources_hash(files: Iterable[Path], bases: list[Path]) -> str:
    """Hash of each file's path (relative to its root, so two checkouts agree) and content."""
    h = hashlib.sha256()
    for f in sorted({Path(f) for f in files if Path(f).is_file()}):
        rel = next((f.relative_to(b.parent) for b in bases if f.is_relative_to(b)), f)
        h.update(f"{rel.as_posix()}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def _versions() -> dict[str, str | None]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _device_model(device: str) -> str | None:
    """The GPU model(s) ``device`` runs on (None on the CPU); ``cuda`` without an index may
    spread over every visible GPU, so it names them all."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    index = device.partition(":")[2]
    ids = [int(index)] if index.isdigit() else range(torch.cuda.device_count())
    return ", ".join(sorted({torch.cuda.get_device_name(i) for i in ids}))


def code_parts(*, backend: str, device: str = "cpu", study: Iterable[str] = (),
               root: str | os.PathLike | None = None) -> dict:
    """What ``code_key`` hashes besides input files, by part (to see why two keys differ)."""
    study = tuple(sorted(set(study)))
    pkg, kernels = _roots(root)
    bases = [pkg, *([kernels] if kernels is not None else [])]
    study_files = [p for p in (_module_path(m, pkg, kernels) for m in study) if p is not None]
    missing = sorted(m for m in study if _module_path(m, pkg, kernels) is None)
    backend_files, backend_module = _backend_files(backend, pkg, kernels)
    return {"sources": _sources_hash(_declared_files(pkg), bases),
            "study": _sources_hash(study_files, bases), "study_missing": missing,
            "backend": backend, "backend_module": backend_module,
            "backend_sources": _sources_hash(backend_files, bases),
            "versions": _versions(), "device": device.split(":")[0], "device_model": _device_model(device)}


@functools.lru_cache(maxsize=None)
def _installed_code_parts(backend: str, device: str, study: tuple[str, ...]) -> str:
    # Once per process: the process computes with the code it imported, so a source file edited
    # while it runs must not change the key of what it computes.
    return json.dumps(code_parts(backend=backend, device=device, study=study), sort_keys=True)


def code_key(*, backend: str, device: str = "cpu", study: Iterable[str] = (), inputs: Iterable = (),
             root: str | os.PathLike | None = None) -> str:
    """The code part of a cache key: a hash of everything besides the cell that decides a result
    of ``study`` (module names, e.g. ``(__name__,)``) through ``backend`` on ``device``, with
    ``inputs`` (file paths) keyed by their content. See the module docstring for what it covers.

    ``root`` hashes another copy of the package (a folder holding ``fa3_numerics/`` and
    ``kernels/``) instead of the one running; it is hashed afresh on every call."""
    study = tuple(sorted(set(study)))
    parts = (_installed_code_parts(backend, device, study) if root is None
             else json.dumps(code_parts(backend=backend, device=device, study=study, root=root), sort_keys=True))
    h = hashlib.sha256(parts.encode())
    for path in inputs:
        h.update(f"\0input {file_sha256(path) if os.path.isfile(path) else 'missing ' + os.fspath(path)}".encode())
    return h.hexdigest()[:16]


def dist_key(dist: str) -> str:
    """``dist`` as a key: a family's argument that names a file (``captured:FILE``,
    ``capture-file:FILE@layer=3``) is replaced by the file's sha256, so the same path holding new
    data is a new key and the same data at another path is the same key."""
    head, colon, arg = dist.partition(":")
    if not colon:
        return dist
    for path, at, suffix in ((arg, "", ""), arg.rpartition("@")):
        if path and os.path.isfile(path):
            return f"{head}:sha256={file_sha256(path)}{at}{suffix}"
    return dist


def numerics_version() -> str:
    """The code part of the emulator's keys on the CPU, for scripts that record it."""
    return code_key(backend="emulate")


def cache_key(dist: str, cell: dict, seed: int, spec: str, *, batch: int, heads: int, kv_heads: int, rows: int,
              backend: str, device: str, study: Iterable[str], extra: dict | None = None) -> str:
    """Hash of everything that determines one (cell, seed, variant) result of ``study`` (the
    study's module names: ``code_key``)."""
    payload = {"dist": dist_key(dist), "cell": cell, "seed": seed, "spec": spec, "batch": batch, "heads": heads,
               "kv_heads": kv_heads, "rows": rows, "backend": backend, "device": device.split(":")[0], "v": 2,
               "code": code_key(backend=backend, device=device, study=study)}
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


def study_cells(folder, context: dict, study_modules, warn: Callable[[str], None] = print, **code) -> "CellStore":
    """The ``CellStore`` of a sequential study in ``folder`` (None: nothing kept): ``context`` is
    what its cells share (inputs' digests, options), ``study_modules`` the modules that compute
    them; ``code`` goes to ``code_key`` (backend, device, inputs) and its key joins the context."""
    code.setdefault("backend", "emulate")
    return CellStore(folder, dict(context, code=code_key(study=tuple(study_modules), **code)), warn=warn)


# -- the cells of a sequential study ------------------------------------------------------------

class CellStore:
    """Finished units of a sequential study (a model pass, a training checkpoint), one
    ``.npz`` of arrays per unit in ``folder/.cells`` (``folder`` None: nothing is kept).

    ``context`` holds everything the units share and that decides their numbers (inputs'
    digests, the options, ``code_key``'s code part); ``key(payload)`` hashes it with the unit's
    own description, so a unit computed under other code or inputs is never reused. Files are
    written whole or not at all; an unreadable one is reported and recomputed, never fatal."""

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

    def drop(self, key: str) -> None:
        """Forget one unit (a training run keeps only its latest checkpoint)."""
        if self.dir is not None:
            (self.dir / f"{key}.npz").unlink(missing_ok=True)
