"""Correctness checks of the Triton kernels, shared by the CPU tests (interpreter) and the device run.

Exposed: ``quantizer_checks``, ``attention_checks``, ``cast_checks``, ``gqa_check``, ``main``.

Each check returns plain dicts of measured numbers; the callers assert the properties (tests)
or commit the numbers (tools/device/triton_h200.py). ``python -m
fa3_numerics.kernels.triton_.selfcheck --json`` prints them all (the CPU tests run it in a
subprocess with TRITON_INTERPRET=1, so that the kernels' module-level ``triton.jit`` sees the
interpreter setting before anything else imports them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import torch

QUANT_CASES = [  # (granularity, block rows, Q group, pow2, rotation)
    ("head", 0, 2, False, "hadamard"), ("head", 0, 1, True, "none"), ("block", 96, 1, False, "hadamard"),
    ("block", 224, 1, True, "hadamard"), ("token", 0, 1, False, "hadamard"), ("tensor", 0, 1, False, "hadamard"),
]

ATT_CASES = [  # (recipe, seqlen, heads, kv_heads, head_dim, causal, backend)
    ("fa3-fp8-kernel", 300, 2, 2, 64, False, "triton"),
    ("fa3-fp8", 300, 2, 2, 64, True, "triton"),
    ("fa3-fp8-no-block-quant", 257, 4, 2, 128, False, "triton"),
    ("fa3-fp8,pow2=0", 333, 4, 1, 128, True, "triton"),
    ("fa3-fp8,order=forward", 250, 2, 2, 64, True, "triton"),
    ("fa3-fp8", 300, 2, 2, 64, True, "triton-two-level"),
    ("fa3-fp8", 200, 2, 2, 256, False, "triton"),
    ("fa3-fp8", 300, 4, 2, 64, True, "triton-fused"),
]


def _gran(name: str, rows: int):
    from fa3_numerics.numerics.granularity import parse_granularity

    return parse_granularity(name if name != "block" else f"block{rows}")


def _outliers(b, h, n, d, seed, hkv=None, p=0.01, sigma=10.0):
    from fa3_numerics.data import distributions

    return distributions.generate("outliers", distributions.AttnShape(b, h, n, d, kv_heads=hkv or h), seed, p=p,
                                  sigma=sigma)


def quantizer_checks(device: str = "cpu", *, shape=(1, 4, 300, 64), exact_modes=(True, False), impls=("butterfly",),
                     cases=QUANT_CASES, seed: int = 0, recip: bool = False, out_layout: str = "bhds",
                     extra: dict | None = None, label: str = "") -> list[dict]:
    """Fused rotate-and-quantize against the emulator's rotation + ``quantize`` on the same input.

    exact: float64 input, float64 path (must be bit-identical). fast: BF16 input (as a model
    gives it), float32 path, compared with the emulator fed the same BF16 values in float64.
    ``extra``: more keywords of ``rotate_quantize`` for the fast path (e.g. reread="smem", the
    shared-memory kernel), named by ``label`` in the mode."""
    from fa3_numerics.numerics.quant import quantize
    from fa3_numerics.numerics.rotation import make_rotation

    from .rotate_quant import rotate_quantize

    b, h, n, d = shape
    q = _outliers(b, h, n, d, seed)[0].to(device)
    out = []
    for gname, rows, group, pow2, rot in cases:
        g = _gran(gname, rows)
        for exact in exact_modes:
            for impl in (("butterfly",) if exact else impls):
                if impl == "dot" and rot == "none":
                    continue
                src = q if exact else q.to(torch.bfloat16)
                o = rotate_quantize(src, layout="bhsd", gran=g, group=group, pow2=pow2, rot=rot, seed=seed + 1,
                                    exact=exact, impl=impl, out_layout=out_layout, recip=recip,
                                    **({} if exact else (extra or {})))
                ref = quantize(make_rotation(rot, d, seed + 1).apply(src.to(torch.float64)), "e4m3", g,
                               group=group, pow2=pow2)
                vals = o.values_bhsd()
                dl = o.descale_like_prepare(h, n).expand_as(ref.descale)
                same = vals.contiguous().view(torch.uint8) == ref.values.contiguous().view(torch.uint8)
                equal = vals.float() == ref.values.float()
                diff_steps = (vals.float() - ref.values.float()).abs()
                out.append({"gran": g.short_str(), "group": group, "pow2": int(pow2), "rot": rot,
                            "mode": "exact-f64" if exact else f"fast-f32-{impl}" + ("-recip" if recip else "")
                            + (f"-{label}" if label and not exact else ""),
                            "values_identical": float(same.double().mean()),
                            # -0 and +0 bytes compare equal as values (Triton's interpreter drops the sign of 0)
                            "values_equal": float(equal.double().mean()),
                            "descales_identical": float((dl == ref.descale).double().mean()),
                            "values_differing": int((~same).sum()), "elements": int(same.numel()),
                            "max_abs_value_diff": float(diff_steps.max())})
    return out


def attention_checks(device: str = "cpu", *, cases=ATT_CASES, accs=("fp32",), seed: int = 0, p=0.01,
                     sigma=10.0) -> list[dict]:
    """Kernel vs emulator (each accumulator model) vs float64 on the same inputs, every row."""
    from fa3_numerics.engine.backends import EmulateBackend, get_backend
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.recipe import Recipe
    from fa3_numerics.numerics.reference import reference_attention

    emu = EmulateBackend()
    out = []
    for spec, n, h, hkv, d, causal, backend in cases:
        q, k, v = (t.to(device) for t in _outliers(1, h, n, d, seed, hkv=hkv, p=p, sigma=sigma))
        rows = torch.arange(n, device=device)
        ref = reference_attention(q, k, v, causal=causal)
        r = Recipe.from_str(spec)
        cache: dict = {}
        ko = get_backend(backend).attention(r, q, k, v, causal=causal, q_index=rows, rotation_seed=seed, cache=cache)
        rk = float(((ko - ref) ** 2).mean().sqrt())
        row = {"recipe": spec, "backend": backend, "seqlen": n, "heads": h, "kv_heads": hkv, "head_dim": d,
               "causal": int(causal), "rmse_kernel": rk, "finite": bool(torch.isfinite(ko).all())}
        for a in accs:
            eo = emu.attention(dataclasses.replace(r, acc=a), q, k, v, causal=causal, q_index=rows,
                               rotation_seed=seed, cache=cache if backend != "triton-fused" else {})
            fid = fidelity(eo, ko, ref)  # over the outputs finite in all three; ``finite`` says if any is not
            row[f"F_{a}"] = fid["F"]
            row[f"identical_{a}"] = fid["identical"]
            row[f"rmse_emulator_{a}"] = float(((eo - ref) ** 2).mean().sqrt())
        out.append(row)
    return out


def gqa_check(device: str = "cpu", *, n=192, h=4, hkv=2, d=64, causal=True) -> dict:
    """GQA against the same K/V repeated per Q head: the kernel must give the same bits."""
    from .attention import attention_fp8, plan_tiles

    g = torch.Generator().manual_seed(5)
    mk = lambda *s: (torch.randn(*s, generator=g) * 4).to(torch.float8_e4m3fn).to(device)  # noqa: E731
    q, k, vt = mk(1, h, n, d), mk(1, hkv, n, d), mk(1, hkv, d, n)
    qd = (torch.rand(1, h, n, generator=g) + 0.5).to(device)
    kd = (torch.rand(1, hkv, n, generator=g) + 0.5).to(device)
    vd = torch.full((1, hkv, 1), 0.75, device=device)
    kw = dict(q_rows=1, k_rows=1, v_rows=1 << 30, causal=causal, plan=plan_tiles(d, 160))
    a = attention_fp8(q, k, vt, qd, kd, vd, **kw)
    rep = lambda t: t.repeat_interleave(h // hkv, dim=1).contiguous()  # noqa: E731
    bb = attention_fp8(q, rep(k), rep(vt), qd, rep(kd), rep(vd), **kw)
    # Causal with more queries than keys: the first rows see no key and must be exactly 0.
    short = attention_fp8(q, k[:, :, : n // 2].contiguous(), vt[..., : n // 2].contiguous(), qd,
                          kd[:, :, : n // 2].contiguous(), vd, q_rows=1, k_rows=1, v_rows=1 << 30, causal=True,
                          plan=plan_tiles(d, 160))
    dead = n - n // 2
    return {"gqa_identical": bool(torch.equal(a, bb)), "finite": bool(torch.isfinite(a).all()),
            "masked_rows_zero": bool((short[:, :, :dead] == 0).all()),
            "live_rows_nonzero": bool((short[:, :, dead:].abs().sum(-1) > 0).all())}


def cast_checks(device: str = "cuda") -> dict:
    """Hardware FP8/BF16 casts (cvt.rn.satfinite) against the float32 soft rounding, on the GPU."""
    from .attention import attention_fp8, plan_tiles
    from .rotate_quant import rotate_quantize

    q = _outliers(1, 4, 512, 128, 3)[0].to(device)
    res = {}
    for exact in (True, False):
        a = rotate_quantize(q, layout="bhsd", rot="hadamard", exact=exact, soft_cast=False, impl="butterfly")
        s = rotate_quantize(q, layout="bhsd", rot="hadamard", exact=exact, soft_cast=True, impl="butterfly")
        diff = a.values.view(torch.uint8) != s.values.view(torch.uint8)
        res[f"quantizer_{'exact' if exact else 'fast'}_hw_eq_soft"] = not bool(diff.any())
        res[f"quantizer_{'exact' if exact else 'fast'}_bytes_differing"] = int(diff.sum())
        res[f"quantizer_{'exact' if exact else 'fast'}_values_equal"] = bool(
            torch.equal(a.values.float(), s.values.float()))
        if diff.any():
            res[f"quantizer_{'exact' if exact else 'fast'}_examples"] = [
                (int(x), int(y)) for x, y in zip(a.values.view(torch.uint8)[diff][:6], s.values.view(torch.uint8)[diff][:6])]
    # Ties, overflow and subnormals of the P cast: P~ is driven through exp2, so feed S directly.
    g = torch.Generator().manual_seed(0)
    mk = lambda *sh: (torch.randn(*sh, generator=g) * 8).to(torch.float8_e4m3fn).to(device)  # noqa: E731
    qq, kk, vt = mk(2, 4, 700, 128), mk(2, 4, 700, 128), mk(2, 4, 128, 700)
    ones = torch.ones(2, 4, 1, device=device)
    for pv in ("chained", "two-level"):
        kw = dict(q_rows=1 << 30, k_rows=1 << 30, v_rows=1 << 30, causal=True, pv=pv, plan=plan_tiles(128, 224))
        hw = attention_fp8(qq, kk, vt, ones * 0.1, ones * 0.1, ones, soft_cast=False, **kw)
        sw = attention_fp8(qq, kk, vt, ones * 0.1, ones * 0.1, ones, soft_cast=True, **kw)
        res[f"attention_{pv}_hw_eq_soft"] = bool(torch.equal(hw, sw))
    return res


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="run the Triton kernels' self-checks and print JSON")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--parts", default="quant,attention,gqa")
    ap.add_argument("--quick", action="store_true", help="fewer cases (the CPU interpreter is slow)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    res = {}
    if "quant" in parts:
        res["quant"] = quantizer_checks(args.device, cases=QUANT_CASES[::2] if args.quick else QUANT_CASES)
    if "attention" in parts:
        res["attention"] = attention_checks(args.device, cases=ATT_CASES[1::2] if args.quick else ATT_CASES)
    if "gqa" in parts:
        res["gqa"] = gqa_check(args.device)
    if "cast" in parts and args.device.startswith("cuda"):
        res["cast"] = cast_checks(args.device)
    print(json.dumps(res, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
