"""Error metrics of an attention output against the float64 reference: a registry, and how
samples combine.

Exposed: ``Metric``, ``register_metric``, ``metrics``, ``get_metric``, ``METRICS``, ``Terms``,
``per_sample``, ``compare_outputs``, ``fidelity``, ``pooled``, ``nonfinite_samples``, ``bootstrap_ci``, ``pool_rule``;
intervals come from ``bootstrap`` (``scipy.stats.bootstrap``, BCa).

Every metric is computed per sample (one (batch, head) of one seed) over the evaluated
query rows and head dim, so that each figure can carry a confidence interval over samples.
RMSE is the headline (FA3 paper, Table 3); the conventions peers use sit beside it (``core.py``).

A metric is a function of ``Terms`` (the output, the reference and shared sums, computed once)
returning a [B, H] tensor, plus how its samples pool (``"rms"``, ``"mean"``, ``"max"``,
``"sum"``). Add one as a module of this package calling ``register_metric``: every run's
dataset gets a variable of that name, and reports, ``compare --metric`` and the audit's ranking
offer it.

A metric undefined on finite data (the cosine of an all-zero output, a relative error against
an all-zero reference) is NaN there, never a 0 or an Inf that would read as a result; the
metric's ``undefined`` says when, and every such NaN is a finding like a non-finite output.

Non-finite samples are never dropped: a sample whose output (or reference) holds NaN or Inf
has NaN errors, and ``pooled`` and the bootstrap of any set holding such a sample are NaN.
Callers report them as "non-finite (k of n samples)" (``nonfinite_samples``) rather than an
estimate over the rest that would look complete.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pkgutil
from typing import Callable

import numpy as np
import torch

POOLS = ("rms", "mean", "max", "sum")


class Terms:
    """The output and reference of one evaluation, [B, H, R, D] float64, and sums over (R, D)
    that several metrics share, computed once on first use."""

    def __init__(self, out: torch.Tensor, ref: torch.Tensor):
        self.o = out.to(torch.float64)
        self.r = ref.to(torch.float64)
        self.n = self.o.shape[2] * self.o.shape[3]

    @functools.cached_property
    def err(self) -> torch.Tensor:
        """O - O_ref, NaN where O is not finite (so every error metric of that sample is NaN)."""
        return torch.where(torch.isfinite(self.o), self.o - self.r, torch.full_like(self.o, math.nan))

    @functools.cached_property
    def se(self) -> torch.Tensor:
        return (self.err ** 2).sum(dim=(2, 3))

    @functools.cached_property
    def ref2(self) -> torch.Tensor:
        return (self.r ** 2).sum(dim=(2, 3))

    @functools.cached_property
    def nonfinite(self) -> torch.Tensor:
        """Count of positions where the output or the reference is NaN or Inf."""
        return (~torch.isfinite(self.o) | ~torch.isfinite(self.r)).sum(dim=(2, 3))


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    description: str
    fn: Callable[[Terms], torch.Tensor]  # -> [B, H]
    pool: str = "mean"  # how samples combine: rms (RMSE), mean, max, sum (counts)
    units: str = ""
    # "higher": larger is worse (errors; ranked by the audit); "lower": larger is better; "": a count
    worse: str = "higher"
    # When the metric is NaN on finite data (stored in the dataset as the variable's "nan_reason")
    undefined: str = ""

    def __post_init__(self):
        if self.pool not in POOLS:
            raise ValueError(f"metric {self.name}: pool must be one of {POOLS}")


_REGISTRY: dict[str, Metric] = {}
#: name -> description of every registered metric, in order (kept in step with the registry).
METRICS: dict[str, str] = {}
_loaded = False


def register_metric(name: str, description: str, *, pool: str = "mean", units: str = "", worse: str = "higher",
                    undefined: str = ""):
    """Decorator: register ``fn(terms) -> [B, H] tensor`` as metric ``name``. ``undefined``: when
    the metric has no value on finite outputs (then ``fn`` returns NaN there), in words."""

    def deco(fn):
        _REGISTRY[name] = Metric(name, description, fn, pool, units, worse, undefined)
        METRICS[name] = description
        return fn

    return deco


def unregister_metric(name: str) -> None:
    """Remove a metric (tests that add one clean up with this)."""
    _REGISTRY.pop(name, None)
    METRICS.pop(name, None)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        importlib.import_module(f"{__name__}.core")
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name not in ("core", "bootstrap"):  # bootstrap: intervals, not a metric
                importlib.import_module(f"{__name__}.{info.name}")


def metrics() -> dict[str, Metric]:
    _load()
    return dict(_REGISTRY)


def get_metric(name: str) -> Metric:
    from ...errors import UsageError

    _load()
    if name not in _REGISTRY:
        raise UsageError(f"unknown metric {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def per_sample(out: torch.Tensor, ref: torch.Tensor) -> dict[str, np.ndarray]:
    """out, ref: [B, H, R, D] -> every registered metric as a [B, H] float64 array."""
    t = Terms(out, ref)
    return {m.name: m.fn(t).to(torch.float64).cpu().numpy() for m in metrics().values()}


def compare_outputs(out: torch.Tensor, other: torch.Tensor, ref: torch.Tensor) -> dict[str, np.ndarray]:
    """Output-for-output comparison of ``out`` with ``other`` (the emulator with the kernel),
    per (batch, head) sample, [B, H] float64 each (see ``compare_outputs.NAMES``):

    - ``vs_se``: sum of (out - other)^2 over positions finite in both; ``vs_n``: their count;
    - ``vs_identical``: positions where the two are bit-identical (and finite);
    - ``vs_nonfinite_here`` / ``vs_nonfinite_there``: positions non-finite in ``out`` only /
      in ``other`` only (an emulator that is NaN where the kernel is finite is a bug);
    - ``vs_max_rel``: max |out - other| / |other| over positions finite in both, other != 0;
    - ``vs_ref_se``: sum of (other - ref)^2 over positions finite in both (F's denominator, so
      that a NaN in either does not hide the fidelity of the rest).
    """
    o, k, r = out.to(torch.float64), other.to(torch.float64), ref.to(torch.float64)
    fo, fk = torch.isfinite(o), torch.isfinite(k)
    both = fo & fk & torch.isfinite(r)
    diff = torch.where(both, o - k, torch.zeros_like(o))
    rel = torch.where(both & (k != 0), diff.abs() / k.abs().clamp_min(1e-30), torch.zeros_like(o))
    vals = {
        "vs_se": (diff ** 2).sum(dim=(2, 3)),
        "vs_n": both.sum(dim=(2, 3)),
        "vs_identical": ((o == k) & both).sum(dim=(2, 3)),
        "vs_nonfinite_here": (~fo & fk).sum(dim=(2, 3)),
        "vs_nonfinite_there": (fo & ~fk).sum(dim=(2, 3)),
        "vs_max_rel": rel.amax(dim=(2, 3)),
        "vs_ref_se": torch.where(both, k - r, torch.zeros_like(k)).pow(2).sum(dim=(2, 3)),
    }
    return {name: v.to(torch.float64).cpu().numpy() for name, v in vals.items()}


compare_outputs.NAMES = ("vs_se", "vs_n", "vs_identical", "vs_nonfinite_here", "vs_nonfinite_there", "vs_max_rel",
                         "vs_ref_se")


def fidelity(emulated: torch.Tensor, kernel: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The fidelity of an emulation to a kernel, over tensors of any (equal) shape:

    - ``F`` = RMSE(emulated, kernel) / RMSE(kernel, ref) over the positions finite in all three
      (0: the emulator is the kernel; NaN when none is finite; Inf when the kernel equals the
      reference but the emulator does not);
    - ``identical``: the share of all positions where the two are bit-identical and finite;
    - ``rmse_diff``, ``rmse_kernel``: F's numerator and denominator; ``finite``: the positions
      they are taken over; ``positions``: all of them.

    The studies' validation pools the same sums per (batch, head) sample (``compare_outputs``)."""
    flat = [t.reshape(1, 1, -1, 1) for t in (emulated, kernel, ref)]
    c = compare_outputs(*flat)
    n = float(c["vs_n"].sum())
    diff = math.sqrt(float(c["vs_se"].sum()) / n) if n else math.nan
    den = math.sqrt(float(c["vs_ref_se"].sum()) / n) if n else math.nan
    if not (math.isfinite(diff) and math.isfinite(den)):
        f = math.nan
    else:
        f = diff / den if den > 0 else (0.0 if diff == 0 else math.inf)
    total = emulated.numel()
    return {"F": f, "identical": float(c["vs_identical"].sum()) / total if total else math.nan,
            "rmse_diff": diff, "rmse_kernel": den, "finite": int(n), "positions": int(total)}


def _pool(metric: str) -> str:
    m = _REGISTRY.get(metric) or metrics().get(metric)
    return m.pool if m is not None else "mean"


def pool_rule(metric: str) -> str:
    """How ``metric``'s samples pool: rms, mean, max or sum."""
    return _pool(metric)


def pooled(metric: str, values: np.ndarray) -> float:
    """Combine per-sample values by the metric's pool rule: RMSE as sqrt(mean(rmse^2)), max_abs
    as max, counts as sum, the rest as mean. NaN if any sample is NaN (never dropped) or none given."""
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0 or np.isnan(v).any():
        return math.nan
    rule = _pool(metric)
    if rule == "rms":
        return float(np.sqrt(np.mean(v ** 2)))
    if rule == "max":
        return float(np.max(v))
    if rule == "sum":
        return float(np.sum(v))
    return float(np.mean(v))


def nonfinite_samples(values: np.ndarray) -> tuple[int, int]:
    """(samples whose value is NaN, samples) of one set of per-sample values."""
    v = np.asarray(values, dtype=np.float64).ravel()
    return int(np.isnan(v).sum()), int(v.size)


def bootstrap_ci(metric: str, values: np.ndarray, *, level: float = 0.95, n_boot: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """BCa bootstrap interval (``scipy.stats.bootstrap``, see ``bootstrap``) of ``pooled`` over the
    samples in ``values``; (nan, nan) when a sample is NaN or fewer than two are given."""
    from .bootstrap import bca, pool_fn

    v = np.asarray(values, dtype=np.float64).ravel()
    _, lo, hi = bca(pool_fn(_pool(metric)), (v,), level=level, n_boot=n_boot, seed=seed)
    return float(lo), float(hi)


_load()

__all__ = ["Metric", "Terms", "register_metric", "unregister_metric", "metrics", "get_metric", "METRICS",
           "per_sample", "compare_outputs", "fidelity", "pooled", "nonfinite_samples", "bootstrap_ci", "pool_rule", "POOLS"]
