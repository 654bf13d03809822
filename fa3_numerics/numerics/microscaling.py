"""Block-scaled (microscaling) quantization: MXFP8, NVFP4, and SageAttention3's two-level P.

Exposed: ``BlockScaled``, ``mx_quantize``, ``nvfp4_quantize``, ``quantize_p_two_level``,
``P_ROW_TARGET``, ``P_ROW_OFFSET``, ``MX_BLOCK``, ``NVFP4_BLOCK``.

Layering as in microxcaling (elemwise_ops -> mx_ops): ``formats`` rounds elements,
``granularity.group_amax`` forms the blocks, this module chooses the scales. Every scale is
computed in float64 from the block amax and rounded once into its own format; elements
saturate explicitly.

The block runs along the contraction dimension of the GEMM that consumes the operand:
head_dim for Q and K (``axis=-1``), keys for P (``axis=-1`` of [.., R, N]) and V
(``axis=2`` of [B, H, N, D]).

- MXFP8 (OCP Microscaling Formats v1.0): e4m3 (or e5m2) elements, one E8M0 scale 2^e per
  ``MX_BLOCK`` = 32 elements. ``scale_rounding="floor"`` is the spec's and microxcaling's
  rule (``mx/mx_ops.py`` ``_shared_exponents`` then ``shared_exp - emax``):
  e = floor(log2 amax) - emax_elem (8 for e4m3), clamped to [-127, 127], an all-zero block
  gets 2^-127, and elements above the element max saturate (floor can put amax up to
  2^(emax+1)); torchao calls it FLOOR. ``"ceil"`` is NVIDIA's rule (cuBLAS block scaling,
  TransformerEngine's ``float_to_e8m0``; torchao RCEIL): ``cvt.rp.satfinite.ue8m0x2.f32`` of
  amax / max, e = ceil(log2(amax / max)), so nothing saturates. Those kernels form
  amax * float32(1 / 448) in float32; here the quotient is exact, which differs only when
  amax / 448 lies within a float32 rounding of a power of two.
- NVFP4: E2M1 elements, one E4M3 scale per ``NVFP4_BLOCK`` = 16 elements, and an FP32
  tensor scale t = amax_tensor / (448 * 6) so that the block scales amax_block / (6 t) use
  E4M3's range. SageAttention3 quantizes Q, K and V without a tensor scale (t = 1): its
  ``scaled_fp4_quant`` kernels (``sageattention3_blackwell/sageattn3/quantization/
  fp4_quantization_4d.cu``) take SF = amax16 / 6 in float32, cast it to e4m3 (RNE,
  satfinite), and multiply the elements by 1 / SF before ``cvt.rn.satfinite.e2m1x2.f32``.
  Here the element is x / SF in float64, rounded once: the kernel's float32 reciprocal
  and product can differ from it only where x / SF lies within a float32 rounding of an
  E2M1 tie.
- Two-level P (SageAttention3, arXiv 2505.11594; kernel ``sageattn3/blackwell/
  softmax_fused.h`` and ``mainloop_tma_ws.h``): level 1 scales each row so that P's
  maximum maps to 448 * 6 = ``P_ROW_TARGET``; then every block of 16 keys gets an E4M3
  scale blockmax / 6, which can no longer exceed 448. The kernel folds level 1 into the
  exponent: P~ = exp2(S * scale_log2 - (m * scale_log2 - log2(2688))) with m the running
  row max, i.e. an exp2 offset of ``P_ROW_OFFSET`` = log2(2688) where FA3 uses 8 and
  SageAttention2 log2(448). It then divides P~ by the float32 block scale and converts the
  *same* float32 scale to E4M3 for the MMA, so the elements are scaled by the unrounded
  scale and dequantized with the rounded one: every block of P carries a common relative
  error of up to 2^-4 (``match="kernel"``). ``match="scale"`` divides by the rounded
  scale instead, as the Q/K/V quantizer does. The block scale is computed here as
  blockmax / 6; the kernel gets it from ex2.approx of the block's max score, which this
  module does not reproduce.

Operands for a float32 GEMM: ``BlockScaled.operand()`` is values x block scale, exact in
float32 (e4m3 x 2^e: 4 significant bits, within float32's range for float32 inputs; e2m1 x
e4m3: at most 6 bits), so a per-block scale that varies along the contraction can be folded
into the operand and the GEMM run in float32; the tensor scale (NVFP4) multiplies after.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import UsageError
from .formats import E2M1, E8M0_MAX_EXP, E8M0_MIN_EXP, Format, element_format, get_format
from .formats import round_fast as round_to_format  # the reference rounding, compiled where it applies
from .granularity import Granularity, PerTensor, amax, expand_groups, group_amax

MX_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
P_ROW_TARGET = E4M3_MAX * E2M1_MAX  # 2688: level 1 maps a row's max of P here
P_ROW_OFFSET = math.log2(P_ROW_TARGET)  # 11.392...: the same as an exp2 offset


@dataclasses.dataclass
class BlockScaled:
    """Elements and scales of a block-scaled tensor.

    ``values``: float32, x's shape, holding the element format's values. ``scale``:
    float32, compact (x's shape with ``axis`` of length ceil(n / block)), holding the block
    scale format's values. ``tensor_scale``: float32 broadcasting against x (the NVFP4
    FP32 scale, or the per-row scale of two-level P), or None for 1. ``dequantize()`` is
    values x scale x tensor_scale."""

    values: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    elem: Format
    scale_fmt: str  # "e8m0" or "e4m3"
    block: int
    axis: int

    def expanded_scale(self) -> torch.Tensor:
        return expand_groups(self.scale, self.block, self.axis, self.values.shape[self.axis])

    def operand(self) -> torch.Tensor:
        """values x block scale in float32 (exact; see the module docstring: at most 6
        significant bits, far inside float32's range, so the float32 product does not round)."""
        return self.values.to(torch.float32) * self.expanded_scale().to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        y = self.values.to(torch.float64) * self.expanded_scale().to(torch.float64)
        if self.tensor_scale is not None:
            y = y * self.tensor_scale.to(torch.float64)
        return y.to(dtype)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite a > 0, exactly (frexp, not log2's rounding)."""
    return torch.frexp(a)[1].to(torch.int64) - 1


def mx_quantize(x: torch.Tensor, elem: str | Format = "e4m3", *, block: int = MX_BLOCK, axis: int = -1,
                scale_rounding: str = "floor") -> BlockScaled:
    """MX quantization: ``elem`` values with one E8M0 scale per ``block`` elements along ``axis``.

    x [.., n along axis, ..] -> values (x's shape), scale (compact, ceil(n / block) along
    ``axis``; powers of two in [2^-127, 2^127], NaN where the block holds a non-finite
    value or the exponent would pass 127). See the module docstring for the two scale rules.
    """
    f = element_format(elem)
    if not f.saturate:
        raise UsageError(f"MX element format must be a saturating narrow format, not {f.name}")
    if scale_rounding not in ("floor", "ceil"):
        raise UsageError(f"scale_rounding {scale_rounding!r}: use floor (OCP MX) or ceil")
    x64 = x.to(torch.float64)
    a = group_amax(x64, block, axis)
    finite = torch.isfinite(a)
    pos = finite & (a > 0)
    safe = torch.where(pos, a, torch.ones_like(a))
    if scale_rounding == "floor":
        e = _floor_log2(safe) - (math.frexp(f.max)[1] - 1)  # emax of the element: 8 for e4m3
    else:
        # amax / max rounded once in float64 lands on a power of two only if it is one, since
        # max has few significant bits (448 = 7 * 2^6): so ceil(log2) of it is exact.
        m, ex = torch.frexp(safe / f.max)
        e = ex.to(torch.int64) - (m == 0.5).to(torch.int64)
    e = torch.where(pos, e, torch.full_like(e, E8M0_MIN_EXP)).clamp_min(E8M0_MIN_EXP)
    bad = ~finite | (e > E8M0_MAX_EXP)
    scale64 = torch.ldexp(torch.ones_like(a), e.clamp_max(E8M0_MAX_EXP))
    scale64 = torch.where(bad, torch.full_like(scale64, torch.nan), scale64)
    n = x.shape[axis]
    values = round_to_format(x64 / expand_groups(scale64, block, axis, n), f)  # power-of-two division: exact
    return BlockScaled(values.to(torch.float32), scale64.to(torch.float32), None, f, "e8m0", block, axis)


def nvfp4_quantize(x: torch.Tensor, *, block: int = NVFP4_BLOCK, axis: int = -1,
                   tensor_scale: Granularity | None = PerTensor()) -> BlockScaled:
    """NVFP4: E2M1 values, one E4M3 scale per ``block`` elements along ``axis``, and an FP32
    tensor scale.

    x [.., n along axis, ..] -> values (x's shape), scale (compact, E4M3 values),
    tensor_scale: ``amax(x, tensor_scale) / 2688`` in float64 rounded to float32, shaped as
    that granularity's amax (all ones for ``PerTensor``, any rank; ``PerHead`` gives
    [B, H, 1, 1] and needs 4-d input), or None (no tensor scale: SageAttention3's Q, K, V). Block scale
    s = E4M3(amax_block / (6 t)), rounded to nearest even, saturating, computed in float64;
    a block whose scale rounds to 0 gets all-zero elements, as the kernel's zero reciprocal
    gives them.
    """
    x64 = x.to(torch.float64)
    t = None
    t64 = torch.ones((), dtype=torch.float64, device=x.device)
    if tensor_scale is not None:
        if isinstance(tensor_scale, PerTensor):
            at = x64.abs().amax().reshape([1] * x.dim())  # any rank (P is [.., R, N])
        else:
            if x.dim() != 4:
                raise UsageError("a per-head/block/token tensor scale needs x laid out [B, H, N, D]")
            at = amax(x64, tensor_scale)
        ok = torch.isfinite(at) & (at > 0)
        t = torch.where(ok, at / P_ROW_TARGET, torch.ones_like(at)).to(torch.float32)
        t64 = t.to(torch.float64)
    n = x.shape[axis]
    a = group_amax(x64, block, axis)
    t_grp = t64 if t is None else _compact_like(t64, a, axis)
    s = round_to_format(a / (E2M1_MAX * t_grp), get_format("e4m3"))
    denom = expand_groups(s, block, axis, n) * t64  # exact in float64: 4 x 24 significant bits
    vals = round_to_format(x64 / torch.where(denom > 0, denom, torch.ones_like(denom)), E2M1)
    vals = torch.where(denom > 0, vals, torch.zeros_like(vals))
    return BlockScaled(vals.to(torch.float32), s.to(torch.float32), t, E2M1, "e4m3", block, axis)


def _compact_like(t: torch.Tensor, a: torch.Tensor, axis: int) -> torch.Tensor:
    """A tensor scale that broadcasts against x, made to broadcast against the compact
    block amax ``a`` (it is constant along ``axis`` unless it has that axis's full length)."""
    ax = axis % a.dim()
    if t.shape[ax] == 1:
        return t
    raise UsageError("the tensor-scale granularity must be constant along the block axis")


def quantize_p_two_level(p: torch.Tensor, *, block: int = NVFP4_BLOCK, row_scale: str = "none",
                         match: str = "kernel") -> BlockScaled:
    """SageAttention3's two-level quantization of P ([.., R, N], non-negative) along keys.

    Level 1, ``row_scale``: ``"none"`` when P already carries it, as the kernel's
    P~ = exp2(... + ``P_ROW_OFFSET``) does (P~ <= 2688); ``"amax"`` for a materialised P
    (the paper's form): r = rowmax(P) / 2688 in float64, rounded to float32, and
    P1 = float32(P / r). Level 2: per ``block`` keys, sf = float32(blockmax(P1) / 6) <= 448;
    elements E2M1(float32(P1 / sf)) (``match="kernel"``) or E2M1(P1 / E4M3(sf))
    (``match="scale"``); block scale E4M3(sf). A block with sf = 0 (all of P zero or
    masked) gets zero elements and contributes nothing.

    Returns values [.., R, N], scale [.., R, ceil(N / block)] (E4M3 values), tensor_scale
    r [.., R, 1] (None with ``row_scale="none"``); ``dequantize()`` is the P the P V MMA sees.
    """
    if row_scale not in ("none", "amax") or match not in ("kernel", "scale"):
        raise UsageError("quantize_p_two_level: row_scale is none or amax, match is kernel or scale")
    p64 = p.to(torch.float64)
    r = None
    if row_scale == "amax":
        rm = p64.amax(dim=-1, keepdim=True)
        ok = torch.isfinite(rm) & (rm > 0)
        r = torch.where(ok, rm / P_ROW_TARGET, torch.ones_like(rm)).to(torch.float32)
        p64 = (p64 / r.to(torch.float64)).to(torch.float32).to(torch.float64)
    if p.dtype == torch.float32 or row_scale == "amax":
        # P1 holds float32 values (the emulator's P~ per KV tile): the same numbers in float32
        return _two_level_f32(p64.to(torch.float32), block, match, r)
    sf = (group_amax(p64, block, -1) / E2M1_MAX).to(torch.float32).to(torch.float64)
    s8 = round_to_format(sf, get_format("e4m3"))
    n = p.shape[-1]
    div = expand_groups(sf if match == "kernel" else s8, block, -1, n)
    live = div > 0
    q = p64 / torch.where(live, div, torch.ones_like(div))
    if match == "kernel":
        q = q.to(torch.float32).to(torch.float64)  # the kernel's float32 division
    vals = torch.where(live, round_to_format(q, E2M1), torch.zeros_like(q))
    return BlockScaled(vals.to(torch.float32), s8.to(torch.float32), r, E2M1, "e4m3", block, -1)


def _two_level_f32(p1: torch.Tensor, block: int, match: str, r) -> BlockScaled:
    """Level 2 of ``quantize_p_two_level`` for float32-valued P1, computed in float32 where that
    is exact: a block max is exact, a float32 quotient of float32 values is the correctly rounded
    float32(P1 / sf) of the kernel form, E2M1 x E4M3 products are exact. The ``scale`` form
    divides in float64 so that E2M1 rounds the exact quotient once, as the reference does."""
    n = p1.shape[-1]
    ng = -(-n // block)
    pp = torch.nn.functional.pad(p1, (0, ng * block - n)) if ng * block != n else p1
    pp = pp.reshape(*p1.shape[:-1], ng, block)
    # P >= 0, so zero padding never raises a block max; NaN propagates as in group_amax
    sf = (pp.amax(dim=-1, keepdim=True).to(torch.float64) / E2M1_MAX).to(torch.float32)
    s8 = round_to_format(sf, get_format("e4m3"))
    div = sf if match == "kernel" else s8
    live = div > 0
    safe = torch.where(live, div, torch.ones_like(div))
    q = pp / safe if match == "kernel" else pp.to(torch.float64) / safe.to(torch.float64)
    vals = torch.where(live, round_to_format(q, E2M1).to(torch.float32), torch.zeros((), dtype=torch.float32))
    vals = vals.reshape(*p1.shape[:-1], ng * block)[..., :n]
    return BlockScaled(vals, s8.squeeze(-1), r, E2M1, "e4m3", block, -1)
