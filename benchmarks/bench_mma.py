#!/usr/bin/env python
"""Benchmark: the cost of the Hopper MMA model (``acc=fp22``) against the float32 emulator.

Runs ``fa3-fp8-kernel`` (the public FA3 kernel's recipe with the tensor-core model on both
GEMMs) and ``fa3-fp8-kernel,acc=fp32`` (float32 matmuls) on the same inputs, in one process,
alternating, and prints the median time of each and their ratio (target <= 3). The
prepare step (quantization) is shared and warmed first, so the ratio compares the attention
arithmetic, which is where the model costs.

    python benchmarks/bench_mma.py                         # batch 1 x 8 heads, seqlen 8192, 256 rows
    python benchmarks/bench_mma.py --device cuda --heads 32 --rows 1024

It prints; it does not assert.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.engine.sampling import query_rows
from fa3_numerics.numerics import native
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import parse_recipes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here; use --device cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    shape = AttnShape(batch=a.batch, heads=a.heads, seqlen=a.seqlen, head_dim=a.head_dim)
    q, k, v = generate("outliers", shape, a.seed, device=a.device, p=0.001, sigma=10.0)
    q, k, v = (t.to(a.device) for t in (q, k, v))
    qi = query_rows(a.seqlen, a.rows, a.seed, a.device)
    recipes = dict(parse_recipes("fa3-fp8-kernel;fa3-fp8-kernel,acc=fp32"))
    cache: dict = {}
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    for r in recipes.values():  # warm-up: prepare cache, native build, CUDA context
        emulate(r, q, k, v, q_index=qi[:8], cache=cache)
    load0 = os.getloadavg()[0]
    times: dict[str, list[float]] = {n: [] for n in recipes}
    for _ in range(a.repeat):
        for name, r in recipes.items():
            sync()
            t0 = time.perf_counter()
            emulate(r, q, k, v, q_index=qi, cache=cache)
            sync()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    fp22, fp32 = med["fa3-fp8-kernel"], med["fa3-fp8-kernel,acc=fp32"]
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"{platform.machine()} CPU"
    # Another process on the cores moves both timings, the compiled model's (OpenMP) most: the
    # load average before and after the runs says whether the ratio can be trusted.
    print(f"device: {where}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; native: {native.status()}")
    print(f"shape: batch {a.batch} x {a.heads} heads, seqlen {a.seqlen}, head dim {a.head_dim}, {a.rows} query rows; "
          f"median of {a.repeat}")
    for n, t in times.items():
        print(f"  {n:28s} {med[n]:8.3f} s  (runs: {', '.join(f'{x:.3f}' for x in t)})")
    print(f"ratio fp22 / fp32: {fp22 / fp32:.2f}x (target <= 3)")


if __name__ == "__main__":
    main()
