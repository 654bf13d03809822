"""The study protocol: every study runs, caches, writes and renders the same way.

Exposed: ``Study``, ``StudyOption``, ``StudyContext``, ``Outcome``, ``run_study``, ``register_study``, ``get_study``,
``studies``, ``ENTRY_POINTS``.

A study is an object with (``Study`` gives the defaults):

- ``kind``: written as the dataset's ``kind`` attribute; the report registry renders by it;
- ``stem``: the dataset's file name in the output folder (``{stem}.nc``);
- ``describe()``: the line printed when it starts (what it will compute);
- ``tasks()``: its units of work, ``engine.runner.Task`` objects for ``run_tasks``; a sequential
  or stateful study (a model pass after a model pass, a training run's checkpoints) returns
  nothing here and computes in ``run`` with ``ctx.cells`` (the same cache, one file per
  finished unit);
- ``run(ctx)``: the computation; by default ``run_tasks(self.tasks())`` into ``ctx.cache``;
- ``assemble(results) -> xarray.Dataset``: the dataset, with the study's own findings in it;
- ``nonfinite(ds)``: the non-finite findings (``engine.nonfinite``); ``extra_files`` and
  ``summary`` for what a study writes beside the dataset and prints on stdout.

``run_study`` does the rest, the same for every study: holds the output folder (one lock for
every command), clears the cache on ``fresh``, runs, assembles, writes ``{stem}.nc`` through
``engine.dataset.write``, renders the report through the ``render`` it is given (the report
registry; the engine never imports report code), and returns the exit code: 0, or 3 when the
results hold NaN or Inf and they are not allowed. Bad input raises ``UsageError`` (exit 2)
before the folder is touched: a study checks its options when it is made.

Studies are registered by kind (``register_study``, or the entry-point group ``ENTRY_POINTS``
for third-party packages), so ``fa3-numerics report`` and the command line find a study
without a list to edit.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

ENTRY_POINTS = "fa3_numerics.studies"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class StudyContext:
    """What ``run_study`` hands a study's ``run``: where to keep finished work and how to report."""

    out: Path  # the held output folder
    cache: Path  # OUT/.cells: the one cache (engine.cache keys, whole-or-absent files)
    workers: int = 0
    scheduler: str | None = None
    progress: Any = None  # an engine.progress.Progress (run_tasks' display)
    echo: Callable[[str], None] = _stderr

    def cells(self, context: dict, study_modules: Sequence[str], **code) -> "Any":
        """A ``CellStore`` under ``cache`` for a sequential study: ``context`` is everything its
        cells share (inputs' digests, options), ``study_modules`` the modules that compute them;
        ``code`` goes to ``engine.cache.code_key`` (backend, device, inputs)."""
        from .cache import study_cells

        return study_cells(self.out, context, study_modules, warn=self.echo, **code)


@dataclasses.dataclass(frozen=True)
class StudyOption:
    """One option a study declares: the command line makes ``--name`` of it (``many``: a comma
    list), its help and default shown; ``from_options`` receives the parsed value (None: not given)."""

    name: str
    kind: type  # int, float, str or bool
    help: str
    default: Any = None  # shown in the help; the study applies it when the value is None
    many: bool = False


class Study:
    """Defaults of the protocol; a study overrides what it needs (see the module docstring)."""

    kind: str = ""
    stem: str = ""
    # A study that declares its options gets its command from the registry (``cli.studies``):
    # ``command`` (e.g. "run backward"), ``options``, ``dist_options`` (the distribution
    # registry's parameters as options too), ``examples``; ``from_options(**values)`` makes it.
    command: str = ""
    help: str = ""  # the command's help text
    options: tuple[StudyOption, ...] = ()
    dist_options: bool = False
    examples: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, **values) -> "Study":
        return cls(**values)

    def describe(self) -> str:
        return self.kind

    def tasks(self) -> list:
        return []

    def run(self, ctx: StudyContext):
        from .runner import run_tasks

        return run_tasks(self.tasks(), cache_dir=ctx.cache, workers=ctx.workers, scheduler=ctx.scheduler,
                         progress=ctx.progress)

    def assemble(self, results):
        raise NotImplementedError(f"{type(self).__name__} must assemble its results into a dataset")

    def nonfinite(self, ds) -> list:
        from .nonfinite import scan

        return scan(ds)

    def extra_files(self, ds, path: Path) -> list[Path]:
        return []

    def failure(self, ds) -> tuple[int, str] | None:
        """(exit code, one line) when the study's own verdict fails (``recommend``: no candidate
        meets the budget, exit 4); every file is written first."""
        return None

    def summary(self, ds) -> str:
        return ""


@dataclasses.dataclass
class Outcome:
    """What ``run_study`` did: the dataset, every file written, the non-finite findings and the
    exit code the command should end with."""

    dataset: Any
    written: list[Path]
    findings: list
    code: int
    seconds: float = 0.0


def clear_cache(path: Path) -> None:
    """Forget every finished cell (``--fresh``): the cache folder's files, the folder kept."""
    cache = path / ".cells"
    if cache.is_dir():
        for f in cache.iterdir():
            if f.is_file():
                f.unlink()
            elif f.is_dir():
                shutil.rmtree(f)


def run_study(study, out, *, render: Callable | None = None, formats: Sequence[str] = ("html", "md"),
              fresh: bool = False, workers: int = 0, scheduler: str | None = None, allow_nonfinite: bool = False,
              progress=None, echo: Callable[[str], None] = _stderr, stdout: Callable[[str], None] | None = None,
              clock=None, finisher: Callable | None = None, done: Callable | None = None) -> Outcome:
    """Run ``study`` into the folder ``out`` and write its dataset and report (module docstring).

    ``render(ds, folder, formats) -> [paths]`` renders the report (None: no report);
    ``stdout`` receives the study's summary text; ``clock`` an ``engine.progress.PhaseClock``.
    ``done(outcome)`` (module-level, as ``finish_study``'s other arguments are picklable) runs
    after the files are written, while the folder is still held. ``finisher(fn, *args) -> exit
    code`` runs the writing step elsewhere (``engine.report_process``: a process that imported
    the report's modules while the study computed); the returned ``Outcome`` then holds only
    the exit code."""
    import time

    from .files import OutputFolder
    from .progress import make_progress

    t0 = time.perf_counter()
    folder = OutputFolder(out, "--out")
    with folder as path:
        if fresh:
            clear_cache(path)
        echo(f"{study.describe()}; writing to {path}")
        if folder.cleaned:
            echo(f"removed {len(folder.cleaned)} temp file(s) of an interrupted run")
        ctx = StudyContext(path, path / ".cells", workers, scheduler,
                           progress if progress is not None else make_progress(), echo)
        results = study.run(ctx)
        if clock is not None:
            clock.done("runs")
        args = (study, results, path, render, tuple(formats), allow_nonfinite, echo, stdout, clock, t0, done)
        if finisher is not None:
            return Outcome(None, [], [], finisher(finish_study, *args), time.perf_counter() - t0)
        return finish_study(*args)


def finish_study(study, results, path: Path, render, formats, allow_nonfinite: bool, echo, stdout, clock,
                 t0: float, done=None) -> Outcome:
    """The writing step of ``run_study``: assemble, find the non-finite results, write the
    dataset, the study's files and the report, print the summary; then ``done(outcome)``."""
    import time

    from .dataset import write
    from .nonfinite import warn

    ds = study.assemble(results)
    ds.attrs["kind"] = study.kind
    findings = study.nonfinite(ds)
    written = [write(ds, path / f"{study.stem}.nc")]
    if clock is not None:
        clock.done("dataset file")
    written += study.extra_files(ds, path)
    if render is not None:
        written += render(ds, path, formats)
        if clock is not None:
            clock.done("report")
    text = study.summary(ds)
    if text and stdout is not None:
        stdout(text)
    if clock is not None:
        clock.report(echo)  # printed only when FA3N_TIMINGS is set
    warn(findings, echo)
    code = 3 if findings and not allow_nonfinite else 0
    failed = study.failure(ds) if not code else None
    if failed:
        code = failed[0]
        echo(f"error: {failed[1]}")
    outcome = Outcome(ds, written, findings, code, time.perf_counter() - t0)
    if done is not None:
        done(outcome)
    return outcome


# -- the registry -----------------------------------------------------------------------------

_REGISTRY: dict[str, str | type] = {}


def register_study(kind: str, target: str | type) -> None:
    """Register a study class (or ``"module:Class"``, imported when first asked for) under ``kind``."""
    _REGISTRY[kind] = target


def _entry_points() -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        _REGISTRY.setdefault(ep.name, ep.value)


def studies() -> dict[str, str | type]:
    """Every registered study by kind (entry points included), not yet imported."""
    _entry_points()
    return dict(_REGISTRY)


def get_study(kind: str):
    """The study class registered under ``kind``; ``KeyError`` if none is."""
    target = studies()[kind]
    if isinstance(target, str):
        target = _REGISTRY[kind] = load_target(target)
    return target


def load_target(target: str):
    """The object a registry's ``"module:attr"`` string names, its module imported now."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["Study", "StudyOption", "StudyContext", "Outcome", "run_study", "finish_study", "register_study",
           "get_study", "load_target", "studies", "clear_cache", "ENTRY_POINTS"]
