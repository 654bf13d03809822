"""Confidence intervals: ``scipy.stats.bootstrap`` with the BCa method, for every study.

Exposed: ``LEVEL``, ``N_BOOT``, ``MIN_SAMPLES``, ``bca``, ``pool_fn``, ``few_samples``.

(A helper module of the metric package: it registers no metric.)

``bca(statistic, data)`` is the one place intervals are made: the pooled metric of one cell
(``bootstrap_ci``), the ratio of two runs (``compare``), the effects of an ablation and the shares
of the error attribution all call it. BCa (bias-corrected and accelerated) corrects the
percentile interval for the skew of pooled errors, whose bootstrap distributions are far from
symmetric when a few samples carry outliers; the percentile bootstraps it replaces were
hand-written three times.

Resampling is over samples (the last axis of every array in ``data``): a study's samples are
(seed, batch, head) draws, and the same resampled indices apply to every row of an array, so
cells measured on the same samples stay paired. ``paired=True`` extends that to several arrays
(two runs of the same inputs).

Two cases scipy leaves undefined are settled here, element by element:

- every resample gives the estimate (no spread: e.g. a contrast of two recipes that compute the
  same numbers): the interval is the estimate itself, [x, x];
- fewer than two samples, or a NaN among them (a non-finite result): NaN, never an interval over
  the finite rest.

An interval on fewer than ``MIN_SAMPLES`` samples is reported with a warning (``few_samples``):
BCa's acceleration is estimated from the jackknife of those samples and is unreliable below it.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import numpy as np

LEVEL = 0.95
N_BOOT = 2000
MIN_SAMPLES = 8
_BATCH = 250  # resamples evaluated at once (bounds the memory of a many-cell statistic)


def few_samples(n: int) -> bool:
    """True when an interval over ``n`` samples deserves a warning."""
    return n < MIN_SAMPLES


def pool_fn(rule: str) -> Callable[..., np.ndarray]:
    """The pool rule ("rms", "max", "sum", "mean") as a vectorised ``f(values, axis)``."""
    if rule == "rms":
        return lambda v, axis=-1: np.sqrt(np.mean(v ** 2, axis=axis))
    if rule == "max":
        return lambda v, axis=-1: np.max(v, axis=axis)
    if rule == "sum":
        return lambda v, axis=-1: np.sum(v, axis=axis)
    return lambda v, axis=-1: np.mean(v, axis=axis)


def _rng_kw(seed: int) -> dict:
    import inspect

    import scipy.stats

    # scipy 1.15 renamed random_state to rng; the project supports scipy >= 1.10.
    name = "rng" if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else "random_state"
    return {name: np.random.default_rng(seed)}


def bca(statistic: Callable[..., np.ndarray], data: tuple[np.ndarray, ...], *, level: float = LEVEL,
        n_boot: int = N_BOOT, seed: int = 0, paired: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(estimate, lo, hi) of ``statistic(*data, axis=-1)``, the BCa interval at ``level``.

    ``statistic`` must be vectorised: it receives arrays whose last axis holds the samples and
    whose other axes (rows of ``data``, then scipy's batch of resamples) it keeps, and may return
    any shape (one interval per element). Seeded, so the same data always give the same interval.
    """
    import scipy.stats

    data = tuple(np.asarray(d, dtype=np.float64) for d in data)
    est = np.asarray(statistic(*data, axis=-1), dtype=np.float64)
    nan = np.full(est.shape, math.nan)
    if min(d.shape[-1] for d in data) < 2 or any(np.isnan(d).any() for d in data) or not np.isfinite(est).any():
        return est, nan, nan.copy()
    with warnings.catch_warnings():
        # Degenerate elements (no spread) warn and come back NaN; they are settled below.
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", getattr(scipy.stats, "DegenerateDataWarning", RuntimeWarning))
        res = scipy.stats.bootstrap(data, statistic, n_resamples=n_boot, confidence_level=level, method="BCa",
                                    vectorized=True, paired=paired, axis=-1, batch=_BATCH, **_rng_kw(seed))
    lo = np.array(res.confidence_interval.low, dtype=np.float64, copy=True).reshape(est.shape)
    hi = np.array(res.confidence_interval.high, dtype=np.float64, copy=True).reshape(est.shape)
    dist = np.asarray(res.bootstrap_distribution, dtype=np.float64).reshape(est.shape + (-1,))
    with np.errstate(invalid="ignore"):
        flat = np.isfinite(est) & (np.nanmax(dist, axis=-1) == np.nanmin(dist, axis=-1))
    lo = np.where(flat, est, lo)
    hi = np.where(flat, est, hi)
    return est, lo, hi


__all__ = ["LEVEL", "N_BOOT", "MIN_SAMPLES", "bca", "pool_fn", "few_samples"]
