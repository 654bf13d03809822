"""Symmetric integer formats (INT8, INT4) for Q and K, their rounding, and the exact integer GEMM.

Exposed: ``IntFormat``, ``INT_FORMATS``, ``get_int_format``, ``round_to_int``, ``TIES``,
``int_matmul``, ``float32_gemm_is_exact``.

SageAttention quantizes Q and K to integers with one float32 scale per group of tokens:
``scale = amax / qmax`` and ``q = round(x / scale)``, with qmax = 127 for INT8 and 7 for INT4
(thu-ml/SageAttention ``sageattention/triton/quant_per_block.py``, ``quant_per_thread.py``:
``tl.max(tl.abs(x)) / 127.`` and ``/ 7.``). The code is symmetric: -qmax .. qmax, so the most
negative two's-complement code (-128, -8) is never produced. Casts clamp to +-qmax
explicitly; with amax scaling nothing can exceed qmax by more than a float32 rounding.

Tie rule. Two rules are used by SageAttention's own kernels, and both are offered:

- ``away`` (default): round half away from zero. The Triton quantizers, which every
  default entry point uses (``per_block_int8`` in v1, ``per_thread_int8`` for the v2 CUDA
  kernels on sm80/sm89/sm90, see ``sageattention/core.py``), add ``0.5 * sign(x)`` and
  truncate (``.to(tl.int8)``). Here the rule is applied exactly; the Triton float32 sum
  differs from it only for |x| within 2^-25 below 0.5 (where ``x + 0.5`` rounds up to 1).
- ``even``: round half to even, saturating: ``cvt.rni.sat.s8.f32``, used by the CUDA
  quantizers ``quant_per_block_int8_cuda`` / ``quant_per_warp_int8_cuda``
  (``csrc/fused/fused.cu`` via ``float_to_int8_rn`` in ``csrc/numeric_conversion.cuh``).

A tie needs ``x / scale`` exactly at k + 1/2; continuous data never hits one, dyadic test
data does.

The Q K^T product of integer codes is exact: the tensor core multiplies INT8/INT4 codes
and accumulates in int32 (``mma.sync ... s32.s8.s8.s32``, ``wgmma ... s32.s8.s8``), and
|sum| <= d * 127^2 stays far below 2^31. The emulator can use a float32 matmul of the codes
instead, because every partial sum is an integer below 2^24 in magnitude whenever
d * qmax_q * qmax_k < 2^24 (``float32_gemm_is_exact``: d <= 1040 for INT8), so no
summation order can round.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UsageError

TIES = ("away", "even")


@dataclasses.dataclass(frozen=True)
class IntFormat:
    name: str
    bits: int

    @property
    def qmax(self) -> int:
        """Largest code; the format is symmetric, -qmax .. qmax."""
        return 2 ** (self.bits - 1) - 1

    @property
    def max(self) -> float:  # the name ``quant.amax_to_scale`` reads: scale = amax / max
        return float(self.qmax)

    @property
    def saturate(self) -> bool:
        return True

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8  # INT4 codes are held in int8 (torch has no unpacked int4)

    @property
    def short(self) -> str:
        return self.name


INT_FORMATS: dict[str, IntFormat] = {"int8": IntFormat("int8", 8), "int4": IntFormat("int4", 4)}


def get_int_format(name: str | IntFormat) -> IntFormat:
    if isinstance(name, IntFormat):
        return name
    key = name.lower()
    if key not in INT_FORMATS:
        raise UsageError(f"unknown integer format {name!r}; choose one of: {', '.join(INT_FORMATS)}")
    return INT_FORMATS[key]


def round_to_int(x: torch.Tensor, fmt: str | IntFormat, ties: str = "away") -> torch.Tensor:
    """Round ``x`` to the nearest integer (``ties``: ``away`` or ``even``, see the module
    docstring) and clamp to +-qmax; same floating dtype as ``x``, exact. NaN stays NaN
    (callers give finite values: scales are computed from a finite amax)."""
    f = get_int_format(fmt)
    if ties not in TIES:
        raise UsageError(f"tie rule {ties!r} is not one of {', '.join(TIES)}")
    r = torch.round(x)  # half to even
    if ties == "away":
        t = torch.trunc(x)
        r = torch.where((x - t).abs() == 0.5, t + torch.sign(x), r)
    return r.clamp(-f.qmax, f.qmax)


def float32_gemm_is_exact(k: int, a: str | IntFormat, b: str | IntFormat) -> bool:
    """True when a float32 matmul of integer codes over a contraction of ``k`` is exact in
    any summation order: every partial sum is an integer of magnitude < 2^24."""
    return k * get_int_format(a).qmax * get_int_format(b).qmax < 2 ** 24


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer GEMM with int32 accumulation, as the tensor core does it: a [.., M, K],
    b [.., K, N] holding integers (any dtype) -> int32 [.., M, N].

    Refuses inputs whose sums could overflow int32 (the hardware would wrap). Computed as a
    float64 matmul, which is exact because every partial sum is an integer below 2^31.
    """
    k = a.shape[-1]
    bound = k * a.abs().amax().item() * b.abs().amax().item() if a.numel() and b.numel() else 0
    if bound >= 2 ** 31:
        raise UsageError(f"int32 accumulation could overflow: K x max|a| x max|b| = {bound:.3g} >= 2^31")
    return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.int32)
