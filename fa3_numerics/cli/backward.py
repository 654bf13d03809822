"""`fa3-numerics run backward`: dQ, dK, dV errors of low-precision backward passes, attributed per product."""

from __future__ import annotations

from typing import Optional

import typer

from .options import ALLOW_NONFINITE_HELP, dist_options, examples, finish, parse_list, with_options, wrote
from .run import HELP

EXAMPLES = examples(
    "fa3-numerics run backward                                    # backward presets, outliers, seqlen 1024",
    "fa3-numerics run backward --dist k-bias --causal true,false --out results/bwd-kbias",
    "fa3-numerics run backward --variants 'fa3-fp8-bwd-bf16;cudnn-fp8,bwd.gran=head' --no-attribution",
)


def _defaults() -> str:
    from ..numerics.recipe import BACKWARD_PRESETS

    return ", ".join(BACKWARD_PRESETS)


def write_backward(res, path, allow_nonfinite: bool) -> None:
    """The dataset, report.md and a table on stdout; exit 3 on non-finite gradients (unless allowed)."""
    from ..engine.dataset import write
    from ..engine.files import atomic_write
    from ..engine.nonfinite import scan_counts
    from ..report.backward import gradient_table, markdown_report
    from ..report.document import md_table
    from ..studies.backward import GRADS

    ds = res.dataset()
    written = [write(ds, path / "backward.nc"), atomic_write(path / "report.md", markdown_report(ds))]
    findings = []
    for g in GRADS:
        counts = ds[f"{g}_nonfinite"].sel(stage="full")
        found = scan_counts(counts, ("batch", "head", "kv_head"))
        findings += [f"{g}: {f.line()}" for f in found]
    first = {d: ds[d].values[0].item() for d in ds["o_rmse"].dims if d not in
             ("variant", "stage", "seed", "batch", "head", "kv_head")}
    typer.echo(md_table(gradient_table(ds, first, "rel_l2")))
    typer.echo("\n" + wrote(written, f"({ds.attrs['wall_seconds']} s for the runs)"))
    finish(findings, allow_nonfinite, lambda m: typer.echo(m, err=True))


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @run_app.command("backward", epilog=EXAMPLES)
    @with_options(dist_options)
    def backward(
        seqlen: Optional[str] = typer.Option(None, help=HELP["seqlen"], show_default="1024"),
        head_dim: Optional[str] = typer.Option(None, "--head-dim", help=HELP["head_dim"], show_default="128"),
        batch: Optional[int] = typer.Option(None, help=HELP["batch"], show_default="1"),
        heads: Optional[int] = typer.Option(None, help=HELP["heads"], show_default="4"),
        kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help=HELP["kv_heads"], show_default="0"),
        seeds: Optional[str] = typer.Option(None, help=HELP["seeds"], show_default="0"),
        causal: Optional[str] = typer.Option(None, help=HELP["causal"], show_default="false"),
        variants: Optional[str] = typer.Option(None, help=HELP["variants"] + " (with bwd.* keys)",
                                               show_default=_defaults()),
        dist: Optional[str] = typer.Option(None, help="input distribution (see `fa3-numerics run outliers --help`)",
                                           show_default="outliers"),
        attribution: bool = typer.Option(True, help="also run each stage alone in low precision (fwd, s, dv, dp, "
                                                    "ds, dq, dk, out, fwd+s, exact): about 10x the runs"),
        out: str = typer.Option("results/backward", help="output folder for backward.nc and report.md"),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        **dist_params,
    ):
        """Gradient error (dQ, dK, dV, beside the forward's O) of backward presets against float64 autograd,
        with the error of each backward product measured alone. Every query row is computed (dK and dV sum
        over all of them); dO is drawn N(0, 1) from the seed."""
        from ..engine.files import OutputFolder
        from ..studies.backward import compute, load_study

        overrides = {k: parse_list(v, float, k) for k, v in dist_params.items()}
        overrides.update({
            "seqlen": parse_list(seqlen, int, "seqlen"), "head_dim": parse_list(head_dim, int, "head_dim"),
            "causal": parse_list(causal, bool, "causal"), "seeds": parse_list(seeds, int, "seeds"),
            "batch": batch, "heads": heads, "kv_heads": kv_heads, "dist": dist,
            "variants": None if variants is None else [variants],
        })
        study = load_study(overrides, attribution)  # every check before the folder is touched
        with OutputFolder(out, "--out") as path:
            exp = study.exp
            typer.echo(f"backward: {len(exp.cells())} cell(s) x {len(exp.seeds)} seed(s) x {len(exp.recipes)} "
                       f"variant(s) x {len(study.stages())} stage(s); writing to {path}", err=True)
            res = compute(study, progress=lambda m: typer.echo(m, err=True))
            write_backward(res, path, allow_nonfinite)
