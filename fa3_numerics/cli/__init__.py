"""The ``fa3-numerics`` command line.

Each command lives in its own module of this package and exposes ``register(app)``;
modules are discovered here, so adding a command never means editing dispatch code.
Errors that users can fix (``UsageError``) print one line and exit with code 2.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

from ..errors import UsageError

app = typer.Typer(
    name="fa3-numerics",
    help="Numerical accuracy of FP8 attention (FlashAttention-3): emulate, measure, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
run_app = typer.Typer(help="Run an experiment and write its dataset and summary.", no_args_is_help=True)
app.add_typer(run_app, name="run")


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "register"):
            mod.register(app, run_app)


_discover()


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=True)
    except UsageError as exc:
        typer.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted; finished cells are kept and a rerun resumes from them", err=True)
        sys.exit(130)
