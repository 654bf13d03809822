"""SageAttention2's per-thread INT8 quantizer on the GPU against the emulator's models of it, scale by scale
and code by code: the direct check of the fused scale (``fma(max|x|, rcp(127), 1e-7)``, one rounding)
that the sage2-sm90 preset adopted from the kernel's outputs.

For each validation case named (default: the two whose heads showed it), the case's inputs are drawn
as ``validate`` draws them and handed over as the sage2 backend hands them (``kernel_inputs``); K is
smoothed as ``core.py`` does (``k.mean`` on the GPU, ``k - km`` in the input dtype), and the package's
``per_thread_int8`` (Triton) quantizes Q and K (BLKQ 64, WARPQ 16, BLKK 128, WARPK 128, as
``sageattn_qk_int8_pv_fp8_cuda_sm90`` calls it). The emulator's ``triton_quantize_int`` quantizes the
same FP16 values once with the scale fused and once with it rounded twice; printed per case and
tensor: the scales and codes each model gets wrong, and the GPU's K mean against the emulator's.
Needs CUDA and the built package (``FA3N_SAGE2_PATH``, as tools/device/sage2_h200.sh sets it);
``--mock`` runs on the CPU with the emulator's fused model standing in for the Triton kernel (it must
report 0 for the fused model)::

    python3 tools/device/sage2_scales.py [--mock] [--grid stress] [CASE ...]
"""

from __future__ import annotations

import argparse
import sys

CASES = {"stress": ["fp8-n2048-d128-h8-causal-p0.02s100-tensor", "fp8-n2048-d128-h8-kv1-p0.01s30-head"],
         "small": ["fp8-n1000-d128-h8-kv2-causal-p0.001s10-head-hadamard", "fp8-n2048-d128-h8-p0s10-head"]}


def _scale_index(n: int, q: bool):
    """Index into the kernel's scale vector for each token: Q rows {r, r+8} of each 16-row slice share
    scale (r // 16) * 8 + r % 8; K keys of a 128-key block share (k // 128) * 4 + (k % 8) // 2."""
    import torch

    t = torch.arange(n)
    return (t // 16) * 8 + t % 8 if q else (t // 128) * 4 + (t % 8) // 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mock", action="store_true", help="CPU, the fused model as the kernel (plumbing check)")
    ap.add_argument("--grid", default=None, help="the cases' grid (default: stress and small)")
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args(argv)

    import torch

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.numerics import sage_quant
    from fa3_numerics.numerics.granularity import PerThread
    from fa3_numerics.numerics.sage_quant import smooth_k_in, triton_quantize_int
    from fa3_numerics.studies.validate import case_recipe, grid

    backend = get_backend("sage2")
    dev = "cpu" if args.mock else "cuda"
    if args.mock:
        def per_thread(q, k, km):
            ks = (k - km).to(torch.float64)
            qq = triton_quantize_int(q.to(torch.float64), "int8", PerThread(16, 1), block_rows=64, scale=1.0, eps=1e-7)
            kq = triton_quantize_int(ks, "int8", PerThread(128, 2), block_rows=128, scale=1.0, eps=1e-7)
            qs = torch.zeros(q.shape[:2] + (int(_scale_index(q.shape[2], True).max()) + 1,))
            kss = torch.zeros(k.shape[:2] + (int(_scale_index(k.shape[2], False).max()) + 1,))
            qs[..., _scale_index(q.shape[2], True)] = qq.descale[..., 0]
            kss[..., _scale_index(k.shape[2], False)] = kq.descale[..., 0]
            return qq.values, qs, kq.values, kss
    else:
        why = backend.check("cuda")
        if why is not None:
            print(f"error: the sage2 kernel cannot run here: {why}", file=sys.stderr)
            return 2
        from fa3_numerics.kernels.sage2 import load_kernel

        mod = load_kernel()[2]
        quant = __import__(mod.__name__ + ".triton.quant_per_thread", fromlist=["per_thread_int8"])

        def per_thread(q, k, km):
            return quant.per_thread_int8(q, k, km, BLKQ=64, WARPQ=16, BLKK=128, WARPK=128, tensor_layout="HND")
    from fa3_numerics.kernels.sage import kernel_inputs

    grids = [args.grid] if args.grid else list(CASES)
    bad = 0
    for g in grids:
        by_name = {c.name: c for c in grid(g)}
        for name in args.cases or CASES.get(g, []):
            if name not in by_name:
                print(f"error: no case {name!r} in grid {g}", file=sys.stderr)
                return 2
            c = by_name[name]
            r = case_recipe(c, backend=backend)
            dist, params = c.data()
            q, k, v = DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                                 c.seed).draw(dev)
            qi, ki, _ = kernel_inputs(r, q, k, v, c.seed)
            km = ki.mean(dim=2, keepdim=True)
            q8, qs, k8, ks = per_thread(qi, ki, km)
            km_emul = sage_quant.input_round(ki.to(torch.float64).mean(dim=2, keepdim=True), r.inp)
            ksm = (ki - km).to(torch.float64)
            line = [f"{g} {name}: K mean channels differing from the emulator's {int((km.double() != km_emul).sum())}"
                    f"/{km.numel()}"]
            for label, fused in (("fused", True), ("two roundings", False)):
                saved = sage_quant.fma32
                if not fused:
                    sage_quant.fma32 = lambda a, b, c: ((a * b).to(torch.float32) + c).to(torch.float32)
                try:
                    eq = triton_quantize_int(qi.to(torch.float64), "int8", PerThread(16, 1), block_rows=64, scale=1.0,
                                             eps=1e-7)
                    ek = triton_quantize_int(ksm, "int8", PerThread(128, 2), block_rows=128, scale=1.0, eps=1e-7)
                finally:
                    sage_quant.fma32 = saved
                n_q, n_k = qi.shape[2], ki.shape[2]
                sq = qs[..., _scale_index(n_q, True).to(qs.device)].float()
                sk = ks[..., _scale_index(n_k, False).to(ks.device)].float()
                wrong = (int((eq.descale[..., 0].to(sq.device) != sq).sum()),
                         int((ek.descale[..., 0].to(sk.device) != sk).sum()),
                         int((eq.values.to(q8.device).to(torch.int8) != q8).sum()),
                         int((ek.values.to(k8.device).to(torch.int8) != k8).sum()))
                line.append(f"{label}: Q/K scales wrong {wrong[0]}/{sq.numel()}, {wrong[1]}/{sk.numel()} "
                            f"(per token); Q/K codes wrong {wrong[2]}, {wrong[3]}")
                if fused and any(wrong):
                    bad += 1
            print("; ".join(line), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
