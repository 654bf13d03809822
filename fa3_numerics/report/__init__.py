"""One report package for every study: each renders its datasets, nothing here computes.

Exposed: ``render_report``, ``render_run_report``, ``FORMATS``, ``figure_plan``, ``make_figures``.

``render_report(ds, out_dir)`` looks at which study wrote ``ds`` (``engine.dataset.dataset_kind``)
and renders it:

- a run (``run outliers``): ``report.html`` (figures embedded as data URIs, no external
  assets) and ``report.md`` with ``figures/*.png`` (modules ``figures``, ``document``,
  ``html``, ``markdown``, ``summary``);
- an ablation: ``report.md`` with figures and CSV tables (``ablation``);
- an audit: ``audit.md`` with heatmaps and the ranking (``audit``);
- a validation: ``validation.md`` (``validation``).

The commands call it after writing the dataset and ``fa3-numerics report DATASET`` calls it on
a saved one; the output depends only on the dataset, so both give the same files. Every file
is written whole or not at all (``fa3_numerics.engine.files``). ``compare`` renders through
``compare``; number formats are shared (``format``).
"""

from __future__ import annotations

from pathlib import Path

import xarray as xr

from ..engine.files import atomic_write
from ..errors import UsageError
from .figures import figure_plan, make_figures

FORMATS = ("html", "md")


def render_report(ds: xr.Dataset, out_dir: str | Path, formats=FORMATS, metric: str = "rmse") -> list[Path]:
    """Render the report of ``ds`` (any study's dataset) into ``out_dir``; return the files written."""
    from ..engine.dataset import dataset_kind

    kind = dataset_kind(ds)
    out_dir = Path(out_dir)
    if kind == "ablation":
        from .ablation import render_report as ablation_report

        out_dir.mkdir(parents=True, exist_ok=True)
        return [ablation_report(ds, out_dir)]
    if kind == "audit":
        from .audit import write_report

        a = ds.attrs
        budget = a.get("budget", "")
        return [write_report(ds, out_dir, budget=float(budget) if budget not in ("", None) else None,
                             budget_metric=a.get("budget_metric", "rmse"), rank_by=a.get("rank_by", "worst"),
                             rank_metric=a.get("rank_metric", "rel_l2"))]
    if kind == "validation":
        from .validation import write_validation

        out_dir.mkdir(parents=True, exist_ok=True)
        return [write_validation(ds, out_dir)]
    return render_run_report(ds, out_dir, formats, metric)


def render_run_report(ds: xr.Dataset, out_dir: str | Path, formats=FORMATS, metric: str = "rmse") -> list[Path]:
    """The report of a run's dataset in ``formats``; return the files written."""
    from ..engine.dataset import summary_table
    from .document import build_document
    from .html import render_html
    from .markdown import render_markdown

    formats = tuple(dict.fromkeys(formats))
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UsageError(f"unknown report format(s) {', '.join(map(repr, bad)) or '(none)'}; choose from {', '.join(FORMATS)}")
    if metric not in ds:
        raise UsageError(f"the dataset has no metric {metric!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_table(ds, metric)
    figures = make_figures(ds, rows, metric)
    blocks = build_document(ds, figures, rows, metric)
    written = []
    if "md" in formats:
        fig_dir = out_dir / "figures"
        fig_dir.mkdir(exist_ok=True)
        names = {f"{f.name}.png" for f in figures}
        for stale in fig_dir.glob("*.png"):  # figures of an earlier render with other dims
            if stale.name not in names:
                stale.unlink()
        for f in figures:
            written.append(_write(fig_dir / f"{f.name}.png", f.png))
        written.append(_write(out_dir / "report.md", render_markdown(blocks).encode()))
    if "html" in formats:
        written.append(_write(out_dir / "report.html", render_html(blocks).encode()))
    return written


_write = atomic_write


__all__ = ["render_report", "render_run_report", "FORMATS", "figure_plan", "make_figures"]
