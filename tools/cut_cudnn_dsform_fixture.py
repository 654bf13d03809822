"""Cut the test fixture of ``bwd.dsform=cudnn-ffma`` and ``bwd.dqscale=end`` from a saved causal ``cudnn_bwd_h200.py`` case (MHA):
one head, the first ``--rows`` query and key rows, and one pin row after them.

Under the causal mask dQ[i] = sum_{j <= i} dS[i, j] K[j] reads only rows <= i, so the kernel's dQ codes of
the first rows are reproduced from those rows alone, given the same scale_dP and the same per-tensor
descales. scale_dP comes from the amax of dS over the whole call: the cut must hold its argmax (checked, not
assumed). The descales are re-derived from the cut's own amax: the pin row holds, for each of Q, K, V, dO
and O, a row of that tensor with its max code (from any head), and an infinite LSE, so that its P, and so
every dS it touches, is 0 (its key row is seen only by itself, being last).

    python tools/cut_cudnn_dsform_fixture.py NPZ --case NAME --arm e5m2:e5m2 --rows 300 --out tests/fixtures/X.npz
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MAXC = {"e4m3": 448.0, "e5m2": 57344.0}
DTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def dq_codes(t: dict, sc: dict, do_fmt: str, grad_fmt: str, dsform: str, dqscale: str = "end") -> torch.Tensor:
    """uint8 codes of dQ at the kernel's scale_dQ: cudnn-fp8-kernel's backward at ``bwd.dsform`` and
    ``bwd.dqscale`` from the float64 tensors of ``t`` (q, k, v, do, o [1, 1, N, D]; lse [1, 1, N]), causal."""
    from fa3_numerics.numerics.backward import Forward, backward_from
    from fa3_numerics.numerics.formats import cast
    from fa3_numerics.numerics.recipe import get_recipe
    from fa3_numerics.kernels.cudnn import bwd_formats

    keys = {**bwd_formats(do_fmt, grad_fmt), "bwd_out": "fp32", "bwd_dsform": dsform, "bwd_dqscale": dqscale}
    r = dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, **keys)
    gr = backward_from(r, t["q"], t["k"], t["v"], Forward(t["o"], t["lse"]), t["do"], causal=True,
                       softmax_scale=1.0 / math.sqrt(t["q"].shape[-1]))
    return cast(gr.dq.to(torch.float32) * torch.tensor(sc["scale_dQ"], dtype=torch.float32), grad_fmt).view(torch.uint8)


def decode(z, sc: dict, do_fmt: str) -> dict:
    """The fixture's float64 tensors from its codes (inputs: code * descale, O: code * descale_o)."""
    dec = lambda a, f, s: torch.from_numpy(np.ascontiguousarray(a)).view(DTS[f]).double() * s  # noqa: E731
    return {"q": dec(z["q"], "e4m3", sc["descale_q"]), "k": dec(z["k"], "e4m3", sc["descale_k"]),
            "v": dec(z["v"], "e4m3", sc["descale_v"]), "do": dec(z["do"], do_fmt, sc["descale_dO"]),
            "o": dec(z["o"], "e4m3", sc["descale_o"]), "lse": torch.from_numpy(np.asarray(z["lse"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--case", required=True)
    ap.add_argument("--arm", default="e5m2:e5m2")
    ap.add_argument("--head", type=int, default=0)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from fit_cudnn_bwd import cases

    hit = [d for name, arm, d in cases(a.npz) if name == a.case and arm == a.arm]
    if not hit:
        print(f"error: {a.case} {a.arm} not in {a.npz}", file=sys.stderr)
        return 2
    d = hit[0]
    if not d["case"]["causal"] or d["case"]["heads"] != d["case"]["kv_heads"]:
        print("error: the cut needs an MHA case with a causal mask", file=sys.stderr)
        return 2
    sc, h, n, do_fmt, grad_fmt = d["scalars"], a.head, a.rows, d["do_fmt"], d["grad_fmt"]
    # codes of every tensor as the kernel read them (O as code / scale_o, which the fit decodes)
    z = np.load(a.npz)
    pre = f"{a.case}/"
    raw = {"q": z[pre + "q"], "k": z[pre + "k"], "v": z[pre + "v"], "do": z[pre + f"{a.arm}/do"],
           "o": z[pre + f"{a.arm}/o_raw"]}
    fmts = {"q": "e4m3", "k": "e4m3", "v": "e4m3", "do": do_fmt, "o": "e4m3"}
    sc = dict(sc, descale_o=float(np.float32(1.0) / np.float32(sc["scale_o"])))
    cut = {}
    for t, arr in raw.items():
        vals = torch.from_numpy(np.ascontiguousarray(arr)).view(DTS[fmts[t]]).float()
        where = (vals.abs() == MAXC[fmts[t]]).any(-1).nonzero()
        if not len(where):
            print(f"error: {t} holds no max code: its descale cannot be pinned", file=sys.stderr)
            return 2
        _, hh, i = where[0].tolist()
        cut[t] = np.concatenate([arr[:, h:h + 1, :n], arr[:, hh:hh + 1, i:i + 1]], axis=2)
    lse = np.concatenate([d["lse"][:, h:h + 1, :n].numpy(), np.full((1, 1, 1), np.inf, np.float32)], axis=2)
    fix = {**{t: cut[t] for t in raw}, "lse": lse.astype(np.float32)}
    tens = decode(fix, sc, do_fmt)
    ker = d["raw"]["dq"].view(torch.uint8)[:, h:h + 1, :n]
    res = {}
    for form, where in (("fa3", "end"), ("cudnn", "end"), ("cudnn-ffma", "tile"), ("cudnn-ffma", "end")):
        res[f"{form}/{where}"] = int((dq_codes(tens, sc, do_fmt, grad_fmt, form, where)[:, :, :n] != ker).sum())
    print(f"{n} rows of head {h}: dQ codes differing from the kernel's {res}")
    meta = {"source": Path(a.npz).name, "case": a.case, "arm": a.arm, "head": h, "rows": n, "scalars": sc,
            "case_meta": d["case"], "differ": res}
    out = Path(a.out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, meta=json.dumps(meta), dq=ker.numpy(), **fix)
    os.replace(tmp, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
