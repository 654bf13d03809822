"""What the command line reads from the registries to build its options, kept on disk.

Building the app needs the registries' names and help texts (distribution parameters, ablation
factors, backends, metrics, targets, the studies' declared options), and the registries live in
modules that import torch and numpy: 2-3 s before any ``--help`` could print. Those texts are
plain data, so they are computed once and kept as JSON in ``$FA3N_CACHE/cli`` (default
``~/.cache/fa3-numerics/cli``), keyed by a fingerprint of the package: its version, every
source file's size and modification time, the entry points of its registries (another package's
study or backend) and the interpreter. Any edit, install or plug-in gives a new key, so a stale
help text is never shown; an unwritable cache folder only costs the time. ``FA3N_CLI_CACHE=0``
turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

GROUP_PREFIX = "fa3_numerics."


def _folder() -> Path:
    root = os.environ.get("FA3N_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                        or os.path.expanduser("~/.cache"), "fa3-numerics")
    return Path(root) / "cli"


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """Changes with any source file of the package (or its kernels), its plug-ins, the interpreter."""
    import importlib.metadata

    h = hashlib.sha256(sys.version.encode() + sys.prefix.encode())
    pkg = Path(__file__).resolve().parents[1]
    roots = [pkg, pkg.parent / "kernels"]
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".toml")):
                    st = os.stat(os.path.join(dirpath, name))
                    h.update(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    try:
        h.update(importlib.metadata.version("fa3-numerics").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    # every plug-in of every registry of ours (studies, reports, recipe keys, backends, ...)
    # (through the distributions: entry_points() without a group differs across Python releases)
    eps = {(ep.group, ep.name, ep.value) for d in importlib.metadata.distributions() for ep in d.entry_points
           if ep.group.startswith(GROUP_PREFIX)}
    for group, name, value in sorted(eps):
        h.update(f"{group}:{name}={value}".encode())
    return h.hexdigest()[:20]


_MEMO: dict[str, Any] = {}


def _path() -> Path:
    return _folder() / f"registry-{fingerprint()}.json"


def _load() -> dict:
    if "data" not in _MEMO:
        try:
            _MEMO["data"] = json.loads(_path().read_text())
        except (OSError, ValueError):
            _MEMO["data"] = {}
    return _MEMO["data"]


def _store(data: dict) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file
    except OSError:
        pass  # a read-only home: the texts are computed again next time


def cached(*modules: str) -> Callable:
    """Decorator: ``fn()`` (JSON-serializable, no arguments) from the cache when the package is
    unchanged, computed when any of ``modules`` (the registries it reads) is already imported:
    then computing costs nothing, and what this process registered at run time is included."""

    def deco(fn: Callable[[], Any]) -> Callable[[], Any]:
        return _cached(fn, modules)

    return deco


_ALL: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = []


def _key(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _cached(fn: Callable[[], Any], modules: tuple[str, ...]) -> Callable[[], Any]:
    _ALL.append((_key(fn), fn, modules))

    @functools.wraps(fn)
    def wrapper():
        if os.environ.get("FA3N_CLI_CACHE", "1") == "0" or any(m in sys.modules for m in modules):
            return fn()
        data = _load()
        key = _key(fn)
        if key not in data:
            # Fill every text a clean process can compute now, in one go: once the first has
            # imported torch, the others' registries are imported too and would not be kept.
            fresh = [(k, f) for k, f, mods in _ALL if k not in data and not any(m in sys.modules for m in mods)]
            for k, f in fresh:
                data[k] = f()
            _store(data)
        return data[key]

    return wrapper


__all__ = ["cached", "fingerprint"]
