"""Compare two runs' datasets: the same variants side by side with ratios B / A, and gates.

Exposed: ``compare``, ``findings``, ``match_variants``, ``gate``, ``sample_warnings``, ``GATE_RULES``,
``SettingsDiffer``
(the rendering is ``fa3_numerics.report.compare``).

For two machines, two backends, two seeds, or before/after a change.

- **Variants** are matched by label; a hardware variant named ``BACKEND:VARIANT`` (``fa3:fa3-fp8-kernel``,
  ``triton:fa3-fp8``, as ``kernels/device/h200.py`` names them) matches the variant of the other
  run that computes the same recipe (same spec), else the one named ``VARIANT``. Several
  hardware variants may match one emulator variant (``sdpa-flash:fa3-fp16`` and
  ``sdpa-cudnn:fa3-fp16``): each is a row.
- **Cells**: swept parameters are aligned by their common values (a parameter swept in one run
  and fixed in the other is compared at the fixed value). Settings that differ between the runs
  (a fixed seqlen 1024 against 2048, another distribution, cells of a sweep that only one run
  holds) are an error (``SettingsDiffer``, a ``UsageError``) unless ``allow_different=True``
  (``--allow-different-settings``): then they are returned in ``differs``, which the rendering
  puts first, as a warning, and the cells only one run holds are named there, never dropped
  silently. ``rows`` (how many query rows each sample evaluates) is a sample size, not a
  setting: it is listed in ``differs`` but never refused.
- **Intervals**: each side's value is the pooled metric over its (seed, batch, head) samples with
  its BCa interval (``fa3_numerics.numerics.metrics.bootstrap``); the ratio's BCa interval
  resamples both sides, *paired* when the two runs hold the same samples (same seeds, batch and
  heads: the same inputs when the data agree, so that a CPU-GPU comparison is as tight as the
  inputs allow), independently otherwise. "Covers 1" then means the runs agree within sampling
  noise.
- **Ratios** of error metrics: B/A; +Inf when B's pooled value is infinite (or A's is 0 and B's is
  not), 0 when A's is infinite and B's finite, 1 when both are 0.
- **Gates** (``gate``), like pytest-benchmark's ``--benchmark-compare-fail``: ``fail_above``
  fails a row, for error metrics (larger is worse), by one of two ``GATE_RULES``: ``interval``
  (the default) when the whole interval of B/A lies above the threshold, so that two runs of the
  same code on different seeds do not fail on sampling noise (a row without an interval is gated
  on its point estimate and says so); ``point`` when the point estimate exceeds it. An infinite
  ratio fails under both. ``fail_if_not_covered`` fails a row whose ratio interval excludes 1
  (an infinite or zero ratio excludes it).

A side whose samples hold NaN (non-finite outputs) has no value and no interval: the row says
"non-finite (k of n samples)" and ``findings`` lists it, never a ratio over the finite rest.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import xarray as xr

from ..engine.dataset import SAMPLE_DIMS
from ..errors import UsageError
from ..numerics.metrics import bootstrap_ci, get_metric, metrics, nonfinite_samples, pool_rule, pooled
from ..numerics.metrics.bootstrap import MIN_SAMPLES, bca, few_samples, pool_fn

# Coordinates that describe variants or bins, not the setting of a run.
_NOT_SETTINGS = ("variant", "spec", "paper_rmse", "abs_bin_lo", "abs_bin", "tensor", "backend")
# Sample sizes: a difference is reported, never refused (a subsample of query rows estimates the
# same per-sample error as every row).
_SAMPLE_SIZES = ("rows",)
GATE_RULES = {"interval": "the whole interval of B/A lies above the threshold",
              "point": "the point estimate of B/A exceeds the threshold"}
_FEW = 5  # names listed in an error before "and N more"


class SettingsDiffer(UsageError):
    """The two runs differ in a setting (or in the cells of a sweep); ``differs`` lists how."""

    def __init__(self, differs: list[str]):
        super().__init__(f"the runs differ in their settings ({_few(differs, sep='; ')}), so their ratios would compare "
                         "different things; compare runs of one setting, or pass --allow-different-settings "
                         "(allow_different=True) to compare them anyway")
        self.differs = differs


def _few(names: list, k: int = _FEW, sep: str = ", ") -> str:
    """The first ``k`` names and how many more: an error line stays one readable line."""
    shown = sep.join(str(x) for x in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "") if names else "none"


def _swept(ds: xr.Dataset, metric: str) -> list[str]:
    return [d for d in ds[metric].dims if d not in SAMPLE_DIMS and d != "variant"]


def _values(ds: xr.Dataset, d: str) -> list:
    if d not in ds.coords:
        return []
    v = np.asarray(ds.coords[d].values)
    return [x.item() if hasattr(x, "item") else x for x in np.atleast_1d(v)]


def _same(a, b) -> bool:
    if isinstance(a, (bool, np.bool_)) or isinstance(b, (bool, np.bool_)):
        return bool(a) == bool(b)
    try:
        return bool(np.isclose(float(a), float(b), rtol=1e-9, atol=0))
    except (TypeError, ValueError):
        return a == b


def _specs(ds: xr.Dataset) -> dict[str, str]:
    labels = [str(v) for v in ds["variant"].values]
    return dict(zip(labels, (str(s) for s in ds["spec"].values))) if "spec" in ds.coords else {}


def _unprefixed(label: str) -> str | None:
    """``VARIANT`` of a hardware label ``BACKEND:VARIANT``; None for a plain label. A recipe spec
    never holds ':' (keys are written key=value), so the first ':' is the backend's."""
    head, sep, rest = label.partition(":")
    return rest if sep and head and "=" not in head else None


def match_variants(a: xr.Dataset, b: xr.Dataset) -> list[tuple[str, str]]:
    """Pairs (label in A, label in B), in A's order then B's: same label; else a ``BACKEND:``
    label on one side matched to the other side's variant with the same spec, else the same
    name after the prefix."""
    la, lb = [str(v) for v in a["variant"].values], [str(v) for v in b["variant"].values]
    sa, sb = _specs(a), _specs(b)
    pairs = [(v, v) for v in la if v in lb]
    used_a, used_b = {p[0] for p in pairs}, {p[1] for p in pairs}

    def find(label: str, spec: str | None, pool: list[str], specs: dict[str, str], used: set[str]) -> str | None:
        plain = [v for v in pool if v not in used and _unprefixed(v) is None]
        by_spec = [v for v in plain if spec is not None and specs.get(v) == spec]
        name = _unprefixed(label)
        by_name = [v for v in plain if name is not None and v == name]
        return (by_spec or by_name or [None])[0]

    for v in lb:  # hardware variants of B against A's emulator variants
        if v not in used_b and _unprefixed(v) is not None:
            hit = find(v, sb.get(v), la, sa, set())
            if hit is not None:
                pairs.append((hit, v))
                used_b.add(v)
    for v in la:  # and the other way round
        if v not in used_a and _unprefixed(v) is not None and not any(p[0] == v for p in pairs):
            hit = find(v, sa.get(v), lb, sb, used_b)
            if hit is not None:
                pairs.append((v, hit))
    order_a = {v: i for i, v in enumerate(la)}
    order_b = {v: i for i, v in enumerate(lb)}
    return sorted(pairs, key=lambda p: (order_a[p[0]], order_b[p[1]]))


def _paired(a: xr.Dataset, b: xr.Dataset, metric: str) -> bool:
    """Both runs hold the same (seed, batch, head) samples, in the same order."""
    for d in SAMPLE_DIMS:
        if (d in a[metric].dims) != (d in b[metric].dims):
            return False
        if d in a[metric].dims and not np.array_equal(np.asarray(a[d].values), np.asarray(b[d].values)):
            return False
    return True


def _ratio(pa: float, pb: float) -> float:
    """B/A of two pooled values (see the module docstring for zeros and infinities)."""
    if math.isnan(pa) or math.isnan(pb):
        return math.nan
    if pa == 0:
        return 1.0 if pb == 0 else math.inf
    return pb / pa  # inf / inf is NaN: no ratio


def compare(a: xr.Dataset, b: xr.Dataset, metric: str = "rmse", level: float = 0.95, *,
            allow_different: bool = False) -> dict:
    """Rows (cell, variant pair) with A, B, their intervals, ratio B/A, its interval and coverage of 1.

    Raises ``SettingsDiffer`` when the runs differ in a setting or in the cells of a sweep,
    unless ``allow_different`` (then ``differs`` lists how)."""
    get_metric(metric)  # a registered metric, or the one-line error listing them
    for name, ds in (("A", a), ("B", b)):
        if metric not in ds:
            raise UsageError(f"dataset {name} has no metric {metric!r}; choose one of "
                             f"{', '.join(m for m in metrics() if m in ds)}")
    va = [str(v) for v in a["variant"].values]
    vb = [str(v) for v in b["variant"].values]
    pairs = match_variants(a, b)
    if not pairs:
        raise UsageError(f"no variants in common (A has {len(va)}: {_few(va)}; B has {len(vb)}: {_few(vb)}); "
                         "compare runs of the same variants (or BACKEND:VARIANT against VARIANT)")
    sa, sb = _swept(a, metric), _swept(b, metric)
    dims = [d for d in sa] + [d for d in sb if d not in sa]
    cell_values: dict[str, list] = {}
    dropped: list[str] = []
    for d in dims:
        xa, xb = _values(a, d), _values(b, d)
        if not xa or not xb:
            raise UsageError(f"parameter {d!r} is swept in one dataset and absent from the other; cannot align them")
        vals = [x for x in xa if any(_same(x, y) for y in xb)]
        if not vals:
            raise UsageError(f"no common values of {d} (A: {_few(xa)}; B: {_few(xb)}); compare runs that share a "
                             "setting")
        cell_values[d] = vals
        for side, mine, other in (("A", xa, xb), ("B", xb, xa)):
            only = [x for x in mine if not any(_same(x, y) for y in other)]
            if only:
                dropped.append(f"{d}={_few(only)} only in {side} (not compared)")
    differs = _differs(a, b, dims) + dropped
    refused = [x for x in differs if x.split(":")[0] not in _SAMPLE_SIZES]
    if refused and not allow_different:
        raise SettingsDiffer(refused)
    spec_a, spec_b = _specs(a), _specs(b)
    paired = _paired(a, b, metric)
    rule = pool_rule(metric)
    pool = pool_fn(rule)
    rows = []
    for combo in itertools.product(*(cell_values[d] for d in dims)):
        where = dict(zip(dims, combo))
        sub_a, sub_b = _at(a[metric], where), _at(b[metric], where)
        for v, w in pairs:
            xa = sub_a.sel(variant=v).values.ravel()
            xb = sub_b.sel(variant=w).values.ravel()
            pa, pb = pooled(metric, xa), pooled(metric, xb)
            la, ha = bootstrap_ci(metric, xa, level=level)
            lb, hb = bootstrap_ci(metric, xb, level=level)
            ratio = _ratio(pa, pb)
            rlo = rhi = math.nan
            if 0 < pa < math.inf and math.isfinite(pb) and (not paired or xa.size == xb.size):
                with np.errstate(divide="ignore", invalid="ignore"):
                    _, rlo, rhi = bca(lambda x, y, axis=-1: pool(y, axis=axis) / pool(x, axis=axis), (xa, xb),
                                      level=level, paired=paired and xa.size == xb.size, seed=1)
                rlo, rhi = float(rlo), float(rhi)
            if ratio in (0.0, math.inf):  # one side infinitely worse: no noise covers that
                covers = False
            else:
                covers = bool(rlo <= 1.0 <= rhi) if math.isfinite(rlo) else None
            rows.append({**where, "variant": v if v == w else f"{v} ↔ {w}", "variant_a": v, "variant_b": w,
                         "a": pa, "a_lo": la, "a_hi": ha, "b": pb, "b_lo": lb, "b_hi": hb,
                         "ratio": ratio, "ratio_lo": rlo, "ratio_hi": rhi, "covers_1": covers,
                         "n_a": xa.size, "n_b": xb.size, "nonfinite_a": nonfinite_samples(xa)[0],
                         "nonfinite_b": nonfinite_samples(xb)[0],
                         "same_spec": spec_a.get(v) == spec_b.get(w)})
    res = {"metric": metric, "dims": dims, "rows": rows, "differs": differs, "paired": paired, "level": level,
           "pool": rule, "only_a": [v for v in va if v not in {p[0] for p in pairs}],
           "only_b": [v for v in vb if v not in {p[1] for p in pairs}]}
    res.update({"nonfinite": findings(res), "sample_warnings": sample_warnings(res), "verdict": verdict(res)})
    return res


def _differs(a: xr.Dataset, b: xr.Dataset, dims: list[str]) -> list[str]:
    """Fixed settings that differ between the runs, as 'name: A x, B y'."""
    out = []
    for d in sorted(set(a.coords) | set(b.coords)):
        if d in dims or d in _NOT_SETTINGS or d in SAMPLE_DIMS:
            continue
        xa, xb = _values(a, d), _values(b, d)
        if len(xa) == 1 and len(xb) == 1 and not _same(xa[0], xb[0]):
            out.append(f"{d}: A {xa[0]}, B {xb[0]}")
        elif len(xa) == 1 and not xb and d not in a.dims:
            out.append(f"{d}: A {xa[0]}, B not recorded")
        elif len(xb) == 1 and not xa and d not in b.dims:
            out.append(f"{d}: A not recorded, B {xb[0]}")
    for key in ("dist",):
        if a.attrs.get(key) != b.attrs.get(key):
            out.append(f"{key}: A {a.attrs.get(key, '?')}, B {b.attrs.get(key, '?')}")
    return out


def _at(da: xr.DataArray, where: dict) -> xr.DataArray:
    for d, val in where.items():
        if d in da.dims:
            idx = next(i for i, x in enumerate(_values(da, d)) if _same(x, val))
            da = da.isel({d: idx})
    return da


def _cell(res: dict, r: dict) -> str:
    return ", ".join(f"{d}={r[d]}" for d in res["dims"]) or "single cell"


def findings(res: dict) -> list[str]:
    """One line per compared row whose A or B samples hold non-finite values."""
    out = []
    for r in res["rows"]:
        for side in ("a", "b"):
            k = r[f"nonfinite_{side}"]
            if k:
                out.append(f"non-finite results in {side.upper()}: variant {r[f'variant_{side}']!r}, {_cell(res, r)}: "
                           f"{k} of {r[f'n_{side}']} samples")
    return out


def verdict(res: dict) -> dict:
    """What the comparison says, first: how many ratios' intervals lie wholly above or below 1
    (B surely worse or better than A beyond sampling noise), the largest of each, in words."""
    m = res["metric"].upper()
    worse = [r for r in res["rows"] if math.isfinite(r["ratio_lo"]) and r["ratio_lo"] > 1 or r["ratio"] == math.inf]
    better = [r for r in res["rows"] if math.isfinite(r["ratio_hi"]) and r["ratio_hi"] < 1 or r["ratio"] == 0.0]
    n = sum(1 for r in res["rows"] if r["covers_1"] is not None)
    lines = []

    def name(r):
        cell = _cell(res, r)
        return f"`{r['variant']}`" + (f" at {cell}" if res["dims"] else "")

    if worse:
        w = max(worse, key=lambda r: r["ratio"])
        lines.append(f"**B is worse than A** in {len(worse)} of {n} compared row(s), beyond sampling noise (the whole "
                     f"95% interval of B/A above 1); the largest: {name(w)}, {m} ×{w['ratio']:.3f}"
                     + (f" [{w['ratio_lo']:.3f}, {w['ratio_hi']:.3f}]" if math.isfinite(w["ratio_lo"]) else "") + ".")
    if better:
        b = min(better, key=lambda r: r["ratio"])
        lines.append(f"**B is better than A** in {len(better)} of {n} row(s); the largest gain: {name(b)}, {m} "
                     f"×{b['ratio']:.3f}" + (f" [{b['ratio_lo']:.3f}, {b['ratio_hi']:.3f}]"
                                              if math.isfinite(b["ratio_lo"]) else "") + ".")
    if not worse and not better and n:
        lo = min(r["ratio_lo"] for r in res["rows"] if math.isfinite(r["ratio_lo"]))
        hi = max(r["ratio_hi"] for r in res["rows"] if math.isfinite(r["ratio_hi"]))
        lines.append(f"**No difference beyond sampling noise**: every one of the {n} ratio intervals covers 1 "
                     f"(B/A intervals span [{lo:.3f}, {hi:.3f}]).")
    if res["differs"]:
        lines.append("The runs' settings differ (see the warnings): the ratios compare different settings.")
    return {"worse": len(worse), "better": len(better), "compared": n, "lines": lines}


def sample_warnings(res: dict) -> list[str]:
    """Intervals that rest on fewer than ``MIN_SAMPLES`` samples, one line per side."""
    out = []
    for side in ("a", "b"):
        n = sorted({r[f"n_{side}"] for r in res["rows"] if few_samples(r[f"n_{side}"])})
        if n:
            out.append(f"{side.upper()}'s intervals rest on {', '.join(map(str, n))} sample(s), fewer than "
                       f"{MIN_SAMPLES}: they are rough; run more seeds or heads for a sharper comparison")
    return out


def gate(res: dict, *, fail_above: float | None = None, fail_if_not_covered: bool = False,
         rule: str = "interval") -> list[str]:
    """The rows that fail the gates, one line each (empty: passed). ``rule``: one of ``GATE_RULES``."""
    if rule not in GATE_RULES:
        raise UsageError(f"unknown gate rule {rule!r}; choose {' or '.join(GATE_RULES)} "
                         f"({'; '.join(f'{k}: fail when {v}' for k, v in GATE_RULES.items())})")
    out = []
    if fail_above is not None:
        m = get_metric(res["metric"])
        if m.worse != "higher":
            raise UsageError(f"--fail-above applies to error metrics (larger is worse); {res['metric']} is not one: "
                             f"use {', '.join(n for n, x in metrics().items() if x.worse == 'higher')}")
    level = f"{res['level']:.0%}"
    for r in res["rows"]:
        where = f"{r['variant']} at {_cell(res, r)}"
        ratio, lo, hi = r["ratio"], r["ratio_lo"], r["ratio_hi"]
        interval = f"[{lo:.4g}, {hi:.4g}]"
        if fail_above is not None and ratio == math.inf:
            out.append(f"{where}: B/A = inf > {fail_above:g} (B's {res['metric']} is {r['b']:.4g}, A's {r['a']:.4g})")
        elif fail_above is not None and math.isfinite(ratio) and ratio > fail_above:
            if rule == "point":
                out.append(f"{where}: B/A = {ratio:.4g} > {fail_above:g} ({level} interval {interval})")
            elif not math.isfinite(lo):
                out.append(f"{where}: B/A = {ratio:.4g} > {fail_above:g} (no interval: gated on the point estimate)")
            elif lo > fail_above:
                out.append(f"{where}: B/A = {ratio:.4g} > {fail_above:g}, and so is its whole {level} interval "
                           f"{interval}")
        if fail_if_not_covered and r["covers_1"] is False:
            out.append(f"{where}: the {level} interval of B/A {interval if math.isfinite(lo) else f'(B/A = {ratio:g})'} "
                       "excludes 1")
    return out


__all__ = ["compare", "findings", "match_variants", "gate", "sample_warnings", "GATE_RULES", "SettingsDiffer"]
