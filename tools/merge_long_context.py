"""Join long-context datasets measured in separate device calls into one, along ``length``.

A device call holds the GPU for at most 10 minutes, so the 256K stage ran in a call of its own
from the earlier lengths. The datasets must agree on every other coordinate and on the
attributes that define the measurement (distribution, rows, head dim, kernel, stream); the
findings are recomputed over the joined lengths by the study's own ``findings`` and the
``history`` lines of both are kept. Then render with ``fa3-numerics report OUT``::

    python tools/merge_long_context.py reports/h200/long-context/long_context.nc stage256k.nc \
        --out reports/h200/long-context/long_context.nc
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Attributes that describe the measurement and so must be equal in every part.
SAME = ("dist", "rows", "head_dim", "spread", "vmean", "decoys", "decoy_ratio", "sink_v", "qcorr", "kv_tile",
        "reference", "rng_stream", "lost_rule", "kernel_module", "kernel_version", "kind")


def merge(paths: list[Path]):
    import numpy as np
    import xarray as xr

    from fa3_numerics.studies.long_context import findings

    parts = [xr.open_dataset(p).load() for p in paths]
    first = parts[0]
    for p, ds in zip(paths[1:], parts[1:]):
        for dim in first.dims:
            if dim != "length" and not np.array_equal(first[dim].values, ds[dim].values):
                raise ValueError(f"{p}: coordinate {dim!r} differs from {paths[0]}'s; measure it on the same grid")
        for a in SAME:
            if str(first.attrs.get(a)) != str(ds.attrs.get(a)):
                raise ValueError(f"{p}: attribute {a!r} is {ds.attrs.get(a)!r}, {paths[0]} has {first.attrs.get(a)!r}")
    lengths = np.concatenate([ds["length"].values for ds in parts])
    if len(set(lengths.tolist())) != len(lengths):
        raise ValueError(f"the parts repeat a length ({sorted(lengths.tolist())}); give each length once")
    out = xr.concat(parts, dim="length", data_vars="minimal", coords="minimal", compat="override",
                    combine_attrs="override").sortby("length")
    out.attrs["history"] = "\n".join(h for h in (str(ds.attrs.get("history", "")) for ds in parts) if h)
    out.attrs["source"] = next((ds.attrs["source"] for ds in reversed(parts)
                                if "?" not in str(ds.attrs.get("source", "?"))), first.attrs.get("source", ""))
    out.attrs["merged_from"] = json.dumps([str(p) for p in paths])
    out.attrs["findings"] = json.dumps(findings(out))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    missing = [p for p in args.parts if not p.exists()]
    if missing or len(args.parts) < 2:
        print(f"error: give two or more existing datasets (missing: {', '.join(map(str, missing)) or '-'})",
              file=sys.stderr)
        return 2
    try:
        ds = merge(args.parts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from fa3_numerics.engine.dataset import write

    write(ds, args.out)
    print(f"wrote {args.out}: lengths {', '.join(str(int(n)) for n in ds['length'].values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
