"""Whether the emulator's CUDA path of sage1 gives the CPU path's numbers (diagnostic, prints only).

One validation case (seqlen 1000, causal) through the sage1 kernel and the emulator on the CPU
and on CUDA: the share of outputs identical to the kernel's per device, and how many INT8 codes
of Q and K and how many outputs differ between the two devices. Needs CUDA and sageattention::

    python3 tools/device/sage_diag.py [--seqlen 1000] [--no-causal]
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=1000)
    ap.add_argument("--no-causal", action="store_true")
    args = ap.parse_args(argv)
    causal = not args.no_causal

    import torch

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.numerics.emulator import emulate, prepare
    from fa3_numerics.numerics.recipe import get_recipe
    from fa3_numerics.studies.validate import Case

    kernel = get_backend("sage1")
    why = kernel.check("cuda")
    if why is not None:
        print(f"error: the sage1 kernel cannot run here: {why}", file=sys.stderr)
        return 2
    r = get_recipe("sage1").recipe
    c = Case(seqlen=args.seqlen, causal=causal)
    dist, params = c.data()
    q, k, v = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                         c.seed).draw()
    rows = torch.arange(c.seqlen)
    ker = kernel.attention(r, q.cuda(), k.cuda(), v.cuda(), causal=causal, q_index=rows.cuda(), rotation_seed=0,
                           cache={}).cpu()
    out = {}
    for dev in ("cpu", "cuda"):
        qq, kk, vv = (t.to(dev) for t in (q, k, v))
        out[dev] = emulate(r, qq, kk, vv, causal=causal).cpu()
        pre = prepare(r, qq, kk, vv, q_index=rows.to(dev), causal=causal, cache={})
        out[dev + "_pre"] = [t.cpu() for t in (pre.q.values, pre.k.values)]
        print(f"emulator on {dev}: identical to the kernel {(out[dev] == ker).double().mean().item():.3f}")
    print("q codes differing", int((out["cpu_pre"][0] != out["cuda_pre"][0]).sum()), "k codes differing",
          int((out["cpu_pre"][1] != out["cuda_pre"][1]).sum()), "outputs differing",
          int((out["cpu"] != out["cuda"]).sum()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
