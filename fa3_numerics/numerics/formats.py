"""Floating-point formats used by FP8 attention, and round-to-nearest-even casts into them.

Exposed: ``Format``, ``FORMATS``, ``get_format``, ``cast``, ``round_to_format``.

One table holds every format; special cases are stated once. ``round_to_format`` is the
pure reference (works in float64 or float32, any device): it rounds to nearest, ties to
even, with the format's subnormals, and then either saturates (FP8 casts in FA3 use
``cvt.rn.satfinite``) or overflows to +-inf (IEEE FP16/BF16). ``cast`` is the fast path
used by the emulator: torch's own dtype conversion after an explicit clamp, because
torch's plain cast to float8 turns overflow into NaN instead of saturating.
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
    dtype: torch.dtype | None  # torch storage dtype, None for "no rounding"

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
    return torch.where(torch.isnan(x), x, y)


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
        return x.to(torch.float64)
    if x.dtype == torch.float64 and f.dtype != torch.float64:
        x = to_float32_round_odd(x) if f.mbits <= 21 else round_to_format(x, f).to(torch.float32)
    if f.saturate:
        x = torch.clamp(x, -f.max, f.max)
    return x.to(f.dtype)


def quantize_dequantize(x: torch.Tensor, fmt: str | Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``cast`` then back to ``dtype``: the value the next arithmetic stage sees."""
    f = get_format(fmt)
    if f.dtype is None:
        return x.to(dtype)
    if f.name == "fp32" and x.dtype == torch.float32:
        return x.to(dtype)
    return cast(x, f).to(dtype)
