"""Distributed sweeps: in this process and on dask with 1 and 2 workers give identical datasets,
and a sweep killed midway resumes without recomputing any finished cell and ends with the same
dataset."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import xarray as xr

pytest.importorskip("distributed")

from fa3_numerics.studies.ablation import load_ablation, run_ablation, tasks  # noqa: E402

# Provenance that legitimately differs between runs.
VOLATILE = {"created_utc", "wall_seconds", "cells_reused", "workers", "command", "hostname", "device_name",
            "loadavg_start", "loadavg_end", "history", "source"}  # history: time + command; source: device


pytestmark = pytest.mark.slow  # dask clusters and a killed subprocess sweep


def assert_same(a: xr.Dataset, b: xr.Dataset) -> None:
    assert set(a.data_vars) == set(b.data_vars)
    for m in a.data_vars:
        np.testing.assert_array_equal(a[m].values, b[m].values, err_msg=m)
    for c in a.coords:
        np.testing.assert_array_equal(a[c].values, b[c].values, err_msg=c)
    keep = lambda d: {k: v for k, v in d.items() if k not in VOLATILE}  # noqa: E731
    assert keep(a.attrs) == keep(b.attrs)


@pytest.fixture(scope="module")
def toml(ablation_toml):
    """2 x 2 cells (p x seqlen), 2 seeds, the core design over 3 x 2 levels, with attribution."""
    return ablation_toml(description="distributed test", data=(("outliers", {"p": [0.001, 0.01], "sigma": [10.0]}),),
                         shape={"seqlen": [128, 256]}, run={"seeds": [0, 1], "attribution": True},
                         designs=[{"name": "core", "gran": ["tensor", "head", "block"], "rot": ["none", "hadamard"]}])


@pytest.fixture(scope="module")
def uninterrupted(toml, tmp_path_factory, threads):
    """The sweep in this process (workers 0, one torch thread as a dask worker has), on 1 dask
    worker and on 2, each into its own empty cache."""
    out = {}
    for w in (0, 1, 2):
        cache = tmp_path_factory.mktemp(f"w{w}")
        with threads(1):
            out[w] = run_ablation(load_ablation(str(toml)), cache_dir=cache, workers=w, progress=lambda m: None)
    return out


def test_one_and_two_workers_give_identical_datasets(uninterrupted):
    ds1, ds2 = uninterrupted[1], uninterrupted[2]
    assert np.isfinite(ds1["rmse"].sel(variant=[v for v, s in zip(ds1["variant"].values, ds1["stage"].values)
                                                 if s == "full"])).all()
    assert_same(ds1, ds2)


def test_two_workers_match_the_in_process_run(uninterrupted):
    """The dataset does not depend on where the cells ran: 2 worker processes, each computing
    its own share in its own order, give what one process gives, bit for bit."""
    assert_same(uninterrupted[0], uninterrupted[2])
    assert uninterrupted[0].attrs["workers"] == 0 and uninterrupted[2].attrs["workers"] == 2


# Loaded by every Python process of the killed sweep (driver and dask workers) through PYTHONPATH:
# after a cache file is written, once the cache holds KILL_AFTER files, the whole process group
# (the sweep's session) is killed with SIGKILL. The kill therefore always lands mid-sweep, at a
# point set by the sweep's own progress, not by how fast this machine is.
KILL_HOOK = """
import os, signal
_after = int(os.environ.get("FA3N_TEST_KILL_AFTER", "0"))
if _after:
    from fa3_numerics.engine import cache as _cache
    _save = _cache.save
    def save(path, arrays):
        _save(path, arrays)
        if sum(1 for _ in path.parent.glob("*.npz")) >= _after:
            os.killpg(os.getpgid(0), signal.SIGKILL)
    _cache.save = save
"""
KILL_AFTER = 30


def test_killed_sweep_resumes_without_recomputing_and_matches(toml, tmp_path, uninterrupted, threads):
    out = tmp_path / "run"
    cells = out / ".cells"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    env = dict(os.environ, FA3N_TEST_KILL_AFTER=str(KILL_AFTER),
               PYTHONPATH=os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]))
    ts, _ = tasks(load_ablation(str(toml)))
    variant_keys = {j.key for t in ts for j in t.jobs}
    assert len(variant_keys) > 2 * KILL_AFTER  # the kill lands well before the end
    cmd = [sys.executable, "-c", "from fa3_numerics.cli import main; main()", "run", "ablation", "--experiment",
           str(toml), "--workers", "2", "--out", str(out), "--report", ""]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (out / "tiny.nc").exists()
    for _ in range(500):  # wait until no process of the sweep's group is left (workers included)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        pytest.fail("processes of the killed sweep survive")
    finished = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cells.glob("*.npz")}
    assert len(finished) >= KILL_AFTER
    msgs = []
    with threads(1):  # resumed in this process: also checks that in-process and dask results agree bit for bit
        ds = run_ablation(load_ablation(str(toml)), cache_dir=cells, workers=0, progress=msgs.append)
    for p, stamp in finished.items():
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stamp, f"{p.name} was rewritten"
    done = {p.stem for p in finished} & variant_keys
    assert 0 < len(done) < len(variant_keys)
    computed = sum(int(m.split(": ")[1].split(" computed")[0]) for m in msgs if " computed, " in m)
    assert computed == len(variant_keys) - len(done)  # exactly the unfinished variants ran
    assert_same(ds, uninterrupted[1])
