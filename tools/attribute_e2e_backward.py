"""Where an end-to-end backward miss comes from, on the CPU, from a kernel run dumped by
``tools/device/dump_backward_case.py`` (its ``kernel_o``, ``kernel_lse`` and kernel gradients).

``validate --backward``'s end-to-end mode runs the emulator's own forward, then its backward; the
kernel-fwd mode runs the same backward from the kernel's O and LSE. Where kernel-fwd is exact and
end-to-end is not, the forward's O (through D = rowsum(dO O)) or its LSE (through P) carries the miss.
This draws the case's inputs again (bit for bit, as validate draws them), runs the emulator's forward
and prints, per case: how many O values and LSE entries differ from the kernel's, and F of dQ / dK / dV
(with the count of values that differ) against the kernel's for each mix (kernel O + emulator LSE, emulator O + kernel LSE, both the kernel's,
both the emulator's, and the emulator's O codes at the kernel's descale of O)::

    python tools/attribute_e2e_backward.py DUMP.npz --backend cudnn-fp8 --grid small [CASE ...]

About 15 s a case (n 2048, 8 heads) on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="the .npz dump_backward_case.py wrote (with --grads dq,dk,dv)")
    ap.add_argument("--backend", default="cudnn-fp8", help="whose backward recipe the case ran (as dumped)")
    ap.add_argument("--grid", default="small")
    ap.add_argument("cases", nargs="*", help="default: every case in the dump")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.numerics.backward import Forward, backward_from, run_forward
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.studies.validate import grid
    from fa3_numerics.studies.validate_backward import backward_recipe, case_tensors

    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        z = np.load(args.dump)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read the dump {args.dump} ({exc}); pass the .npz dump_backward_case.py wrote",
              file=sys.stderr)
        return 2
    names = args.cases or sorted({k.split("/")[0] for k in z.files})
    by_name = {c.name: c for c in grid(args.grid)}
    backend = get_backend(args.backend)
    for name in names:
        if name not in by_name or f"{name}/kernel_dq" not in z.files:
            print(f"error: {name!r} is not a {args.grid} case with dumped gradients in {args.dump}", file=sys.stderr)
            return 2
        c = by_name[name]
        drawn = case_tensors(c)
        q, k, v, do, scale, ref = (drawn[x] for x in ("q", "k", "v", "do", "scale", "ref"))
        r = backward_recipe(c, backend)
        kernel = {g: torch.from_numpy(z[f"{name}/kernel_{g}"]).to(torch.float64) for g in ("dq", "dk", "dv")}
        ko = torch.from_numpy(z[f"{name}/kernel_o"]).to(torch.float64)
        kl = torch.from_numpy(z[f"{name}/kernel_lse"]).to(torch.float32)
        emu = run_forward(r, q, k, v, causal=c.causal, softmax_scale=scale, rotation_seed=c.seed)
        eo, el = emu.o.to(torch.float64), emu.lse.to(torch.float32)
        print(f"{name}: O values differing {int((eo != ko).sum())} of {eo.numel()}; LSE entries differing "
              f"{int((el != kl).sum())} of {el.numel()} (max |diff| {float((el - kl).abs().max()):.3g})")
        # O written in FP8 with one descale per tensor (oscale=amax): the emulator's codes at the kernel's descale
        # tell a miss in a few codes from a descale one ulp apart (amax_O taken from one float32 value)
        both = (eo != 0) & (ko != 0)
        ratio = float((eo[both] / ko[both]).median()) if bool(both.any()) else 1.0
        eo_at_k = (eo / ratio).to(torch.float32).to(torch.float64)
        print(f"  descale of O, emulator / kernel: {ratio:.9f}; at the kernel's descale "
              f"{int((eo_at_k != ko).sum())} O values differ")
        for label, o, lse in (("kernel O + kernel LSE (kernel-fwd)", ko, kl), ("kernel O + emulator LSE", ko, el),
                              ("emulator O + kernel LSE", eo, kl), ("emulator O + emulator LSE (end-to-end)", eo, el),
                              ("emulator O at the kernel's descale + emulator LSE", eo_at_k, el)):
            gr = backward_from(r, q, k, v, Forward(o, lse), do, causal=c.causal, softmax_scale=scale,
                               rotation_seed=c.seed)
            parts = []
            for g in ("dq", "dk", "dv"):
                e = getattr(gr, g).to(torch.float64)
                # compared as the float32 values the dump holds: FP8 codes over a float32 scale
                n_diff = int((e.to(torch.float32) != kernel[g].to(torch.float32)).sum())
                parts.append(f"{g} F {fidelity(e, kernel[g], ref[g])['F']:.4f} ({n_diff} of {e.numel()} values differ)")
            print(f"  {label}: " + ", ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
