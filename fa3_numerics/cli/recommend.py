"""``fa3-numerics recommend``: pick, explain and verify the attention recipe for a model and a target
(``fa3-numerics report RECOMMEND.nc`` renders a saved study again).

Exit codes: 0 a verified recipe meets the budget; 2 bad input (one line); 3 non-finite results;
4 no verified candidate meets the budget (the closest is named; every file is still written).
Heavy imports happen inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ._registry_cache import cached
from .options import examples

HELP = (
    "Screen every candidate of the target (the field's remedies included) per layer on the model's own Q, K, V, "
    "predict the model-level KL from per-layer gains, verify the best candidates and the cheapest per-layer mix "
    "with full end-to-end runs, and recommend the cheapest measured one that meets the budget (default: 10x the "
    "KL of the model's own BF16 SDPA on the same text). Scales a target calibrates are fitted on one half of the "
    "text and verified on the other. Writes OUT/recommend.nc, OUT/recommend.json (the choice per layer and what "
    "the target takes), OUT/report.md and OUT/report.html. Exit 4 when no verified candidate meets the budget, "
    "3 when a result is non-finite, 2 on bad input."
)

EXAMPLES = examples(
    "fa3-numerics recommend --model smollm2 --out results/recommend",
    "fa3-numerics recommend --model smollm2 --target vllm --budget-kl 0.01 --out results/recommend-vllm",
    "fa3-numerics recommend -m model.gguf --target any --add 'fa3-fp8-kernel,smooth=k' --drop fa3-bf16 --out r/",
    "fa3-numerics report results/recommend/recommend.nc --out again/",
)


@cached("fa3_numerics.studies.recommend_targets")
def _targets() -> list[str]:
    from ..studies.recommend_targets import target_names

    return list(target_names())


def register(app: typer.Typer, run_app: typer.Typer) -> None:

    @app.command("recommend", help=HELP, short_help="Pick, explain and verify the recipe for a model and a target.",
                 epilog=EXAMPLES)
    def recommend_cmd(
        model: str = typer.Option("smollm2", "--model", "-m", help="Local HF model folder, .gguf file, or `smollm2`."),
        target: str = typer.Option("fa3", "--target", "-t", help="What you deploy on: " + ", ".join(_targets())),
        add: Optional[List[str]] = typer.Option(None, "--add", help="Add a candidate (preset or spec); repeatable."),
        drop: Optional[List[str]] = typer.Option(None, "--drop", help="Remove a candidate by name; repeatable."),
        text: Optional[Path] = typer.Option(None, "--text", help="Held-out text (with --calib-text); default: the two "
                                            "halves of Python's pydoc_data.topics."),
        calib_text: Optional[Path] = typer.Option(None, "--calib-text", help="Calibration text for static scales."),
        tokens: int = typer.Option(256, "--tokens", "-n", help="Tokens of each text."),
        budget_kl: Optional[float] = typer.Option(None, "--budget-kl", help="Absolute budget on the KL mean."),
        budget_ppl: Optional[float] = typer.Option(None, "--budget-ppl", help="Budget on |ppl change|."),
        budget_top1: Optional[float] = typer.Option(None, "--budget-top1", help="Least top-1 agreement (0-1)."),
        budget_factor: float = typer.Option(10.0, "--budget-factor", help="Default budget: this x BF16 SDPA's KL."),
        verify: int = typer.Option(3, "--verify", help="Uniform candidates verified end to end."),
        mix_runs: int = typer.Option(2, "--mix-runs", help="Full runs of the per-layer mix search (0 = none)."),
        backend: str = typer.Option("emulate", help="emulate or another registered backend."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        seed: int = typer.Option(0, help="Seed of the Hadamard rotations' signs."),
        device_map: Optional[str] = typer.Option(
            None, "--device-map", help="Spread the model's layers over GPUs: auto (equal runs over the visible "
                                       "GPUs) or e.g. 0-14:cuda:0,15-29:cuda:1; each layer's attention runs on "
                                       "its GPU."),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Exit 0 despite non-finite values."),
        out: Path = typer.Option(Path("results/recommend"), help="Output folder."),
        format: str = typer.Option("html,md", "--format", help="Report formats: html, md (comma list)."),
        fresh: bool = typer.Option(False, help="Start over in an --out an earlier run used (nothing is cached "
                                               "yet: accepted for the same options on every study)."),
    ) -> None:
        from ..studies.recommend import RecommendStudy
        from ._study import run_study_command

        study = RecommendStudy(model=model, text=text, calib_text=calib_text, tokens=tokens, target=target,
                               add=add or (), drop=drop or (), budget_kl=budget_kl, budget_ppl=budget_ppl,
                               budget_top1=budget_top1, budget_factor=budget_factor, verify=verify,
                               mix_runs=mix_runs, backend=backend, device=device, seed=seed, device_map=device_map)
        from .report import parse_formats

        run_study_command(study, out, fresh=fresh, allow_nonfinite=allow_nonfinite, formats=parse_formats(format))
