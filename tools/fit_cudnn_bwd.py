"""Fit the emulated cuDNN FP8 backward to what the kernel wrote, offline, from
``tools/device/cudnn_bwd_h200.py``'s ``cudnn_bwd_cases.npz`` (its FP8 inputs, the kernel's O, Stats and
dQ, dK, dV bytes and every scale).

For each saved case and arm it rebuilds the emulator's inputs from the very bytes the kernel read,
runs the backward from the kernel's own O and Stats (``numerics.backward.backward_from``) under each
candidate recipe (``--candidates``: recipe keys that replace the arm's ``cudnn-fp8-kernel`` recipe's) and
prints, per gradient, F_q = RMSE(emulator, kernel) / RMSE(kernel, fp64 on the FP8 inputs), F = the same
against fp64 on the original inputs (the device run's F: the case's family inputs and dO are drawn again
on the CPU, as ``cudnn_bwd_h200.case_inputs`` drew them) and the share of output codes that are equal
(the kernel writes code = x * scale_dX, the emulator x / descale: equal codes, not bit-equal values, is
the match).

    python tools/fit_cudnn_bwd.py /path/to/cudnn_bwd_cases.npz --candidates 'bwd.acc=fp22' 'bwd.acc=fp22,bwd.bn=64'

The defaults compare dQ's dS cast directly (as dK's) with the FP16 step cuDNN takes (``bwd.dqcast``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "device"))

_DT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _fp8(a: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).view(_DT[fmt])


def cases(path: str):
    """Yield (case name, arm, dict of float64 tensors and scalars) for every arm the kernel ran."""
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    for c in meta["cases"]:
        name = c["name"]
        # keys are "<case>/<arm>/<name>"; a case name may itself hold "/" (h2/2), an arm holds ":"
        rest = [k[len(name) + 1:] for k in z.files if k.startswith(name + "/")]
        arms = sorted({x.split("/")[0] for x in rest if ":" in x.split("/")[0]})
        if not arms:
            continue
        dq_, dk_, dv_ = (float(x) for x in z[f"{name}/descales_qkv"])
        q = _fp8(z[f"{name}/q"], "e4m3").double() * dq_
        k = _fp8(z[f"{name}/k"], "e4m3").double() * dk_
        v = _fp8(z[f"{name}/v"], "e4m3").double() * dv_
        for arm in arms:
            do_fmt, grad_fmt = arm.split(":")
            sc = json.loads(str(z[f"{name}/{arm}/scalars"]))
            do = _fp8(z[f"{name}/{arm}/do"], do_fmt).double() * sc["descale_dO"]
            o = _fp8(z[f"{name}/{arm}/o_raw"], "e4m3").double() / sc["scale_o"]
            lse = torch.from_numpy(z[f"{name}/{arm}/stats"])[..., 0].float()
            raw = {g: _fp8(z[f"{name}/{arm}/{g}_raw"], grad_fmt) for g in ("dq", "dk", "dv")}
            yield name, arm, {"case": c, "q": q, "k": k, "v": v, "do": do, "o": o, "lse": lse, "raw": raw,
                              "scalars": sc, "do_fmt": do_fmt, "grad_fmt": grad_fmt}


def original_reference(d: dict) -> dict:
    """fp64 gradients of exact attention on the case's original (unquantized) inputs: the device run's
    reference, drawn again from the case's family and seed (``cudnn_bwd_h200.case_inputs``)."""
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from cudnn_bwd_h200 import Case, case_inputs

    c = d["case"]
    case = Case(c["family"], c["seqlen"], c["head_dim"], c["causal"], c["heads"], c["kv_heads"], c["seed"])
    q, k, v, do = case_inputs(case)
    return dict(zip(("o", "dq", "dk", "dv"), reference_gradients(q, k, v, do, causal=c["causal"],
                                                                 softmax_scale=1.0 / math.sqrt(c["head_dim"]))))


def score(d: dict, extra: str, ref0: dict | None = None) -> dict:
    from fa3_numerics.kernels.cudnn import decode
    from fa3_numerics.numerics.backward import Forward, backward_from
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from fa3_numerics.numerics.formats import cast
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.recipe import Recipe
    from cudnn_bwd_h200 import Arm, arm_recipe

    r = arm_recipe(Arm(d["do_fmt"], d["grad_fmt"]), "fp32")
    if extra:
        # the candidate's keys replace the arm's
        given = {x.split("=", 1)[0] for x in extra.split(",")}
        kept = [x for x in r.spec().split(",") if x.split("=", 1)[0] not in given]
        r = Recipe.from_str(",".join(kept + [extra]))
    c = d["case"]
    scale = 1.0 / math.sqrt(c["head_dim"])
    gr = backward_from(r, d["q"], d["k"], d["v"], Forward(d["o"], d["lse"]), d["do"], causal=c["causal"],
                       softmax_scale=scale)
    ref = dict(zip(("o", "dq", "dk", "dv"), reference_gradients(d["q"], d["k"], d["v"], d["do"], causal=c["causal"],
                                                                softmax_scale=scale)))
    out = {}
    for g, emu in (("dq", gr.dq), ("dk", gr.dk), ("dv", gr.dv)):
        s = d["scalars"][f"scale_d{g[1].upper()}"]
        ker = decode(d["raw"][g], s)
        codes = cast(emu * s, d["grad_fmt"])
        eq = codes.view(torch.uint8) == d["raw"][g].view(torch.uint8)
        same = float(eq.double().mean())
        out[g] = {"F_q": fidelity(emu, ker, ref[g])["F"], "codes_equal": same, "codes_differ": int((~eq).sum())}
        if ref0 is not None:
            out[g]["F"] = fidelity(emu, ker, ref0[g])["F"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--candidates", nargs="+", default=["bwd.acc=fp22,bwd.dqcast=direct",
                                                        "bwd.acc=fp22,bwd.dqcast=fp16"])
    ap.add_argument("--no-original", action="store_true",
                    help="skip F against the original inputs (F_q only: no family inputs drawn again)")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    if not Path(a.npz).is_file():
        print(f"error: {a.npz} not found; it is written by tools/device/cudnn_bwd_h200.py", file=sys.stderr)
        return 2
    rows = []
    ref0, ref0_of = None, None
    for name, arm, d in cases(a.npz):
        if not a.no_original and ref0_of != name:
            ref0, ref0_of = original_reference(d), name
        for cand in a.candidates:
            res = score(d, cand, ref0)
            rows.append({"case": name, "arm": arm, "candidate": cand, **res})
            print(f"{name:32} {arm:10} {cand:48} " + "  ".join(
                f"{g}" + (f" F {res[g]['F']:.4f}" if "F" in res[g] else "") +
                f" F_q {res[g]['F_q']:.4f} codes {100 * res[g]['codes_equal']:6.2f}% ({res[g]['codes_differ']} differ)"
                for g in ("dq", "dk", "dv")),
                flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
