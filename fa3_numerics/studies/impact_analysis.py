"""Statistics of an impact study: per-token summaries, how kernel error maps to model error.

Exposed: ``SUMMARY_DEFINITIONS``, ``summarize``, ``spearman``, ``power_fit``, ``layer_rel_l2``.

Summaries never drop a non-finite value: a NaN KL (from non-finite logits) makes the mean,
p99 and max NaN, and the study reports where it came from.
"""

from __future__ import annotations

import math

import numpy as np

SUMMARY_DEFINITIONS = {
    "kl_mean": "mean over tokens of KL(reference || variant) of the next-token distribution, nats",
    "kl_p99": "99th percentile over tokens of that KL (linear interpolation, numpy's default)",
    "kl_max": "max over tokens of that KL",
    "top1_agree": "fraction of tokens whose argmax next token equals the reference's",
    "ppl": "perplexity exp(mean NLL) of the text's next tokens (every position but the last)",
    "ppl_delta": "ppl minus the reference's ppl",
}


def summarize(kl: np.ndarray, nll: np.ndarray, top1: np.ndarray, ref_ppl: float) -> dict[str, np.ndarray]:
    """Summaries over the last axis (tokens) of per-token arrays of any leading shape."""
    ppl = np.exp(nll[..., :-1].mean(axis=-1))  # the last position has no target (NaN by design)
    return {
        "kl_mean": kl.mean(axis=-1),
        "kl_p99": np.percentile(kl, 99, axis=-1),
        "kl_max": kl.max(axis=-1),
        "top1_agree": top1.astype(np.float64).mean(axis=-1),
        "ppl": ppl,
        "ppl_delta": ppl - ref_ppl,
    }


def spearman(x, y) -> tuple[float, float, int]:
    """(rho, two-sided p, n) of Spearman's rank correlation over the pairs where both are finite;
    NaN when fewer than 3 pairs or either side is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    n = int(ok.sum())
    if n < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return math.nan, math.nan, n
    res = spearmanr(x[ok], y[ok])
    return float(res.statistic), float(res.pvalue), n


def power_fit(x, y) -> dict:
    """Least-squares fit of log10 y = a + b log10 x over positive finite pairs: y ~ 10^a x^b.

    Returns a, b, n and ``spread``: the factor that covers 90% of the points around the line
    (10 ** the 90th percentile of |residual|), so a prediction from it reads "within x spread"."""
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    n = int(ok.sum())
    if n < 3 or np.ptp(np.log10(x[ok])) == 0:
        return {"a": math.nan, "b": math.nan, "n": n, "spread": math.nan}
    lx, ly = np.log10(x[ok]), np.log10(y[ok])
    b, a = np.polyfit(lx, ly, 1)
    res = ly - (a + b * lx)
    return {"a": float(a), "b": float(b), "n": n, "spread": float(10 ** np.percentile(np.abs(res), 90))}


def layer_rel_l2(rel_l2: np.ndarray, out_rms: np.ndarray) -> np.ndarray:
    """One rel_l2 per layer from per-head values: heads pooled as ||O - O_ref|| / ||O_ref|| over the
    whole layer, each head weighted by its reference output's energy (rms^2). Last axis: heads."""
    w = out_rms ** 2
    return np.sqrt((rel_l2 ** 2 * w).sum(axis=-1) / w.sum(axis=-1))



__all__ = ["SUMMARY_DEFINITIONS", "summarize", "spearman", "power_fit", "layer_rel_l2"]
