"""`fa3-numerics backends`: what can compute attention on this machine, and what is missing."""

from __future__ import annotations

import typer


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("backends")
    def backends_cmd(
        device: str = typer.Option("", help="device to check (cpu, cuda or cuda:N); default: cuda when a GPU is "
                                            "visible, and cpu as well"),
    ):
        """List every registered backend with whether it works here and, if not, why and the fix."""
        import torch

        from ..engine.backends import backend_table, check_device

        devices = [check_device(device)] if device else (["cuda", "cpu"] if torch.cuda.is_available() else ["cpu", "cuda"])
        for dev in devices:
            typer.echo(f"device {dev}:")
            for row in backend_table(dev):
                mark = "usable " if row["usable"] else "missing"
                kind = "hardware" if row["hardware"] else "emulated"
                typer.echo(f"  {row['name']:<17} {mark}  [{kind}] {row['description']}")
                if not row["usable"]:
                    typer.echo(f"  {'':<17}          why/fix: {row['why']}")
        typer.echo("\nSelect one with `fa3-numerics run outliers --backend NAME --device cuda`; recipes a backend "
                   "cannot compute are refused with the reason (e.g. per-block scales on fa3).")
