"""Where the GPU time of the command line's "runs" phase goes: the paper-shape Table 3 (batch 2,
16 heads, seqlen 8192, head dim 128, every query row) timed per variant on the device, the float64
reference beside it, and torch.profiler's ten heaviest operators for the slowest variant (the
launch count and the CPU time between kernels show whether the phase is launch-bound).

    python3 tools/device/cli_kernels.py --out $OUT      (after source tools/device/setup_device.sh)

Writes ``--out``/cli_kernels.txt. The arithmetic these runs need is about 0.2 s of H200 time
(one float64 reference and seven float32 emulations of 1.1 TFLOP each); the difference to the
measured phase is what a faster emulator can remove.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import log, paper_qkv


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 3) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqlen", type=int, default=8192)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a check of the script itself
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import TABLE3, get_recipe
    from fa3_numerics.numerics.reference import reference_attention

    q, k, v = paper_qkv(2, 16, args.seqlen, 128, seed=0, device=dev)
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    lines = [f"shape 2x16x{args.seqlen}x128, {name} torch {torch.__version__}"]
    t = timed(lambda: reference_attention(q, k, v, causal=False), reps=2)
    lines.append(f"reference float64: {t:.3f} s")
    worst, worst_t, total = None, 0.0, t
    for name in TABLE3:
        r = get_recipe(name).recipe
        t = timed(lambda r=r: emulate(r, q, k, v, causal=False), reps=2)
        total += t
        lines.append(f"{name}: {t:.3f} s")
        if t > worst_t:
            worst, worst_t = r, t
    lines.append(f"sum: {total:.3f} s")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        emulate(worst, q, k, v, causal=False)
        sync()
    lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))
    text = "\n".join(lines)
    log(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cli_kernels.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
