"""`fa3-numerics report DATASET...` and `fa3-numerics compare A.nc B.nc`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import UsageError
from ._registry_cache import cached
from .options import ALLOW_NONFINITE_HELP, JSON_HELP, examples, finish, json_text, wrote

REPORT_EXAMPLES = examples(
    "fa3-numerics report results/outliers/outliers.nc --out my-report",
    "fa3-numerics report results/ablation/ablation.nc --format html",
    "fa3-numerics report audit/audit.nc                 # the audit report, with the audit's budget and ranking",
    "fa3-numerics report reports/h200/table3_hardware.nc reports/h200/validation.nc --out h200-html   # one page",
)
COMPARE_EXAMPLES = examples(
    "fa3-numerics compare cpu/outliers.nc gpu/outliers.nc",
    "fa3-numerics compare reports/outliers/default/outliers.nc reports/h200/table3_hardware.nc   # emulator vs FA3",
    "fa3-numerics compare main.nc branch.nc --fail-above 1.05      # CI: exit 1 when B is surely >5% worse anywhere",
    "fa3-numerics compare main.nc branch.nc --fail-above 1.05 --gate point   # ... when B's estimate is >5% worse",
    "fa3-numerics compare s1024.nc s2048.nc --allow-different-settings   # compare across a setting on purpose",
    "fa3-numerics compare a.nc b.nc --fail-if-not-covered --out cmp.html",
    "fa3-numerics compare main.nc branch.nc --fail-above 1.05 --json > cmp.json   # rows, warnings, gate for a CI",
)


def parse_formats(text: str) -> tuple[str, ...]:
    from ..report import FORMATS

    parts = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not parts:
        raise UsageError(f"--format got an empty list; give one or more of {', '.join(FORMATS)}")
    bad = [p for p in parts if p not in FORMATS]
    if bad:
        raise UsageError(f"--format {', '.join(bad)} is not supported; choose from {', '.join(FORMATS)}")
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        raise UsageError(f"--format lists {twice[0]} twice; give each format once")
    return tuple(parts)


@cached("fa3_numerics.numerics.metrics")
def _metric_help() -> str:
    from ..numerics.metrics import metrics

    return f"metric to compare: {', '.join(metrics())}"


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("report", epilog=REPORT_EXAMPLES)
    def report(
        datasets: List[Path] = typer.Argument(..., metavar="DATASET...",
                                              help="datasets (.nc) written by any study (`run`, `impact`, "
                                                   "`recommend`, `audit`, `validate`, ...); several go on one page"),
        out: Optional[str] = typer.Option(None, help="output folder", show_default="the first dataset's folder"),
        format: str = typer.Option("html,md", "--format", help="comma list of html (self-contained page) and md "
                                                                "(Markdown with the figures as PNG and SVG files)"),
    ):
        """Render the report of a saved dataset of any study, as the command that made it does (the page is chosen by the dataset's kind)."""
        from ..engine.dataset import read
        from ..engine.files import OutputFolder
        from ..report import render_combined, render_report

        formats = parse_formats(format)
        folder = OutputFolder(out if out is not None else str(datasets[0].parent), "--out")
        loaded = [(p, read(p, kinds=None)) for p in datasets]
        with folder as path:
            if len(loaded) == 1:
                paths = render_report(loaded[0][1], path, formats)
            else:
                paths = render_combined([(p.name, ds) for p, ds in loaded], path, formats)
        typer.echo(wrote(paths))

    @app.command("compare", epilog=COMPARE_EXAMPLES)
    def compare_cmd(
        a: Path = typer.Argument(..., metavar="A.nc", help="first dataset (the reference, A)"),
        b: Path = typer.Argument(..., metavar="B.nc", help="second dataset (B); ratios are B / A"),
        metric: str = typer.Option("rmse", help=_metric_help()),
        out: Optional[str] = typer.Option(None, help="also write the comparison to this file: Markdown, or a "
                                                     "self-contained page when it ends in .html"),
        fail_above: Optional[float] = typer.Option(
            None, "--fail-above", metavar="RATIO",
            help="exit 1 when B/A of an error metric exceeds RATIO (e.g. 1.05: B may be at most 5% worse) by the "
                 "--gate rule; an infinite B/A always fails"),
        gate_rule: str = typer.Option(
            "interval", "--gate", metavar="interval|point",
            help="--fail-above rule: interval fails a row when the whole 95% interval of B/A lies above RATIO "
                 "(two runs of the same code on different seeds pass); point when the point estimate does"),
        fail_if_not_covered: bool = typer.Option(
            False, "--fail-if-not-covered",
            help="exit 1 when any ratio's 95% interval excludes 1 (the runs differ beyond sampling noise)"),
        allow_different: bool = typer.Option(
            False, "--allow-different-settings",
            help="compare runs whose settings differ (seqlen 1024 against 2048, another distribution, sweep cells "
                 "only one run has): a warning at the top instead of an error"),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        json_out: bool = typer.Option(False, "--json", help=JSON_HELP + "; exit codes as without it"),
    ):
        """The same variants of two runs side by side, with ratios B/A and whether their intervals cover 1.

        Hardware variants named BACKEND:VARIANT (fa3:..., triton:..., sdpa-math:...) are matched to
        the variant that runs the same recipe. Runs whose settings differ are refused unless
        --allow-different-settings (then a warning at the top names every difference).
        Exit codes: 0 passed, 1 a --fail-above / --fail-if-not-covered gate failed, 2 bad input,
        3 non-finite results.
        """
        from ..engine.dataset import read
        from ..engine.files import atomic_write, output_file
        from ..errors import require
        from ..report.compare import html_report, markdown_report, text_report, warnings
        from ..studies.compare import GATE_RULES, compare, findings, gate

        require(gate_rule in GATE_RULES, f"--gate must be {' or '.join(GATE_RULES)}, got {gate_rule!r}")
        if fail_above is not None:
            require(fail_above > 0 and fail_above == fail_above, f"--fail-above must be a positive ratio, got {fail_above}")
        dest = output_file(out) if out is not None else None
        da, db = read(a, ("run", "ablation", "audit")), read(b, ("run", "ablation", "audit"))
        res = compare(da, db, metric, allow_different=allow_different)
        if a.resolve() == b.resolve():
            typer.echo(f"warning: A and B are the same file ({a}): every ratio is 1 by construction", err=True)
        failed = gate(res, fail_above=fail_above, fail_if_not_covered=fail_if_not_covered, rule=gate_rule)
        if dest is not None:
            render = html_report if dest.suffix.lower() in (".html", ".htm") else markdown_report
            atomic_write(dest, render(res, da, db, str(a), str(b)))
        if json_out:
            typer.echo(json_text({
                "a": str(a), "b": str(b), **res, "warnings": warnings(res), "findings": findings(res),
                "gate": {"fail_above": fail_above, "rule": gate_rule, "fail_if_not_covered": fail_if_not_covered,
                         "failed": failed},
                "written": [str(dest)] if dest is not None else []}))
        else:
            typer.echo(text_report(res, da, db, str(a), str(b)))
            if dest is not None:
                typer.echo("\n" + wrote([dest]))
        for line in failed:
            typer.echo(f"FAILED: {line}", err=True)
        finish(findings(res), allow_nonfinite, lambda m: typer.echo(m, err=True))
        if failed:
            gates = ([f"--fail-above {fail_above:g} (--gate {gate_rule})"] if fail_above is not None else []) + \
                (["--fail-if-not-covered"] if fail_if_not_covered else [])
            typer.echo(f"error: {len(failed)} comparison(s) failed the gate {' and '.join(gates)}", err=True)
            raise typer.Exit(1)
