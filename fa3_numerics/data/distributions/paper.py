"""The FA3 paper's outlier distribution: every entry is N(0,1) + N(0, sigma^2) * Bernoulli(p).

Section 4.3 of Shah et al. (2024) uses p = 0.001 and sigma = 10 for Q, K and V alike.
"""

from __future__ import annotations

import math

import torch

from . import AttnShape, generator, register
from ...errors import require


# Largest sigma whose draws keep Q K^T finite in float64 at every supported head dim: an
# outlier of ~8 sigma (a 1-in-10^15 Gaussian tail) in Q and in K, summed over 256 products,
# must stay below float64's max (1.8e308): (8 sigma)^2 * 256 < 1.8e308.
SIGMA_MAX = 1e150


def _validate(params: dict) -> None:
    p, sigma = params["p"], params["sigma"]
    require(0.0 <= p <= 1.0 and math.isfinite(p), f"--p must lie in [0, 1] (a probability), got {p}")
    require(sigma >= 0.0 and math.isfinite(sigma), f"--sigma must be a finite number >= 0, got {sigma}")
    require(sigma <= SIGMA_MAX, f"--sigma {sigma:g} would overflow the float64 reference (Q K^T of ~8-sigma outliers); "
                                f"use --sigma <= {SIGMA_MAX:g}")


def outliers_like(shape: tuple[int, ...], g: torch.Generator, p: float, sigma: float) -> torch.Tensor:
    """One tensor of the paper's distribution. The outlier term is drawn only where the
    Bernoulli mask is set (in flattened order), which is the same distribution at a third of
    the cost of drawing it everywhere."""
    dev = g.device
    x = torch.randn(shape, generator=g, dtype=torch.float64, device=dev)
    mask = torch.rand(shape, generator=g, dtype=torch.float64, device=dev) < p
    n = int(mask.sum())
    if n:
        x[mask] += torch.randn(n, generator=g, dtype=torch.float64, device=dev) * sigma
    return x


@register(
    "outliers",
    description="N(0,1) + N(0, sigma^2) * Bernoulli(p) on every entry of Q, K and V (FA3 paper, sec. 4.3)",
    params={"p": (0.001, "probability that an entry carries an outlier term"),
            "sigma": (10.0, "standard deviation of the outlier term")},
    validate=_validate,
    on_device=True,
)
def paper_outliers(shape: AttnShape, seed: int, *, p: float, sigma: float, device: str = "cpu"):
    g = generator(seed, device)
    q = outliers_like(shape.q_shape, g, p, sigma)
    k = outliers_like(shape.kv_shape, g, p, sigma)
    v = outliers_like(shape.kv_shape, g, p, sigma)
    return q, k, v
