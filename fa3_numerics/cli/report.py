"""`fa3-numerics report DATASET` and `fa3-numerics compare A.nc B.nc`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from .options import ALLOW_NONFINITE_HELP, finish


def parse_formats(text: str) -> tuple[str, ...]:
    from ..report import FORMATS

    parts = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not parts:
        raise UsageError(f"--format got an empty list; give one or more of {', '.join(FORMATS)}")
    bad = [p for p in parts if p not in FORMATS]
    if bad:
        raise UsageError(f"--format {', '.join(bad)} is not supported; choose from {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(parts))


def _metric_help() -> str:
    from ..numerics.metrics import metrics

    return f"metric to compare: {', '.join(metrics())}"


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("report")
    def report(
        dataset: Path = typer.Argument(..., help="a dataset (.nc) written by `fa3-numerics run`, `audit` or `validate`"),
        out: Optional[str] = typer.Option(None, help="output folder (default: the dataset's folder)"),
        format: str = typer.Option("html,md", "--format", help="for runs: comma list of html (self-contained) and "
                                                                "md (report.md + figures/*.png)"),
    ):
        """Render the report of a saved dataset (run, ablation, audit or validation), as the command that made it does."""
        from ..engine.dataset import read
        from ..engine.files import OutputFolder
        from ..report import render_report

        formats = parse_formats(format)
        folder = OutputFolder(out if out is not None else str(dataset.parent), "--out")
        ds = read(dataset)
        with folder as path:
            paths = render_report(ds, path, formats)
        for p in paths:
            typer.echo(f"wrote {p}")

    @app.command("compare")
    def compare_cmd(
        a: Path = typer.Argument(..., metavar="A.nc", help="first dataset (the reference, A)"),
        b: Path = typer.Argument(..., metavar="B.nc", help="second dataset (B); ratios are B / A"),
        metric: str = typer.Option("rmse", help=_metric_help()),
        out: Optional[str] = typer.Option(None, help="also write the comparison as Markdown to this file"),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
    ):
        """The same variants of two runs side by side, with ratios B/A and whether their intervals cover 1."""
        from ..engine.dataset import read
        from ..engine.files import atomic_write, output_file
        from ..report.compare import markdown_report, text_report
        from ..studies.compare import compare, findings

        dest = output_file(out) if out is not None else None
        da, db = read(a, ("run", "ablation", "audit")), read(b, ("run", "ablation", "audit"))
        res = compare(da, db, metric)
        typer.echo(text_report(res, da, db, str(a), str(b)))
        if dest is not None:
            atomic_write(dest, markdown_report(res, da, db, str(a), str(b)))
            typer.echo(f"\nwrote {dest}")
        finish(findings(res), allow_nonfinite, lambda m: typer.echo(m, err=True))
