"""The one command tail: every study command ends here (``engine.study.run_study``, the report
from the report registry, the files written, the exit code)."""

from __future__ import annotations

import functools
from typing import Sequence

import typer


def _stderr(msg: str) -> None:
    typer.echo(msg, err=True)


def report_done(outcome, console=None) -> None:
    """After a study's files are written: its console table (``console(ds)``, else the report
    registry's for its kind), the files written, then its exit code (3 when results are
    non-finite and not allowed)."""
    from ..report import console_text
    from .options import wrote

    if outcome.dataset is not None:
        if console is not None:
            console(outcome.dataset)
        else:
            text, notes = console_text(outcome.dataset)
            if text:
                typer.echo(text)
            for line in notes:
                _stderr(line)
    typer.echo("\n" + wrote(outcome.written, f"({outcome.seconds:.0f} s)"))
    if outcome.code:
        from ..engine.nonfinite import summary_line

        if not outcome.findings:  # the study's own verdict failed; it said why
            raise typer.Exit(outcome.code)
        _stderr(f"error: {summary_line(outcome.findings)}; files are written; see the warnings above, or pass "
                "--allow-nonfinite to exit 0")
        raise typer.Exit(outcome.code)


def run_study_command(study, out, *, formats: Sequence[str] = ("html", "md"), fresh: bool = False,
                      workers: int = 0, scheduler: str | None = None, allow_nonfinite: bool = False,
                      clock=None, finisher=None, progress=None, render=None, console=None):
    """Run ``study`` into ``out`` with its report (``engine.study.run_study``), print what was
    written and end with the study's exit code; return the ``Outcome``."""
    from ..engine.study import run_study
    from ..report import render_report

    outcome = run_study(study, out, render=render if render is not None else render_report, formats=formats, fresh=fresh, workers=workers,
                        scheduler=scheduler, allow_nonfinite=allow_nonfinite, echo=_stderr, stdout=typer.echo,
                        clock=clock, finisher=finisher, done=functools.partial(report_done, console=console),
                        progress=progress)
    if outcome.code:  # the writing step ran in another process, which said why
        raise typer.Exit(outcome.code)
    return outcome
