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

Cost, 10^7 float32 on the project's 2-core CPU (noisy, best of 3): the compiled loops
(``native.sfu``; ex2 reads a per-segment cubic plus 2-bit codes, 2 MB that stay in cache, not its
64 MB table) ex2 0.32-0.36 s, lg2 0.5-0.95 s, rcp 0.35-0.7 s, against emulator.exp2_rz 0.77-0.81 s
and float32 torch.exp2 0.05-0.09 s; the PyTorch fallbacks (one int32 index_select into a joined
2^24-entry table: 64 MB each for ex2 and lg2, 32 MB for rcp) 0.85-1.7 s.

ftz inputs: subnormals are zeros. NaN in -> 0x7FFFFFFF (the unit's canonical NaN); lg2 of x < 0 or
-inf is that NaN, lg2(+-0) = -inf; ex2(-inf) = +0; rcp(+-0) = +-inf, rcp(+-inf) = +-0.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from . import native as _native

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


def wanted(recipe) -> bool:
    """Whether the recipe asks for these models (``sfu=h200``, keys/sfu.py) at the emulators'
    exp2/lg2 call sites; objects without the key keep the stand-ins."""
    return getattr(recipe, "sfu", "rz") == "h200"


def _joined(name: str, a: str, b: str, fn) -> torch.Tensor:
    """A 2^24-entry int32 table: [a | fn(b)], so one int32 gather serves both halves of a reduction
    (index_select with int32 indices: the cheapest gather torch has on the CPU)."""
    t = _CACHE.get(name)
    if t is None:
        t = _CACHE[name] = torch.cat([table(a), fn(table(b))])
    return t


def _ex2_packed() -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [64, 4] cubics, uint8 [2^21] 2-bit codes: 0 +0, 1 +1 ulp, 2 -1 ulp) for the compiled
    ex2, whose 2 MB of codes stay in cache where the 2^24-entry table's random reads do not."""
    t = _CACHE.get("ex2_packed")
    if t is None:
        with np.load(TABLES) as z:
            coef = np.ascontiguousarray(z["ex2/coef"], dtype=np.float64)
        d = table("ex2").numpy().astype(np.int64) - base_table(coef, 1 << 23).view(np.int32).astype(np.int64)
        if np.abs(d).max() > 1:
            raise RuntimeError(f"{TABLES}: ex2 distances beyond one ulp of the base: the 2-bit packing does not hold")
        code = np.where(d == 1, 1, np.where(d == -1, 2, 0)).astype(np.uint8).reshape(-1, 4)
        packed = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
        t = _CACHE["ex2_packed"] = (torch.from_numpy(coef), torch.from_numpy(packed.astype(np.uint8)))
    return t


def _ex2_neg_half(e: torch.Tensor) -> torch.Tensor:
    # x < 0 with fraction F: E[2^23 - 1 - F] / 2 (the one's complement), and 1 at F = 0
    n = torch.flip(e, (0,)) - (1 << 23)
    n[0] = 127 << 23
    return n


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"SFU models take float32, got {x.dtype}")
    return x.contiguous().view(torch.int32)


_ON_DEVICE: dict = {}


def _on(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # a table is 32-64 MB: copied to a GPU once per table and device, not once per call (the
    # emulator calls these per KV tile)
    if t.device == x.device:
        return t
    key = (t.data_ptr(), t.numel(), str(x.device))
    got = _ON_DEVICE.get(key)
    if got is None:
        got = _ON_DEVICE[key] = t.to(x.device)
    return got


def ex2(x: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` of float32 x, bit for bit as the H200 (the compiled loop where it
    is built, else PyTorch: the same numbers; ``compiled=False`` forces PyTorch, for the tests)."""
    if compiled and x.device.type == "cpu":
        coef, packed = _ex2_packed()
        y = _native.sfu_ex2_packed(_bits(x).view(torch.float32), coef, packed)
        if y is not None:
            return y
    T = _on(_joined("ex2_pm", "ex2", "ex2", _ex2_neg_half), x)
    b = _bits(x)
    neg = b >> 31  # -1 where the sign bit is set, else 0
    # |x| >= 200 saturates either way (+inf or +0); the clamp keeps X = |x| 2^23 inside int32.
    X = x.abs().clamp_(max=200.0).mul_(8388608.0).to(torch.int32)  # exact; the cast truncates as the unit
    idx = (X & MANT) | (neg & (1 << 23))
    s = (X >> 23).bitwise_xor_(neg).sub_(neg)  # the power of two: +I or -I
    y = torch.index_select(T, 0, idx.view(-1)).view_as(idx)
    ef = (y >> 23).add_(s)  # the result's exponent field (table entries are positive, in [0.5, 2))
    y.add_(s << 23)
    y.masked_fill_(ef <= 0, 0)  # below 2^-126: +0 (ftz); -inf lands here
    y.masked_fill_(ef >= 255, 0x7F800000)
    y.masked_fill_(x.isnan(), NAN_BITS)
    return y.view(torch.float32)


def rcp(x: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of float32 x, bit for bit as the H200 (the compiled loop where it
    is built, else PyTorch: the same numbers; ``compiled=False`` forces PyTorch, for the tests)."""
    R = _on(table("rcp"), x)
    if compiled:
        y = _native.sfu(2, _bits(x).view(torch.float32), R)
        if y is not None:
            return y.view(torch.float32)
    b = _bits(x)
    sign = b & -0x80000000
    e = (b >> 23).bitwise_and_(0xFF).sub_(127)
    r = torch.index_select(R, 0, (b & MANT).view(-1)).view_as(b)  # in (0.5, 1]: exponent field 126 or 127
    ef = (r >> 23).sub_(e)
    y = r.sub_(e << 23).bitwise_or_(sign)
    flushed = ef <= 0  # result below 2^-126 (x = +-inf too: e = 128)
    y = torch.where(flushed, sign, y)
    y = torch.where(e == -127, sign | 0x7F800000, y)  # +-0 and (ftz) subnormal inputs: +-inf
    y.masked_fill_(x.isnan(), NAN_BITS)
    return y.view(torch.float32)


def lg2(x: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """``lg2.approx.ftz.f32`` of float32 x, bit for bit as the H200 (the compiled loop where it
    is built, else PyTorch: the same numbers; ``compiled=False`` forces PyTorch, for the tests)."""
    T = _on(_joined("lg2_hl", "lg2_hi", "lg2_lo", lambda t: t), x)
    if compiled:
        y = _native.sfu(1, _bits(x).view(torch.float32), T)
        if y is not None:
            return y.view(torch.float32)
    b = _bits(x)
    e = (b >> 23).bitwise_and_(0xFF).sub_(127)
    lo = e < 0
    zero = e == -127  # +-0 and (ftz) subnormals
    bad = (b < 0) & ~zero  # x < 0 or -inf
    idx = (b & MANT).bitwise_or_(lo.to(torch.int32) << 23)
    t = torch.index_select(T, 0, idx.view(-1)).view_as(b).view(torch.float32)
    v = t.double().add_(e.add_(lo))  # e + H[m] or (e + 1) + W[m], exact in float64
    r = v.float()
    # toward zero: step back one ulp where rounding to nearest went away from zero
    y = r.view(torch.int32).sub_((r.double().abs_() > v.abs_()).to(torch.int32))
    y.masked_fill_(zero, -0x800000)  # -inf
    y.masked_fill_(bad, NAN_BITS)
    y.masked_fill_(b == 0x7F800000, 0x7F800000)
    y.masked_fill_(x.isnan(), NAN_BITS)
    return y.view(torch.float32)
