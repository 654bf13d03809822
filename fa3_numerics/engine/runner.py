"""The one study runner: tasks of (inputs, reference, jobs) through backends, cached, resumable,
in this process or on dask.

Exposed: ``Job``, ``Task``, ``TaskResult``, ``RunResult``, ``compute_task``, ``run_tasks``.

Every study (``fa3_numerics.studies``) reduces to a list of ``Task``s. A task draws its inputs
once (``fa3_numerics.engine.inputs``), refuses unusable ones, picks its query rows
(``fa3_numerics.engine.sampling``), computes the float64 reference once (or takes it from the
task's probe), and runs each ``Job`` (a recipe through a backend) on them, measuring every
registered metric per (batch, head) sample. A job may name another job of the task
(``against``): it is then also compared with that job's output, output for output (the
emulator against the kernel in ``validate``). A task may name a probe, ``"module:function"``,
that computes extra statistics from the inputs (the audit's), and may return the reference.

Results are placed by slot, never by completion order, so a dataset does not depend on the
number of workers. Each finished job is written to the cache as soon as it finishes
(``fa3_numerics.engine.cache``); ``run_tasks`` reads what is cached and submits only what is
missing, so a killed sweep resumes where it stopped. Non-finite outputs and references are
measured, not dropped: the metrics carry them and ``notes`` say where.

Progress goes to a ``fa3_numerics.engine.progress.Progress`` (a live display on a terminal, plain
lines otherwise; any ``Callable[[str], None]`` is wrapped into the plain one): the plan, each task
and variant as it starts and ends, and, in this process, each tile of the emulator through its
``PROGRESS`` hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import time
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from ..numerics.metrics import METRICS, compare_outputs, per_sample
from ..numerics.recipe import Recipe
from . import cache as _cache
from .heap import release_free_memory
from .backends import get_backend
from .inputs import (HIST_EDGES, CaptureInputs, DistInputs, TensorInputs, check_inputs, default_scale, input_histogram,
                     input_summary)
from .progress import PhaseClock, Progress, as_progress, short_name
from .sampling import deterministic_matmuls, query_rows


class JobEvents(Protocol):
    """What ``compute_task`` reports while it runs in this process (``run_tasks`` binds it to
    the task's ``Progress``); on a dask worker nothing is reported until the task returns."""

    def job_start(self, slot: int) -> None: ...

    def job_done(self, slot: int) -> None: ...

    def tile(self, done: int, total: int, unit: str = "tiles") -> None: ...


@dataclasses.dataclass
class Job:
    """One recipe through one backend. ``key`` names its cache file (``""``: not cached)."""

    slot: int
    recipe: Recipe
    key: str = ""
    backend: str = ""  # "" = the task's
    against: int | None = None  # slot of the job whose outputs this one is compared with


@dataclasses.dataclass
class Task:
    """One draw of inputs and every job on them. ``hist_key``: cache file of the inputs' |x|
    histogram (``""`` = compute without caching; None = no histogram)."""

    inputs: DistInputs | CaptureInputs | TensorInputs
    causal: bool
    seed: int  # of the query-row sample and of the rotations
    rows: int
    backend: str
    device: str
    jobs: list[Job]
    hist_key: str | None = ""
    where: str = ""
    modules: tuple[str, ...] = ()  # imported first on a worker (they register what the task needs)
    softmax_scale: float | None = None
    probe: str = ""
    # window_size / softcap / sinks of the attention (numerics/masking.py); empty: plain causal or full
    masking: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TaskResult:
    metrics: dict[int, dict[str, np.ndarray]]  # slot -> metric -> [B, H]
    hist: np.ndarray | None = None
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


@dataclasses.dataclass
class RunResult:
    results: list[dict[int, dict[str, np.ndarray]]]
    hists: list[np.ndarray | None]
    extras: list[dict[str, np.ndarray]]
    seconds: list[float]
    reused: int
    notes: list[str]
    not_run: int = 0  # tasks skipped by a deadline


def _names(job: Job) -> list[str]:
    return list(METRICS) + (list(compare_outputs.NAMES) if job.against is not None else [])


def _sample_shape(task: Task) -> tuple[int, int] | None:
    """(batch, heads) of every per-sample array of ``task`` where the task says it without drawing."""
    inp = task.inputs
    if isinstance(inp, DistInputs):
        return (inp.batch, inp.heads)
    if isinstance(inp, TensorInputs):
        return tuple(inp.q.shape[:2])
    return None


def _fits(arrays: dict[str, np.ndarray], shape: tuple | None) -> bool:
    """Whether a cache file's arrays are what this code writes: real floats, one shape (``shape``
    where known). A file of another layout (edited, or by other code under the same key) is
    recomputed, never read as results."""
    shapes = {a.shape for a in arrays.values()}
    return (all(a.dtype.kind == "f" for a in arrays.values()) and len(shapes) == 1
            and (shape is None or shapes == {tuple(shape)}) and len(next(iter(shapes))) == 2)


def _probe(path: str) -> Callable:
    mod, fn = path.split(":")
    return getattr(importlib.import_module(mod), fn)


@contextlib.contextmanager
def _tile_hook(events: JobEvents | None):
    """Route the emulator's per-tile progress to ``events`` for the duration of one job."""
    if events is None:
        yield
        return
    from ..numerics.emulator import PROGRESS

    token = PROGRESS.set(events.tile)
    try:
        yield
    finally:
        PROGRESS.reset(token)


def compute_task(task: Task, cache_dir: str | None = None, threads: int = 0,
                 events: JobEvents | None = None) -> TaskResult:
    """Run every job of ``task``; write each result to the cache as it finishes.

    ``threads`` > 0 sets torch's intra-op threads (workers that share the CPU use 1).
    ``events`` receives each job's start and end and the emulator's tiles (in this process).
    """
    t0 = time.perf_counter()
    if threads > 0:
        torch.set_num_threads(threads)
    clock = PhaseClock(start_up=False, sync=_device_sync(task.device))
    deterministic_matmuls()
    for mod in task.modules:
        importlib.import_module(mod)
    device = task.device  # on a pinned dask worker, "cuda" is its own GPU (engine/distributed.py)
    cdir = Path(cache_dir) if cache_dir else None
    where = f"{task.inputs.describe()}" + (f" at {task.where}" if task.where else "") + f", seed {task.seed}"
    q, k, v = task.inputs.draw(device)
    n, d = q.shape[2], q.shape[3]
    scale = default_scale(d, task.softmax_scale)
    # One pass over the inputs gives both the checks' numbers and the histogram, where both are wanted.
    summary = input_summary(q, k, v) if task.hist_key is not None else None
    check_inputs(q, k, v, scale=scale, where=where, summary=summary)
    hist = None
    if task.hist_key is not None:
        hist = summary.hist if summary is not None else input_histogram(q, k, v)
        if cdir is not None and task.hist_key:
            _cache.save(cdir / f"{task.hist_key}.npz", {"hist": hist})
    q, k, v = (t.to(device) for t in (q, k, v))
    q_index = query_rows(n, task.rows, task.seed, device)
    clock.done("inputs")
    extras: dict[str, np.ndarray] = {}
    ref = None
    if task.probe:
        extras = dict(_probe(task.probe)(task, q, k, v, q_index))
        ref = extras.pop("reference", None)
    if ref is None or task.masking:  # the statistics probe's reference is plain causal attention
        from ..numerics.reference import reference_attention

        ref = reference_attention(q, k, v, causal=task.causal, softmax_scale=task.softmax_scale, q_index=q_index,
                                  **task.masking)
    clock.done("reference")
    notes = []
    bad_ref = int((~torch.isfinite(ref)).sum())
    if bad_ref:
        notes.append(f"{where}: the float64 reference holds {bad_ref} non-finite value(s)")
    shared: dict = {}
    outputs: dict[int, torch.Tensor] = {}
    wanted = {j.against for j in task.jobs if j.against is not None}
    results: dict[int, dict[str, np.ndarray]] = {}
    for job in task.jobs:
        backend = get_backend(job.backend or task.backend)
        # Keys added after the emulator's prepare cache was written keep their tensors apart.
        ns = job.recipe.cache_namespace()
        cache = shared.setdefault(ns, {}) if ns else shared
        if events is not None:
            events.job_start(job.slot)
        if task.masking:
            from ..numerics.masking import masking

            mk = masking(task.causal, heads=q.shape[1], seqlen_q=q.shape[2], seqlen_k=k.shape[2], **task.masking)
            why = backend.masking_refusal(mk)
            if why is not None:
                raise UsageError(f"{where}: {mk.describe()}: {why}")
        with _tile_hook(events):
            o = backend.attention(job.recipe, q, k, v, causal=task.causal, q_index=q_index,
                                  rotation_seed=task.seed, cache=cache, softmax_scale=task.softmax_scale,
                                  **task.masking)
        vals = per_sample(o, ref)
        if job.against is not None:
            vals.update(compare_outputs(o, outputs[job.against], ref))
        if job.slot in wanted:
            outputs[job.slot] = o
        results[job.slot] = vals
        if cdir is not None and job.key:
            _cache.save(cdir / f"{job.key}.npz", vals)
        if events is not None:
            events.job_done(job.slot)
        del o
        release_free_memory(device)  # the next variant starts from what is live, not a fragmented heap
        if clock.enabled:  # naming the recipe costs a pass over the presets
            clock.done(short_name(job.recipe))
    clock.report(lambda m: print(f"{where}: {m}", file=sys.stderr, flush=True))
    return TaskResult(results, hist, extras, notes, time.perf_counter() - t0)


def _device_sync(device: str) -> Callable[[], None] | None:
    """What makes a timing include the GPU work queued before it (FA3N_TIMINGS)."""
    return torch.cuda.synchronize if device.startswith("cuda") and torch.cuda.is_available() else None


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Bound:
    """A task's events bound to its index in the run (``JobEvents`` for ``compute_task``)."""

    progress: Progress
    ti: int

    def job_start(self, slot: int) -> None:
        self.progress.job_start(self.ti, slot)

    def job_done(self, slot: int) -> None:
        self.progress.job_done(self.ti, slot)

    def tile(self, done: int, total: int, unit: str = "tiles") -> None:
        self.progress.tile(done, total, unit)


def run_tasks(tasks: list[Task], *, cache_dir: Path | None = None, workers: int = 0, scheduler: str | None = None,
              progress: Progress | Callable[[str], None] = _progress, deadline: float | None = None,
              label: str = "") -> RunResult:
    """Results of every task, in task order.

    Cached jobs are read, not recomputed; a task whose every job and histogram is cached is not
    submitted. ``workers=0`` (and no ``scheduler``) computes in this process; otherwise tasks go
    to dask.distributed. ``deadline`` (a ``time.perf_counter()`` value, in-process only) skips
    the tasks that would start after it, leaving their results empty. ``progress``: a
    ``Progress`` or a callable taking message lines; ``label`` names the run in the display.
    """
    progress = as_progress(progress)
    results: list[dict[int, dict]] = [{} for _ in tasks]
    hists: list[np.ndarray | None] = [None] * len(tasks)
    extras: list[dict] = [{} for _ in tasks]
    seconds = [float("nan")] * len(tasks)
    notes: list[str] = []
    todo: list[tuple[int, Task]] = []
    cached_slots: list[set[int]] = []
    reused = 0
    warn = lambda m: progress(f"warning: {m}")  # noqa: E731
    for ti, task in enumerate(tasks):
        cached_slots.append(set())
        missing = []
        for job in task.jobs:
            got = _cache.load(cache_dir / f"{job.key}.npz", _names(job), warn) if cache_dir and job.key else None
            if got is not None and not _fits(got, _sample_shape(task)):
                warn(f"cached result {job.key}.npz holds arrays of the wrong shape or dtype; recomputing it")
                got = None
            if got is None:
                missing.append(job)
            else:
                results[ti][job.slot] = got
                cached_slots[ti].add(job.slot)
                reused += 1
        # A job compared against another needs that one's outputs, not only its metrics.
        need = {j.against for j in missing if j.against is not None}
        missing += [j for j in task.jobs if j.slot in need and j not in missing]
        missing.sort(key=lambda j: task.jobs.index(j))
        h = None
        if task.hist_key and cache_dir is not None:
            h = _cache.load(cache_dir / f"{task.hist_key}.npz", ["hist"], warn)
            if h is not None and not _fits(h, (3, len(HIST_EDGES))):
                warn(f"cached result {task.hist_key}.npz holds arrays of the wrong shape or dtype; recomputing it")
                h = None
            if h is not None:
                hists[ti] = h["hist"]
        hist_missing = task.hist_key is not None and h is None
        if missing or hist_missing or task.probe:
            # A missing histogram alone recomputes one job to regenerate the inputs; a cached
            # histogram is not rewritten (hist_key "" tells the task not to save it). A probe
            # alone (every job cached) runs no job: it draws the inputs itself.
            todo.append((ti, dataclasses.replace(task, jobs=missing or ([] if task.probe else task.jobs[:1]),
                                                 hist_key=(task.hist_key if hist_missing else
                                                           (None if task.hist_key is None else "")))))
    total = len(tasks)

    def finish(ti: int, sub: Task, res: TaskResult) -> None:
        results[ti].update(res.metrics)
        if res.hist is not None:
            hists[ti] = res.hist
        extras[ti] = res.extras
        seconds[ti] = res.seconds
        for note in res.notes:
            notes.append(note)
            progress(f"warning: {note}")
        progress.task_done(ti, len(sub.jobs), len(tasks[ti].jobs) - len(sub.jobs), res.seconds)

    queued = {ti for ti, _ in todo}
    progress.begin(tasks, cached_slots, label, skipped=[ti for ti in range(total) if ti not in queued])
    if len(todo) < total:
        progress(f"{total - len(todo)} of {total} task(s) fully cached; {reused} variant result(s) reused")
    not_run = 0
    try:
        if todo and (workers or scheduler):
            from .distributed import run_dask

            run_dask(todo, compute_task, cache_dir=cache_dir, workers=workers, scheduler=scheduler, finish=finish,
                     progress=progress)
        else:
            for i, (ti, sub) in enumerate(todo):
                if deadline is not None and time.perf_counter() > deadline:
                    not_run = len(todo) - i
                    progress(f"deadline reached: {not_run} task(s) not run")
                    break
                progress.task_start(ti, [j.slot for j in sub.jobs])
                finish(ti, sub, compute_task(sub, str(cache_dir) if cache_dir else None,
                                             events=_Bound(progress, ti)))
    finally:
        progress.end()
    return RunResult(results, hists, extras, seconds, reused, notes, not_run)


__all__ = ["Job", "Task", "TaskResult", "RunResult", "compute_task", "run_tasks"]
