"""How often the emulators' special-function stand-ins and the bit-exact models (numerics/sfu.py)
give the H200's bits: on the probe's random samples (tools/device/mufu_probe.py, MUFU_DIR) and,
with --field, on the kernel dumps in tests/fixtures (cuDNN FP8 forward O codes; PyTorch SDPA flash
BF16 LSE and gradients under fa2math=torch; FA3 FP8, SageAttention 1 and 2 outputs), sfu=rz
(default) against sfu=h200::

    python3 tools/sfu_compare.py MUFU_DIR [--field]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def samples(folder: Path) -> None:
    from mufu_tables import load

    from fa3_numerics.numerics import sfu
    from fa3_numerics.numerics.emulator import exp2_rn, exp2_rz, flush_subnormals
    from fa3_numerics.numerics.fa2_loop import _log2_toward_zero
    from fa3_numerics.numerics.sage_quant import recip32

    _, _, s = load(folder)
    rows = {
        "ex2": [("exp2_rz (flushed)", lambda t: flush_subnormals(exp2_rz(t))),
                ("exp2_rn (flushed)", lambda t: flush_subnormals(exp2_rn(t))), ("sfu.ex2", sfu.ex2)],
        "lg2": [("log2 toward zero (fa2_loop)", _log2_toward_zero),
                ("log2 to nearest", lambda t: torch.log2(t.double()).float()), ("sfu.lg2", sfu.lg2)],
        "rcp": [("recip32 (sage_quant)", recip32), ("1/x to nearest", lambda t: (1 / t.double()).float()),
                ("sfu.rcp", sfu.rcp)],
    }
    for op, models in rows.items():
        ib, ob = s[op]["in"], s[op]["out"]
        x = ib.view(np.float32)
        with np.errstate(invalid="ignore"):
            dom = {"ex2": np.isfinite(x), "lg2": np.isfinite(x) & (x >= 2.0 ** -126),
                   "rcp": (x >= 2.0 ** -126) & (x < 2.0 ** 126)}[op]
        xt = torch.from_numpy(x.copy())
        for name, f in models:
            eq = f(xt).contiguous().view(torch.int32).numpy().view(np.uint32) == ob
            print(f"{op} samples ({int(dom.sum())} in the stand-ins' domain of {len(ob)}): {name:28s} "
                  f"{eq[dom].mean() * 100:8.3f}% identical (all samples {eq.mean() * 100:.3f}%)")


def field() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "numerics"))
    from safetensors.torch import load_file
    from test_field_fidelity import FIX, FIX_N768, _cudnn_codes, _fid

    from fa3_numerics.data.dumps import read_grouped

    from fa3_numerics.numerics.backward import Forward, backward_from, emulate_backward
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from fa3_numerics.numerics.recipe import Recipe, get_recipe

    tensors, info = read_grouped(FIX)
    base = get_recipe("cudnn-fp8-fwd").recipe.short_str()
    for case in ("c_n1024_d64", "c_n256_d64_causal_gauss"):
        for sfu in ("rz", "h200"):
            got = _cudnn_codes(f"{base},sfu={sfu}", tensors[case], info[case])
            print(f"cudnn-fp8-fwd {case} sfu={sfu}: O codes differing {int((got != tensors[case]['o8']).sum())} "
                  f"of {got.numel()}")
    n768 = {key.split("/", 1)[1]: x for key, x in load_file(str(FIX_N768)).items()}
    for label, t in (("b_n512_d64_causal", tensors["b_n512_d64_causal"]), ("n768 causal (3 splits)", n768)):
        q, k, v, do = (t[x].double() for x in ("q", "k", "v", "do"))
        ref = dict(zip(("o", "dq", "dk", "dv"), reference_gradients(q, k, v, do, causal=True)))
        kf = Forward(t["o"].double(), t["lse"].float())
        for sfu in ("rz", "h200"):
            r = Recipe.from_str(f"sdpa-flash-bf16,fa2math=torch,sfu={sfu}")
            g = emulate_backward(r, q, k, v, do, causal=True)
            alone = backward_from(r, q, k, v, kf, do, causal=True)
            got = {"o": g.forward.o, "dq": g.dq, "dk": g.dk, "dv": g.dv}
            print(f"sdpa-flash-bf16,fa2math=torch {label} sfu={sfu}: LSE identical "
                  f"{(g.forward.lse == t['lse']).double().mean().item() * 100:.2f}%, differing end to end "
                  f"{ {nm: int((x != t[nm].double()).sum()) for nm, x in got.items()} }, backward alone "
                  f"{ {nm: int((getattr(alone, nm) != t[nm].double()).sum()) for nm in ('dq', 'dk', 'dv')} }, "
                  f"F end to end { {nm: round(_fid(x, t[nm], ref[nm]), 4) for nm, x in got.items()} }")


def kernels() -> None:
    """FA3's FP8 forward (tests/fixtures/fa3_h200_s1000_h4_d128), SageAttention 1's n333 case and
    SageAttention 2's dumped rows: outputs differing from the kernel's, sfu=rz against sfu=h200."""
    sys.path.insert(0, str(ROOT / "tests" / "numerics"))
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    import test_mma
    import test_sage_quant
    from test_kernels_sage import DATA, Case

    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe

    def show(label, spec, run, want):
        for sfu in ("rz", "h200"):
            o = run(Recipe.from_str(f"{spec},sfu={sfu}"))
            print(f"{label} sfu={sfu}: outputs differing from the kernel's {int((o != want).sum())} of {o.numel()}")

    q, k, v, rows, o_k, _ = test_mma._kernel_case()
    cache: dict = {}
    show("fa3-fp8-kernel s1000 h4 d128", "fa3-fp8-kernel", lambda r: emulate(r, q, k, v, q_index=rows, cache=cache), o_k)
    with np.load(DATA) as z:
        h = {key: z[key] for key in z.files}
    c = Case(seqlen=333)
    dist, params = c.data()
    q1, k1, v1 = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                            c.seed).draw()
    r1 = torch.from_numpy(h["n333_rows"])
    show("sage1 n333", "sage1", lambda r: emulate(r, q1, k1, v1, q_index=r1, rotation_seed=c.seed),
         torch.from_numpy(h["n333_o"].astype(np.float64)))
    with np.load(test_sage_quant.FIXTURE) as z:
        fx = {key: z[key] for key in z.files}
    meta, q2, k2, v2 = test_sage_quant._rebuild(fx)
    r2 = torch.from_numpy(fx["rows"].astype(np.int64))
    show("sage2-sm90 dumped rows", meta["spec"], lambda r: emulate(r, q2, k2, v2, causal=True,
                                                                    softmax_scale=meta["softmax_scale"],
                                                                    q_index=r2)[0, 0],
         torch.from_numpy(fx["o_kernel"].astype(np.float64)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, nargs="?", help="the probe's --out folder (mufu.json)")
    ap.add_argument("--field", action="store_true", help="also the kernel dumps in tests/fixtures")
    a = ap.parse_args(argv)
    if a.folder is None and not a.field:
        print("error: give MUFU_DIR, --field, or both", file=sys.stderr)
        return 2
    if a.folder is not None:
        if not (a.folder / "mufu.json").is_file():
            print(f"error: no mufu.json in {a.folder}", file=sys.stderr)
            return 2
        samples(a.folder)
    if a.field:
        field()
        kernels()
    return 0


if __name__ == "__main__":
    sys.exit(main())
