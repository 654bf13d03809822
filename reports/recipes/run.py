"""Run the recipe study and write its report: ``python reports/recipes/run.py``.

Every number in reports/recipes/ comes from the commands below, run through the package's own
CLI; their command lines, wall times and the machine's load are written to ``timings.json``.
``--report-only`` rebuilds README.md and the figures from the datasets already here.

Data (each a ``run outliers`` at seqlen 2048, head dim 128, 8 heads, 256 query rows, seeds 0-2:
24 samples of (seed, head) per cell):
- the FA3 paper's outliers (p 0.001, sigma 10);
- the structured families: k-bias (bias 8: SmolLM2's typical largest K channel mean, and 20),
  channel-outliers, sink-tokens, student-t (df 3);
- the k-bias contrasts (``KBIAS_VARIANTS``) over bias 0, 2, 8, 20;
- a SmolLM2-135M capture (1024 tokens of pydoc prose), every layer x head, through ``audit``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from fa3_numerics.studies.recipes import FIELD_VARIANTS, KBIAS_VARIANTS  # noqa: E402

COMMON = ["--seqlen", "2048", "--head-dim", "128", "--batch", "1", "--heads", "8", "--rows", "256", "--seeds", "0,1,2"]
FIELD = ";".join(v for v, _ in FIELD_VARIANTS)
KBIAS = ";".join(v for v, _ in KBIAS_VARIANTS)
CAPTURE = ROOT / ".capture" / "smollm2-1024.safetensors"

RUNS = {
    "outliers": ["run", "outliers", *COMMON, "--variants", FIELD, "--dist", "outliers", "--p", "0.001",
                 "--sigma", "10"],
    "k-bias": ["run", "outliers", *COMMON, "--variants", FIELD, "--dist", "k-bias", "--bias", "8,20"],
    "channel-outliers": ["run", "outliers", *COMMON, "--variants", FIELD, "--dist", "channel-outliers"],
    "sink-tokens": ["run", "outliers", *COMMON, "--variants", FIELD, "--dist", "sink-tokens"],
    "student-t": ["run", "outliers", *COMMON, "--variants", FIELD, "--dist", "student-t", "--df", "3"],
    "k-bias-smoothing": ["run", "outliers", *COMMON, "--variants", KBIAS, "--dist", "k-bias", "--bias", "0,2,8,20"],
}


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def run_all(names: list[str]) -> dict:
    timings = json.loads((HERE / "timings.json").read_text()) if (HERE / "timings.json").is_file() else {}
    steps = [(n, RUNS[n] + ["--out", str(HERE / "runs" / n)]) for n in names if n in RUNS]
    if "smollm2" in names:
        if not CAPTURE.is_file():
            steps.append(("capture", ["capture", "--model", "smollm2", "--tokens", "1024", "--out", str(CAPTURE)]))
        steps.append(("smollm2", ["audit", str(CAPTURE), "--variants", FIELD, "--rows", "256", "--budget", "0.05",
                                  "--out", str(HERE / "smollm2")]))
    for name, argv in steps:
        if name == "smollm2" and CAPTURE.is_file():
            k_channel_means(CAPTURE, HERE / "k_channel_means.json")
        load0, t0 = _load(), time.perf_counter()
        print(f"== {name}: fa3-numerics {' '.join(argv)}", flush=True)
        subprocess.run([sys.executable, "-m", "fa3_numerics.cli", *argv], check=True, cwd=ROOT)
        timings[name] = {"command": "fa3-numerics " + " ".join(_quote(a) for a in argv).replace(str(ROOT) + "/", ""),
                         "wall_s": round(time.perf_counter() - t0, 1), "loadavg_start": load0, "loadavg_end": _load()}
        (HERE / "timings.json").write_text(json.dumps(timings, indent=1) + "\n")
    return timings


def k_channel_means(capture: Path, out: Path, skip: int = 4) -> dict:
    """What K smoothing meets in SmolLM2, per layer x KV head: the largest |mean over tokens| of
    a K channel over the median per-channel std (the k-bias family's ``bias`` units; the first
    ``skip`` tokens, attention sinks, left out); the share of K's energy the channel means carry;
    per query head, the attention mass on token 0 (rows 64 and later, causal, the model's scale)
    and how much longer smoothing makes token 0's key (|k0 - mean| / |k0|)."""
    import numpy as np
    import torch

    from fa3_numerics.data.capture import load_capture

    cap = load_capture(str(capture))
    ratio, share, sink, k0_growth = [], [], [], []
    g = cap.heads // cap.kv_heads
    causal = torch.tril(torch.ones(cap.tokens, cap.tokens, dtype=torch.bool))
    for layer in cap.layers:
        q, k, _ = (t.to(torch.float64) for t in cap.qkv(layer))  # [H, N, D], [Hkv, N, D]
        mu, sd = k[:, skip:].mean(dim=1), k[:, skip:].std(dim=1)
        ratio.append((mu.abs().amax(dim=-1) / sd.median(dim=-1).values).tolist())
        share.append(((mu ** 2).sum(dim=-1) / (k[:, skip:] ** 2).mean(dim=1).sum(dim=-1)).tolist())
        p0, grow = [], []
        for h in range(cap.heads):
            kh = k[h // g]
            s = (q[h] @ kh.T * cap.scale).masked_fill(~causal, -math.inf)
            p0.append(float(torch.softmax(s, dim=-1)[64:, 0].mean()))
            grow.append(float((kh[0] - kh.mean(dim=0)).norm() / kh[0].norm()))
        sink.append(p0)
        k0_growth.append(grow)
    r, e = np.array(ratio).ravel(), np.array(share).ravel()
    res = {"heads": int(r.size), "tokens_skipped": skip, "layers": list(cap.layers),
           "max_mean_over_std": {"median": float(np.median(r)), "q10": float(np.quantile(r, 0.1)),
                                 "q90": float(np.quantile(r, 0.9)), "max": float(r.max())},
           "mean_energy_share": {"median": float(np.median(e)), "min": float(e.min()), "max": float(e.max())},
           "sink_mass": sink, "k0_growth": k0_growth}
    out.write_text(json.dumps(res) + "\n")
    return res


def _quote(a: str) -> str:
    return f"'{a}'" if any(c in a for c in ";, ") and not a.startswith("/") else a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="rebuild README.md and figures from the datasets")
    ap.add_argument("--only", default=",".join([*RUNS, "smollm2"]), help="comma list of steps to run")
    args = ap.parse_args()
    if not args.report_only:
        run_all(args.only.split(","))
    from make_report import build  # noqa: E402  (this folder)

    build(HERE)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
