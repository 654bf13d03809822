#!/usr/bin/env python
"""Benchmark: an ablation sweep on 1 GPU and on N GPUs of this host (one pinned dask worker per
GPU, ``fa3_numerics.engine.distributed``), each from an empty cache.

Prints each run's wall time, the speed-up and the scaling efficiency T1 / (N * TN), and whether
the two datasets are bit-identical (with ``--gpus 1 --check-in-process``, the one pinned worker
against the same cells computed in this process, the check one GPU allows) (they should be: each cell is computed by the same kernels on
the same kind of GPU, whichever worker runs it; a difference means the CUDA path is not
deterministic per cell). Writes OUT/bench.json when --out is given.

    python benchmarks/bench_gpus.py --gpus 2 --designs core --seqlen 1024,4096 --seeds 0,1,2,3

Exits 2 on a machine without CUDA (one line), or with --gpus above the visible GPUs; else 0,
unless --strict: then 1 when the datasets differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Provenance that legitimately differs between the two runs.
VOLATILE = {"created_utc", "wall_seconds", "cells_reused", "workers", "command", "hostname", "device_name",
            "loadavg_start", "loadavg_end", "history", "source"}


def _same(x, y) -> bool:
    # NaN equals NaN here: a coordinate of NaNs (the paper's RMSE where it has none) is the same
    # in both runs, and np.array_equal's default would call it a difference.
    try:
        return np.array_equal(x, y, equal_nan=True)
    except TypeError:  # strings and objects have no NaN
        return np.array_equal(x, y)


def _differences(a, b) -> list[str]:
    """Names of the data variables, coordinates and attributes on which two datasets differ."""
    out = [m for m in sorted(set(a.data_vars) | set(b.data_vars))
           if m not in a or m not in b or not _same(a[m].values, b[m].values)]
    out += [c for c in a.coords if c not in b.coords or not _same(a[c].values, b[c].values)]
    keep = lambda d: {k: v for k, v in d.items() if k not in VOLATILE}  # noqa: E731
    out += [f"attr {k}" for k in sorted(set(keep(a.attrs)) | set(keep(b.attrs)))
            if str(keep(a.attrs).get(k)) != str(keep(b.attrs).get(k))]
    return out


def _sweep(ab, workers: int) -> tuple[float, object]:
    from fa3_numerics.studies.ablation import run_ablation

    with tempfile.TemporaryDirectory(prefix="fa3n-bench-gpus-") as cache:
        t0 = time.perf_counter()
        ds = run_ablation(ab, cache_dir=Path(cache), workers=workers, progress=lambda m: None)
        return time.perf_counter() - t0, ds.load()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU)")
    ap.add_argument("--experiment", default="ablation", help="experiments/NAME.toml or a .toml path")
    ap.add_argument("--designs", default="core", help="comma-separated designs to keep")
    ap.add_argument("--seqlen", default=None, help="comma-separated sequence lengths (default: the TOML's)")
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds: the sweep's tasks scale with them")
    ap.add_argument("--out", default=None, help="folder for bench.json")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the 1- and N-GPU datasets differ")
    ap.add_argument("--check-in-process", action="store_true",
                    help="with --gpus 1: also run the cells in this process (no dask) and compare the datasets")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_gpus: no CUDA device on this machine (torch.cuda.is_available() is False); "
              "run it on a host with GPUs", file=sys.stderr)
        return 2
    from fa3_numerics.engine.distributed import gpu_slots, visible_gpus
    from fa3_numerics.errors import UsageError
    from fa3_numerics.studies.ablation import load_ablation

    gpus = visible_gpus()
    n = len(gpus) if args.gpus is None else args.gpus
    try:
        if n < 1:
            raise UsageError(f"--gpus must be >= 1, got {n}")
        gpu_slots(n, gpus)
        ints = lambda s: [int(x) for x in s.split(",")] if s else None  # noqa: E731
        ab = load_ablation(args.experiment, {"device": "cuda", "designs": args.designs.split(","),
                                             "seqlen": ints(args.seqlen), "seeds": ints(args.seeds)})
    except (UsageError, ValueError) as exc:
        print(f"bench_gpus: {exc}", file=sys.stderr)
        return 2
    print(f"{ab.name} on {torch.cuda.get_device_name(0)}: visible GPUs {','.join(gpus)}; 1 and {n} worker(s)",
          flush=True)
    t1, ds1 = _sweep(ab, 1)
    print(f"  1 GPU : {t1:8.1f} s", flush=True)
    rec = {"experiment": ab.name, "device_name": torch.cuda.get_device_name(0), "gpus": n, "wall_1_s": round(t1, 2)}
    if n == 1 and args.check_in_process:
        # One GPU: the same cells in this process (no dask) must give the pinned worker's dataset.
        t0_, ds0 = _sweep(ab, 0)
        diff = _differences(ds1, ds0)
        print(f"  in-process (no dask): {t0_:8.1f} s", flush=True)
        print("  datasets 1 pinned worker vs in-process: " + ("bit-identical" if not diff else
                                                              f"DIFFER in {', '.join(diff)}"), flush=True)
        rec |= {"wall_in_process_s": round(t0_, 2), "identical": not diff, "differences": diff}
    if n > 1:
        tn, dsn = _sweep(ab, n)
        diff = _differences(ds1, dsn)
        speedup, eff = t1 / tn, t1 / (n * tn)
        print(f"  {n} GPUs: {tn:8.1f} s   speed-up {speedup:.2f}x, scaling efficiency {eff:.0%}", flush=True)
        print(f"  datasets 1 vs {n} GPUs: " + ("bit-identical" if not diff else f"DIFFER in {', '.join(diff)}"),
              flush=True)
        rec |= {"wall_n_s": round(tn, 2), "speedup": round(speedup, 3), "efficiency": round(eff, 3),
                "identical": not diff, "differences": diff}
    if args.out:
        from fa3_numerics.engine.files import atomic_write

        Path(args.out).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(args.out) / "bench.json", json.dumps(rec, indent=2) + "\n")
    return 1 if args.strict and rec.get("differences") else 0


if __name__ == "__main__":
    sys.exit(main())
