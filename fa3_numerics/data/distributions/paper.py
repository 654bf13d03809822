"""The FA3 paper's outlier distribution: every entry is N(0,1) + N(0, sigma^2) * Bernoulli(p).

Section 4.3 of Shah et al. (2024) uses p = 0.001 and sigma = 10 for Q, K and V alike.
"""

from __future__ import annotations

import math

import torch

from . import AttnShape, generator, register
from ...numerics.native import randn
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


def bernoulli_positions(n: int, p: float, g: torch.Generator, chunk: int = 0) -> torch.Tensor:
    """The indices in [0, n) where n i.i.d. Bernoulli(p) draws come out 1, ascending (int64).

    Drawn as the gaps between successes, which are i.i.d. Geometric(p) on {1, 2, ...}: the
    same law as comparing n uniforms with p, at a cost proportional to n p rather than n (at
    the paper's shape, 33 M entries per tensor and p = 0.001, 0.05 s instead of 0.7 s). The
    gaps come from ``g`` in chunks of about n p + 6 sqrt(n p) values, rarely more than one
    (``chunk`` > 0 sets another size; tests use it to exercise the continuation)."""
    dev = g.device
    if n <= 0 or p <= 0.0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    if p >= 1.0:
        return torch.arange(n, device=dev)
    mean = n * p
    chunk = chunk or int(mean + 6.0 * math.sqrt(mean) + 16)
    found, last = [], -1.0
    while last < n:
        # float64 holds every partial sum exactly while it is below 2^53, far beyond any n here;
        # a gap beyond n (possible when n p << 1) just ends the loop.
        pos = torch.empty(chunk, dtype=torch.float64, device=dev).geometric_(p, generator=g).cumsum_(0).add_(last)
        last = float(pos[-1])
        found.append(pos[pos < n])
    return torch.cat(found).to(torch.int64)


def outliers_like(shape: tuple[int, ...], g: torch.Generator, p: float, sigma: float) -> torch.Tensor:
    """One tensor of the paper's distribution, from ``g`` in this order: the N(0, 1) bulk for
    every entry (``randn``, float64, row-major), then the entries that carry an outlier term
    (``bernoulli_positions`` over the flattened tensor), then the outlier terms N(0, sigma^2)
    for those entries only, in ascending position. Drawing the outlier term only where it is
    added is the same distribution at a fraction of the cost of drawing it everywhere."""
    dev = g.device
    x = randn(shape, g)  # torch.randn's values; on the CPU its map to normals on every thread
    where = bernoulli_positions(x.numel(), p, g)
    if where.numel():
        x.view(-1)[where] += torch.randn(where.numel(), generator=g, dtype=torch.float64, device=dev) * sigma
    return x


@register(
    "outliers",
    description="N(0,1) + N(0, sigma^2) * Bernoulli(p) on every entry of Q, K and V (FA3 paper, sec. 4.3)",
    params={"p": (0.001, "probability that an entry carries an outlier term"),
            "sigma": (10.0, "standard deviation of the outlier term")},
    validate=_validate,
    on_device=True,
    labels={"p": ("p", "outlier probability per entry", "outlier probability p (per entry)"),
            "sigma": ("σ", "outlier standard deviation (x the N(0,1) bulk)", "outlier std σ (× the N(0,1) bulk)")},
    histogram="The dashed line is what N(0,1) alone would give; the excess to the right of it is the outliers.",
    bulk=True,
)
def paper_outliers(shape: AttnShape, seed: int, *, p: float, sigma: float, device: str = "cpu"):
    g = generator(seed, device)
    q = outliers_like(shape.q_shape, g, p, sigma)
    k = outliers_like(shape.kv_shape, g, p, sigma)
    v = outliers_like(shape.kv_shape, g, p, sigma)
    return q, k, v
