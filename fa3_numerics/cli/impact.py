"""``fa3-numerics impact``: what an attention recipe does to a real model's predictions; and
``fa3-numerics impact-report IMPACT.nc`` to render a saved study again.

Heavy imports happen inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

HELP = (
    "Run a real model over real text with every attention layer computed by each recipe (through a "
    "backend), and compare its next-token predictions with the same model under float64 attention: "
    "KL (mean, p99, max over tokens), top-1 agreement, perplexity; the model's own SDPA in FP32 and "
    "BF16 for scale; per-layer sensitivity (one layer at a time); the audit's per-layer rel_l2 and its "
    "Spearman correlation with the per-layer KL; decode against an FP8 KV cache; per-layer recipe maps "
    "and, with --budget-kl, the cheapest verified assignment. Writes OUT/impact.nc, OUT/report.md "
    "(+ figures/) and OUT/report.html. Finished passes are kept in OUT/.cells: a rerun resumes. Exit 3 "
    "when any value is non-finite (unless --allow-nonfinite)."
)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("impact", help=HELP, short_help="What a recipe does to a real model's predictions (KL, ppl).")
    def impact_cmd(
        model: str = typer.Option("smollm2", "--model", "-m", help="Local HF model folder, .gguf file, or `smollm2`."),
        text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file. Default: Python's pydoc_data.topics."),
        tokens: int = typer.Option(512, "--tokens", "-n", help="Tokens of the text (the first N)."),
        variants: Optional[str] = typer.Option(
            None, help="Recipes: comma-separated presets, ';' between specs. Default: exact, fa3-fp16, baseline-fp8, "
                       "fa3-fp8, fa3-fp8-kernel, fa3-fp8-kernel-hadamard."),
        backend: str = typer.Option("emulate", help="emulate, fa3 (Hopper), sdpa-* or any registered backend."),
        device: str = typer.Option("cpu", help="cpu or cuda (the model runs there too)."),
        layers: Optional[str] = typer.Option(None, help="Layers of the one-layer-at-a-time sweep, e.g. 0-4,20. "
                                                        "Default: all."),
        sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="Run the per-layer sweep (and the audit)."),
        recipe_map: Optional[List[str]] = typer.Option(
            None, "--recipe-map", help="Per-layer assignment, e.g. '0-1:fa3-fp16;*:fa3-fp8'; repeatable."),
        budget_kl: Optional[float] = typer.Option(None, "--budget-kl", help="Recommend the cheapest per-layer "
                                                  "assignment whose measured KL (see --budget-stat) is <= this, "
                                                  "verified by full runs."),
        budget_stat: str = typer.Option("mean", "--budget-stat", help="KL statistic of the budget: mean, p99, max."),
        budget_runs: int = typer.Option(4, "--budget-runs", help="Most full runs the budget search may verify."),
        decode: str = typer.Option("head,token", help="Decode KV-cache scalings: token, head, tensor (comma list) "
                                                      "or none."),
        baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="Also run the model's own SDPA "
                                       "(float32 and BF16)."),
        audit: bool = typer.Option(True, "--audit/--no-audit", help="Audit the same tokens and correlate."),
        check_prefix: int = typer.Option(2, "--check-prefix", help="Sweep passes re-run in full to check that "
                                         "starting at the layer is bit-identical (0 = none)."),
        sweep_acc: str = typer.Option("auto", "--sweep-acc", help="Accumulator of the per-layer sweep: auto (acc=fp22 "
                                      "recipes run acc=fp32 on a CPU with the emulator: ~40x faster; checked on "
                                      "the --check-prefix layers), given, fp32."),
        seed: int = typer.Option(0, help="Seed of the Hadamard rotations' signs."),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Exit 0 despite non-finite values "
                                             "(they are reported either way)."),
        out: Path = typer.Option(Path("results/impact"), help="Output folder."),
        format: str = typer.Option("html,md", "--format", help="Report formats: html, md (comma list)."),
    ) -> None:
        import time

        from ..cli.report import parse_formats
        from ..engine.dataset import write
        from ..errors import require
        from ..report.impact import render_impact
        from ..studies.impact import impact

        t0 = time.perf_counter()
        formats = parse_formats(format)
        require(str(out).strip() != "", "--out is empty; pass a folder, e.g. --out results/impact")
        require(not out.exists() or out.is_dir(), f"--out {out} is a file; pass a folder")
        written = []

        def write_files(ds) -> None:  # the study still holds --out while its files are written
            written.append(write(ds, out / "impact.nc"))
            written.extend(render_impact(ds, out, formats))

        ds = impact(model=model, text=text, tokens=tokens, variants=variants, backend=backend, device=device,
                    layers=layers, sweep=sweep, recipe_maps=recipe_map or (), budget_kl=budget_kl,
                    budget_stat=budget_stat, budget_runs=budget_runs, decode=decode, baselines=baselines,
                    audit=audit, check_prefix=check_prefix, sweep_acc=sweep_acc, seed=seed, out=out,
                    then=write_files)
        nc, paths = written[0], written[1:]
        _print_summary(ds)
        typer.echo(f"wrote {nc}, " + ", ".join(str(p) for p in paths if p.suffix != ".png")
                   + f" ({time.perf_counter() - t0:.0f} s)")
        bad = int(ds.attrs.get("nonfinite_total", 0))
        if bad:
            typer.echo(f"NON-FINITE: {bad} values (see the report's first section and attrs['nonfinite_where'])",
                       err=True)
            if not allow_nonfinite:
                sys.exit(3)

    @app.command("impact-report", short_help="Render the report of a saved impact study.")
    def impact_report_cmd(
        dataset: Path = typer.Argument(..., help="impact.nc written by `fa3-numerics impact`."),
        out: Optional[Path] = typer.Option(None, help="Output folder (default: the dataset's folder)."),
        format: str = typer.Option("html,md", "--format", help="html, md (comma list)."),
    ) -> None:
        """Render report.md / report.html of a saved impact dataset, as `impact` does."""
        from ..cli.report import parse_formats
        from ..engine.files import OutputFolder
        from ..report.impact import render_impact
        from ..studies.impact_dataset import read_impact

        formats = parse_formats(format)
        folder = OutputFolder(out if out is not None else dataset.parent, "--out")
        ds = read_impact(dataset)
        with folder as target:  # held as every command holds its folder
            for p in render_impact(ds, target, formats):
                typer.echo(f"wrote {p}")


def _print_summary(ds) -> None:
    from ..report.format import fmt_e

    rows = [("variant", "KL mean", "KL p99", "KL max", "top-1", "dppl")]
    for v in ds["variant"].values:
        s = ds.sel(variant=v, mask="all")
        rows.append((str(v), fmt_e(float(s.kl_mean)), fmt_e(float(s.kl_p99)), fmt_e(float(s.kl_max)),
                     f"{100 * float(s.top1_agree):.2f}%", f"{float(s.ppl_delta):+.4f}"))
    if "baseline" in ds.dims:
        for b in ds["baseline"].values:
            s = ds.sel(baseline=b)
            rows.append((str(b), fmt_e(float(s.base_kl_mean)), fmt_e(float(s.base_kl_p99)),
                         fmt_e(float(s.base_kl_max)), f"{100 * float(s.base_top1_agree):.2f}%",
                         f"{float(s.base_ppl_delta):+.4f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    typer.echo(f"every layer, {ds.attrs.get('tokens')} tokens, reference ppl {float(ds.attrs['ref_ppl']):.4f}:")
    for r in rows:
        typer.echo("  " + "  ".join(c.ljust(n) for c, n in zip(r, w)))
    budget = ds.attrs.get("budget", "")
    if budget:
        import json

        b = json.loads(budget)
        best = b.get("best")
        typer.echo(f"budget KL {b['stat']} <= {b['budget']:g}: " + (
            f"{best['label']} (cost {best['cost']}, measured {fmt_e(best['measured'])})" if best else
            "no verified assignment meets it"))
