"""`fa3-numerics run outliers` and `fa3-numerics variants`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError

# option -> help; one table so the CLI's help cannot drift from what the runner reads.
HELP = {
    "p": "outlier probability per entry, in [0, 1]; a comma list sweeps",
    "sigma": "standard deviation of the outlier term; a comma list sweeps",
    "seqlen": "sequence length (queries = keys); a comma list sweeps",
    "head_dim": "head dim: 64, 96, 128, 192 or 256; a comma list sweeps",
    "batch": "batch size (samples)",
    "heads": "query heads (samples)",
    "kv_heads": "K/V heads for grouped-query attention (0 = same as heads)",
    "rows": "query rows evaluated per (batch, head), drawn at random (0 = all)",
    "seeds": "seeds, comma separated (e.g. 0,1,2); each is one draw of Q, K, V",
    "causal": "causal masking; 'true,false' sweeps",
    "variants": "presets or recipe specs: comma-separated presets, ';' between specs (see `fa3-numerics variants`)",
    "dist": "input distribution (registry name, e.g. outliers)",
    "device": "cpu or cuda",
    "backend": "emulate (default) or another registered backend (see `fa3-numerics backends`)",
    "out": "output folder for the dataset (.nc) and the summary (.md)",
    "fresh": "ignore cached cells from an earlier run into the same --out",
    "workers": "dask worker processes (0 = run in this process)",
    "scheduler": "address of an existing dask scheduler (e.g. tcp://host:8786)",
}


def parse_list(text: Optional[str], kind: type, name: str) -> Optional[list]:
    if text is None:
        return None
    parts = [t.strip() for t in str(text).split(",") if t.strip()]
    if not parts:
        raise UsageError(f"--{name.replace('_', '-')} got an empty list; give at least one value")
    try:
        if kind is bool:
            vals = []
            for t in parts:
                if t.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                vals.append(t.lower() in ("true", "1", "yes"))
            return vals
        return [kind(float(t)) if kind is int and float(t).is_integer() else kind(t) for t in parts]
    except ValueError:
        raise UsageError(f"--{name.replace('_', '-')} expects {kind.__name__} values, got {text!r}") from None


def run_and_write(name: str, overrides: dict, out: Path, fresh: bool, workers: int = 0,
                  scheduler: Optional[str] = None) -> None:
    from ..engine.dataset import write
    from ..engine.experiment import load_experiment, run_experiment
    from ..report.summary import markdown_summary, text_table

    exp = load_experiment(name, overrides)
    cache = out / ".cells"
    if fresh and cache.is_dir():
        for f in cache.glob("*.npz"):
            f.unlink()
    typer.echo(f"{exp.name}: {len(exp.cells())} cell(s) x {len(exp.seeds)} seed(s) x {len(exp.recipes)} variant(s), "
               f"backend {exp.backend} on {exp.device}; writing to {out}", err=True)
    ds = run_experiment(exp, cache_dir=cache, workers=workers, scheduler=scheduler)
    path = write(ds, out / f"{exp.name}.nc")
    md = out / "summary.md"
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(markdown_summary(ds))
    os.replace(tmp, md)
    try:
        from ..report import render_report  # issue 3: figures and HTML, when present

        render_report(ds, out)
    except ImportError:
        pass
    typer.echo(text_table(ds))
    typer.echo(f"\nwrote {path} and {md} ({ds.attrs['wall_seconds']} s)")


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("outliers")
    def outliers(
        p: Optional[str] = typer.Option(None, help=HELP["p"]),
        sigma: Optional[str] = typer.Option(None, help=HELP["sigma"]),
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"]),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"]),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"]),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"]),
        kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help=HELP["kv_heads"]),
        rows: Optional[int] = typer.Option(None, help=HELP["rows"]),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"]),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"], show_default="false"),
        variants: Optional[str] = typer.Option(None, help=HELP["variants"]),
        dist: Optional[str] = typer.Option(None, help=HELP["dist"]),
        device: str = typer.Option("cpu", help=HELP["device"]),
        backend: str = typer.Option("emulate", help=HELP["backend"]),
        out: Path = typer.Option(Path("results/outliers"), help=HELP["out"]),
        fresh: bool = typer.Option(False, help=HELP["fresh"]),
        workers: int = typer.Option(0, help=HELP["workers"]),
        scheduler: Optional[str] = typer.Option(None, help=HELP["scheduler"]),
    ):
        """The FA3 paper's Table 3: FP8 and FP16 attention RMSE on Gaussian inputs with outliers."""
        overrides = {
            "p": parse_list(p, float, "p"), "sigma": parse_list(sigma, float, "sigma"),
            "seqlen": parse_list(seqlen, int, "seqlen"), "head_dim": parse_list(head_dim, int, "head_dim"),
            "causal": parse_list(causal, bool, "causal"), "seeds": parse_list(seeds, int, "seeds"),
            "batch": batch, "heads": heads, "kv_heads": kv_heads, "rows": rows, "dist": dist,
            "variants": None if variants is None else [variants], "device": device, "backend": backend,
        }
        run_and_write("outliers", overrides, out, fresh, workers, scheduler)

    @app.command("variants")
    def variants_cmd():
        """List the preset variants (recipes) with what each does and its full spec."""
        from ..numerics.recipe import PRESETS

        for name, pre in PRESETS.items():
            paper = f" [paper RMSE {pre.paper_rmse:g}]" if pre.paper_rmse else ""
            typer.echo(f"{name}{paper}\n    {pre.description}\n    spec: {pre.recipe.spec()}")
        typer.echo("\nAny recipe can be written as key=value pairs, optionally after a preset to override it, "
                   "e.g. 'fa3-fp8,acc=fp22,bn=128'. Keys: " + ", ".join(
                       sorted(__import__("fa3_numerics.numerics.recipe", fromlist=["x"])._FIELD_OF)))
