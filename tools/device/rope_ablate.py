"""Where the fused RoPE pre-pass's time goes, on the H200: one operand (Q, BF16 (b, s, h, d)) through
``rope_quantize``'s persistent kernel with parts of its work switched off, beside the plain
quantizer (``rotate_quantize``), as device time (CUDA-graph replays) and % of a copy's bandwidth.

    pip install --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
    python tools/device/rope_ablate.py --out $OUT          # about a minute

Rows: the full kernel (RoPE + Hadamard, per-head scales: two passes), its rotation with fewer or
other products (``split``), without the rotation, without RoPE, without both, per-token scales
(one pass), and the plain quantizer with and without the rotation. Each row's bytes are the
minimal ones (the input read once, FP8 written once) and, for two passes, the traffic (two reads).
Writes ``rope_ablate.json`` and ``rope_ablate.md`` whole; exit 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_times, log, quantile  # noqa: E402
from rope_h200 import env_info, map_kernels_package, write_whole  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--shape", default="2,16,8192", help="batch,heads,seqlen (head_dim 128)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    map_kernels_package()
    import torch

    if not torch.cuda.is_available() or not args.out:
        print("error: needs a CUDA GPU and --out DIR (or $OUT)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from fa3_numerics.kernels.triton_ import rope_quant as rq
    from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
    from fa3_numerics.numerics.granularity import PerHead, PerToken

    b, h, s = (int(v) for v in args.shape.split(","))
    d = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64, device="cuda") / d))
    cos, sin = rq.rope_tables(inv.float(), s, device="cuda")
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_ms = quantile([t * 1e3 for t in graph_times(lambda: y.copy_(x), calls=10, reps=args.reps)], 0.5)
    copy_tbs = 2 * x.numel() / (copy_ms * 1e-3) / 1e12
    del x, y
    log(f"copy {copy_tbs:.2f} TB/s")
    minimal = q.numel() * 3
    base = dict(gran=PerHead(), exact=False, out_layout="bshd", impl="persistent")
    rows = []

    def add(name, fn, passes):
        try:
            fn()
            ms = quantile([t * 1e3 for t in graph_times(fn, calls=10, reps=args.reps)], 0.5)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a row
            rows.append({"name": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            log(f"  {name}: {rows[-1]['error']}")
            return
        pct = 100 * minimal / (ms * 1e-3) / 1e12 / copy_tbs
        traffic = 100 * (minimal + (passes - 1) * q.numel() * 2) / (ms * 1e-3) / 1e12 / copy_tbs
        rows.append({"name": name, "ms": ms, "pct_copy": pct, "traffic_pct_copy": traffic, "passes": passes})
        log(f"  {name:44s} {ms:.4f} ms  {pct:4.0f}% of copy (minimal), {traffic:4.0f}% (traffic)")

    for launch in (dict(), dict(tile=32, num_warps=2, stages=3, progs_per_sm=4)):
        tag = "default" if not launch else "t32w2"
        kw = {**base, **launch}
        add(f"{tag}: rope + hadamard, head, bf16x3", lambda kw=kw: rq.rope_quantize(q, cos, sin, **kw), 2)
        for sp in ("bf16x3t", "bf16x2", "bf16x1", "tf32x2"):
            add(f"{tag}: rope + hadamard, head, {sp}", lambda kw=kw, sp=sp: rq.rope_quantize(q, cos, sin, split=sp,
                                                                                            **kw), 2)
        add(f"{tag}: rope, no rotation, head", lambda kw=kw: rq.rope_quantize(q, cos, sin, rot="none", **kw), 2)
        add(f"{tag}: hadamard, no rope, head", lambda kw=kw: rq.rope_quantize(q, rope="none", **kw), 2)
        add(f"{tag}: neither, head", lambda kw=kw: rq.rope_quantize(q, rope="none", rot="none", **kw), 2)
        add(f"{tag}: rope + hadamard, token (one pass)",
            lambda kw=kw: rq.rope_quantize(q, cos, sin, **{**kw, "gran": PerToken()}), 1)
    add("rotate_quantize: hadamard, head", lambda: rotate_quantize(q, layout="bshd", gran=PerHead(), rot="hadamard",
                                                                   out_layout="bshd"), 2)
    add("rotate_quantize: none, head", lambda: rotate_quantize(q, layout="bshd", gran=PerHead(), rot="none",
                                                               out_layout="bshd"), 2)
    add("rotate_quantize: hadamard, token", lambda: rotate_quantize(q, layout="bshd", gran=PerToken(),
                                                                    rot="hadamard", out_layout="bshd"), 1)
    res = {"env": env_info(torch), "shape": [b, h, s, d], "copy_tbs": copy_tbs, "rows": rows}
    md = [f"# Fused RoPE pre-pass ablation (tools/device/rope_ablate.py), Q of b={b} h={h} s={s} d={d}", "",
          f"{res['env'].get('gpu')}, torch {res['env'].get('torch')}, triton {res['env'].get('triton')}, commit "
          f"{res['env'].get('commit')}, {res['env'].get('date_utc')} UTC. Device time per call, median of "
          f"{args.reps} CUDA-graph replays of 10 calls; copy {copy_tbs:.2f} TB/s.", "",
          "| variant | ms | % of copy (minimal bytes) | % of copy (traffic) |", "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['name']} | " + (f"{r['ms']:.4f} | {r['pct_copy']:.0f}% | {r['traffic_pct_copy']:.0f}% |"
                                        if "ms" in r else f"- | - | {r['error']} |"))
    write_whole(out / "rope_ablate.json", json.dumps(res, indent=1, default=str))
    write_whole(out / "rope_ablate.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
