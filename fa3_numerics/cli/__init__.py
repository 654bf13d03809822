"""The ``fa3-numerics`` command line.

Each command lives in its own module of this package and exposes ``register(app, run_app)``;
modules are discovered here, so adding a command never means editing dispatch code. Options
that come from registries (distribution parameters, ablation factors, metrics, backends) are
generated when the app is built (``build_app``), so an entry added to a registry is on the
command line at once.

Exit codes: 0 done; 1 a gate failed (``compare --fail-above`` / ``--fail-if-not-covered``); 2 bad input (``UsageError``: one line on stderr naming the fix, never a
traceback); 3 results hold NaN or Inf (``NonFiniteError``, after every file is written; pass
``--allow-nonfinite`` to accept them); 130 interrupted (Ctrl-C; finished cells stay cached).
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import sys

import typer

from ..errors import NonFiniteError, UsageError

INTERRUPTED = "interrupted; finished results are kept (a rerun into the same --out resumes from them)"
# What a command that keeps no finished results says instead: its files are whole or absent.
INTERRUPTED_NO_RESUME = "interrupted; no file was written half (a rerun starts over)"
# Commands whose finished results are cached in --out/.cells, so that a rerun resumes.
RESUMING = {"outliers", "ablation", "impact", "audit"}


def _interruptible(fn, resumes: bool = True):
    """typer turns KeyboardInterrupt into a silent exit 130 before ``main`` sees it: say so first
    (that a rerun resumes only for a command that caches what it finished)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            typer.echo(INTERRUPTED if resumes else INTERRUPTED_NO_RESUME, err=True)
            raise typer.Exit(130) from None

    return wrapper


def build_app() -> typer.Typer:
    """A fresh app with every command of this package, options read from the registries now."""
    app = typer.Typer(
        name="fa3-numerics",
        help="Numerical accuracy of FP8 attention (FlashAttention-3): emulate, measure, report.",
        no_args_is_help=True,
        add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish, PowerShell)
        pretty_exceptions_enable=False,
    )
    app.callback()(_options)
    run_app = typer.Typer(help="Run an experiment and write its dataset and summary.", no_args_is_help=True)
    app.add_typer(run_app, name="run")
    # Every command module first, then their options: the registry texts they read are then
    # all known when the first is computed (``_registry_cache``).
    modules = [importlib.import_module(f"{__name__}.{info.name}")
               for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
               if not info.name.startswith("_") and info.name != "options"]
    for mod in modules:
        if hasattr(mod, "register"):
            mod.register(app, run_app)
    from . import _conventions
    from .options import dist_params, factor_flag, factor_list

    _conventions.apply(app, set(dist_params()), {factor_flag(name, help_text) for name, help_text, _ in factor_list()})
    for typer_app in (app, run_app):
        for cmd in typer_app.registered_commands:
            name = cmd.name or cmd.callback.__name__
            cmd.callback = _interruptible(cmd.callback, resumes=name in RESUMING)
    return app


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"fa3-numerics {__version__}")
        raise typer.Exit(0)


def _options(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print the version and exit"),
) -> None:
    # Options of the program itself, before any command (typer's app callback).
    pass


@functools.lru_cache(maxsize=1)
def _app() -> typer.Typer:
    return build_app()


def __getattr__(name: str):
    # ``app`` is built on first use, so that the console script can start CUDA first.
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def entry() -> None:
    """The ``fa3-numerics`` console script: ``main``, then an exit that skips the interpreter's
    teardown (unloading ~3000 modules, the CUDA context, the allocator's arenas): 0.7 s on the
    2-core CPU and about 1 s on the H200 machine, after every file is written and closed. Output
    streams are flushed first; the exit code is ``main``'s. A command on a CUDA device starts
    CUDA while torch is imported (``engine.cuda_start``) and may fork helper processes
    (``engine.forking``): a run writes its dataset and report from a process forked before it."""
    from ..engine.cuda_start import start_cuda_early
    from ..engine.forking import allow_forks, flush_output

    code = 0
    try:
        start_cuda_early(sys.argv[1:])
        allow_forks()
        main()
    except SystemExit as exc:
        code = _exit_code(exc)
    flush_output()
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter would give ``exc``: its code, 0 for None, and for
    sys.exit("message") the message on stderr and 1."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _error_line(exc: UsageError | NonFiniteError) -> str:
    return f"error: {str(exc).splitlines()[0]}"


def guarded(fn) -> int:
    """``fn()`` as a command's step, in a process of its own (``engine.report_process``): 0, or
    the exit code the command line gives what ended it, with the same one-line message."""
    try:
        fn()
        return 0
    except (UsageError, NonFiniteError) as exc:
        typer.echo(_error_line(exc), err=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:
        return _exit_code(exc)


def _option_error(exc) -> int:
    """An option typer could not parse (``--batch 1e308``, an unknown option) as one line with the
    command's help to read, where typer would draw a box of six; a missing command shows the help."""
    from typer._click.exceptions import NoArgsIsHelpError

    if isinstance(exc, NoArgsIsHelpError):
        exc.show()
        return exc.exit_code
    ctx = getattr(exc, "ctx", None)
    where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
    message = " ".join(exc.format_message().split()).rstrip(".")
    typer.echo(f"error: {message}{where}", err=True)
    return exc.exit_code


def main(argv: list[str] | None = None, application: typer.Typer | None = None) -> None:
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort

    try:
        # Not standalone: typer's own handling of a bad option is a rich box; ours is one line.
        code = (application or _app())(args=argv, standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except ClickException as exc:
        sys.exit(_option_error(exc))
    except Abort:
        typer.echo(INTERRUPTED_NO_RESUME, err=True)
        sys.exit(130)
    except (UsageError, NonFiniteError) as exc:
        typer.echo(_error_line(exc), err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo(INTERRUPTED, err=True)
        sys.exit(130)
