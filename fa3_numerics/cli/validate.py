"""`fa3-numerics validate`: the emulator against the compiled FA3 kernel over a grid of cases."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("validate")
    def validate_cmd(
        grid: str = typer.Option("small", help="case grid: small (17 cases), full (~200 cases) or tiny"),
        out: Path = typer.Option(Path("results/validate"), help="output folder for validation.nc and validation.md"),
        device: str = typer.Option("cuda", help="device of the kernel and the emulator (the kernel needs cuda)"),
        backend: str = typer.Option("fa3", help="hardware backend to validate against"),
        acc: Optional[str] = typer.Option(None, help="emulator accumulator models, comma separated "
                                                     "(default: all: fp32, fp22, two-level)"),
    ):
        """Same inputs through the emulator and the kernel: F = RMSE(emu, kernel) / RMSE(kernel, f64), bit-identical share."""
        from ..engine.backends import get_backend
        from ..errors import require
        from ..studies.validate import accumulator_ranking, grid as make_grid, markdown_validation, run_validation

        cases = make_grid(grid)
        kernel = get_backend(backend)
        why = kernel.check(device)
        require(why is None, f"backend {backend!r} cannot run on {device}: {why}")
        accs = [a.strip() for a in acc.split(",") if a.strip()] if acc else None
        typer.echo(f"validate: {len(cases)} case(s), backend {backend} on {device}; writing to {out}", err=True)
        ds = run_validation(cases, device=device, backend=backend, accs=accs, kernel=kernel,
                            progress=lambda m: typer.echo(m, err=True))
        from ..engine.dataset import write

        path = write(ds, out / "validation.nc")
        md = markdown_validation(ds)
        tmp = out / "validation.md.tmp"
        tmp.write_text(md)
        os.replace(tmp, out / "validation.md")
        typer.echo(md)
        rank = accumulator_ranking(ds)
        if rank:
            typer.echo(f"best accumulator model: {rank[0]['acc']} (max F {rank[0]['max_F']:.4f})")
        typer.echo(f"wrote {path} and {out / 'validation.md'}")
