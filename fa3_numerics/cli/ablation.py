"""`fa3-numerics run ablation`: the factorial ablation, its attribution and its report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from .options import ALLOW_NONFINITE_HELP, factor_options, finish, parse_list, with_options

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
    "workers": "dask worker processes (default: one per CPU core, or per GPU); 0 = in this process",
    "scheduler": "address of an existing dask scheduler (tcp://host:8786) instead of a LocalCluster",
    "device": "cpu, cuda or cuda:N",
    "backend": "emulate (default) or another registered backend",
    "out": "folder for the dataset (ablation.nc) and the cache of finished cells (.cells/)",
    "report": "folder for the report (report.md, figures, tables); '' to skip the report",
    "fresh": "ignore cached cells from an earlier run into the same --out",
}


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("ablation")
    @with_options(factor_options)
    def ablation(
        experiment: str = typer.Option("ablation", help=HELP["experiment"]),
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"]),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"]),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"]),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"]),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"]),
        rows: Optional[int] = typer.Option(None, help=HELP["rows"]),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"]),
        designs: Optional[str] = typer.Option(None, help=HELP["designs"]),
        data: Optional[str] = typer.Option(None, help=HELP["data"]),
        capture: Optional[Path] = typer.Option(None, help=HELP["capture"]),
        capture_layer: int = typer.Option(0, "--capture-layer", help=HELP["capture_layer"]),
        attribution: Optional[bool] = typer.Option(None, "--attribution/--no-attribution", help=HELP["attribution"]),
        workers: Optional[int] = typer.Option(None, help=HELP["workers"], show_default="one per core"),
        scheduler: Optional[str] = typer.Option(None, help=HELP["scheduler"]),
        device: str = typer.Option("cpu", help=HELP["device"]),
        backend: str = typer.Option("emulate", help=HELP["backend"]),
        out: str = typer.Option("results/ablation", help=HELP["out"]),
        report: str = typer.Option("reports/ablation", help=HELP["report"]),
        fresh: bool = typer.Option(False, help=HELP["fresh"]),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        **factor_levels,
    ):
        """Factorial ablation of FP8 attention recipes with error attribution, effects and a report.

        Every registered ablation factor has an option that replaces its levels.
        """
        from contextlib import ExitStack

        from ..engine.dataset import write
        from ..engine.distributed import check_scheduler
        from ..engine.files import OutputFolder, atomic_write
        from ..engine.nonfinite import scan
        from ..errors import require
        from ..studies.ablation import load_ablation, run_ablation

        require(workers is None or workers >= 0, f"--workers must be >= 0, got {workers}")
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
        ab = load_ablation(experiment, overrides)
        with ExitStack() as stack:
            path = stack.enter_context(OutputFolder(out, "--out"))
            rep = stack.enter_context(OutputFolder(report, "--report")) if report and \
                Path(report).resolve() != path.resolve() else (path if report else None)
            cache = path / ".cells"
            if fresh and cache.is_dir():
                for f in cache.glob("*.npz"):
                    f.unlink()
            t0 = time.perf_counter()
            ds = run_ablation(ab, cache_dir=cache, workers=workers, scheduler=scheduler)
            findings = scan(ds)
            nc = write(ds, path / f"{ab.name}.nc")
            typer.echo(f"wrote {nc} ({ds.attrs['wall_seconds']} s for the sweep)", err=True)
            if rep is not None:
                from ..report.ablation import render_report

                md = render_report(ds, rep, dataset_path=nc)
                total = time.perf_counter() - t0
                atomic_write(md, md.read_text() + f"\nWall time of the command: {total:.0f} s "
                             f"({ds.attrs['wall_seconds']:.0f} s the sweep, the rest the analysis and figures).\n")
                typer.echo(f"wrote {md}", err=True)
            typer.echo(f"total {time.perf_counter() - t0:.1f} s", err=True)
        finish(findings, allow_nonfinite, lambda m: typer.echo(m, err=True))
