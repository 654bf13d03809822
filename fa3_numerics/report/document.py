"""The content of a report as a list of blocks, rendered to Markdown or HTML elsewhere.

Exposed: ``Block``, ``build_document``.

Blocks carry Markdown-flavoured inline text (backticks for code, ``**`` for bold) and
Markdown tables, so that the Markdown and the HTML reports say exactly the same things.
Tables and provenance reuse ``fa3_numerics.report.summary``; nothing here depends on the time of
rendering, so the same dataset always gives the same report.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import xarray as xr

from ..engine.dataset import paper_setting, summary_table
from .format import fmt_e as _e
from .format import nonfinite_text
from .summary import markdown_table, nonfinite_block, provenance_block
from .figures import SYMBOL, Figure, _eq, _fmt_val, paper_setting_text, reference_cell, swept_dims



def other_metrics(ds: xr.Dataset, metric: str) -> list[str]:
    """Every registered metric the dataset holds besides the headline, in registry order."""
    from ..numerics.metrics import metrics

    return [m for m in metrics() if m != metric and m in ds]


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str  # h1, h2, p, figure, table (Markdown table text), list (Markdown bullets)
    text: str = ""
    figure: Figure | None = None


def where_line(ds: xr.Dataset) -> str:
    a = ds.attrs
    return (f"**Where it ran:** {a.get('device_name', '?')} (device `{a.get('device', '?')}`, backend "
            f"`{a.get('backend', '?')}`, {a.get('platform', '?')}). **Command:** `{a.get('command', '?')}`")


def build_document(ds: xr.Dataset, figures: list[Figure], rows: list[dict], metric: str = "rmse") -> list[Block]:
    exp = ds.attrs.get("experiment", "run")
    desc = ds.attrs.get("description", "")
    sw = swept_dims(ds)
    ref = reference_cell(ds)
    blocks = [Block("h1", f"{exp}: {desc}" if desc else exp), Block("p", where_line(ds))]
    flag = nonfinite_block(ds)
    if flag:
        head_, _, items = flag.partition("\n\n")
        blocks += [Block("p", head_), Block("list", items)]
    shape = " × ".join(f"{ds.sizes[d]} {SYMBOL.get(d, d)}" for d in sw) or "a single cell"
    nsamp = int(np.prod([ds.sizes.get(d, 1) for d in ("seed", "batch", "head")]))
    blocks.append(Block("p", f"{ds.sizes['variant']} variant(s) over {shape}; {nsamp} samples per "
                             f"(cell, variant) = {ds.sizes.get('seed', 1)} seed(s) × {ds.sizes.get('batch', 1)} "
                             f"batch × {ds.sizes.get('head', 1)} heads, every cell drawn from the same seeds. "
                             f"Intervals are 95% percentile bootstrap over those samples."
                             + (" Figures that fix a swept parameter use the reference cell "
                                + ", ".join(f"{SYMBOL.get(d, d)}={_fmt_val(v)}" for d, v in ref.items()) + "."
                                if ref else "")))
    head = _headline(ds, rows, ref)
    if head:
        blocks.append(Block("p", head))
    blocks.append(Block("h2", "Figures"))
    blocks += [Block("figure", figure=f) for f in figures]
    blocks.append(Block("h2", f"{metric.upper()} against the float64 reference"))
    blocks.append(Block("p", f"Measured on {ds.attrs.get('device_name', '?')} (device `{ds.attrs.get('device', '?')}`, "
                             f"backend `{ds.attrs.get('backend', '?')}`) by `{ds.attrs.get('command', '?')}`. "
                             "Paper values (FA3 paper, Table 3) are listed only for cells in the paper's setting "
                             f"({paper_setting_text()})."))
    blocks.append(Block("table", markdown_table(ds, metric)))
    other = _other_metrics(ds, ref, metric)
    if other:
        where = ", ".join(f"{SYMBOL.get(d, d)}={_fmt_val(v)}" for d, v in ref.items())
        blocks.append(Block("h2", "Other metrics" + (f" at {where}" if where else "")))
        blocks.append(Block("table", other))
    blocks.append(Block("h2", "Provenance"))
    blocks.append(Block("list", provenance_block(ds)))
    blocks.append(Block("h2", "Variants (full recipe specs)"))
    blocks.append(Block("list", "\n".join(f"- `{v}`: `{s}`" for v, s in zip(ds["variant"].values, ds["spec"].values))))
    return blocks


def _headline(ds: xr.Dataset, rows: list[dict], ref: dict) -> str:
    """One sentence on the paper's comparison, where the run has the paper's setting."""
    at = [r for r in rows if all(_eq(r[d], v) for d, v in ref.items())]
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


def _other_metrics(ds: xr.Dataset, ref: dict, metric: str = "rmse") -> str:
    ms = other_metrics(ds, metric)
    if not ms:
        return ""
    tables = {m: {r["variant"]: r for r in summary_table(ds, m) if all(_eq(r[d], v) for d, v in ref.items())}
              for m in ms}
    lines = ["| variant | " + " | ".join(f"{m} [95% CI]" if m != "nonfinite" else "non-finite outputs" for m in ms)
             + " |", "|" + "---|" * (len(ms) + 1)]
    for v in [str(x) for x in ds["variant"].values]:
        cols = []
        for m in ms:
            r = tables[m].get(v)
            if r is None:
                cols.append("-")
            elif m == "nonfinite":
                cols.append(f"{int(r['value'])}" if math.isfinite(r["value"]) else "-")
            elif r["nonfinite"]:
                cols.append(nonfinite_text(r["nonfinite"], r["n"]))
            else:
                cols.append(f"{_e(r['value'])} [{_e(r['lo'])}, {_e(r['hi'])}]")
        lines.append(f"| `{v}` | " + " | ".join(cols) + " |")
    return "\n".join(lines)
