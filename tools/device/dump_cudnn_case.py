"""cuDNN's FP8 forward on whole validation cases, bytes in and bytes out, for fitting the
``cudnn-fp8-fwd`` preset on the CPU where ``validate`` still misses (issue 26: the causal n 2048 case).

For each case named (of ``--grid``), the inputs are drawn on the GPU as ``validate`` draws them and
prepared by the preset as the backend prepares them; saved per case (prefix ``NAME/``): ``q8``, ``k8``,
``v8`` (the kernel's E4M3 inputs as uint8 codes, [B, H(kv), N, D]), ``descales`` (float32: q, k, v, s,
scale_s, scale_o, descale_o), ``o8_kernel`` (O's E4M3 codes at the backend's scale_o) and
``o8_emulator`` (the preset's O on the GPU over the kernel's descale_o, as codes; ``o_emulator`` as
float32, since the preset's own scale_o may differ), ``amax`` (Amax_S, Amax_O of the
first and the scaled run) and ``meta`` (JSON). Offline, Q = code x descale (float64) reproduces the
prepared inputs exactly: the preset's descale of a tensor whose amax is 448 x descale is descale.
F per head and the rows whose codes differ are printed, so the log alone says where the misses are::

    python3 tools/device/dump_cudnn_case.py --grid small --out DIR fp8-n2048-d128-h8-causal-p0.001s10-head
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="small")
    ap.add_argument("--out", required=True)
    ap.add_argument("cases", nargs="+", help="validation case names")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.numerics.emulator import emulate, prepare
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.reference import reference_attention
    from fa3_numerics.studies.validate import case_recipe, grid

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kernel = get_backend("cudnn-fp8")
    why = kernel.check("cuda")
    if why is not None:
        print(f"error: the cudnn-fp8 kernel cannot run here: {why}", file=sys.stderr)
        return 2
    kc = sys.modules[type(kernel).__module__]
    by_name = {c.name: c for c in grid(args.grid)}
    arrays: dict[str, np.ndarray] = {}
    u8 = lambda t: t.contiguous().view(torch.uint8).cpu().numpy()  # noqa: E731
    for name in args.cases:
        if name not in by_name:
            print(f"error: no case {name!r} in grid {args.grid}", file=sys.stderr)
            return 2
        c = by_name[name]
        r = case_recipe(c, backend=kernel)
        dist, params = c.data()
        q, k, v = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                             c.seed).draw("cuda")
        scale = c.scale or 1.0 / math.sqrt(c.head_dim)
        b, h, n, d = q.shape
        hkv = k.shape[1]
        idx = torch.arange(n, device="cuda")
        pre = prepare(r, q, k, v, q_index=idx, rotation_seed=c.seed, causal=c.causal, cache={})
        ins = kc.kernel_inputs(pre, r, hkv)
        entry = kc.build_graph(q.device, b, h, hkv, n, n, d, v.shape[-1], c.causal, scale, r.out)
        first = kc.run_graph(entry, ins, 1.0, r.out)
        descale_o = kc.out_descale(first["amax_o"], r)
        scale_o = float(torch.tensor(1.0 / descale_o, dtype=torch.float32))
        res = kc.run_graph(entry, ins, scale_o, r.out)
        again = kc.run_graph(entry, ins, scale_o, r.out)
        o_k = res["o"].to(torch.float64) * descale_o
        o_e = emulate(r, q, k, v, causal=c.causal, softmax_scale=scale, q_index=idx, rotation_seed=c.seed, cache={})
        o8_e = (o_e / descale_o).to(torch.float8_e4m3fn)  # the emulator's O is code x descale_o: exact
        ref = reference_attention(q, k, v, causal=c.causal, softmax_scale=scale)
        fid = fidelity(o_e, o_k, ref)
        print(f"cudnn {name}: F {fid['F']:.4f}, identical {fid['identical']:.2%}, repeat identical "
              f"{bool(torch.equal(res['o'].view(torch.uint8), again['o'].view(torch.uint8)))}", flush=True)
        diff = res["o"].view(torch.uint8) != o8_e.view(torch.uint8)
        for hh in range(h):
            fh = fidelity(o_e[:, hh], o_k[:, hh], ref[:, hh])
            rows = torch.nonzero(diff[0, hh].any(-1)).flatten().tolist()
            print(f"  head {hh}: F {fh['F']:.4f}, codes differing {int(diff[0, hh].sum())}, rows "
                  f"{rows[:24]}{' ...' if len(rows) > 24 else ''}", flush=True)
        p = f"{name}/"
        for key in ("q", "k", "v"):
            arrays[p + key + "8"] = u8(ins[key])
        arrays[p + "o8_kernel"] = u8(res["o"])
        arrays[p + "o8_emulator"] = u8(o8_e)
        arrays[p + "o_emulator"] = o_e.to(torch.float32).cpu().numpy()  # its own scale_o may differ
        arrays[p + "descales"] = np.array([float(ins[x].item()) for x in
                                           ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s")]
                                          + [scale_o, descale_o], dtype=np.float32)
        arrays[p + "amax"] = np.array([first["amax_s"], first["amax_o"], res["amax_s"], res["amax_o"]], dtype=np.float32)
        meta = {"case": name, "grid": args.grid, "spec": r.short_str(), "causal": bool(c.causal),
                "softmax_scale": scale, "shape": [b, h, hkv, n, d], "seed": c.seed, "F": fid["F"],
                "identical": fid["identical"], "engine": entry.get("engine", ""),
                "descales_order": "descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, descale_o",
                "amax_order": "amax_s, amax_o at scale_o 1; amax_s, amax_o at scale_o"}
        arrays[p + "meta"] = np.array(json.dumps(meta))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".cudnn_cases.npz.part"
    with open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    tmp.replace(out / "cudnn_cases.npz")
    print(f"wrote {out / 'cudnn_cases.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
