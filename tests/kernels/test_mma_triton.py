"""The Triton kernel of the Hopper MMA model (kernels/triton_/mma_model.py) against the PyTorch
reference (numerics/mma.py ``hopper_fp8_mma_reference``), bit for bit.

Two layers, each skipped with its reason where it cannot run:

- on a GPU (needs CUDA + triton): every case below through ``mma_model.mma`` (the fast float32
  form, the float64 rerun, the fallbacks), through each kernel variant (``mma_raw``: fma.rz or the
  truncating conversion, float32 or float64), and through the hooks ``hopper_fp8_mma`` and
  ``hopper_mma`` that the emulator calls;
- under Triton's CPU interpreter (needs the triton package): a subset of the cases, in a
  subprocess (``triton.jit`` reads TRITON_INTERPRET when the module imports), through the
  conversion variant (the interpreter has no fma.rz).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from fa3_numerics.numerics.formats import get_format
from fa3_numerics.numerics.mma import (BF16_MMA, FP8_MMA, hopper_fp8_mma, hopper_fp8_mma_reference, hopper_mma)

HAS_TRITON = importlib.util.find_spec("triton") is not None
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gpu_reason() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (the kernel runs on the device; tools/device/h200.py --parts mma runs it there)"
    return None


GPU_REASON = _gpu_reason()


def _fp8(g, shape, scale=1.0, dt=E4M3, spread=0):
    """float32 holding FP8 values; ``spread``: per-row scales 2^U(-spread, spread), so that rows
    and k-steps have very different exponents."""
    x = torch.randn(shape, generator=g) * scale
    if spread:
        x = x * torch.exp2(torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=g).float())
    fmax = torch.finfo(dt).max  # e4m3fn has no inf: out-of-range values would become NaN
    return x.clamp(-fmax, fmax).to(dt).to(torch.float32)


def cases(quick: bool = False):
    """(name, a, b, c, a_min_exp, b_min_exp, model) on the CPU; ``quick``: the interpreter's subset."""
    g = torch.Generator().manual_seed(1234)
    out = []
    add = out.append
    a, b = _fp8(g, (2, 20, 70), 4), _fp8(g, (2, 70, 24), 4)  # K, M, N not multiples of the tile
    c = torch.randn(2, 20, 24, generator=g) * 100
    add(("random, no C", a, b, None, -6, -6, FP8_MMA))
    add(("random, C", a, b, c, -6, -6, FP8_MMA))
    cs = torch.full((2, 20, 24), 1e-40)
    cs[0, :5] = -3e-42
    cs[1, :7] = 1e30  # far above every product: their terms truncate to 0
    cs[1, 7:9] = 1e-30  # far below: its own term truncates to 0
    cs[1, 9, :3] = -0.0
    add(("subnormal, huge and tiny C", a, b, cs, -6, -6, FP8_MMA))
    az = a.clone()
    az[..., 32:64] = 0  # an all-zero k-step: C alone, truncated to 14 bits
    add(("all-zero k-step", az, b, c, -6, -6, FP8_MMA))
    add(("all-zero A, C", torch.zeros(1, 5, 40), _fp8(g, (1, 40, 7)), torch.randn(1, 5, 7, generator=g), -6, -6,
         FP8_MMA))
    add(("e5m2 (subnormals)", _fp8(g, (3, 17, 45), 100, E5M2), _fp8(g, (3, 45, 19), 1e-4, E5M2), None, -14, -14,
         FP8_MMA))
    add(("e5m2 x e4m3", _fp8(g, (3, 17, 45), 1, E5M2), _fp8(g, (3, 45, 19)), torch.randn(3, 17, 19, generator=g),
         -14, -6, FP8_MMA))
    add(("broadcast lead dims", _fp8(g, (2, 1, 9, 40)), _fp8(g, (1, 3, 40, 11)), torch.randn(3, 9, 11, generator=g),
         -6, -6, FP8_MMA))
    add(("2-d operands", _fp8(g, (9, 40)), _fp8(g, (40, 11)), None, -6, -6, FP8_MMA))
    add(("K = 0", torch.zeros(2, 3, 0), torch.zeros(2, 0, 5), torch.randn(2, 3, 5, generator=g), -6, -6, FP8_MMA))
    add(("bf16 model", torch.randn(2, 13, 50, generator=g).to(torch.bfloat16).float(),
         torch.randn(2, 50, 10, generator=g).to(torch.bfloat16).float(), torch.randn(2, 13, 10, generator=g),
         -126, -126, BF16_MMA))
    add(("fp16 x bf16 model", (torch.randn(2, 13, 50, generator=g) * 1e-3).to(torch.float16).float(),
         torch.randn(2, 50, 10, generator=g).to(torch.bfloat16).float(), None, -14, -126, BF16_MMA))
    add(("float32 operands (the float64 form)", torch.randn(1, 4, 40, generator=g), _fp8(g, (1, 40, 6)),
         torch.randn(1, 4, 6, generator=g), -6, -6, FP8_MMA))
    if quick:
        return out
    # FP8 products cannot overflow float32 (|D| <= |C| + 32 * 448^2 per step); 16-bit ones can,
    # and the kernel then hands the call to the reference.
    big = (torch.rand(2, 8, 40, generator=g) * 1e30).to(torch.bfloat16).float()
    add(("float32 overflow (reference)", big, big.transpose(-1, -2) * 3, None, -126, -126, BF16_MMA))
    for seed in range(6):  # random shapes, exponent spreads and sparsity
        gg = torch.Generator().manual_seed(seed)
        m, k, n = (int(v) for v in torch.randint(1, 200, (3,), generator=gg))
        dt = (E4M3, E5M2)[seed % 2]
        a = _fp8(gg, (2, m, k), 1, dt, spread=8)
        b = _fp8(gg, (2, k, n), 1, dt, spread=8)
        a = a * (torch.rand(a.shape, generator=gg) > 0.3)
        c = None if seed % 3 == 0 else torch.randn(2, m, n, generator=gg) * 2.0 ** (seed * 6 - 18)
        mn = -6 if dt == E4M3 else -14
        add((f"random draw {seed}: {m}x{k}x{n} {dt}".replace("torch.", ""), a, b, c, mn, mn, FP8_MMA))
    # The emulator's shapes: S = Q K^T with K^T a transposed view, O = rescaled O + P V.
    q = _fp8(gg, (2, 2, 256, 128), 3)
    kt = _fp8(gg, (2, 2, 176, 128), 3).transpose(-1, -2)
    add(("emulator S = Q K^T", q, kt, None, -6, -6, FP8_MMA))
    p = torch.rand(2, 2, 256, 176, generator=gg).to(E4M3).float()
    v = _fp8(gg, (2, 2, 176, 128), 2)
    o = torch.randn(2, 2, 256, 128, generator=gg) * 30
    add(("emulator O + P V", p, v, o, -6, -6, FP8_MMA))
    return out


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))


# The paths through the kernels: mma() (float32 form, float64 reruns, fallbacks), and each
# variant of mma_raw as (impl, float64, truncating conversion instead of fma.rz).
PATHS = ["mma", ("gluon", False, False), ("gluon", False, True), ("gluon", True, False), ("gluon", True, True),
         ("triton", False, False), ("triton", True, False)]


def compare(device: str, quick: bool = False, paths=("mma",)) -> list[dict]:
    """Each case through each path against the reference: one dict per (case, path) with
    ``identical``."""
    from fa3_numerics.kernels.triton_ import mma_model

    rows = []
    for name, a, b, c, amin, bmin, model in cases(quick):
        ref = hopper_fp8_mma_reference(a, b, c, a_min_exp=amin, b_min_exp=bmin, model=model)
        a_d, b_d = a.to(device), b.to(device)
        c_d = None if c is None else c.to(device)
        for path in paths:
            if path == "mma":
                d = mma_model.mma(a_d, b_d, c_d, a_min_exp=amin, b_min_exp=bmin, model=model)
                if d is None:  # the fallback to the reference: only for the overflow case
                    rows.append({"case": name, "path": "mma", "identical": name.startswith("float32 overflow"),
                                 "fallback": True})
                else:
                    rows.append({"case": name, "path": "mma", "identical": _same(d.cpu(), ref)})
                continue
            impl, f64, cvt = path
            if model is BF16_MMA and not f64:
                continue  # terms up to 2^27: only the float64 form is exact
            d, flags = mma_model.mma_raw(a_d, b_d, c_d, a_min_exp=amin, b_min_exp=bmin, k_step=model.k_step,
                                         bits=model.bits, final_bits=model.final_bits, f64=f64, trunc_cvt=cvt,
                                         impl=impl)
            if flags:  # flagged (overflow, or float32 operands in the float32 form): not trusted
                continue
            rows.append({"case": name, "path": f"{impl} f64={f64} cvt={cvt}", "identical": _same(d.cpu(), ref)})
    return rows


# ---------------------------------------------------------------------------- on the GPU


@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p if isinstance(p, str) else "-".join(map(str, p)))
def test_kernel_matches_reference_bit_for_bit(path):
    from fa3_numerics.kernels.triton_ import mma_model

    if path != "mma" and path[0] == "gluon" and mma_model.gluon is None:
        pytest.skip("this triton has no Gluon")
    rows = compare("cuda", paths=(path,))
    bad = [r for r in rows if not r["identical"]]
    assert not bad, bad
    assert len(rows) >= 18


@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_hooks_use_the_kernel_and_keep_the_reference_numbers():
    """hopper_fp8_mma / hopper_mma on CUDA tensors: the kernel's numbers, the reference's NaN and
    Inf propagation (the kernel hands non-finite operands back)."""
    from fa3_numerics.kernels.triton_ import mma_model

    g = torch.Generator().manual_seed(7)
    a, b = _fp8(g, (2, 33, 100), 2), _fp8(g, (2, 100, 40), 2)
    c = torch.randn(2, 33, 40, generator=g)
    calls = mma_model.STATS["calls"]
    d = hopper_fp8_mma(a.cuda(), b.cuda(), c.cuda())
    assert mma_model.STATS["calls"] == calls + 1
    assert _same(d.cpu(), hopper_fp8_mma_reference(a, b, c))
    e4m3, bf16 = get_format("e4m3"), get_format("bf16")
    assert _same(hopper_mma(a.cuda(), b.cuda(), c.cuda(), a_fmt=e4m3, b_fmt=e4m3).cpu(),
                 hopper_fp8_mma_reference(a, b, c))
    ab, bb = a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()
    assert _same(hopper_mma(ab.cuda(), bb.cuda(), c.cuda(), a_fmt=bf16, b_fmt=bf16).cpu(),
                 hopper_fp8_mma_reference(ab, bb, c, a_min_exp=bf16.emin, b_min_exp=bf16.emin, model=BF16_MMA))
    for where in ("a", "b", "c"):
        for bad in (float("nan"), float("inf")):
            aa, bb2, cc = a.clone(), b.clone(), c.clone()
            {"a": aa, "b": bb2, "c": cc}[where][0, 3, 5] = bad
            got = hopper_fp8_mma(aa.cuda(), bb2.cuda(), cc.cuda()).cpu()
            ref = hopper_fp8_mma_reference(aa, bb2, cc)
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_off_switch(monkeypatch):
    from fa3_numerics.kernels.triton_ import mma_model

    monkeypatch.setenv("FA3N_TRITON_MMA", "0")
    assert not mma_model.available("cuda")


# ---------------------------------------------------------------------------- CPU interpreter


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, __file__, "--interpret"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = [r for r in rows if not r["identical"]]
    assert not bad, bad
    assert len(rows) >= 13


def _main() -> int:
    # The interpreter runs the kernels on CPU tensors; mma() itself checks nothing about the device.
    rows = compare("cpu", quick=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_main())
