"""`fa3-numerics validate`: the emulator against the compiled FA3 kernel over a grid of cases."""

from __future__ import annotations

from typing import Optional

import typer

from ._registry_cache import cached
from .options import ALLOW_NONFINITE_HELP, examples, parse_list

EXAMPLES = examples(
    "fa3-numerics validate --grid small --out validation/          # on a Hopper GPU with the fa3 kernel",
    "fa3-numerics validate --grid stress --acc fp22",
    "fa3-numerics validate --dist outliers:p=0.01,sigma=30",
    "fa3-numerics validate --dist captured:smollm2.safetensors --layers 0-4 --rows 512",
    "fa3-numerics validate --grid tiny --backend fa3-mock --device cpu   # the whole path on a CPU, with a stand-in",
)


@cached("fa3_numerics.studies.validate")
def _grid_help() -> str:
    from ..studies.validate import GRIDS

    sizes = {name: len(fn()) for name, fn in GRIDS.items()}
    return "case grid: " + ", ".join(f"{n} ({k} cases)" for n, k in sizes.items())


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("validate", epilog=EXAMPLES)
    def validate_cmd(
        grid: str = typer.Option("small", help=_grid_help()),
        dist: Optional[str] = typer.Option(
            None, help="data of every case: NAME or NAME:k=v,k=v as `run --dist` (e.g. outliers:p=0.01,sigma=30, "
                       "student-t:df=3), or captured:FILE to check the emulator on a capture's recorded Q, K, V "
                       "per layer x head with its softmax scale and causal flag (the grid is then per layer)"),
        layers: Optional[str] = typer.Option(None, help="with --dist captured:FILE: layers to check, e.g. 0-4,10"),
        rows: int = typer.Option(0, help="with --dist captured:FILE: query rows per head (0 = all)"),
        out: str = typer.Option("results/validate", help="output folder for validation.nc and validation.md"),
        device: str = typer.Option("cuda", help="device of the kernel and the emulator (the kernel needs cuda)"),
        backend: str = typer.Option("fa3", help="hardware backend to validate against (fa3-mock: a CPU stand-in)"),
        acc: Optional[str] = typer.Option(None, help="emulator accumulator models, comma separated "
                                                     "(default: all: fp32, fp22, two-level)"),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP),
        format: str = typer.Option("html,md", "--format", help="report formats: html, md (comma list)"),
        backward: bool = typer.Option(False, "--backward", help="validate the backward instead: dQ, dK, dV of the "
                                      "backend's kernel (cudnn-fp8, sdpa-flash) against its emulated preset, from "
                                      "the kernel's own O and LSE and end to end (validation_backward.nc)"),
        max_seqlen: int = typer.Option(0, "--max-seqlen", help="with --backward: skip cases longer than this "
                                       "(0 = none; the backward runs every query row)"),
    ):
        """Same inputs through the emulator and the kernel: F = RMSE(emu, kernel) / RMSE(kernel, f64), bit-identical share."""
        from ..engine.backends import check_device, get_backend
        from ..engine.files import OutputFolder
        from ..errors import require
        from ..report.validation import markdown_validation
        from ..engine.checks import check_rows
        from ..studies.validate import ValidationStudy, accumulator_ranking, captured_cases, check_accs
        from ._study import run_study_command
        from ..studies.validate import grid as make_grid
        from ..studies.validate import with_dist

        check_device(device)
        check_rows(rows)
        accs = parse_list(acc, str, "acc")
        accs = check_accs(accs) if accs else None  # None: the backend's own models (run_validation)
        folder = OutputFolder(out, "--out")
        if dist and dist.strip().startswith("captured:"):
            cases = captured_cases(dist.strip()[len("captured:"):], layers=layers, rows=rows)
        else:
            require(layers is None, "--layers is for --dist captured:FILE")
            require(rows == 0, "--rows is for --dist captured:FILE (the grid's cases set their own rows)")
            cases = make_grid(grid)
            if dist:
                cases = with_dist(cases, dist)
        kernel = get_backend(backend)
        why = kernel.check(device)
        require(why is None, f"backend {backend!r} cannot run on {device}: {why}")
        require(max_seqlen >= 0, f"--max-seqlen {max_seqlen}: give a length, or 0 for none")
        if backward:
            require(acc is None, "--acc is for the forward's validation; --backward runs the backend's preset")
            _validate_backward(cases, device, backend, kernel, max_seqlen, folder, allow_nonfinite, format)
            return
        require(max_seqlen == 0, "--max-seqlen is for --backward")
        study = ValidationStudy(cases, device=device, backend=backend, accs=accs, kernel=kernel)

        def console(ds):
            typer.echo(markdown_validation(ds))
            rank = accumulator_ranking(ds)
            if rank:
                typer.echo(f"best accumulator model: {rank[0]['acc']} (max F {rank[0]['max_F']:.4f})")

        from .report import parse_formats

        run_study_command(study, folder.path, allow_nonfinite=allow_nonfinite, console=console,
                          formats=parse_formats(format))


def _validate_backward(cases, device, backend, kernel, max_seqlen, folder, allow_nonfinite, format) -> None:
    from ..errors import require
    from ..report.validation_backward import markdown_body
    from ..studies.validate_backward import BackwardValidationStudy
    from ._study import run_study_command
    from .report import parse_formats

    require(getattr(kernel, "backward", False), f"backend {backend!r} computes the forward only; --backward needs "
            "one with a backward: cudnn-fp8, sdpa-flash (fa3-numerics backends)")
    study = BackwardValidationStudy(cases, device=device, backend=backend, kernel=kernel, max_seqlen=max_seqlen)
    run_study_command(study, folder.path, allow_nonfinite=allow_nonfinite,
                      console=lambda ds: typer.echo(markdown_body(ds)), formats=parse_formats(format))
