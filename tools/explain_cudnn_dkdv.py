"""Where the emulator's FP8 dK and dV codes differ from cuDNN's, offline, on ``cudnn_bwd_h200.py``'s saved
bytes (MHA cases). For every arm: the ``cudnn-fp8-kernel`` backward from the kernel's own O and Stats, its
float32 dK and dV before the output cast, cast at the kernel's own scale_dK / scale_dV; the codes that
differ, grouped by key row (dV[j] = sum_i P[i, j] dO[i] and dK[j] = sum_i dS[i, j] Q[i]: one P or dS
value of key j a code off moves that whole row); then, for each of the worst rows, the one P (dV) or dS
(dK) code of that key which, moved to its neighbouring code, gives the kernel's row, and how far the
emulator's float32 scaled P or dS lay from the rounding boundary between the two codes (in code steps:
~0 is a tie that float32-level arithmetic decides). A row with one or two differing codes is fitted by
some flip among 2 n candidates by chance; rows with several are the evidence. dK is also tried with the
softmax scale folded into scale_dK (one float32 rounding instead of two).

    python tools/explain_cudnn_dkdv.py reports/h200/backward/cudnn/cudnn_bwd_cases.npz [--rows 8]

(20 s on the CPU for the four saved arms.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "device"))


def traced_backward(d: dict, acc: str = "fp22") -> dict:
    """The preset's backward at float32 output with every P / dS cast (``_cast_tile``: P, dQ's dS, dK's dS
    per KV tile) and every dV / dK product (``_mm`` with ``ta``: dV, then dK per tile) recorded."""
    from fa3_numerics.numerics import backward as bw
    from fa3_numerics.numerics.backward import Forward, backward_from
    from cudnn_bwd_h200 import Arm, arm_recipe

    c = d["case"]
    if c["heads"] != c["kv_heads"]:
        raise SystemExit("error: grouped-query cases sum heads before the cast; this tool reads MHA cases only")
    r = dataclasses.replace(arm_recipe(Arm(d["do_fmt"], d["grad_fmt"]), acc), bwd_out="fp32")
    casts, prods = [], []
    cast0, mm0 = bw._cast_tile, bw._mm

    def cast_spy(x, fmt, descale, wd, via=None, scale=None):
        op = cast0(x, fmt, descale, wd, via, scale=scale)
        # a tile multiplied by ``scale`` (P under bwd.pexp=cudnn) is recorded as divided by its inverse
        casts.append((x, fmt, descale if scale is None else 1.0 / scale, via, op))
        return op

    def mm_spy(a, b, acc, *, ta=False, tb=False):
        out = mm0(a, b, acc, ta=ta, tb=tb)
        if ta:
            prods.append((a, b, out.clone()))
        return out

    by0 = bw._cast_by_scale

    def by_spy(x, fmt, amax, wd, via=None):
        # dS under bwd.dsform=cudnn(-ffma): the product x scale_dP, recorded as x divided by 1 / scale_dP
        op = by0(x, fmt, amax, wd, via)
        casts.append((x, fmt, op.d, via, op))
        return op

    bw._cast_tile, bw._mm, bw._cast_by_scale = cast_spy, mm_spy, by_spy
    try:
        backward_from(r, d["q"], d["k"], d["v"], Forward(d["o"], d["lse"]), d["do"], causal=c["causal"],
                      softmax_scale=1.0 / math.sqrt(c["head_dim"]))
    finally:
        bw._cast_tile, bw._mm, bw._cast_by_scale = cast0, mm0, by0
    tiles = len(prods) // 2
    if len(casts) != 3 * tiles:
        raise SystemExit(f"error: {len(casts)} casts for {tiles} tiles: the backward's structure changed")
    # bwd.dsform=cudnn(-ffma) folds the softmax scale into dS: dK's product is then already scaled
    folded = r.bwd_dsform in ("cudnn", "cudnn-ffma")
    return {"dv": (casts[0::3], prods[0::2]), "dk": (casts[2::3], prods[1::2]), "folded": folded}


def code_values(fmt: str) -> torch.Tensor:
    from fa3_numerics.numerics.formats import get_format

    return torch.arange(256, dtype=torch.uint8).view(get_format(fmt).dtype).to(torch.float64)


def best_flip(row: torch.Tensor, s: torch.Tensor, ker_row: torch.Tensor, fmt: str, tile: tuple, jj: int,
              h: int, factor: float) -> tuple:
    """(codes left differing, query i, emulator's code value, neighbour, margin in steps, scaled value) of the
    single P / dS flip in column ``jj`` of the tile that best gives the kernel's row."""
    from fa3_numerics.numerics.formats import cast

    (xin, ofmt, desc, via, op), (a_op, b_op, _) = tile
    col = op.raw[0, h, :, jj].double()
    scaled = xin[0, h, :, jj] / desc.reshape(-1)[0].to(xin.dtype) if desc is not None else xin[0, h, :, jj]
    scaled = (scaled.to(via) if via is not None else scaled).double()
    vals = code_values(ofmt)
    fin = vals[torch.isfinite(vals)].unique()
    idx = torch.searchsorted(fin, col)
    other = b_op.raw[0, h].double() if b_op.raw is not None else b_op.value()[0, h].double()
    d = factor
    for t in (a_op.d, b_op.d):
        if t is not None:
            d *= float(t.reshape(-1)[0])
    best = None
    for nb in (fin[(idx + 1).clamp(max=len(fin) - 1)], fin[(idx - 1).clamp(min=0)]):
        new = cast((row.double()[None, :] + (nb - col)[:, None] * other * d).float() * s, fmt).view(torch.uint8)
        miss = (new != ker_row[None, :]).sum(-1)
        i = int(miss.argmin())
        margin = float((scaled[i] - (col[i] + nb[i]) / 2).abs() / (nb[i] - col[i]).abs())
        cand = (int(miss[i]), i, float(col[i]), float(nb[i]), margin, float(scaled[i]))
        if best is None or cand[0] < best[0]:
            best = cand
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--rows", type=int, default=8, help="the worst rows per gradient to fit a flip to")
    ap.add_argument("--acc", default="fp22", choices=("fp22", "fp32"), help="bwd.acc (fp32: a dry run's stand-in)")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    if not Path(a.npz).is_file():
        print(f"error: {a.npz} not found; it is written by tools/device/cudnn_bwd_h200.py", file=sys.stderr)
        return 2
    from fa3_numerics.numerics.formats import cast, get_format
    from fit_cudnn_bwd import cases

    for name, arm, d in cases(a.npz):
        c = d["case"]
        sc = torch.tensor(1.0 / math.sqrt(c["head_dim"]), dtype=torch.float32)
        tr = traced_backward(d, a.acc)
        if tr["folded"]:
            sc = torch.tensor(1.0, dtype=torch.float32)
        fmt = d["grad_fmt"]
        for g, key in (("dv", "scale_dV"), ("dk", "scale_dK")):
            s = torch.tensor(d["scalars"][key], dtype=torch.float32)
            tcasts, tprods = tr[g]
            x = torch.cat([p[2] for p in tprods], dim=2)
            ker = d["raw"][g].view(torch.uint8)
            variants = {"": x * sc * s if g == "dk" else x * s}
            if g == "dk":
                variants["scale folded into scale_dK"] = x * (sc * s)
            amax = float(variants[""].abs().max() / s)
            print(f"{name} {arm} {g}: amax emulator {amax:.9g}, kernel {get_format(fmt).max / float(s):.9g}")
            for label, xs in variants.items():
                diff = cast(xs, fmt).view(torch.uint8) != ker
                rows: dict = {}
                for _, h, j, _ in diff.nonzero().tolist():
                    rows[(h, j)] = rows.get((h, j), 0) + 1
                counts = sorted(rows.values(), reverse=True)
                print(f"  {label or 'as the preset casts'}: {int(diff.sum())} of {diff.numel()} codes differ, in "
                      f"{len(rows)} (head, key) rows {counts[:10]}")
                if label:
                    continue
                bn = tprods[0][2].shape[2]
                for (h, j), cnt in sorted(rows.items(), key=lambda t: -t[1])[:a.rows]:
                    t, jj = divmod(j, bn)
                    row = (x[0, h, j] * sc) if g == "dk" else x[0, h, j]
                    left, i, mine, nb, margin, scaled = best_flip(
                        row, s, ker[0, h, j], fmt, (tcasts[t], tprods[t]), jj, h, float(sc) if g == "dk" else 1.0)
                    what = "P" if g == "dv" else "dS"
                    print(f"    h{h} key {j}: {cnt} differ; {what}[query {i}] {mine:.6g} -> {nb:.6g} leaves {left} "
                          f"(scaled {what} {scaled:.9g}, {margin:.2e} of a step from the boundary)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
