#!/usr/bin/env python
"""Benchmark: `fa3-numerics impact` on SmolLM2, 512 tokens, the 6 default recipes, every layer, as a
user runs it (one CLI process, model load included), from an empty cache.

Prints the command with its wall and CPU time and pass/fail against the acceptance limit (<= 600 s
on the 2-core CPU container), plus the machine's load average before and after (other processes on
the two cores slow the run). With --resume-check it then runs the same command again: every model
pass must come from the cache (the rerun only loads the model, redoes the reference pass, the audit
and the report). Writes OUT/bench.json.

    python benchmarks/bench_impact.py --out reports/impact-smollm2 --budget-kl 0.004 \\
        --recipe-map '0-3:fa3-fp16;*:fa3-fp8-kernel-hadamard' --resume-check

Prints; exits 0 unless --strict (then 1 over the limit, on a failed command or a failed resume).
Extra arguments after `--` go to `fa3-numerics impact` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

LIMIT_S = 600.0


def _cmd() -> list[str]:
    exe = shutil.which("fa3-numerics")
    return [exe] if exe else [sys.executable, "-c", "from fa3_numerics.cli import main; main()"]


def _timed(args: list[str], log: Path) -> dict:
    shown = shlex.join(["fa3-numerics"] + args)
    print(f"$ {shown}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as fh:  # progress goes to stderr: keep it, and echo it
        proc = subprocess.Popen(_cmd() + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            fh.write(line)
            if not line.startswith("Converting") and "Loading weights" not in line:
                print("  " + line.rstrip(), flush=True)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log.read_text()
    passes = [ln for ln in text.splitlines() if ln.startswith("[") and "KL mean" in ln]
    cached = sum("(cached)" in ln for ln in passes)
    print(f"  -> exit {rc}, wall {wall:.1f} s, CPU {cpu:.1f} s; {len(passes)} model passes, {cached} from the cache",
          flush=True)
    return {"command": shown, "rc": rc, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "passes": len(passes),
            "cached": cached}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/impact-smollm2"))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budget-kl", type=float, default=None)
    ap.add_argument("--recipe-map", action="append", default=[])
    ap.add_argument("--resume-check", action="store_true", help="rerun: every pass must come from the cache")
    ap.add_argument("--keep-cache", action="store_true", help="do not empty OUT/.cells first (not a clean timing)")
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then more `impact` options")
    args = ap.parse_args()

    cells = args.out / ".cells"
    if cells.is_dir() and not args.keep_cache:
        shutil.rmtree(cells)  # a clean timing computes every pass
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = ["impact", "--model", "smollm2", "--tokens", str(args.tokens), "--out", str(args.out)]
    if args.budget_kl is not None:
        cmd += ["--budget-kl", f"{args.budget_kl:g}"]
    for m in args.recipe_map:
        cmd += ["--recipe-map", m]
    cmd += [a for a in args.extra if a != "--"]
    load0 = os.getloadavg()
    run = _timed(cmd, Path("/tmp") / "bench_impact.log")
    load1 = os.getloadavg()
    ok = run["rc"] == 0
    within = run["wall_s"] <= LIMIT_S
    print(f"\nwall time {run['wall_s']:.1f} s; limit {LIMIT_S:.0f} s: {'PASS' if ok and within else 'FAIL'}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after (1 min)")
    rec = {"run": run, "limit_s": LIMIT_S, "pass": ok and within, "cpus": os.cpu_count(), "loadavg_before": load0,
           "loadavg_after": load1, "python": platform.python_version(), "platform": platform.platform(),
           "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    resumed_ok = True
    if args.resume_check and ok:
        again = _timed(cmd, Path("/tmp") / "bench_impact_resume.log")
        resumed_ok = again["rc"] == 0 and again["cached"] == again["passes"] == run["passes"]
        print(f"resume: {again['cached']}/{again['passes']} passes from the cache in {again['wall_s']:.1f} s: "
              f"{'PASS' if resumed_ok else 'FAIL'}")
        rec["resume"] = {**again, "pass": resumed_ok}
    tmp = args.out / ".bench.json.tmp"
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    os.replace(tmp, args.out / "bench.json")
    return 1 if args.strict and not (ok and within and resumed_ok) else 0


if __name__ == "__main__":
    sys.exit(main())
