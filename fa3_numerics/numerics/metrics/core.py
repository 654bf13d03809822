"""The built-in metrics, in the order datasets list them.

RMSE is the FA3 paper's (Table 3); relative L2 and L1 are SageAttention's; the max absolute error
is "Is Flash Attention Stable?"'s; cosine similarity and SQNR are what quantization papers quote.
``nonfinite`` counts positions where the output or the float64 reference is NaN or Inf, so a
sample that hides one is never mistaken for a finite one.
"""

from __future__ import annotations

import torch

from . import Terms, register_metric


@register_metric("rmse", "root mean square error, sqrt(mean((O - O_ref)^2))", pool="rms", units="output units")
def rmse(t: Terms) -> torch.Tensor:
    return torch.sqrt(t.se / t.n)


@register_metric("rel_l2", "||O - O_ref||_2 / ||O_ref||_2")
def rel_l2(t: Terms) -> torch.Tensor:
    return torch.sqrt(t.se / t.ref2)


@register_metric("rel_l1", "sum|O - O_ref| / sum|O_ref|")
def rel_l1(t: Terms) -> torch.Tensor:
    return t.err.abs().sum(dim=(2, 3)) / t.r.abs().sum(dim=(2, 3))


@register_metric("max_abs", "max |O - O_ref|", pool="max", units="output units")
def max_abs(t: Terms) -> torch.Tensor:
    return t.err.abs().amax(dim=(2, 3))


@register_metric("cosine", "cosine similarity of O and O_ref (flattened)", worse="lower")
def cosine(t: Terms) -> torch.Tensor:
    return (t.o * t.r).sum(dim=(2, 3)) / torch.sqrt((t.o ** 2).sum(dim=(2, 3)) * t.ref2)


@register_metric("sqnr_db", "10 log10(sum O_ref^2 / sum (O - O_ref)^2)", units="dB", worse="lower")
def sqnr_db(t: Terms) -> torch.Tensor:
    return 10 * torch.log10(t.ref2 / t.se)


@register_metric("nonfinite", "count of positions where the output or the float64 reference is NaN or Inf",
                 pool="sum", units="count", worse="")
def nonfinite(t: Terms) -> torch.Tensor:
    return t.nonfinite.to(torch.float64)
