"""Compare two runs' datasets: the same variants side by side with ratios B / A.

Exposed: ``compare``, ``text_report``, ``markdown_report``.

For two machines, two backends, two seeds, or before/after a change. Variants are aligned
by label, swept parameters by their common values (a parameter swept in one run and fixed
in the other is compared at the fixed value). Each side's value is the pooled metric over
its (seed, batch, head) samples with the 95% percentile-bootstrap interval of
``fa3_numerics.numerics.metrics.bootstrap_ci``; the ratio's interval is the percentile interval of
the ratio of independent bootstrap replicates of the two sides, so "covers 1" means the
two runs agree within sampling noise.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import xarray as xr

from ..engine.dataset import SAMPLE_DIMS
from ..errors import UsageError
from ..numerics.metrics import bootstrap_ci, bootstrap_stats, pooled

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
    for name, ds in (("A", a), ("B", b)):
        if metric not in ds:
            raise UsageError(f"dataset {name} has no metric {metric!r}; choose one of rmse, rel_l2, rel_l1, max_abs, "
                             "cosine, sqnr_db")
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
                         "n_a": int(np.isfinite(xa).sum()), "n_b": int(np.isfinite(xb).sum()),
                         "same_spec": spec_a.get(v) == spec_b.get(v)})
    return {"metric": metric, "dims": dims, "rows": rows, "differs": differs,
            "only_a": [v for v in va if v not in vb], "only_b": [v for v in vb if v not in va]}


def _at(da: xr.DataArray, where: dict) -> xr.DataArray:
    for d, val in where.items():
        if d in da.dims:
            idx = next(i for i, x in enumerate(_values(da, d)) if _same(x, val))
            da = da.isel({d: idx})
    return da


def _e(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.3g}" if 0.01 <= abs(x) < 1000 else f"{x:.2e}"


def _table(res: dict) -> tuple[list[str], list[list[str]]]:
    m = res["metric"]
    head = res["dims"] + ["variant", f"A {m}", "A 95% CI", f"B {m}", "B 95% CI", "B/A", "B/A 95% CI", "covers 1"]
    body = []
    for r in res["rows"]:
        cov = "-" if r["covers_1"] is None else ("yes" if r["covers_1"] else "NO")
        body.append([str(r[d]) for d in res["dims"]] + [
            r["variant"] + ("" if r["same_spec"] else " (*)"), _e(r["a"]), f"[{_e(r['a_lo'])}, {_e(r['a_hi'])}]",
            _e(r["b"]), f"[{_e(r['b_lo'])}, {_e(r['b_hi'])}]",
            "-" if not math.isfinite(r["ratio"]) else f"{r['ratio']:.3f}",
            f"[{'-' if not math.isfinite(r['ratio_lo']) else format(r['ratio_lo'], '.3f')}, "
            f"{'-' if not math.isfinite(r['ratio_hi']) else format(r['ratio_hi'], '.3f')}]", cov])
    return head, body


def _side(label: str, path: str, ds: xr.Dataset, code: str = "") -> str:
    at = ds.attrs
    return (f"{label}: {code}{path}{code} — {at.get('device_name', '?')} ({at.get('device', '?')}), backend "
            f"{at.get('backend', '?')}, seeds {at.get('seeds', '?')}, commit {str(at.get('git_commit', '?'))[:12]}; "
            f"command: {code}{at.get('command', '?')}{code}")


def _notes(res: dict) -> list[str]:
    rows = res["rows"]
    n_cov = sum(1 for r in rows if r["covers_1"])
    n_def = sum(1 for r in rows if r["covers_1"] is not None)
    notes = [f"{n_cov} of {n_def} ratio intervals (95%, bootstrap of B/A over each side's samples) cover 1."]
    if any(not r["same_spec"] for r in rows):
        notes.append("(*) the variant's recipe spec differs between A and B.")
    if res["differs"]:
        notes.append("fixed parameters that differ: " + "; ".join(res["differs"]) + ".")
    if res["only_a"]:
        notes.append("only in A (not compared): " + ", ".join(res["only_a"]) + ".")
    if res["only_b"]:
        notes.append("only in B (not compared): " + ", ".join(res["only_b"]) + ".")
    return notes


def text_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    head, body = _table(res)
    widths = [max(len(h), *(len(x[i]) for x in body)) for i, h in enumerate(head)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    lines = [_side("A", path_a, a), _side("B", path_b, b), "", fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(x) for x in body]
    return "\n".join(lines + [""] + _notes(res))


def markdown_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    head, body = _table(res)
    lines = [f"# Comparison of {res['metric']}: B / A", "", f"- {_side('A', path_a, a, '`')}",
             f"- {_side('B', path_b, b, '`')}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(x) + " |" for x in body]
    return "\n".join(lines + [""] + [f"- {n}" for n in _notes(res)]) + "\n"
