"""CUDA libdevice's accurate float32 ``expf`` and ``logf`` bit for bit, as compiled without fast-math and
without flush-to-zero (``__nv_expf``, ``__nv_logf``; torch, vectorized, float32 in and out).

Exposed: ``fma32``, ``expf``, ``logf``.

Where they matter: FlashAttention-2's split-KV combine (flash_fwd_kernel.h ``combine_attn_seqk_parallel``)
calls ``expf`` and ``logf`` (not the ``__expf`` / ``__logf`` intrinsics its tile loop uses), and torch
builds FA2 without ``--use_fast_math``, so the combined LSE ``max + logf(sum expf(lse_s - max))`` and the
per-split weights ``expf(lse_s - lse)`` are these functions' bits (``fa2_loop.flash_fa2``).

The algorithms are the ones in libdevice's bitcode (``llvm-dis`` of nvvm/libdevice/libdevice.10.bc,
CUDA 13.0; the same sequence NVCC emits as FFMA.SAT / FFMA.RM / MUFU.EX2 for ``expf``):

- expf(a): t = sat(fma(a, RN(log2e / 252), 0.5)); j = fma_rm(t, 252, 12582913), so n = j - 12583039 =
  floor(a log2e) (up to t's rounding); f = fma(a, log2e_hi, -n), f = fma(a, log2e_lo, f) (the two
  float32 halves of log2 e); result = ex2.approx.ftz(f) * 2^n, the scale built by shifting j's bits
  left by 23 (its low bits are n + 127). The ex2 is the H200's (``sfu.ex2``, measured bit for bit).
- logf(a): inputs below 2^-126 scaled by 2^23 (exponent -23 added back); a = 2^e m with m in
  [2/3, 4/3) (e from the bits of a - 0x3F2AAAAB); f = m - 1 (exact); a degree-9 polynomial in f by
  Horner in FFMAs (coefficients below), r f^2 + f as ``fma(fmul(r, f), f, f)``, then
  ``fma(e, ln2_f32, that)``. +inf, NaN and negative inputs go through ``fma(a, inf, inf)`` (inf, NaN,
  NaN), zeros to -inf.

Documented accuracy (CUDA C Programming Guide, math functions): expf 2 ulp, logf 1 ulp over the full
range; tests/numerics/test_libdevice.py checks both against float64 and the structure above.

Modelling choices, stated: the non-ftz build (torch compiles FA2 without -ftz); a subnormal input to
``fma``/``fmul`` is kept as IEEE does. The ex2 is the H200's; on another GPU its table would differ.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import torch

from . import sfu

F32, F64 = torch.float32, torch.float64


def _f32_of_double_hex(h: str) -> float:
    """An LLVM IR float constant (printed as the double of the same value) as a Python float; it
    must be a float32 value."""
    x = struct.unpack(">d", bytes.fromhex(h))[0]
    if struct.unpack(">f", struct.pack(">f", x))[0] != x:
        raise AssertionError(f"{h} is not a float32 value")
    return x


def _f32_bits(u: int) -> float:
    return struct.unpack(">f", u.to_bytes(4, "big"))[0]


def _rn32(q: Fraction) -> float:
    """The float32 nearest to a rational (ties to even), for the constants the compiler folds and the
    tests' exact references (float32's normal range)."""
    if q < 0:
        return -_rn32(-q)
    lo = struct.unpack(">f", struct.pack(">f", float(q)))[0]  # within an ulp; compare the neighbours exactly
    b0 = struct.unpack(">I", struct.pack(">f", lo))[0]
    cands = [_f32_bits(b) for b in (b0 - 1, b0, b0 + 1) if 0 <= b < 0x7F800000]
    return min(cands, key=lambda c: (abs(Fraction(c) - q), struct.unpack(">I", struct.pack(">f", c))[0] & 1))


LOG2E_HI = _f32_bits(1069066811)  # 0x3FB8AA3B, 1.44269502: float32 log2(e)
LOG2E_LO = _f32_bits(849703008)   # 0x32A57060, 1.92596303e-08: log2(e) - LOG2E_HI
LOG2E_252 = _rn32(Fraction(LOG2E_HI) / 252)  # `fdiv float %1, 2.52e2`, folded at compile time
ROUND_BIAS = 12582913.0  # (-126 + 0x1.8p23) + 127: 1.5 2^23 makes fma_rm's result an integer in its low bits
N_BIAS = 12583039.0      # 0x1.8p23 + 127
# logf's polynomial, highest degree first, and float32 ln 2 (libdevice's constants as LLVM prints them)
LOG_POLY = tuple(_f32_of_double_hex(h) for h in (
    "BFC0AA04E0000000", "3FC2073EC0000000", "BFBF19B980000000", "3FC1E52AA0000000", "BFC55B1720000000",
    "3FC99DA160000000", "BFCFFFE440000000", "3FD5554F00000000")) + (-0.5,)
LN2_F32 = _f32_of_double_hex("3FE62E4300000000")
TWO_M126 = 2.0 ** -126
LOG_SPLIT = 0x3F2AAAAB  # the bits of float32 2/3: m lands in [2/3, 4/3)


def fma32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """float32 a * b + c rounded once to nearest (the GPU's FFMA), exactly: the float64 product of
    two float32 values is exact, the float64 sum is made round-to-odd from its exact error (TwoSum),
    and round-to-odd at 53 bits then to nearest at 24 is the correctly rounded result (the plain
    float64 sum could round twice)."""
    a = torch.as_tensor(a, dtype=F32)
    p = a.double() * torch.as_tensor(b, dtype=F32).double()
    cd = torch.as_tensor(c, dtype=F32).double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    sb = s.view(torch.int64)
    fix = (err != 0) & torch.isfinite(s) & ((sb & 1) == 0)
    # the odd neighbour of s on the exact value's side: away from zero where err has s's sign
    step = torch.where((err > 0) == (s > 0), 1, -1).to(torch.int64)
    s = torch.where(fix, (sb + step).view(F64), s)
    return s.to(F32)


def _fmul32(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    # one float32 rounding of an exact float64 product
    return (a.double() * torch.as_tensor(b, dtype=F32).double()).to(F32)


def expf(a: torch.Tensor) -> torch.Tensor:
    """libdevice ``__nv_expf`` of float32 a (non-ftz), with the H200's ex2.approx.ftz (module docstring)."""
    if a.dtype != F32:
        raise TypeError(f"expf takes float32, got {a.dtype}")
    t = fma32(a, LOG2E_252, 0.5)
    t = torch.where(torch.isnan(t), torch.zeros_like(t), t.clamp(0.0, 1.0))  # saturate: NaN -> 0
    # fma.rm(t, 252, ROUND_BIAS): t 252 is exact in float64 and the sum lies in [2^23, 2^24), so
    # rounding down is floor
    j = torch.floor(t.double() * 252.0 + ROUND_BIAS)
    n = j - N_BIAS  # in [-126, 126]
    f = fma32(a, LOG2E_HI, (-n).to(F32))
    f = fma32(a, LOG2E_LO, f)
    # (bits(j) << 23) is the float32 2^n: j's low 9 bits are n + 127 and its high bits shift out
    scale = torch.pow(2.0, n)
    return (sfu.ex2(f).double() * scale).to(F32)


def logf(a: torch.Tensor) -> torch.Tensor:
    """libdevice ``__nv_logf`` of float32 a (non-ftz; module docstring)."""
    if a.dtype != F32:
        raise TypeError(f"logf takes float32, got {a.dtype}")
    small = a < TWO_M126  # subnormals (and zeros and negatives, which the end overrides)
    x = torch.where(small, _fmul32(a, 8388608.0), a)
    i0 = torch.where(small, -23.0, 0.0).to(F64)
    xb = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    e = ((xb - LOG_SPLIT) & 0xFF800000)
    mb = (xb - e) & 0xFFFFFFFF
    e_signed = torch.where(e >= 2 ** 31, e - 2 ** 32, e)
    m = torch.where(mb >= 2 ** 31, mb - 2 ** 32, mb).to(torch.int32).view(F32)
    # fma(float(e_bits), 2^-23, i0): exact (an integer exponent)
    i = (e_signed.to(F64) * 2.0 ** -23 + i0).to(F32)
    f = (m.double() - 1.0).to(F32)  # exact (Sterbenz)
    r = fma32(torch.full_like(f, LOG_POLY[0]), f, LOG_POLY[1])
    for c in LOG_POLY[2:]:
        r = fma32(r, f, c)
    q = fma32(_fmul32(r, f), f, f)
    res = fma32(i, LN2_F32, q)
    special = xb >= 0x7F800000  # +inf, NaN, and every negative (sign bit set)
    inf = torch.full_like(x, float("inf"))
    res = torch.where(special, fma32(x, inf, inf), res)
    return torch.where(x == 0, -inf, res)


__all__ = ["fma32", "expf", "logf"]
