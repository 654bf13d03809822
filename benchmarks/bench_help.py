"""Wall and CPU seconds of `fa3-numerics ... --help` for every command, as a user runs it.

    python benchmarks/bench_help.py [--repeat 3] [--cold]

Each command runs in a fresh process (the console script), ``--repeat`` times; the median is
printed with the CPU time (user + system), which a loaded machine inflates less than the wall
time. ``--cold`` first empties the command line's registry cache (``cli._registry_cache``) in a
temporary FA3N_CACHE, so the first call computes the registries' texts (imports torch) and the
rest read them. The target: under 1 s wall for every command on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = ["", "run", "run outliers", "run ablation", "run backward", "impact", "recommend", "audit", "capture",
            "validate", "report", "compare", "variants", "backends"]


def once(cmd: str, env: dict) -> tuple[float, float]:
    exe = shutil.which("fa3-numerics") or sys.executable
    args = [exe] if exe.endswith("fa3-numerics") else [exe, "-m", "fa3_numerics.cli"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(args + cmd.split() + ["--help"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="start from an empty registry cache")
    a = ap.parse_args()
    env = dict(os.environ)
    tmp = None
    if a.cold:
        tmp = tempfile.mkdtemp(prefix="fa3n-help-")
        env["FA3N_CACHE"] = tmp
        wall, cpu = once("", env)
        print(f"first call, empty cache: {wall:.2f} s wall, {cpu:.2f} s cpu (computes and keeps the registries' texts)")
    print(f"load average {os.getloadavg()[0]:.2f}; median of {a.repeat}")
    print(f"{'command':<16} {'wall s':>7} {'cpu s':>7}")
    worst = 0.0
    for cmd in COMMANDS:
        runs = [once(cmd, env) for _ in range(a.repeat)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        worst = max(worst, wall)
        print(f"{(cmd or '(top)'):<16} {wall:7.2f} {cpu:7.2f}")
    print(f"slowest: {worst:.2f} s wall (target < 1 s)")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
