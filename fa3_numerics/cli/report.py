"""`fa3-numerics report DATASET` and `fa3-numerics compare A.nc B.nc`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError


def parse_formats(text: str) -> tuple[str, ...]:
    from ..report import FORMATS

    parts = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not parts:
        raise UsageError(f"--format got an empty list; give one or more of {', '.join(FORMATS)}")
    bad = [p for p in parts if p not in FORMATS]
    if bad:
        raise UsageError(f"--format {', '.join(bad)} is not supported; choose from {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(parts))


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("report")
    def report(
        dataset: Path = typer.Argument(..., help="a dataset (.nc) written by `fa3-numerics run`"),
        out: Optional[Path] = typer.Option(None, help="output folder (default: the dataset's folder)"),
        format: str = typer.Option("html,md", "--format", help="comma list of html (self-contained) and md "
                                                                "(report.md + figures/*.png)"),
    ):
        """Render the report (figures, table, provenance) of a saved dataset, as `run` does."""
        from ..engine.dataset import read
        from ..report import render_report

        formats = parse_formats(format)
        ds = read(dataset)
        paths = render_report(ds, out if out is not None else dataset.parent, formats)
        for p in paths:
            typer.echo(f"wrote {p}")

    @app.command("compare")
    def compare_cmd(
        a: Path = typer.Argument(..., metavar="A.nc", help="first dataset (the reference, A)"),
        b: Path = typer.Argument(..., metavar="B.nc", help="second dataset (B); ratios are B / A"),
        metric: str = typer.Option("rmse", help="metric to compare: rmse, rel_l2, rel_l1, max_abs, cosine, sqnr_db"),
        out: Optional[Path] = typer.Option(None, help="also write the comparison as Markdown to this file"),
    ):
        """The same variants of two runs side by side, with ratios B/A and whether their intervals cover 1."""
        from ..studies.compare import compare, markdown_report, text_report
        from ..engine.dataset import read

        da, db = read(a), read(b)
        res = compare(da, db, metric)
        typer.echo(text_report(res, da, db, str(a), str(b)))
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(markdown_report(res, da, db, str(a), str(b)))
            os.replace(tmp, out)
            typer.echo(f"\nwrote {out}")
