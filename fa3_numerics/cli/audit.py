"""``fa3-numerics audit FILE``: FP8 attention error per layer x head of a captured model, the
statistics that explain it, a risk ranking and (with ``--budget``) a recipe per layer.

Heavy imports happen inside the command, so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = (
    "Audit a capture (from `fa3-numerics capture`): every variant's error against float64 on every "
    "layer x head (causal as the model is, its softmax scale), plus per-channel amax of Q and K (with RoPE "
    "pairs), kurtosis, max/rms, incoherence before and after the Hadamard rotation, attention-sink mass, "
    "the fraction of P~ that underflows in e4m3 and per-block amax at the kernel's tiles. Writes "
    "OUT/audit.nc (xarray) and OUT/audit.md with figures: heatmaps, channel amax, the riskiest heads "
    "and, with --budget, the cheapest recipe per layer that meets it."
)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("audit", help=HELP, short_help="Audit a captured model's attention layers for FP8 error.")
    def audit_cmd(
        file: Path = typer.Argument(..., help="Capture file (.safetensors) from `fa3-numerics capture`."),
        variants: Optional[str] = typer.Option(
            None, help="Presets or recipe specs: comma-separated presets, ';' between specs. Default: "
                       "baseline-fp8, fa3-fp8, fa3-fp8-no-block-quant, fa3-fp8-no-incoherent."),
        backend: str = typer.Option("emulate", help="emulate (default) or another registered backend."),
        budget: Optional[float] = typer.Option(
            None, help="Error budget: recommend per layer the cheapest variant whose error (max over the "
                       "layer's heads) is at most this."),
        budget_metric: str = typer.Option("rmse", "--budget-metric", help="Metric of --budget: rmse, rel_l2, "
                                          "rel_l1 or max_abs."),
        rows: int = typer.Option(256, help="Query rows evaluated per head, a seeded random subset, the same in "
                                            "every layer (0 = all). Rows are independent: exact for those rows."),
        layers: Optional[str] = typer.Option(None, help="Layers to audit, e.g. 0-4,10. Default: all captured."),
        seed: int = typer.Option(0, help="Seed of the row sample and of the Hadamard rotation's signs."),
        rank_by: str = typer.Option("worst", "--rank-by", help="Rank heads by this variant's error, or "
                                    "'worst' (the worst variant per head)."),
        rank_metric: str = typer.Option("rel_l2", "--rank-metric", help="Ranking metric: rel_l2 (default; "
                                        "fair across layers), rmse, rel_l1, max_abs."),
        top: int = typer.Option(10, help="Rows of the ranking table."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        out: Path = typer.Option(Path("results/audit"), help="Output folder: audit.nc, audit.md, figures."),
    ) -> None:
        import time

        from ..studies.audit import DEFAULT_VARIANTS, RANK_METRICS, audit, check_recommendations, rank, recommend
        from ..errors import require

        require(top >= 1, f"--top must be >= 1, got {top}")
        require(rank_metric in RANK_METRICS, f"--rank-metric must be one of {', '.join(RANK_METRICS)}")
        require(budget_metric in RANK_METRICS, f"--budget-metric must be one of {', '.join(RANK_METRICS)}")
        if budget is not None:
            require(budget > 0 and budget == budget and budget != float("inf"),
                    f"--budget must be a positive number, got {budget}")
        require(not out.exists() or out.is_dir(), f"--out {out} is a file; pass a folder")
        t0 = time.perf_counter()
        from ..data.capture import load_capture

        cap = load_capture(file)
        labels = None
        if rank_by != "worst":
            from ..numerics.recipe import parse_recipes

            labels = [lab for lab, _ in parse_recipes(variants or ",".join(DEFAULT_VARIANTS))]
            require(rank_by in labels, f"--rank-by {rank_by!r} is not an audited variant; use worst or one of "
                    f"{', '.join(labels)}")
        ds = audit(cap, variants=variants, backend=backend, rows=rows, layers=layers, seed=seed, device=device)
        ds.attrs.update({"budget": "" if budget is None else budget, "budget_metric": budget_metric,
                         "rank_by": rank_by, "rank_metric": rank_metric})
        from ..report.audit_report import write_report
        from ..engine.dataset import write

        out.mkdir(parents=True, exist_ok=True)
        nc = write(ds, out / "audit.nc")
        md = write_report(ds, out, top=top, budget=budget, budget_metric=budget_metric, rank_by=rank_by,
                          rank_metric=rank_metric)
        typer.echo(f"riskiest (layer, head) by {rank_metric} of {rank_by}:")
        for r in rank(ds, by=rank_by, metric=rank_metric, top=min(top, 5)):
            typer.echo(f"  #{r['rank']} layer {r['layer']} head {r['head']}: {rank_metric} {r['score']:.3g} "
                       f"(worst {r['worst_variant']}); sink {r['sink_mass']:.2f}, P~ underflow "
                       f"{r['p_underflow']:.3f}, K hot channel {r['k_hot']} (pair {r['k_hot_pair']})")
        if budget is not None:
            rec = recommend(ds, budget, metric=budget_metric)
            typer.echo(f"budget {budget_metric} <= {budget:g}: " + ", ".join(
                f"L{r['layer']}={r['recommended'] or 'none'}" for r in rec["layers"]))
            typer.echo(f"whole model: {rec['overall'] or 'no single audited variant meets it everywhere'}")
            problems = check_recommendations(ds, rec)
            if problems:
                typer.echo("recommendation check failed: " + "; ".join(problems), err=True)
        typer.echo(f"wrote {nc} and {md} ({time.perf_counter() - t0:.1f} s)")
