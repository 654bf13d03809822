"""Reports of a run's dataset: figures (seaborn), self-contained HTML and Markdown.

Exposed: ``render_report``, ``FORMATS``, ``figure_plan``, ``make_figures``.

``render_report(ds, out_dir)`` writes ``report.html`` (figures embedded as data URIs, no
external assets) and ``report.md`` with ``figures/*.png`` beside it. `fa3-numerics run`
calls it after writing the dataset and `fa3-numerics report DATASET` calls it on a saved
dataset; the output depends only on the dataset, so both give the same files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import xarray as xr

from ..errors import UsageError
from .figures import figure_plan, make_figures

FORMATS = ("html", "md")


def render_report(ds: xr.Dataset, out_dir: str | Path, formats=FORMATS, metric: str = "rmse") -> list[Path]:
    """Render the report of ``ds`` into ``out_dir`` in ``formats``; return the files written."""
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


def _write(path: Path, data: bytes) -> Path:
    """Write ``path`` whole or not at all (temp file in the same folder + rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


__all__ = ["render_report", "FORMATS", "figure_plan", "make_figures"]
