#!/usr/bin/env python
"""Whether two datasets hold the same results bit for bit: every data variable and coordinate.

    python benchmarks/check_outputs.py BASE.nc NEW.nc

Compares, for every data variable and coordinate of either file: presence, dims, shape, dtype,
the values' bytes (floats compared as their bit patterns, so -0.0 != +0.0 and a NaN equals only
the same NaN payload), and the variable's attributes. The files' global attributes are compared
too, except provenance that differs from run to run (versions, host, commit, command, times,
wall seconds, reused cells: ``PROVENANCE``); ``--ignore-attr NAME`` skips more. Exits 0 when
everything matches, 1 on any difference (each one printed), 2 when a file cannot be read.

A speed change that must not change a number is checked with it against a dataset written
before the change (by the same command, ``--fresh``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# Global attributes that record where, when and how fast a run was made, not what it computed.
# The code's hash changes with any edit of a source that can decide a number (the cache key's
# code part), whether or not the numbers change: what the check is for is whether they did.
PROVENANCE = ("python", "platform", "hostname", "git_commit", "command", "created_utc", "history", "wall_seconds",
              "cells_reused", "source", "device_name", "code_version", "torch_threads")


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's values as comparable raw data: floats as same-width unsigned integers."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def _same_attr(x, y) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        xa, ya = np.asarray(x), np.asarray(y)
        return xa.shape == ya.shape and xa.dtype == ya.dtype and np.array_equal(_bits(xa), _bits(ya))
    if isinstance(x, float) and isinstance(y, float):
        return np.float64(x).view(np.uint64) == np.float64(y).view(np.uint64)
    return type(x) is type(y) and x == y


def compare(base, new, ignore: set[str] = frozenset()) -> list[str]:
    """Differences between two xarray Datasets, one line each (empty: identical results)."""
    diffs = []
    names_b = set(base.data_vars) | set(base.coords)
    names_n = set(new.data_vars) | set(new.coords)
    for name in sorted(names_b - names_n):
        diffs.append(f"{name}: only in the base")
    for name in sorted(names_n - names_b):
        diffs.append(f"{name}: only in the new file")
    for name in sorted(names_b & names_n):
        vb, vn = base[name].variable, new[name].variable
        kind = "coordinate" if name in base.coords else "data variable"
        if (name in base.coords) != (name in new.coords):
            diffs.append(f"{name}: a {kind} in the base, not in the new file")
        if vb.dims != vn.dims or vb.shape != vn.shape:
            diffs.append(f"{name}: dims {vb.dims} {vb.shape} in the base, {vn.dims} {vn.shape} in the new file")
            continue
        if vb.dtype != vn.dtype:
            diffs.append(f"{name}: dtype {vb.dtype} in the base, {vn.dtype} in the new file")
            continue
        a, b = _bits(vb.values), _bits(vn.values)
        if not np.array_equal(a, b):
            ne = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
            first = np.unravel_index(ne[0], vb.shape) if vb.ndim else ()
            diffs.append(f"{name}: {ne.size} of {vb.size} value(s) differ; first at {dict(zip(vb.dims, first))}: "
                         f"{vb.values[first]!r} in the base, {vn.values[first]!r} in the new file")
        for key in sorted(set(vb.attrs) | set(vn.attrs)):
            if key not in vb.attrs or key not in vn.attrs or not _same_attr(vb.attrs[key], vn.attrs[key]):
                diffs.append(f"{name}: attribute {key!r} is {vb.attrs.get(key)!r} in the base, "
                             f"{vn.attrs.get(key)!r} in the new file")
    skip = set(PROVENANCE) | set(ignore)
    for key in sorted(set(base.attrs) | set(new.attrs)):
        if key in skip or key.startswith("version_") or key.endswith("_seconds"):
            continue
        if key not in base.attrs or key not in new.attrs or not _same_attr(base.attrs[key], new.attrs[key]):
            diffs.append(f"global attribute {key!r} is {base.attrs.get(key)!r} in the base, "
                         f"{new.attrs.get(key)!r} in the new file")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--ignore-attr", action="append", default=[], metavar="NAME",
                    help="a global attribute not to compare (repeatable)")
    args = ap.parse_args(argv)
    import xarray as xr

    opened = []
    for path in (args.base, args.new):
        try:
            # Raw values as stored: no decoding of times or fill values that could hide a difference.
            opened.append(xr.open_dataset(path, engine="h5netcdf", decode_cf=False).load())
        except (OSError, ValueError) as exc:
            print(f"error: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    diffs = compare(*opened, ignore=set(args.ignore_attr))
    n = len(opened[0].data_vars) + len(opened[0].coords)
    if diffs:
        for line in diffs:
            print(f"DIFFERENT  {line}")
        print(f"FAIL: {len(diffs)} difference(s) between {args.base} and {args.new}")
        return 1
    print(f"IDENTICAL: {n} data variables and coordinates of {args.base} and {args.new} match bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
