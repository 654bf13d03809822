"""Progress of a study while it runs: a live display on a terminal, plain lines otherwise.

Exposed: ``Progress``, ``PlainProgress``, ``LiveProgress``, ``make_progress``, ``as_progress``,
``Estimator``, ``task_work``, ``PhaseClock``, ``process_age``.

The engine (``fa3_numerics.engine.runner.run_tasks``) reports events to a ``Progress``: the
plan (every task and its variants), a task starting, a variant (job) starting, a tile of the
emulator finishing (``fa3_numerics.numerics.emulator.PROGRESS``), a variant finishing, a task
finishing. A ``Progress`` is also a plain ``Callable[[str], None]``, so it goes wherever a
study takes ``progress=`` and the study's own messages ("audit of ...", warnings) pass through
it unchanged.

- ``LiveProgress`` (stderr is a terminal): a rich display with one bar for the tasks, one for the
  variants of the current task and one for the tiles (or row blocks) of the current variant,
  each with its elapsed time and what is left; messages print above it.
- ``PlainProgress`` (stderr is a file or a pipe, CI logs): one line per finished task, as before
  (``[3/16] where, seed 0: 7 computed, 0 from cache; 12.3 s elapsed, ~40 s left``), and while a
  task runs, one line every ``interval`` seconds naming the variant and tile, so a long task is
  never silent.

"Left" comes from ``Estimator``: the seconds per unit of work (query rows x keys x heads x batch x
head dim) measured so far for each recipe, or over all recipes for one not yet seen, times the work
still to do. Recipes differ in cost by 100x (the Hopper MMA model against a float32 GEMM), so one
average per task would mislead on mixed sweeps. ``FA3N_PROGRESS`` = ``live``, ``plain`` or ``off``
overrides the choice; ``FA3N_PROGRESS_INTERVAL`` sets the plain lines' period (default 15 s).

``PhaseClock``: with ``FA3N_TIMINGS=1`` a command prints where its wall time went (process
start-up and imports, runs, dataset file, summary, report), one line on stderr.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, TextIO

DEFAULT_INTERVAL = 15.0


def task_work(task) -> float:
    """Work units of one job of ``task``: rows x keys x heads x batch x head dim (1 when the
    inputs do not say their shape, e.g. a capture, whose layers then weigh alike)."""
    inp = getattr(task, "inputs", None)
    n = getattr(inp, "seqlen", None)
    if n is None:
        return 1.0
    rows = task.rows if task.rows and task.rows < n else n
    return float(rows * n * inp.heads * inp.batch * inp.head_dim)


@dataclasses.dataclass
class _Job:
    label: str
    spec: str
    work: float
    done: bool = False


@dataclasses.dataclass
class _Task:
    where: str
    seed: int
    jobs: dict[int, _Job]  # slot -> job (slots may have gaps: a task may run some variants only)
    cached: int  # jobs read from the cache, not computed
    done: bool = False

    @property
    def work(self) -> float:
        return next(iter(self.jobs.values())).work if self.jobs else 0.0


class Estimator:
    """Seconds left, from the measured seconds per work unit of each recipe spec."""

    def __init__(self):
        self.rate: dict[str, list[float]] = {}  # spec -> [seconds, work]
        self.total = [0.0, 0.0]
        self.task_overhead = [0.0, 0.0]  # seconds outside jobs (drawing inputs, reference) per work

    def record(self, spec: str, seconds: float, work: float) -> None:
        s = self.rate.setdefault(spec, [0.0, 0.0])
        s[0] += seconds
        s[1] += work
        self.total[0] += seconds
        self.total[1] += work

    def record_task(self, overhead: float, work: float) -> None:
        self.task_overhead[0] += max(overhead, 0.0)
        self.task_overhead[1] += work

    def seconds(self, spec: str, work: float) -> float | None:
        s = self.rate.get(spec)
        if s and s[1] > 0:
            return work * s[0] / s[1]
        if self.total[1] > 0:
            return work * self.total[0] / self.total[1]
        return None

    def overhead(self, work: float) -> float:
        return work * self.task_overhead[0] / self.task_overhead[1] if self.task_overhead[1] > 0 else 0.0


class Progress:
    """Events from the engine and messages from the study. The base class prints messages to
    ``echo`` and keeps the state and the estimate that the displays show."""

    def __init__(self, echo: Callable[[str], None] | None = None):
        self.echo = echo or (lambda m: print(m, file=sys.stderr, flush=True))
        self.tasks: list[_Task] = []
        self.est = Estimator()
        self.rough = False  # the last estimate borrowed some recipe's cost from others'
        self.t0 = time.perf_counter()
        self.current: int | None = None  # task index running in this process
        self.job: int | None = None  # its job index
        self.job_t0 = 0.0
        self.task_t0 = 0.0
        self.task_job_seconds = 0.0
        self.tile_done, self.tile_total, self.tile_unit = 0, 0, "tiles"
        self.finished = 0
        self.label = ""
        self.computing: list[int] = []  # slots the running task computes (the rest are cached)

    # -- messages ---------------------------------------------------------------------------
    def __call__(self, msg: str) -> None:
        self.log(msg)

    def log(self, msg: str) -> None:
        self.echo(msg)

    # -- events -----------------------------------------------------------------------------
    def begin(self, tasks: list, cached: list[set[int]], label: str = "", skipped: list[int] = ()) -> None:
        """``tasks``: the engine's Tasks; ``cached[i]``: slots of task i read from the cache;
        ``skipped``: tasks not run at all (everything cached), counted as done from the start."""
        self.t0 = time.perf_counter()
        self.label = label
        self.tasks = []
        for t, c in zip(tasks, cached):
            w = task_work(t)
            jobs = {j.slot: _Job(short_name(j.recipe), j.recipe.spec(), w, j.slot in c) for j in t.jobs}
            self.tasks.append(_Task(t.where or "single cell", t.seed, jobs, len(c)))
        for ti in skipped:
            self.tasks[ti].done = True
        self.finished = len(skipped)

    def task_start(self, ti: int, slots: list[int]) -> None:
        self.current, self.task_t0, self.task_job_seconds = ti, time.perf_counter(), 0.0
        self.computing = list(slots)

    def job_start(self, ti: int, slot: int) -> None:
        self.job, self.job_t0 = slot, time.perf_counter()
        self.tile_done, self.tile_total = 0, 0

    def tile(self, done: int, total: int, unit: str = "tiles") -> None:
        self.tile_done, self.tile_total, self.tile_unit = done, total, unit

    def job_done(self, ti: int, slot: int) -> None:
        sec = time.perf_counter() - self.job_t0
        job = self.tasks[ti].jobs[slot]
        self.est.record(job.spec, sec, job.work)
        self.task_job_seconds += sec
        job.done = True
        self.job = None

    def task_done(self, ti: int, computed: int, cached: int, seconds: float) -> None:
        t = self.tasks[ti]
        if self.current == ti:  # in-process: what the jobs did not take is the task's overhead
            self.est.record_task(seconds - self.task_job_seconds, t.work)
        else:  # on dask: only the task's time is known; spread it over its jobs' work
            todo = [j for j in t.jobs.values() if not j.done]
            work = sum(j.work for j in todo)
            for j in todo:
                self.est.record(j.spec, seconds * j.work / work if work else 0.0, j.work)
        for j in t.jobs.values():
            j.done = True
        t.done = True
        self.finished += 1
        self.current = None
        self.task_line(ti, computed, cached)

    def dashboard(self, text: str) -> None:
        self.log(text)

    def end(self) -> None:
        pass

    # -- what the displays show ---------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float | None:
        """Seconds left for every job not done, the running one counted by what it has left.
        Before any job has finished, the running job's tiles give a first rate. ``self.rough``
        says afterwards whether some job's figure was borrowed from other recipes' rates (their
        own cost is not yet measured), so the display can say the estimate is rough."""
        total = 0.0
        self.rough = False
        first = self._first_rate()
        for ti, t in enumerate(self.tasks):
            if t.done:
                continue
            if ti != self.current:
                total += self.est.overhead(t.work)
            for slot, j in t.jobs.items():
                if j.done:
                    continue
                own = self.est.rate.get(j.spec)
                s = self.est.seconds(j.spec, j.work)
                if s is None and first is not None:
                    s = first * j.work
                if s is None:
                    return None
                if not (own and own[1] > 0):
                    self.rough = True
                if ti == self.current and slot == self.job:
                    ran = time.perf_counter() - self.job_t0
                    if self.tile_total and self.tile_done:
                        s = ran * (self.tile_total - self.tile_done) / self.tile_done
                    else:
                        s = max(s - ran, 0.0)
                total += s
        return total

    def _first_rate(self) -> float | None:
        """Seconds per unit of work from the running job's tiles, when nothing has finished yet."""
        if self.est.total[1] > 0 or self.current is None or self.job is None or not self.tile_done:
            return None
        job = self.tasks[self.current].jobs.get(self.job)
        if job is None or job.work <= 0:
            return None
        ran = time.perf_counter() - self.job_t0
        return ran * self.tile_total / self.tile_done / job.work

    def left_text(self) -> str:
        sec = self.left()
        return _left(sec, getattr(self, "rough", False))

    def task_line(self, ti: int, computed: int, cached: int) -> None:
        t = self.tasks[ti]
        self.log(f"[{self.finished}/{len(self.tasks)}] {t.where}, seed {t.seed}: {computed} computed, "
                 f"{cached} from cache; {self.elapsed():.1f} s elapsed, {self.left_text()}")

    def now_line(self) -> str:
        """Where the run is now, in one line (the plain display's periodic line)."""
        parts = [f"{self.finished}/{len(self.tasks)} task(s) done"]
        if self.current is not None:
            t = self.tasks[self.current]
            parts.append(f"running {t.where}, seed {t.seed}")
            if self.job is not None:
                k = self.computing.index(self.job) + 1 if self.job in self.computing else 0
                parts.append(f"variant {k}/{len(self.computing)} {t.jobs[self.job].label}")
                if self.tile_total:
                    parts.append(f"{self.tile_unit} {self.tile_done}/{self.tile_total}")
        return "; ".join(parts) + f"; {self.elapsed():.0f} s elapsed, {self.left_text()}"


class PlainProgress(Progress):
    """Lines for logs: every finished task, and the state every ``interval`` seconds."""

    def __init__(self, echo: Callable[[str], None] | None = None, interval: float | None = None):
        super().__init__(echo)
        self.interval = _interval() if interval is None else interval
        self.last = time.perf_counter()

    def log(self, msg: str) -> None:
        self.last = time.perf_counter()
        self.echo(msg)

    def _maybe(self) -> None:
        if self.interval > 0 and time.perf_counter() - self.last >= self.interval:
            self.log(f"... {self.now_line()}")

    def job_start(self, ti: int, slot: int) -> None:
        super().job_start(ti, slot)
        self._maybe()

    def tile(self, done: int, total: int, unit: str = "tiles") -> None:
        super().tile(done, total, unit)
        self._maybe()


class LiveProgress(Progress):
    """A rich live display on a terminal: tasks, the variants of the current task, the tiles of
    the current variant, each with elapsed time and what is left; messages scroll above it."""

    def __init__(self, stream: TextIO | None = None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, SpinnerColumn, \
            TextColumn, TimeElapsedColumn

        self.console = Console(file=stream or sys.stderr, stderr=stream is None)
        super().__init__(lambda m: self.console.print(m, markup=False, highlight=False, soft_wrap=True))
        self.bars = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=28),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[left]}"),
                                 console=self.console, transient=True, refresh_per_second=4)
        self.ids: dict[str, int] = {}
        self.started = False
        self.job_label = ""

    def _bar(self, name: str, description: str, total: float | None, completed: float = 0) -> None:
        if name not in self.ids:
            self.ids[name] = self.bars.add_task(description, total=total, completed=completed, left="")
        else:  # reset, so that the elapsed time is this task's or this variant's own
            self.bars.reset(self.ids[name], description=description, total=total, completed=completed,
                            visible=True)

    def _refresh_left(self) -> None:
        if "tasks" in self.ids:
            self.bars.update(self.ids["tasks"], left=self.left_text())

    def begin(self, tasks: list, cached: list[set[int]], label: str = "", skipped: list[int] = ()) -> None:
        super().begin(tasks, cached, label, skipped)
        if not self.started:
            self.bars.start()
            self.started = True
        self._bar("tasks", label or "tasks", len(self.tasks), self.finished)

    def task_start(self, ti: int, slots: list[int]) -> None:
        super().task_start(ti, slots)
        t = self.tasks[ti]
        self._bar("jobs", f"  {_clip(t.where)}, seed {t.seed}: variants", len(slots), 0)
        self._refresh_left()

    def job_start(self, ti: int, slot: int) -> None:
        super().job_start(ti, slot)
        self.job_label = _clip(self.tasks[ti].jobs[slot].label, 40)
        self._bar("tiles", f"    {self.job_label}", None, 0)
        self._refresh_left()

    def tile(self, done: int, total: int, unit: str = "tiles") -> None:
        super().tile(done, total, unit)
        if "tiles" in self.ids:
            self.bars.update(self.ids["tiles"], total=total, completed=done,
                             description=f"    {self.job_label}: {unit}")
        self._refresh_left()

    def job_done(self, ti: int, slot: int) -> None:
        super().job_done(ti, slot)
        if "jobs" in self.ids:
            self.bars.advance(self.ids["jobs"])
        self._refresh_left()

    def task_done(self, ti: int, computed: int, cached: int, seconds: float) -> None:
        super().task_done(ti, computed, cached, seconds)
        self.bars.update(self.ids["tasks"], completed=self.finished)
        for name in ("jobs", "tiles"):
            if name in self.ids:
                self.bars.update(self.ids[name], visible=False)
        self._refresh_left()

    def task_line(self, ti: int, computed: int, cached: int) -> None:
        # The bars show the state; a finished task is worth a line only when it is slow, so that
        # the scrollback keeps a record of long runs without one line per tiny task.
        if time.perf_counter() - self.task_t0 > 5 or self.current is None:
            super().task_line(ti, computed, cached)

    def end(self) -> None:
        if self.started:
            self.bars.stop()
            self.started = False


def short_name(recipe) -> str:
    """A recipe as people call it: its preset's name when it is one, else its short spec."""
    from ..numerics.recipe import PRESETS

    spec = recipe.spec()
    s = next((name for name, p in PRESETS.items() if p.recipe.spec() == spec), None) or recipe.short_str()
    return s if len(s) <= 60 else s[:57] + "..."


def _clip(text: str, n: int = 48) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _left(sec: float | None, rough: bool = False) -> str:
    if sec is None:
        return "time left: estimating"
    # rough: some recipe's cost is borrowed from others' (not yet timed), so only the order of
    # magnitude is meant
    text = f"~{sec:.0f} s left" if sec < 90 else f"~{sec / 60:.1f} min left"
    return text + (" (rough: not every variant timed yet)" if rough else "")


def _interval() -> float:
    from ..env import env_number

    return env_number("FA3N_PROGRESS_INTERVAL", DEFAULT_INTERVAL)


def make_progress(stream: TextIO | None = None, mode: str | None = None) -> Progress:
    """The display for ``stream`` (stderr): live on a terminal, plain lines otherwise.
    ``mode`` (or ``FA3N_PROGRESS``): ``live``, ``plain``, ``off`` (messages only) or ``auto``."""
    stream = stream or sys.stderr
    from ..env import env_choice

    mode = (mode or env_choice("FA3N_PROGRESS", "auto", ("auto", "live", "plain", "off"))).lower()
    echo = lambda m: print(m, file=stream, flush=True)  # noqa: E731
    if mode == "off":
        return Progress(echo)
    if mode == "live" or (mode == "auto" and _is_terminal(stream)):
        return LiveProgress(None if stream is sys.stderr else stream)
    return PlainProgress(echo)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def as_progress(progress) -> Progress:
    """``progress`` as a ``Progress``: itself, or a plain display printing through a callable."""
    if isinstance(progress, Progress):
        return progress
    return PlainProgress(progress)


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc, 10 ms resolution), or None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class PhaseClock:
    """Wall seconds per phase of a command, printed only when ``FA3N_TIMINGS`` is set: the
    first phase is everything before the clock started (interpreter, imports, checks), unless
    ``start_up`` is False. ``sync`` (e.g. ``torch.cuda.synchronize``) is called before each
    reading when timings are on, so that a phase owns the GPU work it queued."""

    def __init__(self, start_up: bool = True, sync: Callable[[], None] | None = None):
        self.enabled = os.environ.get("FA3N_TIMINGS", "") not in ("", "0")
        self.sync = sync if self.enabled else None
        age = process_age() if start_up else None
        self.phases: list[tuple[str, float]] = [("start-up", age)] if age is not None else []
        self._t = time.perf_counter()

    def done(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.phases.append((name, now - self._t))
        self._t = now

    def report(self, echo: Callable[[str], None]) -> None:
        if self.enabled and self.phases:
            total = sum(sec for _, sec in self.phases)
            echo("timings: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in self.phases) + f"; total {total:.2f} s")


__all__ = ["Progress", "PlainProgress", "LiveProgress", "make_progress", "as_progress", "Estimator", "task_work",
           "PhaseClock", "process_age", "short_name"]
