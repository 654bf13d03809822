"""Scaled quantization of Q, K, V into a narrow format.

Exposed: ``Quantized``, ``amax_to_scale``, ``quantize``, ``quantize_int``.

Layering: ``formats`` / ``intformats`` round elements; ``granularity`` decides which
elements share a scale; this module joins the two. The scale is computed in float64 (as
torchao's ``amax_to_scale`` does) and then rounded to float32, because the kernels receive
their descales as float32 and the quantized values must be the ones that descale
reproduces. Casts saturate explicitly. Block-scaled microscaling formats (MXFP8, NVFP4),
whose scales are themselves narrow formats, are in ``microscaling``.

Input shape -> descale shape (the descale broadcasts against the values):

- ``quantize(x, fmt, PerTensor())``: [B, H, N, D] -> [1, 1, 1, 1]; ``PerHead``: [B, H, 1, 1];
  ``PerBlock``, ``PerToken``, ``PerThread``: [B, H, N, 1] (constant over a block or group);
  ``PerChannel``: [B, H, 1, D]; ``PerGroup``: [B, H, N, D] (one value per group, expanded).
- ``quantize_int``: the same shapes, with integer codes as values.
"""

from __future__ import annotations

import dataclasses

import torch

from .formats import Format, cast, get_format
from .granularity import Granularity, amax
from .intformats import IntFormat, get_int_format, round_to_int


@dataclasses.dataclass
class Quantized:
    """``values`` in the format's storage dtype; ``descale`` (float32) broadcasts against it,
    so that ``values * descale`` approximates the original tensor."""

    values: torch.Tensor
    descale: torch.Tensor
    fmt: Format | IntFormat

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return self.values.to(dtype) * self.descale.to(dtype)


def amax_to_scale(a: torch.Tensor, fmt: Format, *, pow2: bool = False) -> torch.Tensor:
    """descale = amax / fmt.max (float64 in, float32 out); 1 where amax is 0 or not finite.

    With ``pow2`` the descale is rounded up to a power of two, so the scaling is exact and
    no value exceeds the format's range.
    """
    a = a.to(torch.float64)
    s = a / fmt.max
    ok = torch.isfinite(s) & (s > 0)
    s = torch.where(ok, s, torch.ones_like(s))
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return s.to(torch.float32)


def quantize(x: torch.Tensor, fmt: str | Format, gran: Granularity, *, block_rows: int | None = None,
             group: int = 1, pow2: bool = False, rows: torch.Tensor | None = None,
             descale: torch.Tensor | None = None, arith: str = "exact") -> Quantized:
    """Scale ``x`` (float64, [B, H, N, D]) into ``fmt`` at granularity ``gran``, saturating.

    ``descale`` (float32, shaped as the amax at ``gran``) fixes the descale instead of taking it
    from ``x``: static scales, calibrated on other text, where values of ``x`` may saturate.
    With ``rows`` (indices along N) the scales are computed from all of ``x`` but only
    those rows are quantized and returned: evaluating a sample of query rows then costs
    no more than the sample.
    """
    f = get_format(fmt)
    pick = (lambda t: t.index_select(2, rows) if t.shape[2] > 1 else t) if rows is not None else (lambda t: t)
    if (f.dtype is None and f.storage is None) or f.name == "fp32" or not f.saturate:
        # Wide formats (FP16/BF16/FP32) are used unscaled, as the kernels use them.
        one = torch.ones((1, 1, 1, 1), dtype=torch.float32, device=x.device)
        return Quantized(cast(pick(x), f) if f.dtype is not None else pick(x), one, f)
    if arith == "torchao" and descale is None and not pow2:
        return _torchao_cast(x, f, gran, block_rows=block_rows, group=group, pick=pick)
    if descale is not None:
        d = pick(descale.to(device=x.device, dtype=torch.float32))
    else:
        d = pick(amax_to_scale(amax(x, gran, block_rows=block_rows, group=group), f, pow2=pow2))
    return Quantized(_scaled_cast(pick(x), d, f), d, f)


def _torchao_cast(x, f: Format, gran: Granularity, *, block_rows, group, pick) -> Quantized:
    """torchao 0.18's FP8 attention quantizer (``triton_qkv_quantization.py``) in float32: amax of
    the float32 inputs; scale = 448 / amax and descale = amax / 448 with Triton's ``div.full.f32``
    (x * recip32(y), ``sage_quant``), both 1 where amax <= 1e-12; code = cast(float32(x * scale))."""
    from .sage_quant import recip32

    a = amax(x, gran, block_rows=block_rows, group=group).to(torch.float32)
    ok = a > 1e-12
    safe = torch.where(ok, a, torch.ones_like(a))
    fmax = torch.full_like(a, f.max)
    scale = torch.where(ok, (f.max * recip32(safe).double()).to(torch.float32), torch.ones_like(a))
    d = torch.where(ok, (a.double() * recip32(fmax).double()).to(torch.float32), torch.ones_like(a))
    xs = (pick(x).to(torch.float32).double() * pick(scale).double()).to(torch.float32)
    return Quantized(cast(xs, f), pick(d), f)


# float64 elements of one slice of ``_scaled_cast`` (32 MB).
_SLICE_ELEMS = 1 << 22


def _scaled_cast(x: torch.Tensor, d: torch.Tensor, f: Format) -> torch.Tensor:
    """cast(x / d, f), one slice of rows at a time: the float64 quotient and the rounding's
    float32 intermediate of a whole paper-shape K or V would be 268 + 134 MB of temporaries,
    the largest item of a run's peak memory. Each element's arithmetic is unchanged."""
    from . import native  # one pass in C: the same division and rounding, no float64 quotient

    fast = native.scaled_round_f64(x, d, f, f.dtype) if f.dtype is not None else None
    if fast is not None:
        return fast
    n = x.shape[2] if x.dim() == 4 else 0
    if x.dim() != 4 or x.numel() <= _SLICE_ELEMS or d.dim() != 4 or d.shape[2] not in (1, n):
        return cast(x.to(torch.float64) / d.to(torch.float64), f)
    step = max(1, _SLICE_ELEMS // (x.numel() // n))
    out = None
    for a in range(0, n, step):
        b = min(n, a + step)
        dd = d[:, :, a:b] if d.shape[2] > 1 else d
        part = cast(x[:, :, a:b].to(torch.float64) / dd.to(torch.float64), f)
        if out is None:
            out = torch.empty(part.shape[:2] + (n,) + part.shape[3:], dtype=part.dtype, device=part.device)
        out[:, :, a:b] = part
    return out


def quantize_int(x: torch.Tensor, fmt: str | IntFormat, gran: Granularity, *, block_rows: int | None = None,
                 group: int = 1, ties: str = "away", rows: torch.Tensor | None = None) -> Quantized:
    """Symmetric integer quantization of ``x`` (float64, [B, H, N, D]) at ``gran``.

    descale = amax / qmax (amax in float64, descale rounded to float32 as SageAttention
    stores it; 1 where amax is 0), codes = round(x / descale) clamped to +-qmax with the
    tie rule ``ties`` (``intformats``: ``away`` as SageAttention's Triton quantizers,
    ``even`` as its CUDA ones). ``values`` are int8 (INT4 codes too); ``descale`` has the
    shape listed in the module docstring. SageAttention's granularities: ``PerBlock(128)``
    for Q and ``PerBlock(64)`` for K in v1; ``sage2_thread_granularities()`` in v2.

    Where SageAttention differs, on purpose: its scale adds 1e-7 to amax (per-thread) or
    uses amax as is (per-block) and is computed in float32; an all-zero group gets
    descale 1 here, which changes no code (all are 0). ``rows`` as in ``quantize``.
    """
    f = get_int_format(fmt)
    pick = (lambda t: t.index_select(2, rows) if t.shape[2] > 1 else t) if rows is not None else (lambda t: t)
    d = pick(amax_to_scale(amax(x, gran, block_rows=block_rows, group=group), f))
    codes = round_to_int(pick(x).to(torch.float64) / d.to(torch.float64), f, ties)
    return Quantized(codes.to(f.dtype), d, f)
