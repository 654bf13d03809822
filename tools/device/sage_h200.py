"""Dumps of SageAttention 1's kernel on the H200, to fit and check the ``sage1`` preset on a CPU.

Writes into ``--out`` (the device tool's $OUT; at most 8 files come back):

- ``report.json``  environment, timings, what each part did
- ``probes.npz``   P V probes: the attention kernel called directly with INT8 codes chosen so that
                   S is an integer (P~ = exact powers of two, ``pow2``) or not (``gen``), one
                   64-key tile, FP16 V, float32 output, so that O * l gives back the FP16 tile
                   product D = P V exactly (l is known)
- ``quant.npz``    ``per_block_int8`` on two cases' FP16 Q and smoothed K (codes, scales, K mean)
- ``<grid>.npz``   per case of the ``small``, ``stress`` and ``captured`` grids that sageattn
                   runs: the kernel's output at 128 seeded query rows per (batch, head), from the
                   case's CPU-drawn float64 inputs (so a CPU regenerates the very same inputs)
- ``rcp.npz``      Triton's float32 division measured: where 1 / y differs from the correctly
                   rounded reciprocal, for every float32 mantissa (see ``rcp``)
- ``ptx.tar.gz``   the PTX and TTGIR Triton compiled for these kernels (the instructions:
                   division, FMA contraction, exp2, the MMA and its accumulator type)

Run with ``bash tools/device/sage_h200.sh`` (carry the folder holding ``.whl/``: the
sageattention and h5netcdf wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from common import log

ROWS = 128


def probes(out: Path, rep: dict) -> None:
    from sageattention.attn_qk_int8_per_block import forward as attn

    dev = "cuda"
    g = torch.Generator().manual_seed(1234)
    b, h, m, n, d = 1, 8, 128, 64, 128
    res = {}
    for kind in ("pow2", "gen"):
        q8 = torch.zeros(b, h, m, d, dtype=torch.int8)
        q8[0, :, torch.arange(m), torch.arange(m) % d] = 1  # row r reads K's column r: S[r, j] = K[j, r]
        span = torch.tensor([2, 4, 8, 12, 16, 20, 24, 24])  # exponent spread of P~ per head
        k8 = torch.zeros(b, h, n, d, dtype=torch.int8)
        for hi in range(h):
            k8[0, hi] = -torch.randint(0, int(span[hi]) + 1, (n, d), generator=g).to(torch.int8)
        v = torch.randn(b, h, n, d, generator=g)
        v[0, 1] *= torch.exp2(torch.randint(-6, 7, (n, d), generator=g).float())  # wide dynamic range
        v[0, 2] = v[0, 2].abs()  # one sign: partial sums grow
        v[0, 3] = torch.rand(n, d, generator=g) * 1000 + 1000  # FP16 overflow of the sum when P~ ~ 1
        k8[0, 3] = -torch.randint(0, 2, (n, d), generator=g).to(torch.int8)
        v16 = v.to(torch.float16)
        qs = torch.ones(b, h, 1, 1) * (1.0 if kind == "pow2" else 0.37)
        ks = torch.ones(b, h, 1, 1)
        o = attn(q8.to(dev), k8.to(dev), v16.to(dev), qs.to(dev).contiguous(), ks.to(dev).contiguous(),
                 tensor_layout="HND", output_dtype=torch.float32)
        torch.cuda.synchronize()
        res[f"{kind}_q8"], res[f"{kind}_k8"] = q8.numpy(), k8.numpy()
        res[f"{kind}_v16"], res[f"{kind}_qs"] = v16.numpy(), qs.numpy()
        res[f"{kind}_o"] = o.cpu().numpy()
    np.savez_compressed(out / "probes.npz", **res)
    rep["probes"] = "probes.npz: pow2 and gen, 8 heads, 128 rows x 64 keys x d 128"


def quant(out: Path, rep: dict) -> None:
    from sageattention.quant_per_block import per_block_int8

    from fa3_numerics.studies.validate import Case

    cases = {"base": Case(), "s300": Case().with_data(p=0.002, sigma=300.0)}
    res = {}
    for tag, c in cases.items():
        q, k, _ = _draw(c)
        q16, k16 = q.to("cuda", torch.float16), k.to("cuda", torch.float16)
        km = k16.mean(dim=2, keepdim=True)
        ks = k16 - km
        qi, qsc, ki, ksc = per_block_int8(q16, ks.contiguous(), sm_scale=None, tensor_layout="HND")
        torch.cuda.synchronize()
        res[f"{tag}_km"], res[f"{tag}_ks"] = km.cpu().numpy(), ks.cpu().numpy()
        res[f"{tag}_q8"], res[f"{tag}_qscale"] = qi.cpu().numpy(), qsc.cpu().numpy()
        res[f"{tag}_k8"], res[f"{tag}_kscale"] = ki.cpu().numpy(), ksc.cpu().numpy()
    np.savez_compressed(out / "quant.npz", **res)
    rep["quant"] = "quant.npz: cases base (Case()) and s300 (p 0.002, sigma 300)"


def rcp(out: Path, rep: dict) -> None:
    """Triton's float32 division (``div.full.f32``) measured: 1 / y for every float32 mantissa
    y in [1, 2), stored where it differs from the correctly rounded reciprocal (``rcp.npz``:
    ``mant`` the 23-bit fields, ``ulps`` hardware minus RN in ulps), and the hypothesis that
    x / y = float32(x * (1 / y)) tested on random pairs over many binades."""
    import triton
    import triton.language as tl

    @triton.jit
    def _div(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        msk = i < n
        x = tl.load(x_ptr + i, mask=msk)
        y = tl.load(y_ptr + i, mask=msk)
        tl.store(o_ptr + i, x / y, mask=msk)

    def div(x, y):
        o = torch.empty_like(x)
        _div[(triton.cdiv(x.numel(), 1024),)](x, y, o, x.numel(), BLOCK=1024)
        return o

    mant = torch.arange(1 << 23, dtype=torch.int32, device="cuda")
    y = (mant | (127 << 23)).view(torch.float32)
    r = div(torch.ones_like(y), y)
    rn = (1.0 / y.double()).float()
    ulps = (r.view(torch.int32) - rn.view(torch.int32)).cpu()
    nz = ulps != 0
    np.savez_compressed(out / "rcp.npz", mant=mant.cpu()[nz].numpy(), ulps=ulps[nz].numpy().astype(np.int8))
    g = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.rand(1 << 22, generator=g, device="cuda") + 0.5) * torch.exp2(
        torch.randint(-40, 40, (1 << 22,), generator=g, device="cuda").float())
    yy = (torch.rand(1 << 22, generator=g, device="cuda") + 0.5) * torch.exp2(
        torch.randint(-40, 40, (1 << 22,), generator=g, device="cuda").float())
    d = div(x, yy)
    m_y = (yy.view(torch.int32) & 0x7FFFFF)
    ex = ((yy.view(torch.int32) >> 23) & 0xFF) - 127
    r1 = div(torch.ones_like(yy), (m_y | (127 << 23)).view(torch.float32))  # 1 / mantissa
    model = (x.double() * r1.double() * torch.exp2(-ex.double())).float()
    ieee = (x.double() / yy.double()).float()
    rep["rcp"] = {"mantissas_differing_from_rn": int(nz.sum()), "ulps_values": sorted(set(ulps[nz].tolist())),
                  "pairs": int(x.numel()), "div_equals_x_times_rcp": float((model == d).double().mean()),
                  "div_equals_ieee": float((ieee == d).double().mean())}
    log(f"rcp: {rep['rcp']}")


def _draw(c):
    from fa3_numerics.engine.inputs import DistInputs

    dist, params = c.data()
    return DistInputs(dist, tuple(params.items()), c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim,
                      c.seed).draw("cpu")


def grids(out: Path, rep: dict, names: list[str], capture: str | None) -> None:
    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.data.sampling import query_rows
    from fa3_numerics.studies.validate import captured_cases, case_recipe, grid, skips

    kernel = get_backend("sage1")
    rep["grids"] = {}
    for name in names:
        if name == "captured":
            if not (capture and Path(capture).is_file()):
                rep["grids"][name] = f"no capture file {capture}"
                continue
            cases = captured_cases(capture)
        else:
            cases = grid(name)
        res, info = {}, {}
        for i, (c, skip) in enumerate(zip(cases, skips(cases, kernel))):
            if skip:
                info[c.name] = {"skipped": skip}
                continue
            t = time.perf_counter()
            q, k, v = _draw(c)
            rows = query_rows(c.seqlen, ROWS, c.seed)
            r = case_recipe(c, backend=kernel)
            o = kernel.attention(r, q.cuda(), k.cuda(), v.cuda(), causal=c.causal, q_index=rows.cuda(),
                                 rotation_seed=c.seed, cache={}, softmax_scale=c.scale or None)
            res[f"c{i}_o"] = o.to(torch.float32).cpu().numpy()
            res[f"c{i}_rows"] = rows.numpy()
            info[c.name] = {"index": i, "spec": r.short_str(), "seconds": round(time.perf_counter() - t, 2),
                            "nonfinite": int((~torch.isfinite(o)).sum())}
            log(f"{name} {c.name}: {info[c.name]}")
        np.savez_compressed(out / f"{name}.npz", **res)
        rep["grids"][name] = info


def ptx(out: Path, rep: dict) -> None:
    cache = Path(os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")))
    files = [p for p in cache.rglob("*") if p.suffix in (".ptx", ".ttgir", ".json")]
    with tarfile.open(out / "ptx.tar.gz", "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(cache)))
    rep["ptx"] = f"{len(files)} files from {cache}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--grids", default="small,stress,captured")
    ap.add_argument("--capture", default=None)
    ap.add_argument("--parts", default="probes,quant,grids,ptx")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    from fa3_numerics.kernels.sage import kernel_problem, load_kernel

    rep = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(0),
           "kernel_problem": kernel_problem("cuda")}
    rep["kernel"] = load_kernel()[1] if rep["kernel_problem"] is None else None
    log(json.dumps(rep))
    parts = args.parts.split(",")
    for part, fn in (("rcp", lambda: rcp(out, rep)), ("probes", lambda: probes(out, rep)),
                     ("quant", lambda: quant(out, rep)),
                     ("grids", lambda: grids(out, rep, args.grids.split(","), args.capture)),
                     ("ptx", lambda: ptx(out, rep))):
        if part not in parts:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - keep the other parts; the traceback goes in the report
            rep[f"{part}_error"] = traceback.format_exc()
            log(rep[f"{part}_error"])
        rep[f"{part}_seconds"] = round(time.perf_counter() - t, 2)
        (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
        log(f"{part} done")
    sys.exit(0)


if __name__ == "__main__":
    main()
