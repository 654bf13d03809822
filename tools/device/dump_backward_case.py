"""A backend's forward + backward outputs on chosen cases of ``validate --backward``, beside the
emulated backward from the kernel's own O and LSE, for finding on the CPU where they part.

The inputs are not saved: ``validate --backward`` draws them on the CPU from the case's seed
(``studies.validate_backward.case_tensors``), so the CPU draws them again bit
for bit. Saved per case (prefix ``NAME/``), float32 [B, H, N, D] (dK, dV at the KV heads):
``kernel_o``, ``kernel_lse`` ([B, H, N]), ``kernel_dq`` / ``kernel_dk`` / ``kernel_dv`` and
``emulator_dq`` / ... (the kernel-fwd mode's), of the gradients in ``--grads``; ``meta`` (JSON: the
recipe, the backend's last scalars). Per head and gradient the log prints F and the query rows
(or key rows) whose values differ most, so the call alone says where the misses are::

    python3 tools/device/dump_backward_case.py --backend cudnn-fp8 --grid small --out DIR \
        fp8-n333-d128-h8-p0.001s10-head
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--grid", default="small")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (cpu only for a dry run with a stand-in kernel)")
    ap.add_argument("--grads", default="dq,dk,dv", help="which gradients to keep (comma-separated)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the kernel this many times more: run-to-run F (each run against the first) and the "
                         "end-to-end emulator's F against each run, to tell kernel nondeterminism from a model miss")
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.numerics.backward import Forward, backward_from
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.studies.validate import grid
    from fa3_numerics.studies.validate_backward import backward_recipe, case_tensors

    torch.backends.cuda.matmul.allow_tf32 = False
    backend = get_backend(args.backend)
    why = backend.check(args.device)
    if why is not None:
        print(f"error: backend {args.backend} cannot run here: {why}", file=sys.stderr)
        return 2
    keep = [g for g in args.grads.split(",") if g]
    by_name = {c.name: c for c in grid(args.grid)}
    arrays: dict[str, np.ndarray] = {}
    f32 = lambda t: t.detach().to(torch.float32).cpu().contiguous().numpy()  # noqa: E731
    for name in args.cases:
        if name not in by_name:
            print(f"error: no case {name!r} in grid {args.grid}", file=sys.stderr)
            return 2
        c = by_name[name]
        drawn = case_tensors(c)
        q, k, v, do, scale, ref = (drawn[x] for x in ("q", "k", "v", "do", "scale", "ref"))
        r = backward_recipe(c, backend)
        qd, kd, vd, dod = (t.to(args.device) for t in (q, k, v, do))
        shared: dict = {}  # prepare's quantized inputs, kept for the end-to-end emulator as validate keeps them
        ker = backend.gradients(r, qd, kd, vd, dod, causal=c.causal, softmax_scale=scale, rotation_seed=c.seed,
                                cache=shared)
        gr = backward_from(r, qd, kd, vd, Forward(ker["o"].to(torch.float64), ker["lse"].to(torch.float32)), dod,
                           causal=c.causal, softmax_scale=scale, rotation_seed=c.seed)
        emu = {"dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
        p = f"{name}/"
        arrays[p + "kernel_o"], arrays[p + "kernel_lse"] = f32(ker["o"]), f32(ker["lse"])
        for g in ("dq", "dk", "dv"):
            kg, eg, rg = ker[g].to(torch.float64).cpu(), emu[g].to(torch.float64).cpu(), ref[g]
            fid = fidelity(eg, kg, rg)
            err = (eg - kg).pow(2).sum(-1)  # [B, H, rows]
            print(f"{args.backend} {name} {g}: F {fid['F']:.4f}, identical {fid['identical']:.2%}", flush=True)
            for hh in range(kg.shape[1]):
                top = torch.argsort(err[0, hh], descending=True)[:8].tolist()
                share = float(err[0, hh, top].sum() / err[0, hh].sum().clamp_min(1e-300))
                print(f"  head {hh}: F {fidelity(eg[0, hh], kg[0, hh], rg[0, hh])['F']:.4f}, rows "
                      f"differing {int((eg[0, hh] != kg[0, hh]).any(-1).sum())}/{kg.shape[2]}, worst rows {top} "
                      f"({share:.0%} of the squared error)", flush=True)
            if g in keep:
                arrays[p + "kernel_" + g], arrays[p + "emulator_" + g] = f32(kg), f32(eg)
        last = getattr(type(backend), "last_backward", {}) or {}
        if args.repeat > 1:
            from fa3_numerics.numerics.backward import emulate_backward

            e2e = emulate_backward(r, qd, kd, vd, dod, causal=c.causal, softmax_scale=scale,
                                   rotation_seed=c.seed, cache=shared)
            runs = [ker] + [backend.gradients(r, qd, kd, vd, dod, causal=c.causal, softmax_scale=scale,
                                              rotation_seed=c.seed, cache={}) for _ in range(args.repeat - 1)]
            for i, kr in enumerate(runs):
                line = []
                for g in ("o", "dq", "dk", "dv"):
                    kg = kr[g].to(torch.float64).cpu()
                    rg = ref[g]
                    same = fidelity(kg, runs[0][g].to(torch.float64).cpu(), rg)["F"]
                    emu_g = (e2e.forward.o if g == "o" else getattr(e2e, g)).to(torch.float64).cpu()
                    line.append(f"{g} run-vs-first {same:.4f} e2e {fidelity(emu_g, kg, rg)['F']:.4f}")
                lse_diff = int((kr["lse"].float().cpu() != e2e.forward.lse.float().cpu()).sum())
                print(f"  run {i}: " + "; ".join(line) + f"; LSE entries differing from the emulator's {lse_diff}",
                      flush=True)
            print(f"  last run's scalars: {json.dumps(getattr(type(backend), 'last_backward', {}), default=float)}")
        meta = {"case": name, "grid": args.grid, "backend": args.backend, "spec": r.short_str(),
                "causal": bool(c.causal), "softmax_scale": scale, "seed": c.seed,
                "shape": [c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim], "last_backward": last}
        arrays[p + "meta"] = np.array(json.dumps(meta, default=float))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{args.backend}_backward_cases.npz.part"
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    tmp.replace(out / f"{args.backend}_backward_cases.npz")
    print(f"wrote {out / f'{args.backend}_backward_cases.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
