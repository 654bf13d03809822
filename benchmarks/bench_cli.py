"""Wall time of a command as a user runs it, with its phases: the console script in a fresh
process, one first run (cold caches, bytecode), then the median of ``--repeat`` runs.

    python benchmarks/bench_cli.py                       # the README's main job on this machine
    python benchmarks/bench_cli.py --gpu                 # the paper-shape Table 3 on CUDA (H200)
    python benchmarks/bench_cli.py -- run outliers --seqlen 2048 --out /tmp/x

Each timed run sets FA3N_TIMINGS=1, so the command prints its phases (start-up, runs, dataset
file, report, ...; on a GPU each reading synchronizes the device). Printed: every run's wall and
phases, the median of each, the start-up floor (a bare Python importing torch and, on a GPU,
opening a CUDA context: what no change to this package removes), and the previous measurement
beside the figure (``PREVIOUS``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MAIN = ["run", "outliers", "--p", "0.001"]
GPU = ["run", "outliers", "--p", "0.001", "--device", "cuda", "--rows", "0", "--batch", "2", "--heads", "16",
       "--seqlen", "8192"]
# The figures before this benchmark existed, to print beside today's (where and when measured).
PREVIOUS = {
    "gpu": "6.91 s wall (start-up 2.90, runs 1.95, dataset 0.56, report 1.10): this benchmark on the H200, 2026-12-04 "
           "(4.96 s on 2026-12-03 and 5.80 s on 2026-12-01: the machine's start-up moves by a second between calls)",
    "cpu": "about 40 s wall on the 2-core CPU when quiet (README), 2026-12-01",
}
TARGET = {"gpu": "<= 3.0 s wall, runs <= 0.5 s", "cpu": "1.5x the GEMM floor (benchmarks/bench_outliers.py)"}


def run_once(args: list[str], out: str) -> tuple[float, dict[str, float], int]:
    exe = shutil.which("fa3-numerics")
    cmd = ([exe] if exe else [sys.executable, "-m", "fa3_numerics.cli"]) + args + ["--out", out, "--fresh"]
    env = dict(os.environ, FA3N_TIMINGS="1", FA3N_PROGRESS="off")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    phases = {}
    for line in done.stderr.splitlines():
        if line.startswith("timings:"):
            for name, sec in re.findall(r"([a-z][a-z0-9 .\-]*?) (\d+\.\d+) s", line.split(":", 1)[1]):
                phases[name.strip().lstrip(", ")] = float(sec)
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr)
    return wall, phases, done.returncode


# What every process of ours pays before its first line runs: Python, torch's import and, on a GPU,
# the CUDA context (the first allocation opens it). The command's start-up is read against it.
FLOOR = {"gpu": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()", "cpu": "import torch"}


def startup_floor(key: str, repeat: int) -> float:
    """Median wall time of a bare ``python -c FLOOR[key]`` after one warm-up run."""
    walls = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", FLOOR[key]], check=True, capture_output=True)
        if i:
            walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the paper-shape Table 3 on CUDA")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("command", nargs="*", help="the command's arguments (after --); default: the main job")
    a = ap.parse_args()
    args = a.command or (GPU if a.gpu else MAIN)
    key = "gpu" if a.gpu else "cpu"
    out = tempfile.mkdtemp(prefix="fa3n-bench-cli-")
    print(f"command: fa3-numerics {' '.join(args)} --out {out} --fresh")
    wall, phases, code = run_once(args, out)
    print(f"first run: {wall:.2f} s wall (exit {code}); phases: {phases}")
    runs = []
    for i in range(a.repeat):
        wall, phases, code = run_once(args, out)
        runs.append((wall, phases))
        print(f"run {i + 1}: {wall:.2f} s wall (exit {code}); " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    med = statistics.median(w for w, _ in runs)
    names = list(dict.fromkeys(k for _, p in runs for k in p))
    print(f"median of {a.repeat}: {med:.2f} s wall; phases " + ", ".join(
        f"{n} {statistics.median(p.get(n, 0.0) for _, p in runs):.2f} s" for n in names))
    floor = startup_floor(key, a.repeat)
    start = statistics.median(p.get("start-up", 0.0) for _, p in runs)
    print(f"start-up floor: {floor:.2f} s, median of {a.repeat} (python -c \"{FLOOR[key]}\"); the command's start-up "
          f"is {start - floor:+.2f} s above it, the rest of the run {med - start:.2f} s")
    print(f"previous: {PREVIOUS[key]}")
    print(f"target: {TARGET[key]}")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
