"""`fa3-numerics backends`: what can compute attention on this machine, and for the rest, why not."""

from __future__ import annotations

import typer

from .options import JSON_HELP, examples, json_text


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    @app.command("backends", epilog=examples("fa3-numerics backends", "fa3-numerics backends --device cuda:1",
                                             "fa3-numerics backends --json",
                                             "fa3-numerics run outliers --backend sdpa-math --device cuda"))
    def backends_cmd(
        device: str = typer.Option("", help="device to check (cpu, cuda or cuda:N); default: cuda when a GPU is "
                                            "visible, and cpu as well"),
        json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    ):
        """List every registered backend with whether it works here and, if not, why and the fix."""
        import torch

        from ..engine.backends import backend_table, check_device

        devices = [check_device(device)] if device else (["cuda", "cpu"] if torch.cuda.is_available() else ["cpu", "cuda"])
        if json_out:
            typer.echo(json_text({"devices": [{"device": dev, "backends": backend_table(dev)} for dev in devices]}))
            return
        for dev in devices:
            typer.echo(f"device {dev}:")
            for row in backend_table(dev):
                # "not usable here": the backend exists and may work elsewhere; the line below says why not
                mark = "usable here    " if row["usable"] else "not usable here"
                kind = ("hardware" if row["hardware"] else "emulated") + (", fwd+bwd" if row["backward"] else "")
                typer.echo(f"  {row['name']:<17} {mark}  [{kind}] {row['description']}")
                if not row["usable"]:
                    typer.echo(f"  {'':<17} {'':<15}  why, and the fix: {row['why']}")
        typer.echo("\nSelect one with `fa3-numerics run outliers --backend NAME --device cuda`; recipes a backend "
                   "cannot compute are refused with the reason (e.g. per-block scales on fa3). Backends marked fwd+bwd also "
                   "compute gradients: `fa3-numerics run backward --backend NAME --no-attribution --device cuda`.")
