"""`fa3-numerics run ablation`: the factorial ablation, its attribution and its report."""

from __future__ import annotations

import functools
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import typer

from .options import ALLOW_NONFINITE_HELP, examples, experiment_toml, factor_options, parse_list, toml_default, \
    with_options

HELP = {
    "experiment": "experiment definition: a name in experiments/ or a path to a .toml",
    "seqlen": "sequence lengths, comma separated (the seqlen trend needs several)",
    "head_dim": "head dims: 64, 96, 128, 192 or 256; comma separated",
    "causal": "causal masking; 'false,true' sweeps",
    "batch": "batch size (samples)",
    "heads": "heads (samples); K/V have as many",
    "rows": "query rows evaluated per (batch, head), drawn at random (0 = all)",
    "seeds": "seeds, comma separated, integers in [0, 2^32); each is one draw of Q, K, V and of the rotations",
    "designs": "keep only these designs of the experiment (e.g. core,accumulator)",
    "data": "keep only data whose label starts with one of these (e.g. outliers,student-t)",
    "capture": "add a capture file (from `fa3-numerics capture`) as data",
    "capture_layer": "layer of the capture file to use",
    "attribution": "also run the single-stage recipes of the error attribution",
    "workers": "dask worker processes (0 = in this process, as every command's default; N: one per core is "
               "usually best)",
    "scheduler": "address of an existing dask scheduler (tcp://host:8786) instead of a LocalCluster",
    "device": "cpu, cuda or cuda:N",
    "backend": "emulate (default) or another registered backend",
    "out": "output folder: the dataset (ablation.nc), the report (report.html, report.md, figures, CSV tables) "
           "and the cache of finished cells (.cells/), as `run outliers` writes its",
    "report": "another folder for the report (default: --out); '' to skip the report",
    "fresh": "ignore cached cells from an earlier run into the same --out",
}
SOURCE = "experiments/ablation.toml"
EXAMPLES = examples(
    "fa3-numerics run ablation                         # the default design: ~6 minutes on 2 cores",
    "fa3-numerics run ablation --designs core --data outliers --seqlen 1024,4096 --workers 0",
    "fa3-numerics run ablation --p-handling offset8,scale448 --gran head,block --out results/abl",
    "fa3-numerics run ablation --scheduler tcp://HOST:8786   # cells spread over an existing dask cluster",
    "fa3-numerics report results/ablation/ablation.nc --out my-report   # the report again, from the dataset",
)


@functools.lru_cache(maxsize=1)
def _toml() -> dict:
    spec = experiment_toml("ablation")
    return dict(spec.get("shape", {})) | dict(spec.get("run", {}))


def _default(key: str) -> str | bool:
    return toml_default(_toml(), key, SOURCE)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("ablation", epilog=EXAMPLES)
    @with_options(factor_options)
    def ablation(
        experiment: str = typer.Option("ablation", help=HELP["experiment"]),
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"], show_default=_default("seqlen")),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"],
                                               show_default=_default("head_dim")),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"], show_default=_default("causal")),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"], show_default=_default("batch")),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"], show_default=_default("heads")),
        rows: Optional[int] = typer.Option(None, help=HELP["rows"], show_default=_default("rows")),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"], show_default=_default("seeds")),
        designs: Optional[str] = typer.Option(None, help=HELP["designs"], show_default=f"all, from {SOURCE}"),
        data: Optional[str] = typer.Option(None, help=HELP["data"], show_default=f"all, from {SOURCE}"),
        capture: Optional[Path] = typer.Option(None, help=HELP["capture"]),
        capture_layer: int = typer.Option(0, "--layer", "--capture-layer", help=HELP["capture_layer"]),
        attribution: Optional[bool] = typer.Option(None, "--attribution/--no-attribution", help=HELP["attribution"],
                                                   show_default=_default("attribution")),
        workers: int = typer.Option(0, help=HELP["workers"]),
        scheduler: Optional[str] = typer.Option(None, help=HELP["scheduler"]),
        device: str = typer.Option("cpu", help=HELP["device"]),
        backend: str = typer.Option("emulate", help=HELP["backend"]),
        out: str = typer.Option("results/ablation", help=HELP["out"]),
        report: Optional[str] = typer.Option(None, help=HELP["report"], show_default="--out"),
        fresh: bool = typer.Option(False, help=HELP["fresh"]),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        format: str = typer.Option("html,md", "--format", help="report formats: html, md (comma list)"),
        **factor_levels,
    ):
        """Factorial ablation of FP8 attention recipes with error attribution, effects and a report.

        Every registered ablation factor has an option that replaces its levels (the P-handling
        factor is --p-handling: --p is the outlier probability everywhere). Defaults come from
        experiments/ablation.toml. The dataset, report, figures and tables go into --out.
        """
        from ..engine.distributed import check_scheduler
        from ..engine.files import OutputFolder
        from ..errors import require
        from ..studies.ablation import AblationStudy, load_ablation
        from ._study import run_study_command
        from .report import parse_formats

        require(workers >= 0, f"--workers must be >= 0, got {workers}")
        check_scheduler(scheduler)
        strs = lambda t, n: parse_list(t, str, n)  # noqa: E731
        overrides = {
            "seqlen": parse_list(seqlen, int, "seqlen"), "head_dim": parse_list(head_dim, int, "head_dim"),
            "causal": parse_list(causal, bool, "causal"), "seeds": parse_list(seeds, int, "seeds"),
            "batch": batch, "heads": heads, "rows": rows,
            "designs": strs(designs, "designs"), "data": strs(data, "data"),
            "capture": str(capture) if capture else None, "capture_layer": capture_layer if capture else None,
            "attribution": attribution, "device": device, "backend": backend,
        }
        overrides.update({f: strs(v, f) for f, v in factor_levels.items()})
        study = AblationStudy(load_ablation(experiment, overrides))  # every check before a folder is touched
        t0 = time.perf_counter()
        with ExitStack() as stack:
            # --report elsewhere: held as --out is, for the whole command
            other = report not in (None, "") and Path(report).resolve() != Path(out).resolve()
            rep = stack.enter_context(OutputFolder(report, "--report")) if other else None

            def render(ds, path, formats):
                if report == "":
                    return []
                return _report(ds, rep if rep is not None else path, path / f"{study.stem}.nc", t0, formats)

            run_study_command(study, out, fresh=fresh, workers=workers, scheduler=scheduler,
                              allow_nonfinite=allow_nonfinite, render=render, formats=parse_formats(format))


def _report(ds, folder: Path, nc: Path, t0: float, formats=("html", "md")) -> list[Path]:
    """The report of ``ds`` into ``folder``, with the command's wall time in its provenance."""
    from ..report.ablation import ablation_document
    from ..report.document import Bullets, write_document

    doc, extra = ablation_document(ds, dataset_path=nc)
    total = time.perf_counter() - t0
    prov = next(s for s in doc.sections if s.title == "Provenance")
    prov.blocks.append(Bullets([f"wall time of the command: {total:.0f} s ({ds.attrs['wall_seconds']:.0f} s the "
                                "sweep, the rest the analysis and figures)"]))
    return write_document(doc, folder, stem="report", figure_dir="", extra=extra, formats=tuple(formats))
