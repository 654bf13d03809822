"""Cut the test fixture of ``bwd.pexp`` from a saved ``cudnn_bwd_h200.py`` case (MHA, not causal): one
head, every query row (dV[j] = sum_i P[i, j] dO[i] needs all of them) and the key rows whose dV codes
the kernel wrote differently from the emulator's ``bwd.pexp=fa3`` (plus one key row holding K's max
code, so that the per-tensor descale re-derived from the cut equals the kernel's). Q's and dO's max codes
must lie in that head: checked, not assumed. O and V are not stored: dV does not read them.

    python tools/cut_cudnn_pexp_fixture.py NPZ --case NAME --arm e4m3:e4m3 --head 0 --out tests/fixtures/X.npz
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


def dv_codes(q, k, do, lse, sc: dict, do_fmt: str, grad_fmt: str, pexp: str) -> torch.Tensor:
    """uint8 codes of dV at the kernel's scale_dV, the backward of cudnn-fp8-kernel at ``bwd.pexp``
    from float64 Q [1, 1, N, D], K [1, 1, nk, D], dO and LSE [1, 1, N] (O and V zero: dV reads neither)."""
    from fa3_numerics.numerics.backward import Forward, backward_from
    from fa3_numerics.numerics.formats import cast
    from fa3_numerics.numerics.recipe import get_recipe
    from fa3_numerics.kernels.cudnn import bwd_formats

    keys = {**bwd_formats(do_fmt, grad_fmt), "bwd_out": "fp32", "bwd_pexp": pexp}
    r = dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, **keys)
    gr = backward_from(r, q, k, torch.zeros_like(k), Forward(torch.zeros_like(do), lse), do, causal=False,
                       softmax_scale=1.0 / math.sqrt(q.shape[-1]))
    return cast(gr.dv.to(torch.float32) * torch.tensor(sc["scale_dV"], dtype=torch.float32), grad_fmt).view(torch.uint8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--case", required=True)
    ap.add_argument("--arm", default="e4m3:e4m3")
    ap.add_argument("--head", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from fit_cudnn_bwd import cases

    hit = [(arm, d) for name, arm, d in cases(a.npz) if name == a.case and arm == a.arm]
    if not hit:
        print(f"error: {a.case} {a.arm} not in {a.npz}", file=sys.stderr)
        return 2
    _, d = hit[0]
    if d["case"]["causal"] or d["case"]["heads"] != d["case"]["kv_heads"]:
        print("error: the cut needs an MHA case without a causal mask", file=sys.stderr)
        return 2
    sc, h, do_fmt, grad_fmt = d["scalars"], a.head, d["do_fmt"], d["grad_fmt"]
    codes = {t: (d[t][:, h:h + 1] / sc[k]) for t, k in (("q", "descale_q"), ("k", "descale_k"), ("do", "descale_dO"))}
    for t, f in (("q", "e4m3"), ("do", do_fmt)):
        if not (codes[t].abs() == MAXC[f]).any():
            print(f"error: head {h} holds no max code of {t}: the cut's descale would differ", file=sys.stderr)
            return 2
    kmax = int((codes["k"][0, 0].abs() == MAXC["e4m3"]).any(-1).nonzero()[0])
    q, k, do = d["q"][:, h:h + 1], d["k"][:, h:h + 1], d["do"][:, h:h + 1]
    lse = d["lse"][:, h:h + 1]
    ker = d["raw"]["dv"].view(torch.uint8)[:, h:h + 1]
    # which key rows differ under the old form, on the cut (all keys: P's column j reads only K[j])
    old = dv_codes(q, k, do, lse, sc, do_fmt, grad_fmt, "fa3")
    rows = sorted(set((old != ker)[0, 0].any(-1).nonzero().flatten().tolist()) | {kmax})
    sel = torch.tensor(rows)
    new = dv_codes(q, k[:, :, sel], do, lse, sc, do_fmt, grad_fmt, "cudnn")
    old_sel = old[:, :, sel]
    print(f"{len(rows)} key rows; codes differing fa3 {int((old_sel != ker[:, :, sel]).sum())}, "
          f"cudnn {int((new != ker[:, :, sel]).sum())}")
    dts = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    u8 = lambda t, f: t.to(torch.float32).to(dts[f]).view(torch.uint8).numpy()  # noqa: E731  (codes: exact)
    meta = {"source": Path(a.npz).name, "case": a.case, "arm": a.arm, "head": h, "keys": rows, "scalars": sc,
            "case_meta": d["case"]}
    out = Path(a.out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, meta=json.dumps(meta), q=u8(codes["q"], "e4m3"), k=u8(codes["k"][:, :, sel], "e4m3"),
                        do=u8(codes["do"], do_fmt), lse=lse.numpy().astype(np.float32),
                        dv=ker[:, :, sel].numpy())
    os.replace(tmp, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
