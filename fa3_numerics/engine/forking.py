"""Helper processes forked by the console script: whether this process may fork them, and the
pipe and output handling they share.

Exposed: ``allow_forks``, ``forks_allowed``, ``read_all``, ``flush_output``.

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


__all__ = ["allow_forks", "forks_allowed", "read_all", "flush_output"]
