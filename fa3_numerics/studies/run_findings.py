"""What a run (``run outliers``, any sweep of recipes over one distribution) found, for its dataset.

Exposed: ``findings``, ``with_findings``, ``reference_cell``, ``swept_dims``, ``precision_class``.

``findings(ds)`` holds:

- ``reference_cell``: the cell the report's figures and tables fix swept parameters at (the
  paper's value where the sweep has it, the longest sequence, else the middle value);
- ``verdict``: at that cell, the low-precision recipe (FP8, INT8, FP4 in Q/K, V or P) with the
  lowest pooled error, its ratio to the best FP16/BF16 recipe with a 95% BCa interval over the
  (seed, batch, head) samples (paired: the same samples feed every variant), and the
  low-precision recipe to avoid (the highest error, or non-finite); ``lines`` says it in words;
- ``headlines``: the best and worst variant, the paper's comparison in the paper's setting, the
  change along each swept parameter, non-finite variants;
- ``low_precision``: the variants in low precision (the report's pivot marks the best of them).
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..engine.dataset import PAPER_SETTING, SAMPLE_DIMS, paper_setting, py_value, same_value, summary_table
from ..text import column_format, fmt_coord, fmt_interval, md_code
from .findings import store, stored

_SHAPE = {"seqlen": "seqlen", "head_dim": "head dim", "causal": "causal"}
WIDE = ("fp16", "bf16", "fp32", "fp64")  # 16-bit and wider: the references a low-precision recipe is held against
SIXTEEN = ("fp16", "bf16")








def swept_dims(ds: xr.Dataset) -> list[str]:
    """Swept parameters, in the dataset's order (dims of ``rmse`` before ``variant``)."""
    return [d for d in ds["rmse"].dims if d not in SAMPLE_DIMS and d != "variant"]


def reference_cell(ds: xr.Dataset) -> dict:
    """The cell shown where a figure fixes a swept parameter: the paper's value when the
    sweep has it, the longest sequence for seqlen, else the middle value."""
    ref = {}
    for d in swept_dims(ds):
        vals = list(ds.coords[d].values)
        pick = None
        if d in PAPER_SETTING:
            hits = [v for v in vals if np.isclose(float(v), float(PAPER_SETTING[d]))]
            pick = hits[0] if hits else None
        if pick is None:
            pick = max(vals) if d == "seqlen" else vals[len(vals) // 2]
        ref[d] = py_value(pick)
    return ref


def precision_class(spec: str) -> str:
    """"16-bit" (Q/K, V and P all FP16/BF16), "wide" (FP32 or wider somewhere, nothing below 16
    bits) or "low" (any of them in FP8, INT8, FP4...), from a recipe's spec string."""
    fields = dict(kv.split("=", 1) for kv in str(spec).split(",") if "=" in kv)
    fmts = [fields.get(k, "fp16") for k in ("qk", "v", "p")]
    if any(f not in WIDE for f in fmts):
        return "low"
    return "16-bit" if all(f in SIXTEEN for f in fmts) else "wide"


def _sym(d: str) -> str:
    """A parameter as reports write it: the shape's words, else its family's symbol (σ for sigma)."""
    from ..data.distributions import param_symbol

    return _SHAPE.get(d) or param_symbol(d)


def _cell(where: dict) -> str:
    return ", ".join(f"{_sym(d)}={fmt_coord(v)}" for d, v in where.items())


def _at(rows: list[dict], ref: dict) -> list[dict]:
    return [r for r in rows if all(same_value(r[d], v) for d, v in ref.items())]


def _samples(ds: xr.Dataset, metric: str, variant: str, ref: dict) -> np.ndarray:
    da = ds[metric].sel(variant=variant)
    for d, v in ref.items():
        idx = next(i for i, c in enumerate(ds.coords[d].values) if same_value(py_value(c), v))
        da = da.isel({d: idx})
    return np.asarray(da.transpose(*[d for d in SAMPLE_DIMS if d in da.dims]).values, dtype=float).ravel()


def _ratio_interval(ds: xr.Dataset, metric: str, num: str, den: str, ref: dict) -> tuple[float, float, float]:
    """pooled(num) / pooled(den) at ``ref`` with its 95% BCa interval, paired over the samples."""
    from ..numerics.metrics import pool_rule
    from ..numerics.metrics.bootstrap import bca, pool_fn

    x, y = _samples(ds, metric, num, ref), _samples(ds, metric, den, ref)
    pool = pool_fn(pool_rule(metric))
    if x.size != y.size or not (np.isfinite(x).all() and np.isfinite(y).all()) or not pool(y) > 0:
        return math.nan, math.nan, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        est, lo, hi = bca(lambda a, b, axis=-1: pool(a, axis=axis) / pool(b, axis=axis), (x, y), paired=True, seed=1)
    return float(est), float(lo), float(hi)


def _verdict(ds: xr.Dataset, rows: list[dict], ref: dict, metric: str) -> dict:
    from ..numerics.metrics import metrics

    specs = {str(v): str(s) for v, s in zip(ds["variant"].values, ds["spec"].values)}
    at = _at(rows, ref)
    ok = [r for r in at if not r["nonfinite"] and math.isfinite(r["value"])]
    low = [r for r in ok if precision_class(specs.get(r["variant"], "")) == "low"]
    ref16 = [r for r in ok if precision_class(specs.get(r["variant"], "")) == "16-bit"]
    broken = sorted({r["variant"] for r in at if r["nonfinite"]})
    higher_better = getattr(metrics().get(metric), "worse", "higher") == "lower"
    best_of = max if higher_better else min
    worst_of = min if higher_better else max
    n = int(np.prod([ds.sizes.get(d, 1) for d in SAMPLE_DIMS]))
    # the swept parameters at the reference cell, then the fixed ones: where the answer holds
    fixed = {k: py_value(ds.coords[k].values) for k in ("p", "sigma", "seqlen", "head_dim", "causal")
             if k in ds.coords and ds.coords[k].ndim == 0 and k not in ref}
    where = f"at {_cell({**ref, **fixed})}" if ref or fixed else "in this run"
    m = metric.upper()
    out: dict = {"metric": metric, "cell": ref, "samples": n, "use": None, "reference": None, "ratio": None,
                 "avoid": [], "nonfinite": broken, "lines": []}
    fmt = column_format([x for r in ok for x in (r["value"], r["lo"], r["hi"])])

    def val(r):
        return f"{m} {fmt(r['value'])} {fmt_interval(r['lo'], r['hi'], fmt)}"

    if ref16:
        out["reference"] = {k: best_of(ref16, key=lambda r: r["value"])[k] for k in ("variant", "value", "lo", "hi")}
    if low:
        use = best_of(low, key=lambda r: r["value"])
        out["use"] = {k: use[k] for k in ("variant", "value", "lo", "hi")}
        line = (f"**Use {md_code(use['variant'])}**: the lowest {m} of the {len(low)} low-precision recipe(s) {where}, "
                f"{val(use)}")
        if out["reference"] and not higher_better:
            r16 = out["reference"]
            est, lo, hi = _ratio_interval(ds, metric, use["variant"], r16["variant"], ref)
            out["ratio"] = {"value": est, "lo": lo, "hi": hi, "paired": True}
            ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) else ""
            line += (f"; it costs ×{est:.2f}{ci} the error of {md_code(r16['variant'])}, the best FP16/BF16 recipe "
                     f"({m} {fmt(r16['value'])})")
        elif not out["reference"]:
            line += "; the run has no FP16/BF16 recipe to hold it against"
        out["lines"].append(line + ".")
        rest = [r for r in low if r["variant"] != use["variant"]]
        if rest:
            worst = worst_of(rest, key=lambda r: r["value"])
            times = worst["value"] / use["value"] if use["value"] > 0 and not higher_better else math.nan
            out["avoid"].append({"variant": worst["variant"], "value": worst["value"], "times_use": times})
            out["lines"].append(f"**Avoid {md_code(worst['variant'])}**: {val(worst)}"
                                + (f", ×{times:.2f} the error of {md_code(use['variant'])}" if math.isfinite(times) else "")
                                + ".")
    elif ok:
        best = best_of(ok, key=lambda r: r["value"])
        out["lines"].append(f"No low-precision recipe in this run; the lowest {m} {where} is {md_code(best['variant'])}, "
                            f"{val(best)}.")
    for v in broken:
        out["avoid"].append({"variant": v, "value": None, "times_use": None})
    if broken:
        out["lines"].append("**Avoid** " + ", ".join(md_code(v) for v in broken) + ": non-finite outputs (NaN or Inf) "
                            "in some samples; see the warning below.")
    if out["lines"]:
        out["lines"].append(f"Intervals: 95% BCa bootstrap over {n} (seed, batch, head) sample(s)"
                            + (", the ratio's paired (every variant sees the same samples)" if out["ratio"] else "")
                            + (" (fewer than 8: rough)" if n < 8 else "") + ".")
    return out


def headlines(ds: xr.Dataset, rows: list[dict], ref: dict, metric: str = "rmse") -> list[str]:
    """What the run found, in sentences with numbers (every run has at least one)."""
    from ..numerics.metrics import metrics

    lower_worse = getattr(metrics().get(metric), "worse", "higher") == "lower"
    at = [r for r in _at(rows, ref) if not r["nonfinite"] and math.isfinite(r["value"])]
    out = []
    paper = _paper_headline(ds, rows, ref)
    if paper:
        out.append(paper)
    if len(at) >= 2:
        fmt = column_format([x for r in at for x in (r["value"], r["lo"], r["hi"])])
        best = (max if lower_worse else min)(at, key=lambda r: r["value"])
        worst = (min if lower_worse else max)(at, key=lambda r: r["value"])
        where = f"at {_cell(ref)}" if ref else "in this run"
        apart = worst["value"] / best["value"] if best["value"] and not lower_worse else math.nan
        out.append(f"**Best and worst** {where}: {md_code(best['variant'])} has the {'highest' if lower_worse else 'lowest'} "
                   f"{metric.upper()}, {fmt(best['value'])} {fmt_interval(best['lo'], best['hi'], fmt)}; "
                   f"{md_code(worst['variant'])} the {'lowest' if lower_worse else 'highest'}, {fmt(worst['value'])} "
                   f"{fmt_interval(worst['lo'], worst['hi'], fmt)}"
                   + (f" ({apart:.2f}× the best)" if math.isfinite(apart) else "") + ".")
    elif len(at) == 1:
        r = at[0]
        fmt = column_format([r["value"], r["lo"], r["hi"]])
        out.append(f"**Result** {f'at {_cell(ref)}' if ref else 'in this run'}: {md_code(r['variant'])} has {metric.upper()} "
                   f"{fmt(r['value'])} {fmt_interval(r['lo'], r['hi'], fmt)}.")
    for d in [d for d in swept_dims(ds) if ds.sizes[d] > 1]:
        line = _trend(ds, rows, ref, d, metric)
        if line:
            out.append(line)
    bad = sorted({r["variant"] for r in rows if r["nonfinite"]})
    if bad:
        out.append(f"**Non-finite:** {', '.join(f'{md_code(v)}' for v in bad)} produced NaN or Inf in some cells; "
                   "see the warning above.")
    return out


def _trend(ds: xr.Dataset, rows: list[dict], ref: dict, d: str, metric: str) -> str:
    """How the metric changes from the first to the last value of swept parameter ``d`` (the
    others at the reference cell): the range of that change over the variants."""
    vals = [v.item() if hasattr(v, "item") else v for v in ds.coords[d].values]
    others = {k: v for k, v in ref.items() if k != d}
    sub = _at(rows, others)
    first, last = vals[0], vals[-1]
    change = {}
    for v in dict.fromkeys(r["variant"] for r in sub):
        a = next((r for r in sub if r["variant"] == v and same_value(r[d], first)), None)
        b = next((r for r in sub if r["variant"] == v and same_value(r[d], last)), None)
        if a and b and not a["nonfinite"] and not b["nonfinite"] and a["value"] > 0 and math.isfinite(b["value"]):
            change[v] = b["value"] / a["value"]
    if not change:
        return ""
    lo_v, hi_v = min(change, key=change.get), max(change, key=change.get)
    at = f" ({_cell(others)})" if others else ""
    span = f"{_sym(d)} {fmt_coord(first)} → {fmt_coord(last)}{at}"
    if lo_v == hi_v:
        return f"**Along {span}:** {metric.upper()} changes ×{change[lo_v]:.2f} ({md_code(lo_v)})."
    word = "grows" if change[lo_v] > 1 else "falls" if change[hi_v] < 1 else "changes"
    return (f"**Along {span}:** {metric.upper()} {word} by ×{change[lo_v]:.2f} ({md_code(lo_v)}) to ×{change[hi_v]:.2f} "
            f"({md_code(hi_v)}) over {len(change)} variants.")


def _paper_headline(ds: xr.Dataset, rows: list[dict], ref: dict) -> str:
    """One sentence on the paper's comparison, where the run has the paper's setting."""
    at = _at(rows, ref)
    by = {r["variant"]: r for r in at}
    if not paper_setting(ds, ref) or "baseline-fp8" not in by or "fa3-fp8" not in by:
        return ""
    b, f = by["baseline-fp8"]["value"], by["fa3-fp8"]["value"]
    if not (math.isfinite(b) and math.isfinite(f) and f > 0):
        return ""
    ratios = [r["ratio"] for r in at if math.isfinite(r["ratio"])]
    pb, pf = by["baseline-fp8"]["paper"], by["fa3-fp8"]["paper"]
    out = f"**Headline:** in the paper's setting, fa3-fp8 has {b / f:.2f}× lower RMSE than baseline-fp8"
    if math.isfinite(pb) and math.isfinite(pf) and pf > 0:
        out += f" (paper: {pb / pf:.2f}×)"
    if ratios:
        out += f"; ours / paper ranges from {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} variants"
    return out + "."


def findings(ds: xr.Dataset, metric: str = "rmse") -> dict:
    rows = summary_table(ds, metric)
    ref = reference_cell(ds)
    specs = {str(v): str(s) for v, s in zip(ds["variant"].values, ds["spec"].values)}
    return {"kind": "run", "metric": metric, "reference_cell": ref, "verdict": _verdict(ds, rows, ref, metric),
            "headlines": headlines(ds, rows, ref, metric),
            "low_precision": [v for v, s in specs.items() if precision_class(s) == "low"]}


def with_findings(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with its findings (computed where it has none)."""
    if stored(ds) is not None:
        return ds
    return store(ds, findings(ds))


__all__ = ["findings", "with_findings", "reference_cell", "swept_dims", "precision_class", "headlines"]
