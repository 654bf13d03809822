"""The built-in metrics, in the order datasets list them.

RMSE is the FA3 paper's (Table 3); relative L2 and L1 are SageAttention's; the max absolute error
is "Is Flash Attention Stable?"'s; cosine similarity and SQNR are what quantization papers quote.
``nonfinite`` counts positions where the output or the float64 reference is NaN or Inf, so a
sample that hides one is never mistaken for a finite one.
"""

from __future__ import annotations

import math

import torch

from . import Terms, register_metric

_ZERO_REF = "NaN where O_ref is all zeros in the sample (an error relative to a zero reference is undefined)"


def _per(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, NaN where den is 0 (undefined, not the Inf or 0/0 division gives)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), math.nan)


@register_metric("rmse", "root mean square error, sqrt(mean((O - O_ref)^2))", pool="rms", units="output units")
def rmse(t: Terms) -> torch.Tensor:
    return torch.sqrt(t.se / t.n)


@register_metric("rel_l2", "||O - O_ref||_2 / ||O_ref||_2", undefined=_ZERO_REF)
def rel_l2(t: Terms) -> torch.Tensor:
    return torch.sqrt(_per(t.se, t.ref2))


@register_metric("rel_l1", "sum|O - O_ref| / sum|O_ref|", undefined=_ZERO_REF)
def rel_l1(t: Terms) -> torch.Tensor:
    return _per(t.err.abs().sum(dim=(2, 3)), t.r.abs().sum(dim=(2, 3)))


@register_metric("max_abs", "max |O - O_ref|", pool="max", units="output units")
def max_abs(t: Terms) -> torch.Tensor:
    return t.err.abs().amax(dim=(2, 3))


@register_metric("cosine", "cosine similarity of O and O_ref (flattened)", worse="lower",
                 undefined="NaN where O or O_ref is all zeros in the sample (the cosine of a zero vector is undefined)")
def cosine(t: Terms) -> torch.Tensor:
    return _per((t.o * t.r).sum(dim=(2, 3)), torch.sqrt((t.o ** 2).sum(dim=(2, 3)) * t.ref2))


@register_metric("sqnr_db", "10 log10(sum O_ref^2 / sum (O - O_ref)^2)", units="dB", worse="lower",
                 undefined=_ZERO_REF + "; +Inf where O equals O_ref exactly (no noise)")
def sqnr_db(t: Terms) -> torch.Tensor:
    # An exact output (se = 0) against a nonzero reference is +Inf dB: the limit, not a fault.
    return torch.where(t.ref2 > 0, 10 * torch.log10(t.ref2 / t.se), math.nan)


@register_metric("nonfinite", "count of positions where the output or the float64 reference is NaN or Inf",
                 pool="sum", units="count", worse="")
def nonfinite(t: Terms) -> torch.Tensor:
    return t.nonfinite.to(torch.float64)
