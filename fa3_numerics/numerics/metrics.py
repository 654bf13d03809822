"""Error metrics of an attention output against the float64 reference.

Exposed: ``METRICS``, ``per_sample``, ``pooled``, ``bootstrap_stats``, ``bootstrap_ci``.

Every metric is computed per sample (one (batch, head) of one seed) over the evaluated
query rows and head dim, so that each figure can carry a confidence interval over
samples. RMSE is the headline (FA3 paper, Table 3); the other conventions used by peers sit
beside it: relative L2 and relative L1 (SageAttention), max absolute error ("Is Flash
Attention Stable?"), cosine similarity, and SQNR in dB.
"""

from __future__ import annotations

import math

import numpy as np
import torch

METRICS = {
    "rmse": "root mean square error, sqrt(mean((O - O_ref)^2))",
    "rel_l2": "||O - O_ref||_2 / ||O_ref||_2",
    "rel_l1": "sum|O - O_ref| / sum|O_ref|",
    "max_abs": "max |O - O_ref|",
    "cosine": "cosine similarity of O and O_ref (flattened)",
    "sqnr_db": "10 log10(sum O_ref^2 / sum (O - O_ref)^2)",
    "nonfinite": "count of NaN or Inf outputs",
}


def per_sample(out: torch.Tensor, ref: torch.Tensor) -> dict[str, np.ndarray]:
    """out, ref: [B, H, R, D] -> each metric as a [B, H] float64 array."""
    o = out.to(torch.float64)
    r = ref.to(torch.float64)
    bad = (~torch.isfinite(o)).sum(dim=(2, 3))
    err = torch.where(torch.isfinite(o), o - r, torch.full_like(o, math.nan))
    n = o.shape[2] * o.shape[3]
    se = (err ** 2).sum(dim=(2, 3))
    ref2 = (r ** 2).sum(dim=(2, 3))
    dot = (o * r).sum(dim=(2, 3))
    o2 = (o ** 2).sum(dim=(2, 3))
    vals = {
        "rmse": torch.sqrt(se / n),
        "rel_l2": torch.sqrt(se / ref2),
        "rel_l1": err.abs().sum(dim=(2, 3)) / r.abs().sum(dim=(2, 3)),
        "max_abs": err.abs().amax(dim=(2, 3)),
        "cosine": dot / torch.sqrt(o2 * ref2),
        "sqnr_db": 10 * torch.log10(ref2 / se),
        "nonfinite": bad.to(torch.float64),
    }
    return {k: v.cpu().numpy() for k, v in vals.items()}


def pooled(metric: str, values: np.ndarray) -> float:
    """Combine per-sample values: RMSE pools as sqrt(mean(rmse^2)), max_abs as max, nonfinite as sum."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)] if metric != "nonfinite" else v
    if v.size == 0:
        return math.nan
    if metric == "rmse":
        return float(np.sqrt(np.mean(v ** 2)))
    if metric == "max_abs":
        return float(np.max(v))
    if metric == "nonfinite":
        return float(np.sum(v))
    return float(np.mean(v))


def bootstrap_stats(metric: str, values: np.ndarray, *, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """Bootstrap replicates of ``pooled`` over samples (seeded, so reproducible); NaN when
    fewer than two finite samples."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size < 2:
        return np.full(n_boot, math.nan)
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_boot, v.size))
    if metric == "rmse":
        return np.sqrt(np.mean(v[idx] ** 2, axis=1))
    if metric == "max_abs":
        return np.max(v[idx], axis=1)
    return np.mean(v[idx], axis=1)


def bootstrap_ci(metric: str, values: np.ndarray, *, level: float = 0.95, n_boot: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``pooled`` over samples."""
    stats = bootstrap_stats(metric, values, n_boot=n_boot, seed=seed)
    if not np.isfinite(stats).all():
        return (math.nan, math.nan)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
