"""Checks every study makes before it computes anything, each a one-line error naming the fix.

Exposed: ``check_shape``, ``check_rows``, ``check_backend``, ``check_distinct``, ``check_memory``.
"""

from __future__ import annotations

import os

from ..errors import require
from ..numerics.recipe import Recipe
from ..numerics.tiles import check_head_dim
from .backends import check_device, get_backend, refusal
from .sampling import check_seed

# Headroom over the float64 inputs: rotated and quantized copies, the reference's chunks.
_MEMORY_FACTOR = 4
_SEQLEN_MAX = 1 << 24


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(seqlen: int, head_dim: int, batch: int, heads: int, kv_heads: int) -> None:
    """Refuse a shape whose float64 Q, K, V alone (with the copies a run makes) exceed this machine's memory."""
    need = 8 * batch * seqlen * head_dim * (heads + 2 * (kv_heads or heads)) * _MEMORY_FACTOR
    have = _physical_memory()
    require(have is None or need <= have,
            f"seqlen {seqlen} x batch {batch} x {heads} heads x head dim {head_dim} needs about "
            f"{need / 2**30:.3g} GiB (float64 Q, K, V and their working copies); this machine has "
            f"{(have or 0) / 2**30:.3g} GiB: use a smaller --seqlen, --batch or --heads")


def check_distinct(name: str, values: list) -> None:
    """A swept list must not repeat a value (``--p 0.01,0.010`` would compute one cell twice)."""
    seen = []
    for v in values:
        dup = next((s for s in seen if s == v or (isinstance(v, float) and isinstance(s, float)
                                                   and abs(v - s) <= 1e-12 * max(abs(v), abs(s)))), None)
        require(dup is None, f"--{name.replace('_', '-')} lists {v} twice; give distinct values")
        seen.append(v)


def check_rows(rows, option: str = "--rows") -> None:
    """Query rows per head: a non-negative integer (0 = every row). A negative count would
    index rows from the end and give shares of a negative total."""
    require(isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0,
            f"{option} must be >= 0 (0 = every query row), got {rows}")


def check_shape(seqlen, head_dim, batch, heads, kv_heads, rows, seeds, device) -> None:
    """Refuse shapes and seeds no study can run, with the option to fix in the message."""
    require(len(seqlen) > 0, "--seqlen got an empty list; give at least one value")
    for d in head_dim:
        check_head_dim(d)
    for n in seqlen:
        shown = str(n) if len(str(n)) <= 20 else f"{str(n)[:8]}... ({len(str(n))} digits)"
        require(isinstance(n, int) and 1 <= n <= _SEQLEN_MAX, f"--seqlen must lie in [1, {_SEQLEN_MAX}], got {shown}")
    require(batch >= 1 and heads >= 1, "--batch and --heads must be >= 1")
    require(kv_heads >= 0, f"--kv-heads must be >= 0 (0 = as many as --heads), got {kv_heads}")
    require(kv_heads == 0 or heads % kv_heads == 0, f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    check_rows(rows)
    require(len(seeds) > 0, "--seeds got an empty list; give at least one value")
    for s in seeds:
        check_seed(s)
    require(len(set(seeds)) == len(seeds), "--seeds must be distinct integers")
    for name, values in (("seqlen", seqlen), ("head_dim", head_dim)):
        check_distinct(name, values)
    check_device(device)
    for n in seqlen:
        for d in head_dim:
            check_memory(n, d, batch, heads, kv_heads)


def check_backend(name: str, device: str, recipes: list[tuple[str, Recipe]]) -> None:
    backend = get_backend(name)
    why = backend.check(device)
    require(why is None, f"backend {name!r} cannot run: {why}")
    for label, recipe in recipes:
        why = refusal(backend, recipe)
        require(why is None, f"variant {label!r} cannot run on backend {name!r}: {why}")


__all__ = ["check_shape", "check_rows", "check_backend", "check_distinct", "check_memory"]
