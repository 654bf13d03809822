"""Kernel outputs of chosen validation cases of the SageAttention backends, one head each, for
fitting the sage1 / sage2 presets on the CPU.

For each ``CASE:HEAD`` given (a validation grid's case name and a query head), the case's inputs
are drawn on the GPU as ``validate`` draws them, handed to the kernel as the backend hands them
(rotation applied, rounded once to FP16/BF16), and the kernel's output kept for that head, with
the emulator's CUDA output of the preset beside it. Saved per case (prefix ``NAME/hH/``): ``q``,
``k``, ``v`` (the kernel's FP16/BF16 inputs of that query head and its KV head, [N, D]),
``o_kernel``, ``o_emulator`` ([N, D], the output dtype) and ``meta`` (JSON: case fields, the
preset's spec, causal, softmax scale; ``rot_applied``: the inputs are already rotated, so emulate
them with ``rot=none``). F of that head is printed for each, so the call also says which heads
still fail. Needs CUDA and the backend's kernel::

    python3 tools/device/dump_sage.py --backend sage2 --grid small --out DIR \
        fp8-n1000-d128-h8-causal-p0.001s10-head:6 ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", required=True, choices=["sage1", "sage2"])
    ap.add_argument("--grid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("cases", nargs="+", help="CASE:HEAD")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.reference import reference_attention
    from fa3_numerics.studies.validate import case_recipe, grid

    kernel = get_backend(args.backend)
    why = kernel.check("cuda")
    if why is not None:
        print(f"error: the {args.backend} kernel cannot run here: {why}", file=sys.stderr)
        return 2
    mod = sys.modules[type(kernel).__module__]
    by_name = {c.name: c for c in grid(args.grid)}
    arrays: dict[str, np.ndarray] = {}
    for item in args.cases:
        name, _, head = item.rpartition(":")
        if name not in by_name:
            print(f"error: no case {name!r} in grid {args.grid}", file=sys.stderr)
            return 2
        c, h = by_name[name], int(head)
        r = case_recipe(c, backend=kernel)
        dist, params = c.data()
        q, k, v = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                             c.seed).draw("cuda")
        qi, ki, vi = mod.kernel_inputs(r, q, k, v, c.seed)
        scale = c.scale or 1.0 / math.sqrt(c.head_dim)
        idx = torch.arange(c.seqlen, device="cuda")
        o_k = kernel.attention(r, q, k, v, causal=c.causal, q_index=idx, rotation_seed=c.seed, cache={},
                               softmax_scale=scale)
        o_e = emulate(r, q, k, v, causal=c.causal, softmax_scale=scale, q_index=idx, rotation_seed=c.seed, cache={})
        ref = reference_attention(q, k, v, causal=c.causal, softmax_scale=scale)
        hk = h // (c.heads // c.kv_heads)
        ok, oe, rf = o_k[0, h], o_e[0, h], ref[0, h]
        fid = fidelity(oe, ok, rf)
        f, ident = fid["F"], fid["identical"]
        print(f"{args.backend} {name} head {h}: F {f:.4f}, identical {ident:.1%}", flush=True)
        p = f"{name}/h{h}/"
        out_dtype = torch.float16 if r.inp == "fp16" else torch.bfloat16
        for key, t in (("q", qi[0, h]), ("k", ki[0, hk]), ("v", vi[0, hk]), ("o_kernel", ok.to(out_dtype)),
                       ("o_emulator", oe.to(out_dtype))):
            t = t.contiguous().cpu()
            arrays[p + key] = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        meta = {"case": name, "head": h, "kv_head": hk, "spec": r.short_str(), "causal": bool(c.causal),
                "softmax_scale": scale, "seqlen": c.seqlen, "head_dim": c.head_dim, "inp": r.inp,
                "rot_applied": r.rot, "F_head": f, "identical_head": ident,
                "bf16_stored_as_int16": out_dtype == torch.bfloat16 or r.inp == "bf16"}
        arrays[p + "meta"] = np.array(json.dumps(meta))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{args.backend}_{args.grid}_cases.npz.part"
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    tmp.replace(out / f"{args.backend}_{args.grid}_cases.npz")
    print(f"wrote {out / f'{args.backend}_{args.grid}_cases.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
