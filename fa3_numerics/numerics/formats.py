"""Floating-point formats used by FP8 attention, and round-to-nearest-even casts into them.

Exposed: ``Format``, ``FORMATS``, ``get_format``, ``cast``, ``round_to_format``,
``quantize_dequantize``, ``round_fast``, ``to_float32_round_odd``; microscaling element and scale formats:
``E2M1``, ``ELEMENT_FORMATS``, ``element_format``, ``encode_e2m1``, ``decode_e2m1``,
``E8M0_MIN_EXP``, ``E8M0_MAX_EXP``, ``round_to_e8m0``, ``encode_e8m0``, ``decode_e8m0``.

One table holds every format; special cases are stated once. ``round_to_format`` is the
pure reference (works in float64 or float32, any device): it rounds to nearest, ties to
even, with the format's subnormals, and then either saturates (FP8 casts in FA3 use
``cvt.rn.satfinite``) or overflows to +-inf (IEEE FP16/BF16). ``cast`` is the fast path
used by the emulator: torch's own dtype conversion after an explicit clamp, because
torch's plain cast to float8 turns overflow into NaN instead of saturating.

The microscaling formats of Blackwell (OCP MX v1.0; NVIDIA NVFP4) live beside the table but
not in it, so a recipe cannot name them before the emulator handles their block scales:

- ``E2M1`` (FP4: 1 sign, 2 exponent, 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no
  inf, no NaN). torch has only a packed two-per-byte dtype for it, so its values are held in
  float32 (``Format.storage``). Casts round to nearest even and saturate to +-6
  (``cvt.rn.satfinite.e2m1x2.f32``, the instruction SageAttention3 uses). A NaN becomes a
  zero whose sign bit is the NaN's inverted, which is what ml_dtypes 0.6's
  ``float4_e2m1fn`` does; what the hardware does with a NaN is not documented (other
  libraries give +6), and the emulator never feeds it one.
- E8M0 (the MX scale: 8 exponent bits, no sign, no mantissa, no zero; 2^-127 .. 2^127,
  code 0xFF is NaN). It is not a sign/exponent/mantissa format, so it has functions instead
  of a ``Format`` row: ``round_to_e8m0`` with the rounding modes the hardware has (``rz``,
  ``rp``: PTX ``cvt.{rz,rp}.satfinite.ue8m0x2.f32``) and round-to-nearest (``rn``), which no
  hardware offers and no recipe uses.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import UsageError


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    ebits: int
    mbits: int
    emin: int  # exponent of the smallest normal number
    max: float  # largest finite value
    saturate: bool  # overflow clamps to +-max (True) or becomes +-inf (False)
    dtype: torch.dtype | None  # torch storage dtype, None for "no rounding" (unless ``storage``)
    # Formats torch has no dtype for (E2M1): rounded by ``round_to_format`` and held in this
    # wider dtype, which represents every value exactly.
    storage: torch.dtype | None = None
    has_nan: bool = True  # False: a NaN input becomes a zero (E2M1; sign as ml_dtypes gives it)

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def short(self) -> str:
        return self.name


# Values as hex floats with decimals beside them; see ml_dtypes' finfo for the same table.
FORMATS: dict[str, Format] = {
    # e4m3fn: no infinities, one NaN pattern, so the top binade stops at 1.75 * 2^8.
    "e4m3": Format("e4m3", 4, 3, -6, float.fromhex("0x1.Cp8"), True, torch.float8_e4m3fn),  # 448
    "e5m2": Format("e5m2", 5, 2, -14, float.fromhex("0x1.Cp15"), True, torch.float8_e5m2),  # 57344
    "fp16": Format("fp16", 5, 10, -14, float.fromhex("0x1.ffcp15"), False, torch.float16),  # 65504
    "bf16": Format("bf16", 8, 7, -126, float.fromhex("0x1.fep127"), False, torch.bfloat16),  # 3.39e38
    "fp32": Format("fp32", 8, 23, -126, float.fromhex("0x1.fffffep127"), False, torch.float32),
    "fp64": Format("fp64", 11, 52, -1022, float.fromhex("0x1.fffffffffffffp1023"), False, None),
}
_ALIASES = {"e4m3fn": "e4m3", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float16": "fp16",
            "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "none": "fp64"}


@functools.lru_cache(maxsize=None)
def get_format(name: str | Format) -> Format:
    if isinstance(name, Format):
        return name
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise UsageError(f"unknown number format {name!r}; choose one of: {', '.join(FORMATS)}")
    return FORMATS[key]


def round_to_format(x: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (ties to even); same dtype as ``x``.

    Reference implementation: exact in float64 for every format here, and exact in
    float32 for formats narrower than float32.
    """
    f = get_format(fmt)
    if f.name == "fp64" or (f.name == "fp32" and x.dtype == torch.float32):
        return x.clone()
    _, e = torch.frexp(x)  # x = m * 2^e with 0.5 <= |m| < 1, so floor(log2|x|) = e - 1
    # One quantum per binade; below the normal range the quantum stays at the subnormal step.
    q_exp = torch.clamp(e - 1, min=f.emin) - f.mbits
    y = torch.ldexp(torch.round(torch.ldexp(x, -q_exp)), q_exp.to(x.dtype))
    if f.saturate:
        y = torch.clamp(y, -f.max, f.max)
    else:
        # IEEE: a value rounds to infinity once it reaches max + half an ulp of the top binade.
        limit = f.max + 2.0 ** (_top_exp(f) - f.mbits - 1)
        y = torch.where(x.abs() >= limit, torch.sign(x) * torch.inf, y)
    if not f.has_nan:  # a zero with the NaN's sign bit inverted: ml_dtypes' choice (see above)
        return torch.where(torch.isnan(x), torch.where(torch.signbit(x), 0.0, -0.0).to(x.dtype), y)
    return torch.where(torch.isnan(x), x, y)


def round_fast(x: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """``round_to_format`` for finite ``x``, through the compiled rounding when it applies (CPU,
    float32/float64, a format narrower than float32, E2M1 included); same dtype as ``x``, same
    numbers (tests/numerics/test_native.py checks the compiled rounding against ``round_to_format``).
    Infinities saturate or overflow alike in both; NaN stays NaN in both, except in E2M1, whose
    reference maps it to a signed zero: a NaN there takes the reference."""
    f = element_format(fmt)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and f.mbits < 23:
        from . import native

        # the compiled rounding reads (mbits, emin, max, saturate); a dtype marks it as a rounding target
        proxy = f if f.dtype is not None else dataclasses.replace(f, dtype=torch.float32)
        y = native.round_f64(x, proxy) if x.dtype == torch.float64 else native.round_f32(x, proxy)
        if y is not None and (f.has_nan or not bool(torch.isnan(y).any())):
            return y.to(x.dtype)
    return round_to_format(x, f)


def _top_exp(f: Format) -> int:
    import math

    return math.frexp(f.max)[1] - 1


def to_float32_round_odd(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounding to odd: inexact results get an odd last bit.

    Rounding to odd first and then to nearest-even in a format with at least two fewer
    mantissa bits equals one direct rounding (Boldo & Melquiond), so float64 inputs can
    use torch's fast float32 casts without double-rounding errors.
    """
    y = x.to(torch.float32)
    back = y.to(torch.float64)
    bits = y.view(torch.int32)
    fix = (back != x) & ((bits & 1) == 0) & torch.isfinite(back)
    step = torch.where(back.abs() > x.abs(), -1, 1).to(torch.int32)
    return torch.where(fix, bits + step, bits).view(torch.float32)


def cast(x: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Round ``x`` into ``fmt`` and return it in the format's torch dtype (fast path).

    FP8 formats saturate explicitly. Inputs wider than float32 go through
    ``round_to_format`` first so that there is a single rounding, never two.
    """
    f = get_format(fmt)
    if f.dtype is None:
        if f.storage is not None:  # no torch dtype: the reference rounding is exact here
            return round_to_format(x if x.dtype == torch.float64 else x.to(torch.float32), f).to(f.storage)
        return x.to(torch.float64)
    if x.dtype == torch.float64 and f.dtype != torch.float64:
        from . import native  # one pass in C (same single rounding, saturation included)

        fast = native.round_f64(x, f)
        if fast is not None:
            return fast.to(f.dtype)
        x = to_float32_round_odd(x) if f.mbits <= 21 else round_to_format(x, f).to(torch.float32)
    if f.saturate:
        x = torch.clamp(x, -f.max, f.max)
    return x.to(f.dtype)


def quantize_dequantize(x: torch.Tensor, fmt: str | Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``cast`` then back to ``dtype``: the value the next arithmetic stage sees."""
    f = get_format(fmt)
    if f.dtype is None and f.storage is None:
        return x.to(dtype)
    if f.name == "fp32" and x.dtype == torch.float32:
        return x.to(dtype)
    if f.dtype is not None and x.dtype == torch.float32:
        from . import native  # one pass in C, without the round trip through the narrow dtype

        fast = native.round_f32(x, f)
        if fast is not None:
            return fast.to(dtype)
    return cast(x, f).to(dtype)


# -- Microscaling element and scale formats ---------------------------------------------------
# Kept out of FORMATS (and so out of recipes) until the emulator handles their block scales.

# e2m1: the top binade [4, 6] holds 4 and 6; the smallest normal is 1, the subnormal step 0.5.
E2M1 = Format("e2m1", 2, 1, 0, float.fromhex("0x1.8p2"), True, None, storage=torch.float32, has_nan=False)  # 6
ELEMENT_FORMATS: dict[str, Format] = {"e2m1": E2M1, "fp4": E2M1, "float4_e2m1fn": E2M1}
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7


def element_format(name: str | Format) -> Format:
    """A format from ``FORMATS`` or one of the microscaling element formats (``e2m1``)."""
    if isinstance(name, Format):
        return name
    return ELEMENT_FORMATS.get(name.lower()) or get_format(name)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values (exact, e.g. from ``cast(x, E2M1)``) -> their 4-bit codes as uint8
    (bit 3 the sign, bits 0-2 the magnitude's index in 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float64, device=values.device)
    mag = values.abs().to(torch.float64)
    idx = torch.searchsorted(table, mag.contiguous())
    if not torch.equal(table[idx.clamp(max=7)], mag):
        raise ValueError("encode_e2m1 takes values already rounded to E2M1")
    return (idx + 8 * torch.signbit(values).to(idx.dtype)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, low nibble) -> float32 values (-0.0 for code 8)."""
    c = codes.to(torch.int64) & 0xF
    mag = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)[c & 7]
    return torch.where(c >= 8, -mag, mag)


E8M0_MIN_EXP = -127  # code 0
E8M0_MAX_EXP = 127  # code 254; code 255 is NaN


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> float32 values 2^(code - 127); NaN for 0xFF. 2^-127 is a float32
    subnormal, so every value is exact."""
    c = codes.to(torch.int64)
    v = torch.ldexp(torch.ones_like(c, dtype=torch.float64), c - 127).to(torch.float32)
    return torch.where(c == 255, torch.full_like(v, torch.nan), v)


def encode_e8m0(values: torch.Tensor) -> torch.Tensor:
    """Powers of two in [2^-127, 2^127] (or NaN) -> E8M0 codes (uint8)."""
    v = values.to(torch.float64)
    m, e = torch.frexp(v)
    ok = torch.isfinite(v) & (m == 0.5) & (e - 1 >= E8M0_MIN_EXP) & (e - 1 <= E8M0_MAX_EXP)
    if not torch.all(ok | torch.isnan(v)):
        raise ValueError("encode_e8m0 takes powers of two in [2^-127, 2^127] or NaN")
    return torch.where(torch.isnan(v), torch.full_like(e, 255), e - 1 + 127).to(torch.uint8)


def round_to_e8m0(x: torch.Tensor, mode: str = "rn") -> torch.Tensor:
    """Round positive ``x`` to E8M0 (a power of two in [2^-127, 2^127]); float32 result, NaN
    where E8M0 has no value (NaN, zero, negative).

    - ``rz``: toward zero, 2^floor(log2 x); ``rp``: up, 2^ceil(log2 x). Both exact on the
      input's value (float32 or float64) and saturating to [2^-127, 2^127] like PTX's
      ``cvt.rz/rp.satfinite.ue8m0x2.f32`` (+inf gives 2^127).
    - ``rn``: to the nearest power of two by value, once, from the input's own precision
      (float64 is not rounded to float32 first). Between 2^k and 2^(k+1) the midpoint is
      1.5 * 2^k; a tie goes up, since E8M0 has no mantissa whose evenness could decide it
      (ml_dtypes 0.7's ``float8_e8m0fnu`` cast rounds the same way). Everything below 2^-127,
      float32 subnormals included, is nearest to 2^-127 (E8M0 has no zero); from the midpoint
      1.5 * 2^127 on the value is past the top and, as E8M0 has no infinity, NaN.
    """
    if mode == "rn":
        x64 = x.to(torch.float64)  # exact for float32 inputs, subnormals included
        m, e = torch.frexp(x64)  # x = m * 2^e, 0.5 <= m < 1 for finite x > 0
        k = e.to(torch.int64) - 1 + (m >= 0.75).to(torch.int64)  # 2m >= 1.5: nearer 2^(k+1)
        bad = torch.isnan(x64) | torch.isinf(x64) | (x64 <= 0) | (k > E8M0_MAX_EXP)
        v = decode_e8m0((k.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + 127).to(torch.uint8))
        return torch.where(bad, torch.full_like(v, torch.nan), v)
    if mode not in ("rz", "rp"):
        raise ValueError(f"round_to_e8m0 mode {mode!r}: use rn, rz or rp")
    m, e = torch.frexp(x)  # x = m * 2^e, 0.5 <= m < 1 for finite x > 0
    k = e.to(torch.int64) - 1  # floor(log2 x)
    if mode == "rp":
        k = k + (m != 0.5).to(torch.int64)
    k = torch.where(torch.isinf(x), torch.full_like(k, E8M0_MAX_EXP), k).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    v = decode_e8m0((k + 127).to(torch.uint8))
    return torch.where(torch.isnan(x) | (x <= 0), torch.full_like(v, torch.nan), v)
