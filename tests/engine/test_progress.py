"""Live progress (engine/progress.py): events from the runner and the emulator's tiles, the
estimate of what is left, the plain lines of a log and the live display of a terminal."""

from __future__ import annotations

import io

import pytest
import torch

from fa3_numerics.data import distributions
from fa3_numerics.engine.inputs import DistInputs
from fa3_numerics.engine.progress import Estimator, LiveProgress, PlainProgress, Progress, make_progress, task_work
from fa3_numerics.engine.runner import Job, Task, run_tasks
from fa3_numerics.numerics import emulator
from fa3_numerics.numerics.recipe import Recipe

FA3 = Recipe.from_str("fa3-fp8")
BASE = Recipe.from_str("baseline-fp8")


class Recorder(Progress):
    """Keeps every event, in order."""

    def __init__(self):
        super().__init__(echo=lambda m: self.events.append(("log", m)))
        self.events: list = []

    def task_start(self, ti, slots):
        super().task_start(ti, slots)
        self.events.append(("task", ti))

    def job_start(self, ti, slot):
        super().job_start(ti, slot)
        self.events.append(("job", ti, slot))

    def tile(self, done, total, unit="tiles"):
        super().tile(done, total, unit)
        self.events.append(("tile", done, total, unit))

    def job_done(self, ti, slot):
        super().job_done(ti, slot)
        self.events.append(("done", ti, slot))


def _tasks(n_tasks=2, seqlen=256):
    return [Task(DistInputs("outliers", (("p", 0.001), ("sigma", 10.0)), 1, 2, 2, seqlen, 64, seed), False, seed, 32,
                 "emulate", "cpu", [Job(0, FA3), Job(1, BASE)], None, f"cell {seed}") for seed in range(n_tasks)]


def test_runner_reports_tasks_variants_and_tiles_in_order():
    rec = Recorder()
    run_tasks(_tasks(), progress=rec)
    kinds = [e[0] for e in rec.events]
    assert kinds.count("task") == 2 and kinds.count("job") == 4 and kinds.count("done") == 4
    # within the flash variant the KV tiles count up to their number (256 keys / the kernel's
    # kBlockN); the standard (baseline) variant reports blocks of query rows
    first = rec.events.index(("job", 0, 0))
    tiles = [e for e in rec.events[first:rec.events.index(("done", 0, 0))] if e[0] == "tile"]
    n_tiles = -(-256 // FA3.tiles(64, False)[1])
    done = [t[1] for t in tiles]
    assert done == sorted(done) and done[-1] == n_tiles and set(range(1, n_tiles + 1)) <= set(done)
    assert {t[2] for t in tiles} == {n_tiles} and tiles[-1][3] == "KV tiles"
    blocks = [e for e in rec.events[rec.events.index(("job", 0, 1)):rec.events.index(("done", 0, 1))] if e[0] == "tile"]
    assert blocks and blocks[-1][1] == blocks[-1][2] and blocks[-1][3] == "row blocks"
    assert [m for k, m in [(e[0], e[-1]) for e in rec.events] if k == "log"][-1].startswith("[2/2] cell 1, seed 1")


def test_the_tile_hook_changes_no_number():
    shape = distributions.AttnShape(1, 2, 320, 64)
    q, k, v = distributions.generate("outliers", shape, 0)
    qi = torch.arange(0, 320, 5)
    plain = emulator.emulate(FA3, q, k, v, q_index=qi)
    seen = []
    token = emulator.PROGRESS.set(lambda d, t, u: seen.append((d, t)))
    try:
        hooked = emulator.emulate(FA3, q, k, v, q_index=qi)
    finally:
        emulator.PROGRESS.reset(token)
    assert torch.equal(plain, hooked)
    assert seen[-1][0] == seen[-1][1] == -(-320 // FA3.tiles(64, False)[1])


def test_estimate_weighs_work_and_recipe():
    """Seconds left = the measured seconds per unit of work of each recipe x the work left."""
    est = Estimator()
    est.record("fast", 2.0, 100.0)
    est.record("slow", 20.0, 100.0)
    assert est.seconds("fast", 50.0) == pytest.approx(1.0)
    assert est.seconds("slow", 50.0) == pytest.approx(10.0)
    assert est.seconds("unseen", 50.0) == pytest.approx(50.0 * 22.0 / 200.0)  # the mean rate
    t = _tasks(1, seqlen=128)[0]
    assert task_work(t) == 32 * 128 * 2 * 1 * 64  # rows x keys x heads x batch x head dim


def test_plain_progress_prints_periodic_lines_naming_variant_and_tile():
    lines = []
    p = PlainProgress(lines.append, interval=1e-9)  # every event is past the interval
    run_tasks(_tasks(1), progress=p)
    periodic = [m for m in lines if m.startswith("... ")]
    assert any("variant 1/2 fa3-fp8" in m and "KV tiles" in m for m in periodic), periodic[:3]
    assert any("variant 2/2 baseline-fp8" in m for m in periodic)
    assert lines[-1].startswith("[1/1] cell 0, seed 0: 2 computed, 0 from cache;") and "s left" in lines[-1]


def test_live_progress_draws_bars_on_a_terminal():
    from rich.console import Console

    p = LiveProgress(stream=io.StringIO())
    tasks = _tasks(2)
    p.begin(tasks, [set(), set()], "outliers")
    p.task_start(0, [0, 1])
    p.job_start(0, 0)
    p.tile(3, 8, "KV tiles")
    screen = Console(file=io.StringIO(), width=120, record=True)
    screen.print(p.bars.get_renderable())
    frame = screen.export_text()
    p.end()
    lines = frame.splitlines()
    assert lines[0].split()[1] == "outliers" and "0/2" in lines[0]  # the tasks
    assert "cell 0, seed 0: variants" in lines[1] and "0/2" in lines[1]  # the variants of the running task
    assert "fa3-fp8: KV tiles" in lines[2] and "3/8" in lines[2]  # the tiles of the running variant


def test_make_progress_chooses_by_terminal_and_environment(monkeypatch):
    monkeypatch.delenv("FA3N_PROGRESS", raising=False)
    assert type(make_progress(io.StringIO())) is PlainProgress  # a file: plain lines
    monkeypatch.setenv("FA3N_PROGRESS", "off")
    assert type(make_progress(io.StringIO())) is Progress
    monkeypatch.setenv("FA3N_PROGRESS", "live")
    assert isinstance(make_progress(io.StringIO()), LiveProgress)


@pytest.mark.slow
def test_a_dask_run_prints_its_dashboard_or_how_to_get_one():
    import importlib.util

    lines = []
    run_tasks(_tasks(2, seqlen=128), workers=2, progress=lines.append)
    dask = [m for m in lines if m.startswith("dask: LocalCluster with 2")]
    assert len(dask) == 1
    if importlib.util.find_spec("bokeh") is not None:
        assert " dashboard http://" in dask[0]
    else:
        assert "no dashboard (it needs bokeh: pip install 'bokeh>=3.1')" in dask[0]
    assert sum(m.startswith("[") for m in lines) == 2  # one line per finished task, from the workers' results


def test_phase_clock_prints_only_when_asked(monkeypatch):
    """FA3N_TIMINGS=1: one line naming each phase with its seconds, the start-up (process age)
    first; unset: nothing. The phases add up to the total it prints."""
    import re

    from fa3_numerics.engine.progress import PhaseClock, process_age

    age = process_age()
    assert age is None or 0.0 <= age < 24 * 3600
    lines = []
    monkeypatch.delenv("FA3N_TIMINGS", raising=False)
    quiet = PhaseClock()
    quiet.done("runs")
    quiet.report(lines.append)
    assert lines == []
    monkeypatch.setenv("FA3N_TIMINGS", "1")
    clock = PhaseClock()
    clock.done("runs")
    clock.done("report")
    clock.report(lines.append)
    assert len(lines) == 1 and lines[0].startswith("timings: ")
    secs = [float(x) for x in re.findall(r"(\d+\.\d+) s", lines[0])]
    names = re.findall(r"([a-z-]+) \d", lines[0])
    assert names[-3:] == ["runs", "report", "total"] and abs(sum(secs[:-1]) - secs[-1]) <= 0.01 * len(secs)


def test_the_first_estimate_comes_from_the_running_job_s_tiles(monkeypatch):
    """Before any job has finished, the running job's tiles give a rate: a one-cell run says
    how long it has left from its first tiles instead of "estimating" until a variant ends; and
    that figure is marked rough until every recipe has been timed."""
    import fa3_numerics.engine.progress as prog

    clock = {"t": 100.0}
    monkeypatch.setattr(prog.time, "perf_counter", lambda: clock["t"])
    p = Progress(lambda m: None)
    tasks = _tasks(1)
    p.begin(tasks, [set()], "outliers")
    p.task_start(0, [0, 1])
    p.job_start(0, 0)
    assert p.left() is None  # nothing to go on yet
    clock["t"] += 2.0
    p.tile(1, 4, "KV tiles")  # a quarter of the first job in 2 s: 8 s a job of this work
    left = p.left()
    assert left == pytest.approx(6.0 + 8.0)  # 6 s of this job, 8 s of the other, of equal work
    assert p.rough and "rough" in p.left_text()
    clock["t"] += 6.0
    p.job_done(0, 0)
    p.job_start(0, 1)
    assert p.left() == pytest.approx(8.0) and p.rough  # the second recipe is not timed yet
    clock["t"] += 8.0
    p.job_done(0, 1)
    assert p.left() == pytest.approx(0.0) and not p.rough
    assert "rough" not in prog._left(3.0, False) and "rough" in prog._left(3.0, True)
