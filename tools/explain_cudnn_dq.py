"""Where cuDNN's FP8 dQ comes from, offline, on one arm of ``cudnn_bwd_h200.py``'s ``cudnn_bwd_cases.npz``:
the evidence behind ``bwd.dqcast=fp16`` (reports/h200/backward/cudnn.md).

1. Candidates for dQ's dS (dK's kept as the emulator casts it): each one's share of dQ codes equal to
   the kernel's. S, P, dP, D and dS are formed in float32 as ``numerics.backward`` forms them under
   ``cudnn-fp8-kernel`` (the Hopper MMA model, descales multiplied into the products' results), from the
   kernel's own O and Stats; dQ sums 128-key tiles of the MMA model in float32.
2. Row fits: for badly matched dQ rows, single dS codes are flipped to their other neighbouring code,
   greedily, while that brings the row's values into the kernel's codes' rounding intervals; printed: how
   far from a rounding boundary the flipped dS values lay (in code steps) and how many of those flips
   the FP16 step reproduces.

    python tools/explain_cudnn_dq.py reports/h200/backward/cudnn/cudnn_bwd_cases.npz --arm 0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "device"))

F32 = torch.float32
LOG2E = math.log2(math.e)


def intermediates(d: dict) -> dict:
    """float32 S, P, dP, D, dS of one arm, the FP8 values of Q, K, V, dO and their descales."""
    from fa3_numerics.numerics.formats import get_format
    from fa3_numerics.numerics.mma import hopper_mma
    from fa3_numerics.numerics.reference import causal_mask

    c, sc = d["case"], d["scalars"]
    e4, edo = get_format("e4m3"), get_format(d["do_fmt"])
    dsc = {x: torch.tensor(sc[f"descale_{x}"], dtype=F32) for x in ("q", "k", "v", "dO")}
    q, k, v = ((d[x] / sc[f"descale_{x}"]).to(F32) for x in "qkv")
    do = (d["do"] / sc["descale_dO"]).to(F32)
    scale = 1.0 / math.sqrt(c["head_dim"])
    s = hopper_mma(q, k.transpose(-1, -2).contiguous(), a_fmt=e4, b_fmt=e4) * (dsc["q"] * dsc["k"])
    p = torch.exp2(s * torch.tensor(scale * LOG2E, dtype=F32) - (d["lse"] * torch.tensor(LOG2E, dtype=F32))[..., None])
    if c["causal"]:
        n = q.shape[2]
        p = p.masked_fill(~causal_mask(torch.arange(n), 0, n, n, n), 0.0)
    dp = hopper_mma(do, v.transpose(-1, -2).contiguous(), a_fmt=edo, b_fmt=e4) * (dsc["dO"] * dsc["v"])
    dsum = (d["do"].to(F32) * d["o"].to(F32)).sum(-1, keepdim=True, dtype=F32)
    return {"q": q, "k": k, "v": v, "do": do, "s": s, "p": p, "dp": dp, "dsum": dsum, "ds": p * (dp - dsum),
            "scale": scale, "descale_k": dsc["k"], "descale_qk": dsc["q"] * dsc["k"],
            "descale_dov": dsc["dO"] * dsc["v"], "edo": edo, "e4": e4}


def cast_ds(ds: torch.Tensor, fmt: str, descale: torch.Tensor, via: torch.dtype | None = None) -> torch.Tensor:
    """dS / descale cast to ``fmt`` (FP8 values in float32), through ``via`` first when given."""
    from fa3_numerics.numerics.formats import quantize_dequantize

    x = ds / descale
    return quantize_dequantize(x if via is None else x.to(via).to(F32), fmt, F32)


def dq_codes(t: dict, ds8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """dQ in the kernel's code units (x scale_dQ), float64: 128-key tiles on the MMA model, float32 across."""
    from fa3_numerics.numerics.mma import hopper_mma

    k, n = t["k"], t["k"].shape[2]
    acc = torch.zeros_like(t["q"])
    for s0 in range(0, n, 128):
        acc += hopper_mma(ds8[..., s0:s0 + 128].contiguous(), k[:, :, s0:s0 + 128].contiguous(), a_fmt=t["edo"],
                          b_fmt=t["e4"])
    return acc * (descale * t["descale_k"]) * torch.tensor(t["scale"], dtype=F32)


def code_grid(fmt: str) -> torch.Tensor:
    from fa3_numerics.kernels.cudnn import _TORCH_DT

    vals = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(_TORCH_DT[fmt]).double()
    return torch.unique(vals[torch.isfinite(vals)])


def row_fits(t, d, ds8, descale, x, ker, rows_per_head=150, min_mismatch=10, max_flips=30):
    """Greedy single-code dS flips per badly matched dQ row (module docstring, item 2): a list of
    (head, row, key, distance of dS from the rounding boundary in code steps) for the rows fully
    explained."""
    grid_out, grid_ds = code_grid(d["grad_fmt"]), code_grid(d["do_fmt"])
    s_dq = d["scalars"]["scale_dQ"]
    fin = float(descale * t["descale_k"]) * t["scale"] * s_dq
    kt = t["k"].double()
    from fa3_numerics.numerics.formats import cast

    mism = (cast(x, d["grad_fmt"]).double() != ker).sum(-1)
    pre = t["ds"].double() / float(descale)
    codes = ds8.double()
    found = []
    for h in range(x.shape[1]):
        for r in torch.nonzero(mism[0, h] >= min_mismatch).flatten()[:rows_per_head].tolist():
            i = torch.searchsorted(grid_out, ker[0, h, r])
            lo = (grid_out[(i - 1).clamp_min(0)] + ker[0, h, r]) / 2
            hi = (grid_out[(i + 1).clamp_max(len(grid_out) - 1)] + ker[0, h, r]) / 2

            def loss(y):
                return (torch.clamp(lo - y, min=0) + torch.clamp(y - hi, min=0)).sum(-1)

            cv, pv = codes[0, h, r], pre[0, h, r]
            j = torch.searchsorted(grid_ds, cv)
            other = torch.where(pv > cv, grid_ds[(j + 1).clamp_max(len(grid_ds) - 1)], grid_ds[(j - 1).clamp_min(0)])
            step = (other - cv).abs().clamp_min(1e-30)
            dist = 0.5 - (pv - cv).abs() / step
            moves = (other - cv)[:, None] * kt[0, h] * fin
            cur, picked = x[0, h, r].clone(), []
            for _ in range(max_flips):
                total = loss(cur[None] + moves)
                best = int(torch.argmin(total))
                if total[best] >= loss(cur) - 1e-12:
                    break
                cur, picked = cur + moves[best], picked + [best]
                moves[best] = 0
            if float(loss(cur)) == 0.0:
                found += [(h, r, jj, float(dist[jj])) for jj in picked]
    return found


def main(argv=None) -> int:
    from fit_cudnn_bwd import cases
    from fa3_numerics.kernels.cudnn import decode
    from fa3_numerics.numerics.mma import hopper_mma
    from fa3_numerics.numerics.formats import cast, get_format
    from fa3_numerics.numerics.quant import amax_to_scale

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--arm", type=int, default=0, help="which saved case/arm, in the file's order (default 0)")
    a = ap.parse_args(argv)
    if not Path(a.npz).is_file():
        print(f"error: {a.npz} not found; it is written by tools/device/cudnn_bwd_h200.py", file=sys.stderr)
        return 2
    arms = list(cases(a.npz))
    if not 0 <= a.arm < len(arms):
        print(f"error: --arm {a.arm}: the file holds arms 0-{len(arms) - 1}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    name, arm, d = arms[a.arm]
    t = intermediates(d)
    fmt = d["do_fmt"]
    descale = amax_to_scale(t["ds"].abs().amax(), get_format(fmt))
    ker = decode(d["raw"]["dq"], 1.0)
    s_dq = d["scalars"]["scale_dQ"]

    def equal(ds=None, via=None, ds8=None):
        ds8 = cast_ds(t["ds"] if ds is None else ds, fmt, descale, via) if ds8 is None else ds8
        x = dq_codes(t, ds8, descale).double() * s_dq
        return float((cast(x, d["grad_fmt"]).double() == ker).double().mean()), ds8, x

    h16 = lambda y: y.to(torch.float16).to(F32)  # noqa: E731
    k = t["k"]
    s32 = torch.matmul(t["q"], k.transpose(-1, -2)) * t["descale_qk"]
    lse2 = (d["lse"] * torch.tensor(LOG2E, dtype=F32))[..., None]

    def p_of(s_):
        p_ = torch.exp2(s_ * torch.tensor(t["scale"] * LOG2E, dtype=F32) - lse2)
        return torch.where(t["p"] == 0, torch.zeros_like(p_), p_)  # the causal mask's zeros

    pk = p_of(s32)
    diff = t["dp"] - t["dsum"]
    dp32 = torch.matmul(t["do"], t["v"].transpose(-1, -2)) * t["descale_dov"]
    rv = torch.arange(t["q"].shape[-1] - 1, -1, -1)  # head_dim's k-steps in reverse order
    s_rev = hopper_mma(t["q"][..., rv].contiguous(), k[..., rv].transpose(-1, -2).contiguous(), a_fmt=t["e4"],
                       b_fmt=t["e4"]) * t["descale_qk"]
    p_rev = p_of(s_rev)
    print(f"{name} {arm}: dQ codes equal to the kernel's, per candidate for dQ's dS")
    base, ds8, x = equal()
    rows = [("the emulator's dS (direct cast)", base)]
    cands = [("S = Q K^T in float32", pk * diff, None), ("dP = dO V^T in float32", t["p"] * (dp32 - t["dsum"]), None),
             ("S and dP in float32", pk * (dp32 - t["dsum"]), None),
             ("S with head_dim's k-steps reversed", p_rev * diff, None),
             ("FP16 step on dS before scaling", h16(t["ds"]), None),
             ("FP16 step on dS x softmax scale", h16(t["ds"] * t["scale"]) / t["scale"], None),
             ("FP16 step on P", h16(t["p"]) * diff, None), ("FP16 step on dP - D", t["p"] * h16(diff), None),
             ("FP16 step on dP", t["p"] * (h16(t["dp"]) - t["dsum"]), None),
             ("BF16 step on the scaled dS", t["ds"], torch.bfloat16),
             ("FP16 step on the scaled dS (bwd.dqcast=fp16)", t["ds"], torch.float16)]
    for label, ds, via in cands:
        rows.append((label, equal(ds, via)[0]))
    exact = cast((torch.matmul(ds8.double(), k.double()) * float(descale * t["descale_k"]) * t["scale"]) * s_dq,
                 d["grad_fmt"]).double()
    rows.append(("direct cast, products summed exactly", float((exact == ker).double().mean())))
    rows.append(("unquantized float32 dS", float((cast((torch.matmul(t["ds"].double(), k.double()) * float(
        t["descale_k"]) * t["scale"]) * s_dq, d["grad_fmt"]).double() == ker).double().mean())))
    for label, share in rows:
        print(f"  {label:48} {100 * share:6.2f}%")
    # the kernel's own Amax_dQ (its last call, float32 before scale_dQ) against the emulator's largest |dQ|
    meta = json.loads(str(np.load(a.npz)["meta"]))
    amax = next(r for r in meta["rows"] if r["case"] == name)["arms"][arm]["amax"]["bwd"][-1]["amax_dQ"]
    x16 = equal(t["ds"], torch.float16)[2]
    print(f"  Amax_dQ: kernel {amax:.6f}, emulator {float(x.abs().max()) / s_dq:.6f} (direct cast), "
          f"{float(x16.abs().max()) / s_dq:.6f} (FP16 step)")
    fl = row_fits(t, d, ds8, descale, x, ker)
    near = [f for f in fl if f[3] < 0.02]
    ds16 = cast_ds(t["ds"], fmt, descale, torch.float16)
    hit = sum(1 for h, r, j, _ in near if ds16[0, h, r, j] != ds8[0, h, r, j])
    dist = torch.tensor([f[3] for f in near], dtype=torch.float64)
    qs = torch.quantile(dist, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist() if len(near) else []
    print(f"row fits: {len(fl)} flips explain {len({(h, r) for h, r, _, _ in fl})} rows; {len(near)} within 0.02 "
          f"of a code step from a rounding boundary (10/50/90%: " + " / ".join(f"{v:.4f}" for v in qs) +
          f"); the FP16 step flips {hit} of those {len(near)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
