#!/usr/bin/env python
"""Benchmark: the emulated backward over every query row against the emulated forward over every row (CPU).

For each preset: the forward alone (``emulator.emulate`` over every query row, the LSE saved) and the
backward alone from that forward's O and LSE (``numerics.backward.backward_from``), median of
--repeat runs each after one warm-up, on the same inputs. Prints both times and the ratio
backward / forward against the target (<= 3x), plus the machine's load average (other processes on
the two cores slow both). It prints; it does not assert (exit 0) unless --strict (exit 1 over 3x).

    python benchmarks/bench_backward.py
    python benchmarks/bench_backward.py --seqlen 2048 --heads 4 --presets fa3-fp8-bwd-bf16,cudnn-fp8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

TARGET = 3.0


def _time(fn, repeat: int) -> float:
    fn()  # warm-up: compiled helpers, allocator
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    from fa3_numerics.numerics.backward import backward_from, run_forward
    from fa3_numerics.numerics.recipe import BACKWARD_PRESETS, PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--presets", default=",".join(BACKWARD_PRESETS))
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    hkv = a.kv_heads or a.heads
    q = torch.randn(1, a.heads, a.seqlen, a.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(1, hkv, a.seqlen, a.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, a.seqlen, a.head_dim, generator=g, dtype=torch.float64)
    do = torch.randn(q.shape, generator=g, dtype=torch.float64)
    print(f"shape: batch 1, {a.heads} heads ({hkv} KV), seqlen {a.seqlen}, head dim {a.head_dim}, "
          f"causal {a.causal}; every query row; {torch.get_num_threads()} threads; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'preset':<20} {'forward s':>10} {'backward s':>11} {'ratio':>7}  target <= {TARGET:g}x")
    worst = 0.0
    for name in a.presets.split(","):
        r = PRESETS[name].recipe
        fwd = run_forward(r, q, k, v, causal=a.causal)
        # a fresh prepare cache each time: the forward's cost includes quantizing Q, K and V, as the
        # backward's includes quantizing its operands
        t_f = _time(lambda: run_forward(r, q, k, v, causal=a.causal), a.repeat)
        t_b = _time(lambda: backward_from(r, q, k, v, fwd, do, causal=a.causal), a.repeat)
        ratio = t_b / t_f
        worst = max(worst, ratio)
        print(f"{name:<20} {t_f:>10.3f} {t_b:>11.3f} {ratio:>6.2f}x  {'ok' if ratio <= TARGET else 'OVER'}")
    print(f"worst ratio {worst:.2f}x ({'met' if worst <= TARGET else 'not met'}: target <= {TARGET:g}x)")
    return 1 if a.strict and worst > TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
