"""Give the heap's freed memory back to the operating system between the variants of a task.

Exposed: ``release_free_memory``.

glibc serves a freed tensor's memory again from its heap rather than returning it: after the
first large block is freed it raises its mmap threshold (up to 32 MB), so the emulator's S
tiles, kept softmax rows and quantization slices come from the heap, and a heap fragmented by
a few live blocks on top cannot shrink. The default `run outliers` then grew from 1.4 GB after
the reference to 2.2-2.3 GB over its seven variants (measured peaks 1.97-2.31 GB, varying with
where the live blocks landed), above the 2 GB target. ``malloc_trim(0)`` returns every whole
free page of every arena (madvise), so each variant starts from what is live. Elsewhere (other C
libraries, GPUs, whose caching allocator keeps its pool on purpose) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_TRIM: list = []


def _malloc_trim():
    if not _TRIM:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                fn = None
        _TRIM.append(fn)
    return _TRIM[0]


def release_free_memory(device="cpu") -> bool:
    """Return the C heap's free pages to the system when ``device`` is the CPU; True when done."""
    if str(device) != "cpu":
        return False
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


__all__ = ["release_free_memory"]
