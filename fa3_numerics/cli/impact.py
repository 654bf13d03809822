"""``fa3-numerics impact``: what an attention recipe does to a real model's predictions
(``fa3-numerics report IMPACT.nc`` renders a saved study again).

Heavy imports happen inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

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
        device_map: Optional[str] = typer.Option(
            None, "--device-map", help="Spread the model's layers over GPUs: auto (equal runs over the visible "
                                       "GPUs) or e.g. 0-14:cuda:0,15-29:cuda:1; each layer's attention runs on "
                                       "its GPU."),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Exit 0 despite non-finite values "
                                             "(they are reported either way)."),
        out: Path = typer.Option(Path("results/impact"), help="Output folder."),
        format: str = typer.Option("html,md", "--format", help="Report formats: html, md (comma list)."),
        fresh: bool = typer.Option(False, help="Ignore the passes cached by an earlier run into the same --out."),
    ) -> None:
        from ..studies.impact import ImpactStudy
        from ._study import run_study_command
        from .report import parse_formats

        formats = parse_formats(format)
        study = ImpactStudy(model=model, text=text, tokens=tokens, variants=variants, backend=backend, device=device,
                            layers=layers, sweep=sweep, recipe_maps=recipe_map or (), budget_kl=budget_kl,
                            budget_stat=budget_stat, budget_runs=budget_runs, decode=decode, baselines=baselines,
                            audit=audit, check_prefix=check_prefix, sweep_acc=sweep_acc, seed=seed, device_map=device_map)
        run_study_command(study, out, formats=formats, fresh=fresh, allow_nonfinite=allow_nonfinite)


