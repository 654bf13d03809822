"""Peak memory of `fa3-numerics run outliers --seqlen 32768 --batch 1 --heads 1` on this machine.

Runs the CLI in a child process and prints its peak resident set size (ru_maxrss), so the
number covers everything the command allocates. Target: at most 4 GB on CPU.

    python benchmarks/bench_memory.py [--rows N ...extra run args]
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time


def main(extra: list[str]) -> int:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fa3_numerics.cli", "run", "outliers", "--seqlen", "32768", "--batch", "1",
               "--heads", "1", "--out", out, *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(proc.stdout)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    gb = peak_kib * 1024 / 1e9
    print(f"command: {' '.join(cmd[1:])}")
    print(f"peak resident memory: {gb:.2f} GB (target <= 4 GB: {'PASS' if gb <= 4 else 'FAIL'}); wall {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
