"""Compare two runs' datasets: the same variants side by side with ratios B / A.

Exposed: ``compare``, ``findings`` (the rendering is ``fa3_numerics.report.compare``).

For two machines, two backends, two seeds, or before/after a change. Variants are aligned
by label, swept parameters by their common values (a parameter swept in one run and fixed
in the other is compared at the fixed value). Each side's value is the pooled metric over
its (seed, batch, head) samples with the 95% percentile-bootstrap interval of
``fa3_numerics.numerics.metrics.bootstrap_ci``; the ratio's interval is the percentile interval of
the ratio of independent bootstrap replicates of the two sides, so "covers 1" means the
two runs agree within sampling noise.

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
from ..numerics.metrics import bootstrap_ci, bootstrap_stats, get_metric, metrics, nonfinite_samples, pooled

N_BOOT = 2000


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


def _boot(metric: str, values: np.ndarray, seed: int, n_boot: int = N_BOOT) -> np.ndarray:
    return bootstrap_stats(metric, values, n_boot=n_boot, seed=seed)


def compare(a: xr.Dataset, b: xr.Dataset, metric: str = "rmse", level: float = 0.95) -> dict:
    """Rows (cell, variant) with A, B, their intervals, ratio B/A, its interval and coverage of 1."""
    get_metric(metric)  # a registered metric, or the one-line error listing them
    for name, ds in (("A", a), ("B", b)):
        if metric not in ds:
            raise UsageError(f"dataset {name} has no metric {metric!r}; choose one of "
                             f"{', '.join(m for m in metrics() if m in ds)}")
    va = [str(v) for v in a["variant"].values]
    vb = [str(v) for v in b["variant"].values]
    common = [v for v in va if v in vb]
    if not common:
        raise UsageError(f"no variants in common (A has {', '.join(va)}; B has {', '.join(vb)}); "
                         "compare runs of the same variants")
    sa, sb = _swept(a, metric), _swept(b, metric)
    dims = [d for d in sa] + [d for d in sb if d not in sa]
    cell_values: dict[str, list] = {}
    for d in dims:
        xa, xb = _values(a, d), _values(b, d)
        if not xa or not xb:
            raise UsageError(f"parameter {d!r} is swept in one dataset and absent from the other; cannot align them")
        vals = [x for x in xa if any(_same(x, y) for y in xb)]
        if not vals:
            raise UsageError(f"no common values of {d} (A: {xa}; B: {xb}); compare runs that share a setting")
        cell_values[d] = vals
    # fixed parameters that differ are reported, not refused (e.g. a before/after comparison)
    differs = []
    for d in sorted(set(a.coords) | set(b.coords)):
        if d in dims or d in ("variant", "spec", "paper_rmse", "abs_bin_lo", "tensor") or d in SAMPLE_DIMS:
            continue
        xa, xb = _values(a, d), _values(b, d)
        if len(xa) == 1 and len(xb) == 1 and not _same(xa[0], xb[0]):
            differs.append(f"{d}: A {xa[0]}, B {xb[0]}")
    spec_a = dict(zip(va, (str(s) for s in a["spec"].values))) if "spec" in a.coords else {}
    spec_b = dict(zip(vb, (str(s) for s in b["spec"].values))) if "spec" in b.coords else {}
    rows = []
    q = [(1 - level) / 2, (1 + level) / 2]
    for combo in itertools.product(*(cell_values[d] for d in dims)):
        where = dict(zip(dims, combo))
        sub_a, sub_b = _at(a[metric], where), _at(b[metric], where)
        for v in common:
            xa = sub_a.sel(variant=v).values
            xb = sub_b.sel(variant=v).values
            pa, pb = pooled(metric, xa), pooled(metric, xb)
            la, ha = bootstrap_ci(metric, xa, level=level)
            lb, hb = bootstrap_ci(metric, xb, level=level)
            with np.errstate(divide="ignore", invalid="ignore"):
                rep = _boot(metric, xb, seed=1) / _boot(metric, xa, seed=0)
            rep = rep[np.isfinite(rep)]
            rlo, rhi = (float(x) for x in np.quantile(rep, q)) if rep.size else (math.nan, math.nan)
            ratio = pb / pa if pa and math.isfinite(pa) and math.isfinite(pb) else math.nan
            covers = bool(rlo <= 1.0 <= rhi) if math.isfinite(rlo) else None
            rows.append({**where, "variant": v, "a": pa, "a_lo": la, "a_hi": ha, "b": pb, "b_lo": lb, "b_hi": hb,
                         "ratio": ratio, "ratio_lo": rlo, "ratio_hi": rhi, "covers_1": covers,
                         "n_a": xa.size, "n_b": xb.size, "nonfinite_a": nonfinite_samples(xa)[0],
                         "nonfinite_b": nonfinite_samples(xb)[0],
                         "same_spec": spec_a.get(v) == spec_b.get(v)})
    return {"metric": metric, "dims": dims, "rows": rows, "differs": differs,
            "only_a": [v for v in va if v not in vb], "only_b": [v for v in vb if v not in va]}


def _at(da: xr.DataArray, where: dict) -> xr.DataArray:
    for d, val in where.items():
        if d in da.dims:
            idx = next(i for i, x in enumerate(_values(da, d)) if _same(x, val))
            da = da.isel({d: idx})
    return da


def findings(res: dict) -> list[str]:
    """One line per compared row whose A or B samples hold non-finite values."""
    out = []
    for r in res["rows"]:
        for side in ("a", "b"):
            k = r[f"nonfinite_{side}"]
            if k:
                cell = ", ".join(f"{d}={r[d]}" for d in res["dims"]) or "single cell"
                out.append(f"non-finite results in {side.upper()}: variant {r['variant']!r}, {cell}: {k} of "
                           f"{r[f'n_{side}']} samples")
    return out
