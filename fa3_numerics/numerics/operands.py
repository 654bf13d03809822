"""Quantizing attention's operands by format family: Q, K and V before the kernel, P inside it.

Exposed: ``quantize_qk``, ``quantize_v``, ``cast_p``, ``check_tiles``, ``qk_granularity``.

The emulator's ``prepare`` and flash loop call these, so one place decides how each family of
``numerics/families.py`` becomes the float32 operands of the two GEMMs:

- float formats: ``quant.quantize`` (values in the format's dtype, one float32 descale per
  group at ``gran``; ``vgran=channel`` gives V one per channel);
- integers (Q and K only): ``quant.quantize_int`` (int8 codes, float32 descale per group,
  ``ties``); the code GEMM is exact in float32 (``intformats.float32_gemm_is_exact``);
- microscaling: ``microscaling.mx_quantize`` / ``nvfp4_quantize`` along the contraction
  (head_dim for Q and K, tokens for V). ``BlockScaled.operand()`` (elements x block scales) is
  exact in float32, so the block scales fold into the operand and the GEMM runs in float32;
  the NVFP4 tensor scale (``nvts``) becomes the descale, uniform per head or tensor, which
  the emulator folds into the softmax scale (Q, K) or applies to O at the end (V).

P is cast per KV tile (``cast_p``): a float format as the FA3 kernel casts it (round to nearest
even, saturating), MXFP8 with E8M0 scales per 32 keys, or NVFP4 in SageAttention3's two
levels, whose first level is the exp2 offset ``poff`` of the flash algorithm (P~ <= 2^poff;
log2(2688) = 11.3923 makes block scales fill E4M3) or, for materialised P (``algo=standard``),
an explicit per-row scale (the paper's form). The row sum is always taken over float32 P~
before this cast, as FA3 and SageAttention3 do.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .families import MX_FORMATS, family
from .formats import quantize_dequantize
from .granularity import Granularity, PerChannel, PerHead, PerTensor, PerThread, thread_granularities
from .microscaling import mx_quantize, nvfp4_quantize, quantize_p_two_level
from .quant import Quantized, quantize, quantize_int

_TENSOR_SCALE = {"tensor": PerTensor(), "head": PerHead(), "none": None}


def qk_granularity(recipe, which: str, block_m: int, block_n: int) -> Granularity:
    """The granularity of Q (``which="q"``) or K: ``gran=thread`` resolved at the tiles."""
    g = recipe.gran
    if isinstance(g, PerThread) and g.block == 0:
        gq, gk = thread_granularities(block_m, block_n)
        return gq if which == "q" else gk
    return g


def check_tiles(recipe, block_m: int, block_n: int) -> None:
    """UsageError when the tiles cannot hold the recipe's scale groups: microscaling blocks of
    P and V run along keys and must not straddle a KV tile; per-thread groups split tiles
    into MMA fragments."""
    for key in ("p", "v"):
        name = getattr(recipe, key)
        if family(name) == "mx" and block_n % MX_FORMATS[name].block:
            blk = MX_FORMATS[name].block
            raise UsageError(f"{key}={name} scales blocks of {blk} keys, which must not straddle KV tiles: "
                             f"bn={block_n} is not a multiple of {blk}; set bn= to one (e.g. bn=128)")
    if isinstance(recipe.gran, PerThread) and recipe.gran.block == 0:
        thread_granularities(block_m, block_n)


def _microscaled(x: torch.Tensor, name: str, recipe, axis: int) -> Quantized:
    if name == "mxfp8":
        bs = mx_quantize(x, "e4m3", block=MX_FORMATS[name].block, axis=axis, scale_rounding=recipe.mxscale)
    else:
        bs = nvfp4_quantize(x, block=MX_FORMATS[name].block, axis=axis, tensor_scale=_TENSOR_SCALE[recipe.nvts])
    # the NVFP4 tensor scale is [1, 1, 1, 1] (tensor) or [B, H, 1, 1] (head): a uniform descale
    t = bs.tensor_scale
    one = torch.ones((1, 1, 1, 1), dtype=torch.float32, device=x.device)
    return Quantized(bs.operand(), one if t is None else t.to(torch.float32), bs.elem)


def quantize_qk(x: torch.Tensor, recipe, which: str, *, block_m: int, block_n: int, group: int = 1,
                rows: torch.Tensor | None = None, descale: torch.Tensor | None = None) -> Quantized:
    """Q or K (float64 [B, H, N, D], already rotated and smoothed) as the kernel's operand.

    ``group``: query heads per KV head sharing Q's per-head descale (the FA3 kernel's shape);
    ``rows`` (Q only): the query rows to keep (scales still see every row); ``descale``: a static
    descale (float formats only: ``dscale`` refuses the others)."""
    block_rows = block_m if which == "q" else block_n
    g = qk_granularity(recipe, which, block_m, block_n)
    fam = family(recipe.qk)
    if fam == "int":
        return quantize_int(x, recipe.qk, g, block_rows=block_rows, group=group, ties=recipe.ties, rows=rows)
    if fam == "mx":
        # Blocks run along head_dim, within a row: quantizing every row and then keeping some is
        # the same as quantizing those rows, except for NVFP4's tensor scale, which sees all.
        out = _microscaled(x, recipe.qk, recipe, axis=-1)
        if rows is not None:
            out = Quantized(out.values.index_select(2, rows), out.descale, out.fmt)
        return out
    return quantize(x, recipe.qk, g, block_rows=block_rows, group=group, pow2=recipe.pow2, rows=rows,
                    descale=descale, arith=recipe.fquant)


def quantize_v(v: torch.Tensor, recipe, *, block_n: int, descale: torch.Tensor | None = None) -> Quantized:
    """V (float64 [B, Hkv, N, Dv]) as the kernel's operand (``vgran=channel``: one scale per
    channel over all tokens, a [B, Hkv, 1, Dv] descale that multiplies O at the end)."""
    if family(recipe.v) == "mx":
        return _microscaled(v, recipe.v, recipe, axis=2)
    g = PerChannel() if recipe.vgran == "channel" else recipe.gran
    return quantize(v, recipe.v, g, block_rows=block_n, pow2=recipe.pow2, descale=descale, arith=recipe.fquant)


def cast_p(p: torch.Tensor, recipe, *, materialised: bool = False) -> torch.Tensor:
    """P as the P V product sees it (float32, same shape [.., R, N] with N along keys).

    Flash (``materialised=False``): ``p`` is P~ of one KV tile in [0, 2^poff]. Standard:
    ``p`` is the normalised softmax in [0, 1] (times any per-tensor P multiplier)."""
    name = recipe.p
    fam = family(name)
    if fam == "float":
        return quantize_dequantize(p, name)
    if name == "mxfp8":
        return mx_quantize(p, "e4m3", block=MX_FORMATS[name].block, axis=-1, scale_rounding=recipe.mxscale).operand()
    bs = quantize_p_two_level(p, block=MX_FORMATS[name].block, row_scale="amax" if materialised else "none",
                              match=recipe.pmatch)
    return bs.dequantize(torch.float32)


__all__ = ["quantize_qk", "quantize_v", "cast_p", "check_tiles", "qk_granularity"]
