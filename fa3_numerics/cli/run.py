"""`fa3-numerics run outliers` and `fa3-numerics variants`."""

from __future__ import annotations

import functools
from typing import Optional

import typer

from ._registry_cache import cached
from .options import ALLOW_NONFINITE_HELP, JSON_HELP, dist_help, dist_options, examples, experiment_toml, json_text, \
    parse_list, toml_default, with_options

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
SOURCE = "experiments/outliers.toml"
EXAMPLES = examples(
    "fa3-numerics run outliers --p 0.001                        # the paper's Table 3 (~40 s on 2 cores)",
    "fa3-numerics run outliers --seqlen 1024,4096 --p 0.001,0.01 --seeds 0,1,2 --out results/sweep",
    "fa3-numerics run outliers --variants 'fa3-fp8;fa3-fp8,acc=fp22;gran=token,rot=orthogonal'",
    "fa3-numerics run outliers --dist student-t:df=3 --seqlen 2048",
    "fa3-numerics run outliers --backend fa3 --device cuda --variants fa3-fp8-kernel",
)


@functools.lru_cache(maxsize=1)
def _toml() -> dict:
    """The defaults of ``run outliers``: experiments/outliers.toml, flattened (shape, params, run)."""
    spec = experiment_toml("outliers")
    out = dict(spec.get("shape", {})) | dict(spec.get("params", {})) | dict(spec.get("run", {}))
    out["variants"] = ",".join(spec.get("variants", []))
    out["dist"] = spec.get("dist", "outliers")
    return out


def _default(key: str) -> str | bool:
    return toml_default(_toml(), key, SOURCE)


def _dist_help() -> str:
    return dist_help()


@cached("fa3_numerics.engine.backends")
def _backend_help() -> str:
    from ..engine.backends import names

    return f"where variants are computed: {', '.join(names())} (see `fa3-numerics backends`)"


def run_and_write(name: str, overrides: dict, out: str, fresh: bool, workers: int = 0,
                  scheduler: Optional[str] = None, allow_nonfinite: bool = False,
                  formats: tuple[str, ...] = ("html", "md")) -> None:
    """``run NAME``: the experiment TOML's study through the one command tail. The report's
    imports happen beside the computation: in a forked process from the console script
    (``engine.report_process``), else in a thread (``engine.prefetch``); neither while dask's
    worker processes are forked."""
    from ..engine.distributed import check_scheduler
    from ..engine.forking import forks_allowed
    from ..engine.prefetch import prefetch
    from ..engine.progress import PhaseClock
    from ..engine.report_process import ReportProcess
    from ..errors import require
    from ..report import report_modules
    from ..studies.outliers import OutliersStudy
    from . import guarded
    from ._study import run_study_command

    require(workers >= 0, f"--workers must be >= 0, got {workers}")
    check_scheduler(scheduler)
    study = OutliersStudy.load(name, overrides)  # every check before the folder is touched
    local = workers == 0 and scheduler is None
    modules = REPORT_IMPORTS + report_modules(study.kind)
    tail = ReportProcess.start(modules, guarded) if local and forks_allowed() else None
    fetch = prefetch(modules) if local and tail is None else None
    try:
        run_study_command(study, out, fresh=fresh, workers=workers, scheduler=scheduler, formats=formats,
                          allow_nonfinite=allow_nonfinite, clock=PhaseClock(),
                          finisher=tail.run if tail is not None else None)
    finally:
        if tail is not None:
            tail.cancel()
        if fetch is not None:
            # No import may outlive the command: a caller iterating sys.modules meanwhile (pytest
            # between tests, a notebook) would see it change size under it.
            fetch.join()


# What writing a run's dataset and report imports (xarray with pandas, h5netcdf, scipy.stats,
# matplotlib: about 2 s): imported ahead, beside the computation.
REPORT_IMPORTS = (
    "xarray",
    "fa3_numerics.engine.dataset",
    "fa3_numerics.engine.nonfinite",
    "h5netcdf",
    "scipy.stats",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "matplotlib.backends.backend_svg",
    "matplotlib.ticker",
    "fa3_numerics.report.figures",
    "fa3_numerics.report.figures_sweep",
    "fa3_numerics.report.run",
    "fa3_numerics.report.html",
    "fa3_numerics.report.summary",
)


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("outliers", epilog=EXAMPLES)
    @with_options(lambda: dist_options(_toml(), SOURCE))
    def outliers(
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"], show_default=_default("seqlen")),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"],
                                               show_default=_default("head_dim")),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"], show_default=_default("batch")),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"], show_default=_default("heads")),
        kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help=HELP["kv_heads"],
                                               show_default=_default("kv_heads")),
        rows: Optional[int] = typer.Option(None, help=HELP["rows"], show_default=_default("rows")),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"], show_default=_default("seeds")),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"], show_default=_default("causal")),
        variants: Optional[str] = typer.Option(None, help=HELP["variants"],
                                               show_default=f"the {len(_toml()['variants'].split(','))} Table 3 "
                                                            f"presets, from {SOURCE}"),
        dist: Optional[str] = typer.Option(None, help=_dist_help(), show_default=_default("dist")),
        device: str = typer.Option("cpu", help=HELP["device"]),
        backend: str = typer.Option("emulate", help=_backend_help()),
        out: str = typer.Option("results/outliers", help=HELP["out"]),
        fresh: bool = typer.Option(False, help=HELP["fresh"]),
        workers: int = typer.Option(0, help=HELP["workers"]),
        scheduler: Optional[str] = typer.Option(None, help=HELP["scheduler"]),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        format: str = typer.Option("html,md", "--format", help="report formats: html, md (comma list)"),
        **dist_params,
    ):
        """The FA3 paper's Table 3: FP8 and FP16 attention RMSE on Gaussian inputs with outliers.

        Any distribution of the registry runs with --dist NAME; its parameters are options
        (comma lists sweep) or part of --dist (NAME:k=v,k=v). Defaults come from
        experiments/outliers.toml. Progress: a live display on a terminal, a line per task and
        every 15 s otherwise (FA3N_PROGRESS=live|plain|off, FA3N_PROGRESS_INTERVAL=seconds).
        """
        overrides = {k: parse_list(v, float, k) for k, v in dist_params.items()}
        overrides.update({
            "seqlen": parse_list(seqlen, int, "seqlen"), "head_dim": parse_list(head_dim, int, "head_dim"),
            "causal": parse_list(causal, bool, "causal"), "seeds": parse_list(seeds, int, "seeds"),
            "batch": batch, "heads": heads, "kv_heads": kv_heads, "rows": rows, "dist": dist,
            "variants": None if variants is None else [variants], "device": device, "backend": backend,
        })
        from .report import parse_formats

        run_and_write("outliers", overrides, out, fresh, workers, scheduler, allow_nonfinite, parse_formats(format))

    @app.command("variants", epilog=examples("fa3-numerics variants",
                                             "fa3-numerics variants --json",
                                             "fa3-numerics run outliers --variants 'fa3-fp8,acc=fp22,bn=128'"))
    def variants_cmd(json_out: bool = typer.Option(False, "--json", help=JSON_HELP)):
        """List the preset variants (recipes) and every recipe key, with what each does."""
        from ..numerics.keys import fmt_value, keys
        from ..numerics.recipe import PRESETS

        if json_out:
            typer.echo(json_text({
                "presets": [{"name": name, "description": pre.description, "spec": pre.recipe.spec(),
                             "paper_rmse": pre.paper_rmse} for name, pre in PRESETS.items()],
                "keys": [{"key": k.key, "default": fmt_value(k.default), "choices": k.allowed(), "help": k.help}
                         for k in keys()]}))
            return
        for name, pre in PRESETS.items():
            paper = f" [paper RMSE {pre.paper_rmse:g}]" if pre.paper_rmse else ""
            typer.echo(f"{name}{paper}\n    {pre.description}\n    spec: {pre.recipe.spec()}")
        typer.echo("\nAny recipe can be written as key=value pairs, optionally after a preset to override it, "
                   "e.g. 'fa3-fp8,acc=fp22,bn=128'. Keys:")
        for k in keys():
            typer.echo(f"  {k.describe()}")
