"""The report of a run (``run outliers``, or any dataset of its layout) as a ``Document``.

Exposed: ``build_document``, ``run_report_document``, ``where_line``, ``other_metrics``.

The first screen is the verdict the run's study stored in the dataset (``studies.run_findings``):
the low-precision recipe to use at the reference cell and its error against the best FP16/BF16
recipe with the sampling interval, and the one to avoid. Then where it ran, what went wrong if
anything (non-finite results, intervals on too few samples) and the stored headlines (the best
and worst variant, the paper's comparison where the run has the paper's setting, and for each
swept parameter how much the error changes along it). A pivot of variants against
cells follows, then the figures, the other metrics, and the full table of every cell (collapsed
in the HTML when it is long), provenance and the recipes.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..engine.dataset import summary_table
from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text
from ..engine.dataset import same_value
from ..text import fmt_coord
from .figures import SYMBOL, Figure, paper_setting_text, reference_cell, swept_dims
from .stored import findings_of, verdict_block
from ..text import column_format, fmt_interval, nonfinite_text
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


def _cell(where: dict) -> str:
    return ", ".join(f"{SYMBOL.get(d, d)}={fmt_coord(v)}" for d, v in where.items())


PER_TABLE = 3  # metrics per table: a value and its interval each, so that a table fits the page


def _other_metrics(ds: xr.Dataset, ref: dict, metric: str = "rmse") -> list[Table]:
    """The other metrics at the reference cell, a few per table (one table of all ran past the page)."""
    ms = other_metrics(ds, metric)
    return [_metrics_table(ds, ref, ms[i:i + PER_TABLE]) for i in range(0, len(ms), PER_TABLE)]


def _metrics_table(ds: xr.Dataset, ref: dict, ms: list[str]) -> Table:
    tables = {m: {r["variant"]: r for r in summary_table(ds, m) if all(same_value(r[d], v) for d, v in ref.items())}
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
    found = findings_of(ds, kind="run")
    doc = Document(f"{md_text(exp)}: {md_text(desc)}" if desc else md_text(exp),
                   verdict_block(found) + [Para(where_line(ds), "where")])
    flag = nonfinite_block(ds)
    if flag:
        head_, _, items = flag.partition("\n\n")
        doc.lead += [Para(head_, "warning"), Bullets([i[2:] for i in items.splitlines() if i.strip()], "warning")]
    nsamp = int(np.prod([ds.sizes.get(d, 1) for d in ("seed", "batch", "head")]))
    few = few_samples_line(nsamp)
    if few:
        doc.lead.append(Para(few, "warning"))
    doc.lead.append(Bullets(found["headlines"], "headline"))
    shape = " × ".join(f"{ds.sizes[d]} {SYMBOL.get(d, d)}" for d in sw) or "a single cell"
    doc.lead.append(Para(
        f"{ds.sizes['variant']} variant(s) over {shape}; {nsamp} samples per (cell, variant) = "
        f"{ds.sizes.get('seed', 1)} seed(s) × {ds.sizes.get('batch', 1)} batch × {ds.sizes.get('head', 1)} heads, "
        f"every cell drawn from the same seeds. Intervals are 95% BCa bootstrap (scipy.stats.bootstrap) over those "
        f"samples." + (f" Figures and tables that fix a swept parameter use the reference cell {_cell(ref)}."
                       if ref else ""), "note"))
    if sw:
        doc.sections.append(Section(f"{metric.upper()} at a glance",
                                    list(pivot_tables(ds, rows, metric, ref, found.get("low_precision")))))
    doc.sections.append(Section("Figures", [Fig(f) for f in figures]))
    other = _other_metrics(ds, ref, metric)
    if other:
        doc.sections.append(Section("Other metrics" + (f" at {_cell(ref)}" if ref else ""), other))
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


def run_report_document(ds: xr.Dataset, metric: str = "rmse") -> Document:
    """The report of a run's dataset (what ``report`` renders for kind ``run``)."""
    from .figures import make_figures

    rows = summary_table(ds, metric)
    return build_document(ds, make_figures(ds, rows, metric), rows, metric)


__all__ = ["build_document", "run_report_document", "where_line", "other_metrics"]
