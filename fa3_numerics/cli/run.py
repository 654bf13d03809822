"""`fa3-numerics run outliers` and `fa3-numerics variants`."""

from __future__ import annotations

from typing import Optional

import typer

from .options import ALLOW_NONFINITE_HELP, dist_options, finish, parse_list, with_options

# option -> help; one table so the CLI's help cannot drift from what the runner reads.
HELP = {
    "seqlen": "sequence length (queries = keys); a comma list sweeps",
    "head_dim": "head dim: 64, 96, 128, 192 or 256; a comma list sweeps",
    "batch": "batch size (samples)",
    "heads": "query heads (samples)",
    "kv_heads": "K/V heads for grouped-query attention (0 = same as heads)",
    "rows": "query rows evaluated per (batch, head), drawn at random (0 or >= seqlen = all)",
    "seeds": "seeds, comma separated (e.g. 0,1,2), integers in [0, 2^32); each is one draw of Q, K, V",
    "causal": "causal masking; 'true,false' sweeps",
    "variants": "presets or recipe specs: comma-separated presets, ';' between specs (see `fa3-numerics variants`)",
    "device": "cpu, cuda or cuda:N",
    "out": "output folder for the dataset (.nc), summary.md and the report; one run at a time",
    "fresh": "ignore cached cells from an earlier run into the same --out",
    "workers": "dask worker processes (0 = run in this process)",
    "scheduler": "address of an existing dask scheduler (e.g. tcp://host:8786)",
}


def _dist_help() -> str:
    from ..data import distributions
    from ..data.dist_spec import SYNTAX

    return f"input distribution: {SYNTAX}; registered: {', '.join(n.rstrip(':') for n in distributions.available())}"


def _backend_help() -> str:
    from ..engine.backends import names

    return f"where variants are computed: {', '.join(names())} (see `fa3-numerics backends`)"


def run_and_write(name: str, overrides: dict, out: str, fresh: bool, workers: int = 0,
                  scheduler: Optional[str] = None, allow_nonfinite: bool = False) -> None:
    from ..engine.dataset import write
    from ..engine.distributed import check_scheduler
    from ..engine.files import OutputFolder, atomic_write
    from ..engine.nonfinite import scan
    from ..errors import require
    from ..report import render_report
    from ..report.summary import markdown_summary, text_table
    from ..studies.outliers import load_experiment, run_experiment

    require(workers >= 0, f"--workers must be >= 0, got {workers}")
    check_scheduler(scheduler)
    exp = load_experiment(name, overrides)  # every check before the folder is touched
    folder = OutputFolder(out, "--out")
    with folder as path:
        cache = path / ".cells"
        if fresh and cache.is_dir():
            for f in cache.glob("*.npz"):
                f.unlink()
        typer.echo(f"{exp.name}: {len(exp.cells())} cell(s) x {len(exp.seeds)} seed(s) x {len(exp.recipes)} "
                   f"variant(s), backend {exp.backend} on {exp.device}; writing to {path}", err=True)
        if folder.cleaned:
            typer.echo(f"removed {len(folder.cleaned)} temp file(s) of an interrupted run", err=True)
        ds = run_experiment(exp, cache_dir=cache, workers=workers, scheduler=scheduler)
        findings = scan(ds)
        written = [write(ds, path / f"{exp.name}.nc"), atomic_write(path / "summary.md", markdown_summary(ds))]
        written += render_report(ds, path)
        typer.echo(text_table(ds))
        typer.echo(f"\nwrote {', '.join(str(p) for p in written)} ({ds.attrs['wall_seconds']} s)")
    finish(findings, allow_nonfinite, lambda m: typer.echo(m, err=True))


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("outliers")
    @with_options(dist_options)
    def outliers(
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"]),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"]),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"]),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"]),
        kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help=HELP["kv_heads"]),
        rows: Optional[int] = typer.Option(None, help=HELP["rows"]),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"]),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"], show_default="false"),
        variants: Optional[str] = typer.Option(None, help=HELP["variants"]),
        dist: Optional[str] = typer.Option(None, help=_dist_help()),
        device: str = typer.Option("cpu", help=HELP["device"]),
        backend: str = typer.Option("emulate", help=_backend_help()),
        out: str = typer.Option("results/outliers", help=HELP["out"]),
        fresh: bool = typer.Option(False, help=HELP["fresh"]),
        workers: int = typer.Option(0, help=HELP["workers"]),
        scheduler: Optional[str] = typer.Option(None, help=HELP["scheduler"]),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        **dist_params,
    ):
        """The FA3 paper's Table 3: FP8 and FP16 attention RMSE on Gaussian inputs with outliers.

        Any distribution of the registry runs with --dist NAME; its parameters are options
        (comma lists sweep) or part of --dist (NAME:k=v,k=v).
        """
        overrides = {k: parse_list(v, float, k) for k, v in dist_params.items()}
        overrides.update({
            "seqlen": parse_list(seqlen, int, "seqlen"), "head_dim": parse_list(head_dim, int, "head_dim"),
            "causal": parse_list(causal, bool, "causal"), "seeds": parse_list(seeds, int, "seeds"),
            "batch": batch, "heads": heads, "kv_heads": kv_heads, "rows": rows, "dist": dist,
            "variants": None if variants is None else [variants], "device": device, "backend": backend,
        })
        run_and_write("outliers", overrides, out, fresh, workers, scheduler, allow_nonfinite)

    @app.command("variants")
    def variants_cmd():
        """List the preset variants (recipes) and every recipe key, with what each does."""
        from ..numerics.keys import keys
        from ..numerics.recipe import PRESETS

        for name, pre in PRESETS.items():
            paper = f" [paper RMSE {pre.paper_rmse:g}]" if pre.paper_rmse else ""
            typer.echo(f"{name}{paper}\n    {pre.description}\n    spec: {pre.recipe.spec()}")
        typer.echo("\nAny recipe can be written as key=value pairs, optionally after a preset to override it, "
                   "e.g. 'fa3-fp8,acc=fp22,bn=128'. Keys:")
        for k in keys():
            typer.echo(f"  {k.describe()}")
