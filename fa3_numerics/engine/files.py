"""Files written whole or not at all, and output folders that one process owns at a time.

Exposed: ``atomic_path``, ``atomic_write``, ``OutputFolder``, ``output_folder``, ``output_file``,
``clean_stale_temps``, ``TEMP_GLOB``.

Every file the toolkit writes goes through ``atomic_path``: the content goes to a hidden temp
file ``.NAME.<random>.tmp`` in the same folder, which is renamed over ``NAME`` only when it is
complete, so a reader never sees half a file and a crash never leaves a truncated one behind.

A process killed by SIGKILL cannot remove its temp file. ``OutputFolder`` therefore takes an
exclusive ``flock`` on the folder itself (no lock file is left behind) for the whole command,
and, once it holds it, removes
every ``.*.tmp`` in the folder and its cache and figure subfolders: with the lock held no other
writer can own them. The lock also keeps two runs from interleaving their files in one folder
(the dataset of one and the summary of the other): the second refuses at once.
The kernel drops an flock when its process dies, so a killed run never blocks the next one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from ..errors import UsageError, require

TEMP_GLOB = ".*.tmp"
# Subfolders whose temp files belong to the folder's owner (the cell cache, report figures).
_OWNED_SUBDIRS = (".cells", "figures")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on a clean exit it becomes ``path`` (rename), else vanishes.

    For writers that want a file name (``to_netcdf``, ``savefig``, ``np.savez``). The file gets
    the mode a plain ``open`` would give (mkstemp's is 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove the temp files of killed writers in ``folder`` (call with the folder's lock held)."""
    gone = []
    for d in [folder, *(folder / s for s in _OWNED_SUBDIRS)]:
        if d.is_dir():
            for f in d.glob(TEMP_GLOB):
                if f.is_file():
                    f.unlink(missing_ok=True)
                    gone.append(f)
    return gone


def _as_folder(text: str | os.PathLike | None, option: str) -> Path:
    raw = "" if text is None else os.fspath(text)
    require(raw.strip() != "", f"{option} is empty; pass a folder, e.g. {option} results/run")
    path = Path(raw)
    require(not path.exists() or path.is_dir(), f"{option} {raw} is a file; pass a folder (it is created if missing)")
    return path


def output_file(text: str | os.PathLike | None, option: str = "--out") -> Path:
    """Check a file destination: not empty, not an existing folder; its folder is created."""
    raw = "" if text is None else os.fspath(text)
    require(raw.strip() != "", f"{option} is empty; pass a file name, e.g. {option} comparison.md")
    path = Path(raw)
    require(not path.is_dir(), f"{option} {raw} is a folder; pass a file name inside it, e.g. {path / 'out.md'}")
    require(not path.parent.exists() or path.parent.is_dir(), f"{option} {raw}: {path.parent} is a file, not a folder")
    return path


class OutputFolder:
    """An output folder held for one command: created, locked, cleared of stale temp files.

    ``with OutputFolder(text, "--out") as out:`` gives the folder as a Path. A second process
    (or a second ``OutputFolder`` in this one) asking for the same folder gets a ``UsageError``.
    """

    def __init__(self, text: str | os.PathLike | None, option: str = "--out"):
        self.path = _as_folder(text, option)
        self.option = option
        self._fd: int | None = None
        self.cleaned: list[Path] = []

    def __enter__(self) -> Path:
        import fcntl

        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {self.option} {self.path}: {exc.strerror}; pass a writable folder") from None
        require(os.access(self.path, os.W_OK), f"cannot write into {self.option} {self.path}; pass a writable folder")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"another fa3-numerics process is writing into {self.path}; wait for it to finish or "
                             f"pass another {self.option}") from None
        self._fd = fd
        self.cleaned = clean_stale_temps(self.path)
        return self.path

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def output_folder(text: str | os.PathLike | None, option: str = "--out") -> OutputFolder:
    """``OutputFolder(text, option)``: validate now (so bad input fails before any work), lock on entry."""
    return OutputFolder(text, option)


__all__ = ["atomic_path", "atomic_write", "OutputFolder", "output_folder", "output_file", "clean_stale_temps",
           "TEMP_GLOB"]
