"""`fa3-numerics run ablation`: the factorial ablation, its attribution and its report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from .run import parse_list

HELP = {
    "experiment": "experiment definition: a name in experiments/ or a path to a .toml",
    "seqlen": "sequence lengths, comma separated (the seqlen trend needs several)",
    "head_dim": "head dims: 64, 96, 128, 192 or 256; comma separated",
    "causal": "causal masking; 'false,true' sweeps",
    "batch": "batch size (samples)",
    "heads": "heads (samples); K/V have as many",
    "rows": "query rows evaluated per (batch, head), drawn at random (0 = all)",
    "seeds": "seeds, comma separated; each is one draw of Q, K, V and of the rotations",
    "gran": "scale granularity levels (tensor, head, block, blockN, token) for designs that vary it",
    "rot": "rotation levels (none, hadamard, orthogonal) for designs that vary it",
    "p": "P handling levels (offset8, no-offset, scale448) for designs that vary it",
    "acc": "accumulator levels (fp32, fp22, two-level) for designs that vary it",
    "fmt": "format levels (e4m3, v-e5m2, p-e5m2, vp-e5m2) for designs that vary it",
    "designs": "keep only these designs of the experiment (e.g. core,accumulator)",
    "data": "keep only data whose label starts with one of these (e.g. outliers,student-t)",
    "capture": "add a capture file (from `fa3-numerics capture`) as data",
    "capture_layer": "layer of the capture file to use",
    "attribution": "also run the single-stage recipes of the error attribution",
    "workers": "dask worker processes (default: one per CPU core, or per GPU); 0 = in this process",
    "scheduler": "address of an existing dask scheduler (tcp://host:8786) instead of a LocalCluster",
    "device": "cpu or cuda",
    "backend": "emulate (default) or another registered backend",
    "out": "folder for the dataset (ablation.nc) and the cache of finished cells (.cells/)",
    "report": "folder for the report (report.md, figures, tables); '' to skip the report",
    "fresh": "ignore cached cells from an earlier run into the same --out",
}


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("ablation")
    def ablation(
        experiment: str = typer.Option("ablation", help=HELP["experiment"]),
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"]),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"]),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"]),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"]),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"]),
        rows: Optional[int] = typer.Option(None, help=HELP["rows"]),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"]),
        gran: Optional[str] = typer.Option(None, help=HELP["gran"]),
        rot: Optional[str] = typer.Option(None, help=HELP["rot"]),
        p: Optional[str] = typer.Option(None, "--p", help=HELP["p"]),
        acc: Optional[str] = typer.Option(None, help=HELP["acc"]),
        fmt: Optional[str] = typer.Option(None, help=HELP["fmt"]),
        designs: Optional[str] = typer.Option(None, help=HELP["designs"]),
        data: Optional[str] = typer.Option(None, help=HELP["data"]),
        capture: Optional[Path] = typer.Option(None, help=HELP["capture"]),
        capture_layer: int = typer.Option(0, "--capture-layer", help=HELP["capture_layer"]),
        attribution: Optional[bool] = typer.Option(None, "--attribution/--no-attribution", help=HELP["attribution"]),
        workers: Optional[int] = typer.Option(None, help=HELP["workers"], show_default="one per core"),
        scheduler: Optional[str] = typer.Option(None, help=HELP["scheduler"]),
        device: str = typer.Option("cpu", help=HELP["device"]),
        backend: str = typer.Option("emulate", help=HELP["backend"]),
        out: Path = typer.Option(Path("results/ablation"), help=HELP["out"]),
        report: str = typer.Option("reports/ablation", help=HELP["report"]),
        fresh: bool = typer.Option(False, help=HELP["fresh"]),
    ):
        """Factorial ablation of FP8 attention recipes with error attribution, effects and a report."""
        from ..studies.ablation import load_ablation, run_ablation
        from ..engine.dataset import write
        from ..errors import require

        strs = lambda t, n: parse_list(t, str, n)  # noqa: E731
        require(workers is None or workers >= 0, f"--workers must be >= 0, got {workers}")
        overrides = {
            "seqlen": parse_list(seqlen, int, "seqlen"), "head_dim": parse_list(head_dim, int, "head_dim"),
            "causal": parse_list(causal, bool, "causal"), "seeds": parse_list(seeds, int, "seeds"),
            "batch": batch, "heads": heads, "rows": rows, "gran": strs(gran, "gran"), "rot": strs(rot, "rot"),
            "p": strs(p, "p"), "acc": strs(acc, "acc"), "fmt": strs(fmt, "fmt"),
            "designs": strs(designs, "designs"), "data": strs(data, "data"),
            "capture": str(capture) if capture else None, "capture_layer": capture_layer if capture else None,
            "attribution": attribution, "device": device, "backend": backend,
        }
        ab = load_ablation(experiment, overrides)
        cache = out / ".cells"
        if fresh and cache.is_dir():
            for f in cache.glob("*.npz"):
                f.unlink()
        t0 = time.perf_counter()
        ds = run_ablation(ab, cache_dir=cache, workers=workers, scheduler=scheduler)
        path = write(ds, out / f"{ab.name}.nc")
        typer.echo(f"wrote {path} ({ds.attrs['wall_seconds']} s for the sweep)", err=True)
        if report:
            from ..studies.analysis import render_report

            md = render_report(ds, Path(report), dataset_path=path)
            total = time.perf_counter() - t0
            with open(md, "a") as f:
                f.write(f"\nWall time of the command: {total:.0f} s ({ds.attrs['wall_seconds']:.0f} s the sweep, "
                        f"the rest the analysis and figures).\n")
            typer.echo(f"wrote {md}", err=True)
        typer.echo(f"total {time.perf_counter() - t0:.1f} s", err=True)
