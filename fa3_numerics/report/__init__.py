"""One report package for every study: each renders its datasets, nothing here computes.

Exposed: ``render_report``, ``render_run_report``, ``render_combined``, ``FORMATS``, ``figure_plan``,
``make_figures``.

``render_report(ds, out_dir)`` looks at which study wrote ``ds`` (``engine.dataset.dataset_kind``)
and renders it, every study the same way: a ``Document`` (``document``) rendered from jinja2
templates to a self-contained HTML page (figures embedded as data URIs, no external assets) and
to Markdown with its figures as PNG and SVG files:

- a run (``run outliers``): ``report.html``, ``report.md``, ``figures/`` (``run``, ``figures``,
  ``figures_sweep``, ``summary``);
- an ablation: ``report.html``, ``report.md``, figures and CSV tables (``ablation``);
- an audit: ``audit.html``, ``audit.md``, heatmaps and the ranking (``audit``);
- a validation: ``validation.html``, ``validation.md`` (``validation``).

The commands call it after writing the dataset and ``fa3-numerics report DATASET`` calls it on
a saved one; the output depends only on the dataset, so both give the same files.
``render_combined`` puts several datasets (e.g. an H200 run's Table 3 and validation) on one
page. Every file is written whole or not at all (``fa3_numerics.engine.files``). ``compare``
renders through ``compare``; number formats are shared (``format``).
"""

from __future__ import annotations

from pathlib import Path

import xarray as xr

from ..errors import UsageError
from .document import FORMATS, Document, Section, md_text, write_document
from .figures import figure_plan, make_figures


def _check_formats(formats) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(formats))
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UsageError(f"unknown report format(s) {', '.join(map(repr, bad)) or '(none)'}; choose from {', '.join(FORMATS)}")
    return formats


def _require_results(ds: xr.Dataset, dim: str) -> None:
    """A dataset with no variants (no cases) has nothing to draw or tabulate."""
    if ds.sizes.get(dim, 0) == 0:
        raise UsageError(f"the dataset holds no {dim}s: there is nothing to report; pass one from a run that "
                         f"computed at least one")


# kind (the dataset's ``kind`` attribute, ``engine.dataset.dataset_kind``) -> "module:function"
# rendering it: ``function(ds, out_dir, formats) -> [paths written]``. A study's report page is one
# entry here (or in the entry-point group ``REPORT_ENTRY_POINTS`` for another package).
REPORTS: dict[str, str] = {
    "run": "fa3_numerics.report:render_run_report",
    "ablation": "fa3_numerics.report:render_document_report",
    "audit": "fa3_numerics.report:render_document_report",
    "validation": "fa3_numerics.report:render_document_report",
    "impact": "fa3_numerics.report.impact:render_impact",
    "recommend": "fa3_numerics.report.recommend:render_recommend",
    "backward": "fa3_numerics.report.backward:render_backward",
    "train": "fa3_numerics.report.train:render_train",
    "long-context": "fa3_numerics.report.long_context:render_long_context",
    "validation-backward": "fa3_numerics.report.validation_backward:render_validation_backward",
}
REPORT_ENTRY_POINTS = "fa3_numerics.reports"


def register_report(kind: str, target: str) -> None:
    """Render datasets of ``kind`` with ``target`` ("module:function", imported when first used)."""
    REPORTS[kind] = target


def reports() -> dict[str, str]:
    """Every report page by kind, the entry-point group's included."""
    import importlib.metadata

    for ep in importlib.metadata.entry_points(group=REPORT_ENTRY_POINTS):
        REPORTS.setdefault(ep.name, ep.value)
    return dict(REPORTS)


def renderer(kind: str | None):
    """The function that renders a dataset of ``kind``; a one-line error for a kind with no page."""
    from ..engine.study import load_target

    pages = reports()
    if kind not in pages:
        raise UsageError(f"no report page renders datasets of kind {kind!r}; known kinds: {', '.join(sorted(pages))}")
    return load_target(pages[kind])


def report_modules(kind: str) -> tuple[str, ...]:
    """The module that renders ``kind``, for importing it ahead of time (``engine.prefetch``)."""
    return (reports().get(kind, "").partition(":")[0],) if kind in reports() else ()


def document_of(ds: xr.Dataset, metric: str = "rmse") -> tuple[Document, dict]:
    """The report of a run, ablation, audit or validation dataset as a Document, and how
    ``write_document`` lays it out (stem, figure folder, extra files)."""
    from ..engine.dataset import dataset_kind

    kind = dataset_kind(ds)
    _require_results(ds, "case" if kind == "validation" else "variant")
    if kind == "ablation":
        from .ablation import ablation_document

        doc, extra = ablation_document(ds)
        return doc, {"stem": "report", "figure_dir": "", "extra": extra}
    if kind == "audit":
        from .audit import settings_document

        return settings_document(ds), {"stem": "audit", "figure_dir": ""}
    if kind == "validation":
        from .validation import validation_document

        return validation_document(ds), {"stem": "validation", "figure_dir": ""}
    return run_document(ds, metric), {"stem": "report", "figure_dir": "figures"}


def render_document_report(ds: xr.Dataset, out_dir: str | Path, formats=FORMATS, metric: str = "rmse") -> list[Path]:
    formats = _check_formats(formats)
    doc, layout = document_of(ds, metric)
    return write_document(doc, out_dir, formats=formats, **layout)


def run_document(ds: xr.Dataset, metric: str = "rmse") -> Document:
    from ..engine.dataset import summary_table
    from .run import build_document

    if metric not in ds:
        raise UsageError(f"the dataset has no metric {metric!r}")
    _require_results(ds, "variant")
    rows = summary_table(ds, metric)
    return build_document(ds, make_figures(ds, rows, metric), rows, metric)


def render_report(ds: xr.Dataset, out_dir: str | Path, formats=FORMATS, metric: str = "rmse") -> list[Path]:
    """Render the report of ``ds`` (any study's dataset) into ``out_dir`` with the page its kind
    is registered to; return the files written."""
    from ..engine.dataset import dataset_kind

    formats = _check_formats(formats)
    render = renderer(dataset_kind(ds))
    if metric != "rmse":
        return render(ds, out_dir, formats, metric=metric)
    return render(ds, out_dir, formats)


def render_run_report(ds: xr.Dataset, out_dir: str | Path, formats=FORMATS, metric: str = "rmse") -> list[Path]:
    """The report of a run's dataset in ``formats`` and, with Markdown, its ``summary.md``; return the
    files written."""
    from ..engine.files import atomic_write
    from .summary import markdown_summary

    formats = _check_formats(formats)
    doc = run_document(ds, metric)
    written = [atomic_write(Path(out_dir) / "summary.md", markdown_summary(ds))] if "md" in formats else []
    return written + write_document(doc, out_dir, formats=formats, stem="report", figure_dir="figures")


# kind -> "module:function(ds) -> (stdout text, stderr lines)": what a command prints when it is done.
CONSOLE: dict[str, str] = {
    "run": "fa3_numerics.report.summary:console",
    "impact": "fa3_numerics.report.summary:impact_console",
    "backward": "fa3_numerics.report.backward:console",
    "recommend": "fa3_numerics.report.recommend:console",
    "long-context": "fa3_numerics.report.long_context:console",
}


def console_text(ds: xr.Dataset) -> tuple[str, list[str]]:
    """The table a command prints for its dataset, and its warnings; ("", []) for a kind without one."""
    from ..engine.dataset import dataset_kind
    from ..engine.study import load_target

    target = CONSOLE.get(dataset_kind(ds))
    return load_target(target)(ds) if target is not None else ("", [])


def render_combined(datasets: list[tuple[str, xr.Dataset]], out_dir: str | Path, formats=FORMATS,
                    title: str = "") -> list[Path]:
    """Several datasets on one page (``report.html``, ``report.md``, ``figures/``): each
    dataset's report becomes a part, its sections one level down, figures renamed per part."""
    import dataclasses

    formats = _check_formats(formats)
    combined = Document(md_text(title) if title else "Reports of " + ", ".join(md_text(name) for name, _ in datasets))
    for i, (name, ds) in enumerate(datasets, start=1):
        doc, _ = document_of(ds)
        part = Section(f"{md_text(name)}: {doc.title}", list(doc.lead))
        combined.sections.append(part)
        for s in doc.sections:
            blocks = [dataclasses.replace(b, figure=dataclasses.replace(b.figure, name=f"p{i}_{b.figure.name}"))
                      if hasattr(b, "figure") else b for b in s.blocks]
            combined.sections.append(Section(s.title, blocks, level=3))
    return write_document(combined, out_dir, formats=formats, stem="report", figure_dir="figures")


__all__ = ["render_report", "render_document_report", "register_report", "reports", "renderer", "report_modules",
           "REPORTS", "CONSOLE", "console_text", "render_run_report", "render_combined", "document_of", "run_document", "FORMATS",
           "figure_plan", "make_figures"]
