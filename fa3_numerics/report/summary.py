"""Tables of a run's dataset: the full table, the pivots, the text table, provenance.

Exposed: ``full_table``, ``pivot_tables``, ``text_table``, ``markdown_table``, ``markdown_summary``,
``provenance_items``, ``provenance_block``, ``nonfinite_block``, ``few_samples_line``,
``cell_keys``.

A variant whose samples hold NaN or Inf shows "non-finite (k of n samples)" in place of its
value, and the summary opens with the list of such results: never an estimate over the finite
rest that would read as complete. Every column uses one number format
(``fa3_numerics.text.column_format``); an interval over fewer than 8 samples is marked
with ``FEW`` and explained at the top.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..engine.conventions import attr_list
from ..engine.dataset import summary_table
from ..numerics.metrics.bootstrap import MIN_SAMPLES, few_samples
from .document import Table, md_code, md_table, md_text
from .figures import SYMBOL
from ..text import FEW, column_format, fmt_e, fmt_interval, fmt_ratio, fmt_value

_ROW_KEYS = ("variant", "value", "lo", "hi", "n", "nonfinite", "paper", "ratio")


def cell_keys(rows: list[dict]) -> list[str]:
    """The swept parameters of ``summary_table`` rows, in order."""
    return [k for k in rows[0] if k not in _ROW_KEYS] if rows else []


def fmt_param(v) -> str:
    """A parameter value as the reports write it (1e-04 as 0.0001, 10.0 as 10, True as true)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e6 else f"{v:g}"
    return str(v)


def full_table(ds: xr.Dataset, metric: str = "rmse", rows: list[dict] | None = None) -> Table:
    """Every (cell, variant): value, interval, samples, the paper's value and ours / paper."""
    rows = summary_table(ds, metric) if rows is None else rows
    keys = cell_keys(rows)
    val = column_format([x for r in rows for x in (r["value"], r["lo"], r["hi"])])
    pap = column_format([r["paper"] for r in rows])
    body = []
    for r in rows:
        value = fmt_value(r["value"], r["nonfinite"], r["n"], val)
        body.append([fmt_param(r[k]) for k in keys] + [
            md_code(r['variant']), f"**{value}**" if r["nonfinite"] else value,
            fmt_interval(r["lo"], r["hi"], val, few_samples(r["n"])), str(r["n"]), pap(r["paper"]),
            fmt_ratio(r["ratio"])])
    cols = [SYMBOL.get(k, k) for k in keys] + ["variant", metric, "95% CI", "samples", "paper (Table 3)",
                                                 "ours / paper"]
    return Table(cols, body, [False] * len(keys) + [False, True, True, True, True, True])


def markdown_table(ds: xr.Dataset, metric: str = "rmse") -> str:
    return md_table(full_table(ds, metric))


def text_table(ds: xr.Dataset, metric: str = "rmse") -> str:
    """The full table as plain text (the command's stdout), drawn by rich."""
    from .console import table_text

    t = full_table(ds, metric)
    strip = lambda c: c.replace("`", "").replace("**", "")  # noqa: E731
    return table_text([strip(c) for c in t.columns], [[strip(c) for c in r] for r in t.rows], t.numeric)


def _cell_label(where: dict) -> str:
    return ", ".join(f"{SYMBOL.get(k, k)}={fmt_param(v)}" for k, v in where.items()) or "single cell"


def _eq(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    except (TypeError, ValueError):
        return a == b


def pivot_tables(ds: xr.Dataset, rows: list[dict], metric: str, ref: dict, marked: list[str] | None = None,
                 max_cells: int = 8) -> list[Table]:
    """Variants against cells: one table of every cell when there are at most ``max_cells``,
    else one per swept parameter with the others at the reference cell ``ref``. In bold, the
    lowest of each column among ``marked`` (the study's low-precision variants; every variant
    when None): an FP16 row, always lowest, would otherwise take every column."""
    keys = cell_keys(rows)
    variants = [str(v) for v in ds["variant"].values]
    cells = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    if len(cells) <= max_cells or not keys:
        groups = [("", [dict(zip(keys, c)) for c in cells])]
    else:
        groups = []
        for d in [k for k in keys if ds.sizes.get(k, 1) > 1]:
            others = {k: v for k, v in ref.items() if k != d}
            vals = [c[keys.index(d)] for c in cells if all(_eq(c[keys.index(k)], v) for k, v in others.items())]
            groups.append((d, [{**others, d: v} for v in dict.fromkeys(vals)]))
    worse_lower = _worse_lower(metric)
    out = []
    for d, wheres in groups:
        picked = [[next((r for r in rows if r["variant"] == v and all(_eq(r[k], w[k]) for k in keys)), None)
                   for w in wheres] for v in variants]
        fmt = column_format([r["value"] for row in picked for r in row if r])
        best = []
        for j in range(len(wheres)):
            col = [row[j]["value"] for v, row in zip(variants, picked) if row[j] and not row[j]["nonfinite"]
                   and math.isfinite(row[j]["value"]) and (marked is None or v in marked)]
            best.append((max(col) if worse_lower else min(col)) if col else None)
        body = []
        for v, row in zip(variants, picked):
            cells_txt = []
            for j, r in enumerate(row):
                if r is None:
                    cells_txt.append("-")
                    continue
                t = fmt_value(r["value"], r["nonfinite"], r["n"], fmt)
                eligible = marked is None or v in marked
                cells_txt.append(f"**{t}**" if eligible and best[j] is not None and r["value"] == best[j] else t)
            body.append([md_code(v)] + cells_txt)
        if d:
            fixed = _cell_label({k: v for k, v in ref.items() if k != d})
            cols = ["variant"] + [f"{SYMBOL.get(d, d)}={fmt_param(w[d])}" for w in wheres]
            caption = f"{metric.upper()} against {SYMBOL.get(d, d)} at {fixed}; {_bold_rule(marked)}."
        else:
            cols = ["variant"] + [_cell_label(w) for w in wheres]
            caption = f"{metric.upper()} of each variant in each cell; {_bold_rule(marked)}."
        out.append(Table(cols, body, [False] + [True] * len(wheres), caption=caption))
    return out


def _bold_rule(marked) -> str:
    return ("the best low-precision value of each column in bold" if marked else
            "the best of each column in bold")


def _worse_lower(metric: str) -> bool:
    from ..numerics.metrics import metrics

    m = metrics().get(metric)
    return m is not None and m.worse == "lower"


def provenance_items(ds: xr.Dataset) -> list[str]:
    a = ds.attrs
    fixed = {k: ds.coords[k].values.item() for k in ds.coords if ds.coords[k].ndim == 0}
    seeds = attr_list(ds, "seeds") or a.get("seeds", "?")
    return [
        f"command: {md_code(a.get('command', '?'))}",
        f"device: {md_text(a.get('device', '?'))} ({md_text(a.get('device_name', '?'))}), backend {md_code(a.get('backend', '?'))}",
        f"git commit: {md_code(a.get('git_commit', '?'))}; created {md_text(a.get('created_utc', '?'))}; wall time "
        f"{md_text(a.get('wall_seconds', '?'))} s",
        f"versions: fa3-numerics {md_text(a.get('version_fa3_numerics'))}, torch {md_text(a.get('version_torch'))}, "
        f"numpy {md_text(a.get('version_numpy'))}, scipy {md_text(a.get('version_scipy'))}, xarray {md_text(a.get('version_xarray'))}, "
        f"python {md_text(a.get('python'))}",
        f"distribution {md_code(a.get('dist'))}; fixed parameters: " + ", ".join(f"{k}={fmt_param(v)}" for k, v in fixed.items()),
        f"seeds {seeds}; query rows: {md_text(a.get('rows_sampling'))}; intervals: 95% BCa bootstrap "
        f"(scipy.stats.bootstrap) over (seed, batch, head) samples",
    ]


def provenance_block(ds: xr.Dataset) -> str:
    return "\n".join(f"- {x}" for x in provenance_items(ds))


def nonfinite_block(ds: xr.Dataset) -> str:
    """Markdown list of the results holding NaN or Inf ('' when there are none)."""
    from ..engine.nonfinite import scan

    found = scan(ds)
    if not found:
        return ""
    return ("**Non-finite results.** These variants produced NaN or Inf outputs (or the float64 reference did); "
            "their pooled values read \"non-finite (k of n samples)\":\n\n" + "\n".join(f"- {f.line()}" for f in found))


def few_samples_line(n: int) -> str:
    """The warning for intervals over ``n`` samples ('' when there are enough)."""
    if not few_samples(n):
        return ""
    return (f"**Few samples.** Every interval rests on {n} (seed, batch, head) sample(s), fewer than {MIN_SAMPLES} "
            f"(marked {FEW}): read them as rough. More seeds (`--seeds 0,1,2,3`) or heads sharpen them.")


def markdown_summary(ds: xr.Dataset) -> str:
    title = ds.attrs.get("description") or ds.attrs.get("experiment", "run")
    spec_lines = "\n".join(f"- {md_code(v)}: {md_code(s)}" for v, s in zip(ds["variant"].values, ds["spec"].values))
    flag = nonfinite_block(ds)
    rows = summary_table(ds)
    few = few_samples_line(rows[0]["n"]) if rows else ""
    return (f"# {md_text(ds.attrs.get('experiment', 'run'))}: {md_text(title)}\n\n" + (f"{flag}\n\n" if flag else "") +
            (f"{few}\n\n" if few else "") + "## RMSE against the float64 reference\n\n"
            f"{md_table(full_table(ds, 'rmse', rows))}\n\n## Provenance\n\n{provenance_block(ds)}\n\n"
            f"## Variants (full recipe specs)\n\n{spec_lines}\n")


def console(ds: xr.Dataset) -> tuple[str, list[str]]:
    """What ``run`` prints when done: the table, and a warning when intervals rest on few samples."""
    n = int(np.prod([ds.sizes.get(d, 1) for d in ("seed", "batch", "head")]))
    notes = [f"warning: every interval rests on {n} sample(s), fewer than {MIN_SAMPLES} (marked †); more --seeds or "
             "--heads sharpen them"] if few_samples(n) else []
    return text_table(ds), notes


def _impact_table(ds) -> str:
    """The console table of an impact dataset: every variant on every layer, the baselines, and
    the budget's verified assignment when one was asked for."""
    import json

    rows = [("variant", "KL mean", "KL p99", "KL max", "top-1", "dppl")]
    for v in ds["variant"].values:
        s = ds.sel(variant=v, mask="all")
        rows.append((str(v), fmt_e(float(s.kl_mean)), fmt_e(float(s.kl_p99)), fmt_e(float(s.kl_max)),
                     f"{100 * float(s.top1_agree):.2f}%", f"{float(s.ppl_delta):+.4f}"))
    if "baseline" in ds.dims:
        for b in ds["baseline"].values:
            s = ds.sel(baseline=b)
            rows.append((str(b), fmt_e(float(s.base_kl_mean)), fmt_e(float(s.base_kl_p99)), fmt_e(float(s.base_kl_max)),
                         f"{100 * float(s.base_top1_agree):.2f}%", f"{float(s.base_ppl_delta):+.4f}"))
    from .console import table_text

    lines = [table_text(rows[0], rows[1:], [False, True, True, True, True, True],
                        title=f"every layer, {ds.attrs.get('tokens')} tokens, reference ppl "
                              f"{float(ds.attrs['ref_ppl']):.4f}:")]
    budget = ds.attrs.get("budget", "")
    if budget:
        b = json.loads(budget)
        best = b.get("best")
        lines.append(f"budget KL {b['stat']} <= {b['budget']:g}: " + (
            f"{best['label']} (cost {best['cost']}, measured {fmt_e(best['measured'])})" if best else
            "no verified assignment meets it"))
    return "\n".join(lines)


def impact_console(ds: xr.Dataset) -> tuple[str, list[str]]:
    """What ``impact`` prints when done: every variant on every layer, the baselines, the budget."""
    return _impact_table(ds), []


__all__ = ["full_table", "pivot_tables", "text_table", "markdown_table", "markdown_summary", "provenance_items",
           "provenance_block", "nonfinite_block", "few_samples_line", "cell_keys", "fmt_param", "SYMBOL"]
