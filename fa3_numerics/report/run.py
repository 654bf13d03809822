"""The report of a run (``run outliers``, or any dataset of its layout) as a ``Document``.

Exposed: ``build_document``, ``headlines``, ``where_line``, ``other_metrics``.

The first screen says where it ran, what went wrong if anything (non-finite results, intervals
on too few samples) and what the run found: a headline for every run (the best and worst
variant at the reference cell, the paper's comparison where the run has the paper's setting,
and for each swept parameter how much the error changes along it). A pivot of variants against
cells follows, then the figures, the other metrics, and the full table of every cell (collapsed
in the HTML when it is long), provenance and the recipes.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..engine.dataset import paper_setting, summary_table
from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text
from .figures import SYMBOL, Figure, _eq, _fmt_val, paper_setting_text, reference_cell, swept_dims
from .format import column_format, fmt_interval, nonfinite_text
from .summary import few_samples_line, full_table, nonfinite_block, pivot_tables, provenance_items

LONG_TABLE = 30  # rows past which the full table is collapsed in the HTML


def other_metrics(ds: xr.Dataset, metric: str) -> list[str]:
    """Every registered metric the dataset holds besides the headline, in registry order."""
    from ..numerics.metrics import metrics

    return [m for m in metrics() if m != metric and m in ds]


def backend_of(ds: xr.Dataset) -> str:
    """The run's backend, or its variants' (a hardware run records one per variant)."""
    if ds.attrs.get("backend"):
        return str(ds.attrs["backend"])
    if "backend" in ds.coords:
        return ", ".join(dict.fromkeys(str(b) for b in np.atleast_1d(ds["backend"].values)))
    return "?"


def where_line(ds: xr.Dataset) -> str:
    a = ds.attrs
    return (f"**Where it ran:** {md_text(a.get('device_name', '?'))} (device {md_code(a.get('device', '?'))}, backend "
            f"{md_code(backend_of(ds))}, {md_text(a.get('platform', '?'))}). **Command:** {md_code(a.get('command', '?'))}")


def _at(rows: list[dict], ref: dict) -> list[dict]:
    return [r for r in rows if all(_eq(r[d], v) for d, v in ref.items())]


def _cell(where: dict) -> str:
    return ", ".join(f"{SYMBOL.get(d, d)}={_fmt_val(v)}" for d, v in where.items())


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
        a = next((r for r in sub if r["variant"] == v and _eq(r[d], first)), None)
        b = next((r for r in sub if r["variant"] == v and _eq(r[d], last)), None)
        if a and b and not a["nonfinite"] and not b["nonfinite"] and a["value"] > 0 and math.isfinite(b["value"]):
            change[v] = b["value"] / a["value"]
    if not change:
        return ""
    lo_v, hi_v = min(change, key=change.get), max(change, key=change.get)
    at = f" ({_cell(others)})" if others else ""
    span = f"{SYMBOL.get(d, d)} {_fmt_val(first)} → {_fmt_val(last)}{at}"
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


def _other_metrics(ds: xr.Dataset, ref: dict, metric: str = "rmse") -> Table | None:
    ms = other_metrics(ds, metric)
    if not ms:
        return None
    tables = {m: {r["variant"]: r for r in summary_table(ds, m) if all(_eq(r[d], v) for d, v in ref.items())}
              for m in ms}
    fmts = {m: column_format([x for r in tables[m].values() for x in (r["value"], r["lo"], r["hi"])]) for m in ms}
    cols = ["variant"] + [f"{m} [95% CI]" if m != "nonfinite" else "non-finite outputs" for m in ms]
    body = []
    for v in [str(x) for x in ds["variant"].values]:
        cells = []
        for m in ms:
            r = tables[m].get(v)
            if r is None:
                cells.append("-")
            elif m == "nonfinite":
                cells.append(f"{int(r['value'])}" if math.isfinite(r["value"]) else "-")
            elif r["nonfinite"]:
                cells.append(nonfinite_text(r["nonfinite"], r["n"]))
            else:
                cells.append(f"{fmts[m](r['value'])} {fmt_interval(r['lo'], r['hi'], fmts[m])}")
        body.append([md_code(v)] + cells)
    units = {m: ds[m].attrs.get("units", "") for m in ms}
    caption = "Units: " + ", ".join(f"{m} {u}" for m, u in units.items() if u and u != "1") + \
        "; the others are dimensionless."
    return Table(cols, body, [False] + [True] * len(ms), caption=caption)


def build_document(ds: xr.Dataset, figures: list[Figure], rows: list[dict], metric: str = "rmse") -> Document:
    exp = ds.attrs.get("experiment", "run")
    desc = ds.attrs.get("description", "")
    sw = swept_dims(ds)
    ref = reference_cell(ds)
    doc = Document(f"{md_text(exp)}: {md_text(desc)}" if desc else md_text(exp), [Para(where_line(ds), "where")])
    flag = nonfinite_block(ds)
    if flag:
        head_, _, items = flag.partition("\n\n")
        doc.lead += [Para(head_, "warning"), Bullets([i[2:] for i in items.splitlines() if i.strip()], "warning")]
    nsamp = int(np.prod([ds.sizes.get(d, 1) for d in ("seed", "batch", "head")]))
    few = few_samples_line(nsamp)
    if few:
        doc.lead.append(Para(few, "warning"))
    doc.lead.append(Bullets(headlines(ds, rows, ref, metric), "headline"))
    shape = " × ".join(f"{ds.sizes[d]} {SYMBOL.get(d, d)}" for d in sw) or "a single cell"
    doc.lead.append(Para(
        f"{ds.sizes['variant']} variant(s) over {shape}; {nsamp} samples per (cell, variant) = "
        f"{ds.sizes.get('seed', 1)} seed(s) × {ds.sizes.get('batch', 1)} batch × {ds.sizes.get('head', 1)} heads, "
        f"every cell drawn from the same seeds. Intervals are 95% BCa bootstrap (scipy.stats.bootstrap) over those "
        f"samples." + (f" Figures and tables that fix a swept parameter use the reference cell {_cell(ref)}."
                       if ref else ""), "note"))
    if sw:
        doc.sections.append(Section(f"{metric.upper()} at a glance", list(pivot_tables(ds, rows, metric, ref))))
    doc.sections.append(Section("Figures", [Fig(f) for f in figures]))
    other = _other_metrics(ds, ref, metric)
    if other is not None:
        doc.sections.append(Section("Other metrics" + (f" at {_cell(ref)}" if ref else ""), [other]))
    table = full_table(ds, metric, rows)
    table.long = len(table.rows) > LONG_TABLE
    table.summary = f"Every cell: {metric.upper()}, interval, samples and the paper's value"
    doc.sections.append(Section(f"{metric.upper()} against the float64 reference" + (", every cell" if sw else ""), [
        Para(f"Measured on {md_text(ds.attrs.get('device_name', '?'))} (device {md_code(ds.attrs.get('device', '?'))}, backend "
             f"{md_code(backend_of(ds))}) by {md_code(ds.attrs.get('command', '?'))}. Paper values (FA3 paper, "
             f"Table 3) are listed only for cells in the paper's setting ({paper_setting_text()}).", "note"),
        table]))
    doc.sections.append(Section("Provenance", [Bullets(provenance_items(ds))]))
    doc.sections.append(Section("Variants (full recipe specs)", [
        Bullets([f"{md_code(v)}: {md_code(s)}" for v, s in zip(ds["variant"].values, ds["spec"].values)])]))
    return doc


__all__ = ["build_document", "headlines", "where_line", "other_metrics"]
