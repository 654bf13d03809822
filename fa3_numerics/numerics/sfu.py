"""Bit-exact CPU models of the H200's special-function unit (MUFU) as the attention kernels call it:
``ex2.approx.ftz.f32``, ``lg2.approx.ftz.f32`` and ``rcp.approx.ftz.f32`` (float32 in, float32
out, torch, vectorized).

Measured on an H200 (tools/device/mufu_probe.py: every input of the reduced ranges, plus 3 million
random inputs over the whole ranges; tools/mufu_tables.py) each instruction is a range reduction to
a 23-bit fixed-point argument followed by one value per argument, so each model is that reduction
plus a 2^23-entry table measured exhaustively (packed in sfu_h200.npz by
tools/sfu_build_tables.py; no analytic interpolator reproduces the bits yet):

- ex2: |x| is cut to 23 fraction bits toward zero, X = trunc(|x| 2^23) = I 2^23 + F. For x >= 0 the
  result is E[F] 2^I with E[F] the unit's 2^(F/2^23) in [1, 2). For x < 0 the fraction is the
  one's complement: E[2^23 - 1 - F] 2^-(I+1), and exactly 2^-I when F = 0 (so x in (-2^-23, 0]
  gives 1). Results below 2^-126 flush to +0, above float32 to +inf.
- lg2: x = 2^e m, m in [1, 2). The unit forms e + L(m) in fixed point and rounds it toward zero to
  float32; the tables hold its outputs at e = 0 (H[m] = RZ(L)) and e = -1 (W[m] = RZ(L - 1)),
  which carry enough of L's bits that RZ(e + H[m]) (e >= 0) and RZ(e + 1 + W[m]) (e < 0), the sum
  exact in float64, are the unit's outputs. Absolute, not relative, error near x = 1.
- rcp: sign(x) R[m] 2^-e, R[m] the unit's 1/m in (0.5, 1]; results below 2^-126 flush to signed 0.

ftz inputs: subnormals are zeros. NaN in -> 0x7FFFFFFF (the unit's canonical NaN); lg2 of x < 0 or
-inf is that NaN, lg2(+-0) = -inf; ex2(-inf) = +0; rcp(+-0) = +-inf, rcp(+-inf) = +-0.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

TABLES = Path(__file__).with_name("sfu_h200.npz")
SEG_BITS = 6  # the packed tables' base: a cubic per 1/64 of the argument range
DEG = 3
NAN_BITS = 0x7FFFFFFF
MANT = (1 << 23) - 1
_CACHE: dict[str, torch.Tensor] = {}


def ordered_np(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns -> int64 where adjacent floats differ by 1 (the packing's distance)."""
    i = np.ascontiguousarray(bits).view(np.int32)
    return (i ^ ((i >> 31) & 0x7FFFFFFF)).astype(np.int64)


def _unordered_np(o: np.ndarray) -> np.ndarray:
    i = o.astype(np.int32)
    return (i ^ ((i >> 31) & 0x7FFFFFFF)).view(np.uint32)


def base_table(coef: np.ndarray, n: int) -> np.ndarray:
    """uint32[n] float32 bits of the packing's smooth base: per segment a cubic in u in [0, 1) by
    Horner in float64 (basic IEEE operations only, so every machine gets the same bits), rounded
    to float32 to nearest."""
    seg = n >> SEG_BITS
    u = np.arange(seg, dtype=np.float64) / seg
    out = np.empty((1 << SEG_BITS, seg), dtype=np.float64)
    for s in range(1 << SEG_BITS):
        acc = np.full(seg, coef[s, DEG])
        for p in range(DEG - 1, -1, -1):
            acc = acc * u + coef[s, p]
        out[s] = acc
    return out.reshape(-1).astype(np.float32).view(np.uint32)


def table(name: str) -> torch.Tensor:
    """int32[2^23] float32 bits of one measured table ("ex2", "lg2_hi", "lg2_lo", "rcp"), rebuilt
    from sfu_h200.npz and checked against its SHA-256 (a table that does not rebuild exactly is
    an error: these models are exact or nothing)."""
    t = _CACHE.get(name)
    if t is None:
        if not TABLES.is_file():
            raise FileNotFoundError(f"{TABLES} missing: the SFU models need the packed H200 tables")
        with np.load(TABLES) as z:
            coef, code = z[f"{name}/coef"], z[f"{name}/code"].astype(np.int64)
            code[z[f"{name}/exc_idx"].astype(np.int64)] = z[f"{name}/exc_val"]
            digest = bytes(z[f"{name}/sha256"])
        bits = _unordered_np(ordered_np(base_table(coef, len(code))) + code)
        if hashlib.sha256(bits.tobytes()).digest() != digest:
            raise RuntimeError(f"{TABLES}: table {name} does not rebuild to its recorded SHA-256")
        t = _CACHE[name] = torch.from_numpy(bits.view(np.int32).copy())
    return t


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"SFU models take float32, got {x.dtype}")
    return x.contiguous().view(torch.int32)


def ex2(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` of float32 x, bit for bit as the H200."""
    E = table("ex2").to(x.device)
    b = _bits(x)
    neg = b < 0
    # |x| >= 200 saturates either way (+inf or +0); the clamp keeps X = |x| 2^23 inside int32.
    ax = x.abs().clamp(max=200.0)
    X = (ax * 8388608.0).to(torch.int32)  # exact product, truncation toward zero = the unit's cut
    I, F = X >> 23, X & MANT
    idx = torch.where(neg, MANT - F, F)
    m = E[idx.long()]  # float32 bits in [1, 2): exponent field 127
    exact = neg & (F == 0)
    shift = torch.where(neg, torch.where(exact, -I, -I - 1), I)
    m = torch.where(exact, torch.full_like(m, 127 << 23), m)
    ef = shift + 127
    y = m + (shift << 23)
    y = torch.where(ef <= 0, torch.zeros_like(y), y)
    y = torch.where(ef >= 255, torch.full_like(y, 0x7F800000), y)
    y = torch.where(torch.isnan(x), torch.full_like(y, NAN_BITS), y)
    return y.view(torch.float32)


def rcp(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of float32 x, bit for bit as the H200."""
    R = table("rcp").to(x.device)
    b = _bits(x)
    sign = b & -0x80000000
    e = ((b >> 23) & 0xFF) - 127
    r = R[(b & MANT).long()]  # in (0.5, 1]: exponent field 126 (127 for m = 1)
    ef = ((r >> 23) & 0xFF) - e
    y = (r - (e << 23)) | sign
    y = torch.where(ef <= 0, sign, y)  # flushed result (also x = +-inf: e = 128)
    y = torch.where(e == -127, sign | 0x7F800000, y)  # +-0 and (ftz) subnormal inputs
    y = torch.where(torch.isnan(x), torch.full_like(y, NAN_BITS), y)
    return y.view(torch.float32)


def _rz32(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded toward zero (v finite and far from float32's range ends)."""
    r = v.to(torch.float32)
    over = r.to(torch.float64).abs() > v.abs()
    return torch.where(over, (r.view(torch.int32) - 1).view(torch.float32), r)


def lg2(x: torch.Tensor) -> torch.Tensor:
    """``lg2.approx.ftz.f32`` of float32 x, bit for bit as the H200."""
    H, W = table("lg2_hi").to(x.device), table("lg2_lo").to(x.device)
    b = _bits(x)
    e = ((b >> 23) & 0xFF) - 127
    mi = (b & MANT).long()
    hi = e >= 0
    t = torch.where(hi, H[mi], W[mi]).view(torch.float32).to(torch.float64)
    v = torch.where(hi, e, e + 1).to(torch.float64) + t
    y = _rz32(v).view(torch.int32)
    y = torch.where(e == -127, torch.full_like(y, -0x800000), y)  # +-0, subnormals: -inf
    y = torch.where((b < 0) & (e > -127), torch.full_like(y, NAN_BITS), y)  # x < 0, -inf
    y = torch.where(b == 0x7F800000, b, y)
    y = torch.where(torch.isnan(x), torch.full_like(y, NAN_BITS), y)
    return y.view(torch.float32)
