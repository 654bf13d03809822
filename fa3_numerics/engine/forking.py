"""Helper processes forked by the console script: whether this process may fork them, and the
pipe and output handling they share.

Exposed: ``allow_forks``, ``forks_allowed``, ``read_all``, ``flush_output``, ``forked_map``.

Only the console script allows them (``allow_forks``), and ``FA3N_FORKS=0`` turns them off. A
command called in-process (tests, notebooks) may have replaced ``sys.stdout``, which a child's
writes would bypass, and may run threads that a fork would copy mid-import.
"""

from __future__ import annotations

import os
import sys

_STATE = {"allowed": False}


def allow_forks(on: bool = True) -> None:
    """Let this process fork helper processes (the console script calls this)."""
    _STATE["allowed"] = on


def forks_allowed() -> bool:
    return _STATE["allowed"] and hasattr(os, "fork") and os.environ.get("FA3N_FORKS", "1") != "0"


def read_all(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def flush_output() -> None:
    """Flush stdout and stderr (before a fork or an exit that skips the interpreter's own)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be shown
            pass


def forked_map(calls: list) -> list:
    """``[c() for c in calls]``, with every call but the last in a forked child where forks are
    allowed and the machine has a core to spare: the report's figures each take 0.2-0.5 s of
    single-threaded matplotlib once the run has freed every core. Results (and an exception,
    raised here again) come back pickled through a pipe; a child writes nothing else and never
    returns into its caller. Where forks are not allowed the calls run here, in order."""
    import pickle
    import signal

    if len(calls) < 2 or not forks_allowed() or (os.cpu_count() or 1) < 2:
        return [c() for c in calls]
    flush_output()
    kids = []
    try:
        for call in calls[:-1]:
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 0
                try:
                    os.close(rfd)
                    try:
                        data = pickle.dumps((True, call()))
                    except BaseException as exc:  # noqa: BLE001 - the parent raises it
                        try:
                            data = pickle.dumps((False, exc))
                        except Exception:  # noqa: BLE001 - an exception that does not pickle
                            data = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
                    view = memoryview(data)
                    while view:
                        view = view[os.write(wfd, view):]
                except BaseException:  # noqa: BLE001 - the child must end here whatever happens
                    code = 1
                finally:
                    os._exit(code)
            os.close(wfd)
            kids.append((pid, rfd))
        last = calls[-1]()
        out = []
        while kids:
            pid, rfd = kids.pop(0)  # off the list first: its fd is closed here, never twice
            try:
                data = read_all(rfd)
            finally:
                os.close(rfd)
                os.waitpid(pid, 0)
            if not data:
                raise RuntimeError("a forked helper process ended without its result; rerun with FA3N_FORKS=0")
            ok, value = pickle.loads(data)
            if not ok:
                raise value
            out.append(value)
        return out + [last]
    finally:
        for pid, rfd in kids:  # an error or Ctrl-C here: end the children still running
            try:
                os.close(rfd)
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except OSError:
                pass


__all__ = ["allow_forks", "forks_allowed", "read_all", "flush_output", "forked_map"]
