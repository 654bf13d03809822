"""SageAttention 1's steps before its attention kernel, as ``sageattn`` computes them.

Exposed: ``LOG2E_SAGE``, ``RCP_TABLE``, ``input_round``, ``smooth_k_in``, ``recip32``, ``fma32``,
``triton_quantize_int``.

- ``input_round``: the caller's tensors in the input format (recipe key ``in``).
- ``smooth_k_in``: ``km = k.mean(dim=seq, keepdim=True); k -= km`` in the input format: the mean
  rounded to it, the difference rounded again (``sageattention/core.py``). On an H200 the
  kernel's means matched this model (float64 mean, one rounding) in 1023 of 1024 channels and
  all 2,097,152 smoothed K values (reports/h200/sage1/).
- ``triton_quantize_int``: ``quant_per_block_int8_kernel`` (``sageattention/quant_per_block.py``)
  in float32, as its PTX does it (Triton 3.6 on sm_90a: ``mul.f32``, ``div.full.f32``,
  ``add.f32``, ``cvt.rzi.s16.f32``):

      x     = float32(input) * float32(sm_scale * 1.44269504)    (Q; K: sm_scale = 1)
      scale = max|x| over the block / 127.                        (div.full)
      code  = trunc(x / scale + 0.5 * where(x >= 0, 1, -1))       (div.full, add, truncation)

  Triton's ``/`` on float32 is ``div.full.f32``, not IEEE division. Modelled as x times the
  float32 reciprocal of the divisor, rounded to nearest: that gives the kernel's scale for
  every block (IEEE division: 90-96% of blocks) and its codes for all but 63 of 2,097,152 Q
  values and all K values of the paper-shape case (one block whose hardware reciprocal is an
  ulp higher). The softmax scale in log2 units is folded into Q before it is quantized, so
  Q's descale carries it and the attention kernel multiplies S by nothing more.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .formats import quantize_dequantize
from .granularity import Granularity, amax
from .intformats import get_int_format
from .quant import Quantized

# The constant sageattn multiplies sm_scale by (quant_per_block.py), not log2(e) to float64
# precision: in float32 the products agree for the usual scales, but the kernel's is this one.
LOG2E_SAGE = 1.44269504


def input_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (float64) rounded once to the input format ``fmt`` (``none``: unchanged), through
    ``formats.cast`` (round-to-odd float32, then the format: one rounding on every device)."""
    return x if fmt == "none" else quantize_dequantize(x.to(torch.float64), fmt, torch.float64)


def smooth_k_in(k: torch.Tensor, fmt: str) -> torch.Tensor:
    """K minus its token mean with the mean and the difference each rounded to ``fmt``: k
    [B, Hkv, N, D] float64 holding ``fmt`` values -> the same shape, float64."""
    km = input_round(k.mean(dim=2, keepdim=True), fmt)
    return input_round(k - km, fmt)


# Where the H200's 1 / y (Triton's div.full.f32) differs from the correctly rounded float32
# reciprocal, per 23-bit mantissa of y (tools/device/sage_h200.py, part ``rcp``); absent, the
# reciprocal is modelled as correctly rounded.
RCP_TABLE = Path(__file__).with_name("sage_rcp.npz")
_RCP: dict = {}


def _rcp_table(device: torch.device) -> torch.Tensor | None:
    """int32 [2^23]: ulps to add to RN(1/y) for each mantissa of y, or None without the table."""
    if "cpu" not in _RCP:
        if not RCP_TABLE.is_file():
            _RCP["cpu"] = None
        else:
            with np.load(RCP_TABLE) as z:
                dense = torch.zeros(1 << 23, dtype=torch.int32)
                dense[torch.from_numpy(z["mant"].astype(np.int64))] = torch.from_numpy(z["ulps"].astype(np.int32))
            _RCP["cpu"] = dense
    table = _RCP["cpu"]
    if table is None or device.type == "cpu":
        return table
    key = str(device)
    if key not in _RCP:
        _RCP[key] = table.to(device)
    return _RCP[key]


def recip32(x: torch.Tensor) -> torch.Tensor:
    """The float32 reciprocal inside Triton's ``div.full.f32`` (x / y = float32(x * recip32(y))):
    the correctly rounded 1/x, corrected by the measured table where the hardware's differs.
    For positive normal float32 ``x`` whose reciprocal is normal (scales, row sums)."""
    r = (1.0 / x.to(torch.float64)).to(torch.float32)
    table = _rcp_table(x.device)
    if table is None:
        return r
    mant = x.to(torch.float32).contiguous().view(torch.int32) & 0x7FFFFF
    fix = table[mant.long()]
    ok = torch.isfinite(r) & (r > 0)
    return torch.where(ok, (r.contiguous().view(torch.int32) + fix).view(torch.float32), r)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a * b + c`` rounded once to nearest-even, as an FFMA: float32 tensors in, float32
    out. The float64 product of two float32 values is exact; the float64 sum is made round-to-odd
    from its exact error (two-sum), so the float32 cast after it is a single rounding even where
    a plain float64 sum would round twice."""
    p = a.to(torch.float64) * b.to(torch.float64)
    c64 = c.to(torch.float64)
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))  # p + c == s + err exactly
    bits = s.view(torch.int64)
    step = torch.where((err > 0) == (s > 0), 1, -1).to(torch.int64)  # toward the exact sum
    odd = torch.where((err != 0) & ((bits & 1) == 0) & torch.isfinite(s), bits + step, bits)
    return odd.view(torch.float64).to(torch.float32)


def triton_quantize_int(x: torch.Tensor, fmt: str, gran: Granularity, *, block_rows: int, scale: float,
                        rows: torch.Tensor | None = None, eps: float = 0.0) -> Quantized:
    """``quant_per_block_int8_kernel`` on ``x`` (float64 [B, H, N, D] holding input-format
    values), with ``scale`` multiplied in first (Q: sm_scale * 1.44269504; K: 1.0).

    ``eps`` is added to each scale: SageAttention2's per-thread quantizer
    (``sageattention/triton/quant_per_thread.py``) writes ``max|x| / 127. + 0.0000001`` and folds
    no softmax scale into Q (``scale=1.0``). The H200 rounds that once, as
    ``fma(max|x|, recip32(127), 1e-7)``: the division's multiply by the reciprocal and the add
    fused into one FFMA (``fma32``). Rounding the quotient first and adding 1e-7 after (two
    roundings) leaves most scales in [2, 4) unmoved (1e-7 is under half their ulp) where the
    fused form lifts some by one ulp; a K value at x/scale = 63.5 then codes 64 instead of the
    kernel's 63 (reports/h200/sage2/, "After the input-rounding fix").

    Returns int8 codes and the float32 per-block descale (``scale`` included), rows ``rows``
    only (scales from every row). A block of zeros gets descale 0 (``eps``: eps) and codes 0, as
    the kernel's 0/0 = NaN converts to 0."""
    f = get_int_format(fmt)
    x32 = x.to(torch.float32) * torch.tensor(scale, dtype=torch.float32)
    a = amax(x32.to(torch.float64), gran, block_rows=block_rows).to(torch.float32)
    r = recip32(torch.tensor(float(f.qmax)))
    if eps:
        d = fma32(a, r, torch.tensor(eps, dtype=torch.float32))
    else:
        d = (a * r).to(torch.float32)
    if rows is not None:
        x32 = x32.index_select(2, rows)
        d = d.index_select(2, rows) if d.shape[2] > 1 else d
    y = x32 * torch.where(d > 0, recip32(d), torch.zeros_like(d))
    y = y + torch.where(y >= 0, 0.5, -0.5).to(torch.float32)
    codes = torch.trunc(y).clamp(-f.qmax, f.qmax)
    return Quantized(codes.to(f.dtype), d, f)


__all__ = ["LOG2E_SAGE", "RCP_TABLE", "input_round", "smooth_k_in", "recip32", "fma32", "triton_quantize_int"]
