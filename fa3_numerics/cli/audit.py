"""``fa3-numerics audit FILE``: FP8 attention error per layer x head of a captured model, the
statistics that explain it, a risk ranking and (with ``--budget``) a recipe per layer.

Heavy imports happen inside the command, so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ._registry_cache import cached
from .options import ALLOW_NONFINITE_HELP, examples

HELP = (
    "Audit a capture (from `fa3-numerics capture`): every variant's error against float64 on every "
    "layer x head (causal as the model is, its softmax scale), plus per-channel amax of Q and K (with RoPE "
    "pairs), kurtosis, max/rms, incoherence before and after the Hadamard rotation, attention-sink mass, "
    "the fraction of P~ that underflows in e4m3 and per-block amax at the kernel's tiles. Writes "
    "OUT/audit.nc (xarray) and OUT/audit.md with figures: heatmaps, channel amax, the riskiest heads "
    "and, with --budget, the cheapest recipe per layer that meets it. `fa3-numerics report OUT/audit.nc` renders "
    "the same report again from the dataset."
)
EXAMPLES = examples(
    "fa3-numerics capture --model smollm2 --tokens 2048 --out smollm2.safetensors",
    "fa3-numerics audit smollm2.safetensors --budget 0.03 --out audit/",
    "fa3-numerics audit smollm2.safetensors --layers 0-4,10 --rows 0 --variants 'fa3-fp8;fa3-fp8-kernel'",
    "fa3-numerics report audit/audit.nc --out audit-again/",
)


def _metrics_help(what: str) -> str:
    return f"{what}: {', '.join(_rank_metrics())}"


@cached("fa3_numerics.studies.audit")
def _rank_metrics() -> list[str]:
    from ..studies.audit import rank_metrics

    return list(rank_metrics())


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("audit", help=HELP, short_help="Audit a captured model's attention layers for FP8 error.",
                 epilog=EXAMPLES)
    def audit_cmd(
        file: Path = typer.Argument(..., help="Capture file (.safetensors) from `fa3-numerics capture`."),
        variants: Optional[str] = typer.Option(
            None, help="Presets or recipe specs: comma-separated presets, ';' between specs. Default: "
                       "baseline-fp8, fa3-fp8, fa3-fp8-no-block-quant, fa3-fp8-no-incoherent."),
        backend: str = typer.Option("emulate", help="emulate (default) or another registered backend."),
        budget: Optional[float] = typer.Option(
            None, help="Error budget: recommend per layer the cheapest variant whose error (max over the "
                       "layer's heads) is at most this."),
        budget_metric: str = typer.Option("rmse", "--budget-metric", help=_metrics_help("Metric of --budget")),
        rows: int = typer.Option(256, help="Query rows evaluated per head, a seeded random subset, the same in "
                                            "every layer (0 = all). Rows are independent: exact for those rows."),
        layers: Optional[str] = typer.Option(None, help="Layers to audit, e.g. 0-4,10. Default: all captured."),
        seed: int = typer.Option(0, help="Seed of the row sample and of the Hadamard rotation's signs."),
        rank_by: str = typer.Option("worst", "--rank-by", help="Rank heads by this variant's error, or "
                                    "'worst' (the worst variant per head)."),
        rank_metric: str = typer.Option("rel_l2", "--rank-metric",
                                        help=_metrics_help("Ranking metric (rel_l2 is fair across layers)")),
        top: int = typer.Option(10, help="Rows of the ranking table."),
        device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
        out: str = typer.Option("results/audit", help="Output folder: audit.nc, audit.md, figures."),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        fresh: bool = typer.Option(False, help="Ignore the cells cached by an earlier audit into the same --out."),
        format: str = typer.Option("html,md", "--format", help="Report formats: html, md (comma list)."),
    ) -> None:
        from ..errors import require
        from ..report.audit import audit_document
        from ..report.document import write_document
        from ..studies.audit import AuditStudy, check_recommendations, rank, rank_metrics, recommend
        from ._study import run_study_command

        names = rank_metrics()
        require(top >= 1, f"--top must be >= 1, got {top}")
        require(rank_metric in names, f"--rank-metric must be one of {', '.join(names)}")
        require(budget_metric in names, f"--budget-metric must be one of {', '.join(names)}")
        if budget is not None:
            require(budget > 0 and budget == budget and budget != float("inf"),
                    f"--budget must be a positive number, got {budget}")
        from ..engine.files import OutputFolder

        OutputFolder(out, "--out")  # --out checked before the capture is read
        settings = {"budget": "" if budget is None else budget, "budget_metric": budget_metric, "rank_by": rank_by,
                    "rank_metric": rank_metric, "top": top}
        study = AuditStudy(file, variants=variants, backend=backend, rows=rows, layers=layers, seed=seed,
                           device=device, settings=settings)
        labels = [lab for lab, _ in study.recipes]
        require(rank_by == "worst" or rank_by in labels, f"--rank-by {rank_by!r} is not an audited variant; use "
                f"worst or one of {', '.join(labels)}")

        def render(ds, path, formats):
            return write_document(audit_document(ds, top=top, budget=budget, budget_metric=budget_metric,
                                                 rank_by=rank_by, rank_metric=rank_metric),
                                  path, stem="audit", figure_dir="", formats=tuple(formats))

        def console(ds):
            from ..report.console import table_text

            rows = [[f"#{r['rank']}", r["layer"], r["head"],
                     f"{r['score']:.3g}" if r["score"] == r["score"] else "non-finite", r["worst_variant"],
                     f"{r['sink_mass']:.2f}", f"{r['p_underflow']:.3f}", f"{r['k_hot']} (pair {r['k_hot_pair']})"]
                    for r in rank(ds, by=rank_by, metric=rank_metric, top=min(top, 5))]
            typer.echo(table_text(["rank", "layer", "head", rank_metric, "worst variant", "sink mass", "P~ underflow",
                                   "K hot channel"], rows, [False, True, True, True, False, True, True, False],
                                  title=f"riskiest (layer, head) by {rank_metric} of {rank_by}:"))
            if budget is not None:
                rec = recommend(ds, budget, metric=budget_metric)
                typer.echo(f"budget {budget_metric} <= {budget:g}: " + ", ".join(
                    f"L{r['layer']}={r['recommended'] or 'none'}" for r in rec["layers"]))
                typer.echo(f"whole model: {rec['overall'] or 'no single audited variant meets it everywhere'}")
                problems = check_recommendations(ds, rec)
                if problems:
                    typer.echo("recommendation check failed: " + "; ".join(problems), err=True)

        from .report import parse_formats

        run_study_command(study, out, allow_nonfinite=allow_nonfinite, render=render, console=console, fresh=fresh,
                          formats=parse_formats(format))
