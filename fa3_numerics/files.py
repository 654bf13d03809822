"""Files written whole or not at all, and output folders that one process owns at a time.

Exposed: ``atomic_path``, ``atomic_write``, ``write_error``, ``folder_error``, ``make_folder``, ``temp_file``,
``is_own_temp``, ``OutputFolder``, ``OutputFileLock``, ``output_folder``, ``output_file``, ``clean_stale_temps``,
``clean_dead_temps``, ``TEMP_GLOB``.

Every file the toolkit writes goes through ``atomic_path``: the content goes to a hidden temp
file ``.NAME.fa3n-<random>.tmp`` in the same folder (``temp_file``), which is renamed over
``NAME`` only when it is complete, so a reader never sees half a file and a crash never leaves a
truncated one behind.

A process killed by SIGKILL cannot remove its temp file. ``OutputFolder`` therefore takes an
exclusive ``flock`` on the folder itself (no lock file is left behind) for the whole command,
and, once it holds it, removes the temp files this tool names (``is_own_temp``: the ``fa3n-``
tag and mkstemp's 8 random characters) in the folder and its cache and figure subfolders: with
the lock held no other writer can own them. A user's own ``.draft.tmp`` is never touched. The
lock also keeps two runs from interleaving their files in one folder (the dataset of one and the
summary of the other): the second refuses at once. The kernel drops an flock when its process
dies, so a killed run never blocks the next one.

A command that writes one file outside an owned folder for a long time (a capture: minutes of
model loading and a forward pass before the write) holds that file for the whole command with
``OutputFileLock``: an flock on a hidden ``.NAME.fa3n-lock`` beside it, removed when the command
ends, so a second command writing the same file refuses at once instead of replacing the first's
file with its own. A killed holder's lock file is empty and is taken over by the next one.

A single file written outside an owned folder (a capture) is written inside a private temp
folder of the same naming that the writer holds an flock on (``atomic_path(path, hold=True)``);
the next writer of the same name removes those that no living process holds
(``clean_dead_temps``), whatever the library writing inside left there. Files inside an owned
folder need no hold: the folder's lock already says whose their temp files are.

A device that refuses the bytes (full, over quota, read-only) ends the write with one line
naming the file and the fix (``write_error``, a ``UsageError``), the temp file removed: never a
traceback and never a partial file. So does a folder that cannot be made (``make_folder``: a
figures folder, the folder of a file, a capture's private temp folder): full, read-only, no
permission, or a file in the way, each one line naming the folder (``folder_error``).

A command that creates its output folder and then refuses its input removes the folder again
when nothing was written into it, so a refused run leaves no empty folder behind.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import UsageError, require

# A temp file of this tool: "." + the target's name + ".fa3n-" + mkstemp's 8 random characters + ".tmp".
TEMP_TAG = "fa3n-"
TEMP_GLOB = f".*.{TEMP_TAG}*.tmp"
_OWN_TEMP = re.compile(rf"^\.(?P<name>.+)\.{TEMP_TAG}[a-z0-9_]{{8}}\.tmp$")
# Subfolders whose temp files belong to the folder's owner (the cell cache, report figures).
_OWNED_SUBDIRS = (".cells", "figures")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_own_temp(name: str, target: str | None = None) -> bool:
    """Whether the file name ``name`` is a temp file this tool made (of ``target``'s name, if given)."""
    m = _OWN_TEMP.match(name)
    return m is not None and (target is None or m.group("name") == target)


def temp_file(path: str | os.PathLike, suffix: str = "") -> tuple[int, Path]:
    """A new temp file beside ``path`` with this tool's name, ``(fd, temp path)`` (mkstemp's)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{suffix}.{TEMP_TAG}", suffix=".tmp", dir=path.parent)
    return fd, Path(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, hold: bool = False) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on a clean exit it becomes ``path`` (rename), else vanishes.

    For writers that want a file name (``to_netcdf``, ``savefig``, ``np.savez``). The file gets
    the mode a plain ``open`` would give (mkstemp's is 0600). ``hold``: the temp path lies in a
    private temp folder of this tool's name that this process holds an flock on while it
    writes, so that ``clean_dead_temps`` can tell a killed writer's leftovers from a running
    one's, whatever the writer does inside (safetensors writes its own temp file and renames it).
    """
    import fcntl

    path = Path(path)
    require(not path.is_dir(), f"cannot write {path}: a folder of that name is in the way; remove it (or pass "
            "another output folder)")
    make_folder(path.parent)
    try:
        if hold:
            holder = Path(tempfile.mkdtemp(prefix=f".{path.name}.{TEMP_TAG}", suffix=".tmp", dir=path.parent))
            fd = os.open(holder, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            tmp = holder / path.name
        else:
            fd, tmp = temp_file(path)
            os.close(fd)
    except OSError as exc:
        raise (write_error(exc, path) or folder_error(exc, path.parent)) from None
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        err = write_error(exc, path)
        if err is not None:
            raise err from None
        raise
    finally:
        if hold:
            shutil.rmtree(holder, ignore_errors=True)
            os.close(fd)  # drops the flock


# errno of a device that takes no more bytes, and the words libraries that wrap the error use
# (h5py: "errno = 28", safetensors: "os error 28", matplotlib and numpy: a plain OSError)
_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exhausted",
         errno.EFBIG: "the file is too large for the device", errno.EROFS: "the file system is read-only"}
_FULL_WORDS = {"no space left on device": errno.ENOSPC, "errno = 28": errno.ENOSPC, "os error 28": errno.ENOSPC,
               "disk quota exceeded": errno.EDQUOT, "errno = 122": errno.EDQUOT, "os error 122": errno.EDQUOT,
               "read-only file system": errno.EROFS}


def write_error(exc: BaseException, path: str | os.PathLike) -> UsageError | None:
    """The one-line error for ``exc`` raised while writing ``path`` when the device refused the
    bytes (full, over quota, read-only), else None. The fix is the user's: space or another place."""
    code = getattr(exc, "errno", None)
    if code not in _FULL:
        text = " ".join(str(e).lower() for e in (exc, exc.__cause__, exc.__context__) if e is not None)
        code = next((c for words, c in _FULL_WORDS.items() if words in text), None)
    if code is None:
        return None
    return UsageError(f"cannot write {path}: {_FULL[code]}; free some space (or write elsewhere) and run again - "
                      "nothing partial was left, finished results are kept")


# errno of a place that takes no file or folder: the device's refusals above, no permission, a file
# where a folder should be (or under one)
PLACE_ERRNOS = frozenset(_FULL) | {errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR}


def folder_error(exc: OSError, folder: str | os.PathLike) -> UsageError:
    """The one-line error for ``exc`` raised while making ``folder`` or a file in it: a full or
    read-only device as ``write_error`` says it, else the system's reason (no permission, a file
    in the way) with the fix."""
    where = Path(exc.filename) if getattr(exc, "filename", None) else Path(folder)
    full = write_error(exc, where)
    if full is not None:
        return full
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        reason = "a file is in the way of a folder"
    return UsageError(f"cannot create a folder or file in {where}: {reason.lower()}; make it writable (or write "
                      "elsewhere) and run again - nothing partial was left, finished results are kept")


def make_folder(folder: str | os.PathLike) -> Path:
    """``folder`` and its missing parents, created; any failure one line (``folder_error``)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise folder_error(exc, folder) from None
    return folder


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove this tool's temp files of killed writers in ``folder`` and its cache and figure
    subfolders (call with the folder's lock held). Other files, hidden or not, are left alone."""
    gone = []
    for d in [folder, *(folder / s for s in _OWNED_SUBDIRS)]:
        if d.is_dir():
            for f in d.glob(TEMP_GLOB):
                if is_own_temp(f.name) and f.is_file() and not f.is_symlink():
                    f.unlink(missing_ok=True)
                    gone.append(f)
    return gone


def clean_dead_temps(path: str | os.PathLike) -> list[Path]:
    """Remove the temp folders of ``path``'s name beside it that no living writer holds (left by
    ``atomic_path(..., hold=True)`` in a killed process); one a running writer holds is kept."""
    import fcntl

    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    gone = []
    for f in folder.glob(f".{glob.escape(path.name)}.{TEMP_TAG}*.tmp"):
        if not is_own_temp(f.name, path.name) or f.is_symlink() or not f.is_dir():
            continue
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its writer is alive
        else:
            shutil.rmtree(f, ignore_errors=True)
            gone.append(f)
        finally:
            os.close(fd)
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
        self._created: Path | None = None
        self.cleaned: list[Path] = []

    def __enter__(self) -> Path:
        import fcntl

        created = None
        for p in [self.path.absolute(), *self.path.absolute().parents]:
            if p.exists():
                break
            created = p  # the topmost folder this command creates
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
        for sub in _OWNED_SUBDIRS:
            if (self.path / sub).exists() and not (self.path / sub).is_dir():
                os.close(fd)
                raise UsageError(f"{self.path / sub} is a file where this tool keeps a folder "
                                 f"({'the cache of finished results' if sub == '.cells' else 'report figures'}); "
                                 f"move it away or pass another {self.option}")
        self._fd = fd
        self._created = created
        self.cleaned = clean_stale_temps(self.path)
        return self.path

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            import fcntl

            # Before the lock goes: no other process may start writing into a folder being removed.
            self._remove_if_unused()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _remove_if_unused(self) -> None:
        """Remove the folders this command created when it wrote no file into them (a refused run)."""
        if self._created is None:
            return
        top = self.path.absolute()
        if any(files for _, _, files in os.walk(top)):
            return
        created_depth = len(self._created.parts)
        try:
            for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):  # deepest first
                os.rmdir(d)
            for p in top.parents:
                if len(p.parts) < created_depth:
                    break
                os.rmdir(p)
        except OSError:
            pass  # something else appeared meanwhile: keep it


class OutputFileLock:
    """One output file held for one command (see the module docstring): ``with
    OutputFileLock(path, "--out"):``; a second holder of the same path, in any process, gets a
    ``UsageError`` at once. The lock file is created beside ``path`` (whose folder must exist)
    and removed on exit; a holder checks, once it has the flock, that the name still leads to the
    file it locked (a holder that was leaving may have removed it meanwhile) and tries again."""

    def __init__(self, path: str | os.PathLike, option: str = "--out"):
        self.path = Path(path)
        self.option = option
        self.lock = self.path.with_name(f".{self.path.name}.{TEMP_TAG}lock")
        self._fd: int | None = None

    def __enter__(self) -> Path:
        import fcntl

        while True:
            try:
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
            except OSError as exc:
                raise folder_error(exc, self.lock.parent) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(f"another fa3-numerics process is writing {self.path}; wait for it to finish or "
                                 f"pass another {self.option}") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return self.path
            os.close(fd)  # the file was removed by the holder that just left: lock the new one

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            self.lock.unlink(missing_ok=True)  # while still holding it: a waiter then retries on a fresh file
            os.close(self._fd)
            self._fd = None


def output_folder(text: str | os.PathLike | None, option: str = "--out") -> OutputFolder:
    """``OutputFolder(text, option)``: validate now (so bad input fails before any work), lock on entry."""
    return OutputFolder(text, option)


__all__ = ["atomic_path", "atomic_write", "write_error", "folder_error", "make_folder", "temp_file", "is_own_temp",
           "OutputFolder", "OutputFileLock", "output_folder", "output_file", "clean_stale_temps", "clean_dead_temps",
           "TEMP_GLOB", "PLACE_ERRNOS"]
