"""The engine never loses or mixes results: each fault found by trying bad input as a new
user would, with the behaviour that replaced the traceback or the silent wrong answer."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from fa3_numerics.engine.dataset import read
from fa3_numerics.engine.files import OutputFolder, atomic_path, atomic_write, clean_stale_temps
from fa3_numerics.errors import UsageError

SMALL = ["--seqlen", "128", "--heads", "2", "--batch", "1", "--rows", "16", "--variants", "fa3-fp8,fa3-fp8-no-incoherent"]


def one_line_exit_2(code, err, words, after_start: bool = False):
    """Exit 2 with one error line naming the fix (after the start line, for faults found while running)."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 + after_start and lines[-1].startswith("error: ") and words in lines[-1], err


# -- files: whole or not at all, one owner per folder, no stale temp files ---------------------

def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "f.nc"
    atomic_write(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the new content")
            raise RuntimeError("disk full")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.nc"]


def test_second_owner_of_a_folder_is_refused_and_the_lock_dies_with_its_process(tmp_path):
    out = tmp_path / "o"
    with OutputFolder(out):
        with pytest.raises(UsageError, match="another fa3-numerics process is writing into"):
            with OutputFolder(out):
                pass
        # Another process asking while we hold it is refused too.
        probe = ("import sys\nfrom fa3_numerics.engine.files import OutputFolder\n"
                 "from fa3_numerics.errors import UsageError\n"
                 f"try:\n    OutputFolder({str(out)!r}).__enter__()\nexcept UsageError:\n    sys.exit(7)\n")
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 7
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0  # released with the holder
    # A holder killed by SIGKILL releases it (the kernel drops an flock with its process).
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom fa3_numerics.engine.files import OutputFolder\n"
                               f"OutputFolder({str(out)!r}).__enter__()\nprint('held', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 7
    holder.kill()
    holder.wait(timeout=10)
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
    assert sorted(os.listdir(out)) == []  # no lock file left behind


def test_concurrent_run_into_the_same_out_is_refused_before_writing(tmp_path, cli):
    out = tmp_path / "o"
    with OutputFolder(out):  # a run in progress
        code, _, err = cli(*["run", "outliers", *SMALL, "--out", str(out)])
        one_line_exit_2(code, err, "another fa3-numerics process is writing into")
        assert not (out / "outliers.nc").exists() and not (out / "summary.md").exists()


@pytest.mark.slow
def test_temp_files_of_a_killed_writer_are_removed(tmp_path, cli):
    out = tmp_path / "o"
    (out / ".cells").mkdir(parents=True)
    stale = [out / ".outliers.nc.fa3n-k3j2h1ab.tmp", out / ".cells" / ".0123abcd.npz.fa3n-x9y8_zzz.tmp",
             out / ".summary.md.fa3n-abcdefgh.tmp"]
    for f in stale:
        f.write_bytes(b"")  # what SIGKILL during a write leaves
    keep = out / "notes.txt"
    keep.write_text("mine")
    code, _, err = cli(*["run", "outliers", *SMALL, "--out", str(out)])
    assert code == 0, err
    assert "removed 3 temp file(s) of an interrupted run" in err
    assert not any(f.exists() for f in stale) and keep.read_text() == "mine"
    assert not list(out.rglob(".*.tmp"))


def test_clean_stale_temps_touches_only_temp_files(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / ".a.png.fa3n-1abc2def.tmp").write_bytes(b"")
    (tmp_path / "figures" / "a.png").write_bytes(b"png")
    (tmp_path / ".hidden").write_text("not a temp file")
    (tmp_path / ".a.png.1.tmp").write_text("a user's temp file, not this tool's")
    assert [p.name for p in clean_stale_temps(tmp_path)] == [".a.png.fa3n-1abc2def.tmp"]
    assert (tmp_path / "figures" / "a.png").exists() and (tmp_path / ".hidden").exists()
    assert (tmp_path / ".a.png.1.tmp").exists()


# -- the cache: a broken file is recomputed, with a warning ------------------------------------

@pytest.mark.slow
def test_truncated_cache_file_is_recomputed_with_a_warning(tmp_path, cli):
    out = tmp_path / "o"
    assert cli(*["run", "outliers", *SMALL, "--out", str(out)])[0] == 0
    first = read(out / "outliers.nc")
    victim = sorted((out / ".cells").glob("*.npz"))[0]
    victim.write_bytes(victim.read_bytes()[:40])  # a full disk, a crash of another tool
    code, _, err = cli(*["run", "outliers", *SMALL, "--out", str(out)])
    assert code == 0, err
    assert f"cached result {victim.name} is unreadable (BadZipFile); recomputing it" in err
    again = read(out / "outliers.nc")
    for m in ("rmse", "max_abs", "abs_hist"):
        np.testing.assert_array_equal(first[m].values, again[m].values)
    with np.load(victim) as z:  # rewritten whole: every array readable
        assert z.files and all(z[name].size for name in z.files)


# -- one-line errors instead of tracebacks ------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["--seqlen", "10000000000"], "--seqlen must lie in [1, 16777216]"),
    (["--seqlen", "4000000"], "GiB (float64 Q, K, V and their working copies); this machine has"),
    (["--seeds", "99999999999999999999999"], "--seeds must be integers in [0, 4294967295]"),
    (["--seeds", "-1"], "--seeds must be integers in [0, 4294967295]"),
    (["--scheduler", "not a url"], "is not a dask scheduler address; write it as tcp://HOST:PORT"),
    (["--seqlen", "256,256"], "--seqlen lists 256 twice"),
    (["--p", "0.01,0.010"], "--p lists 0.01 twice"),
    (["--variants", "fa3-fp8,acc=fp22,acc=fp32"], "recipe key acc is given twice"),
    (["--out", ""], "--out is empty; pass a folder"),
    (["--device", "tpu"], "--device 'tpu' is not a device here"),
    (["--dist", "outliers:p=0.01", "--p", "0.02"], "parameter p is given both in --dist and as --p"),
    (["--dist", "outliers:q=1"], "unknown parameter 'q'"),
])
def test_bad_run_options_are_one_line_exit_2_nothing_written(tmp_path, cli, args, words):
    out = tmp_path / "o"
    argv = ["run", "outliers", "--heads", "2", "--batch", "1", "--rows", "16", "--seqlen", "128", *args]
    if "--out" not in args:
        argv += ["--out", str(out)]
    code, _, err = cli(*argv)
    one_line_exit_2(code, err, words)
    assert not out.exists()


def test_out_that_is_a_file_is_refused(tmp_path, cli):
    f = tmp_path / "a_file"
    f.write_text("x")
    code, _, err = cli(*["run", "outliers", *SMALL, "--out", str(f)])
    one_line_exit_2(code, err, f"--out {f} is a file; pass a folder")
    assert f.read_text() == "x"


@pytest.mark.slow
def test_report_and_compare_destinations(tmp_path, cli):
    out = tmp_path / "o"
    assert cli(*["run", "outliers", *SMALL, "--out", str(out)])[0] == 0
    nc = out / "outliers.nc"
    f = tmp_path / "a_file"
    f.write_text("x")
    code, _, err = cli(*["report", str(nc), "--out", str(f)])
    one_line_exit_2(code, err, "is a file; pass a folder")
    folder = tmp_path / "existing"
    folder.mkdir()
    code, _, err = cli(*["compare", str(nc), str(nc), "--out", str(folder)])
    one_line_exit_2(code, err, "is a folder; pass a file name inside it")
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob(".*.tmp"))
    code, _, err = cli(*["compare", str(nc), str(nc), "--out", str(tmp_path / "cmp.md")])
    assert code == 0 and (tmp_path / "cmp.md").read_text().startswith("# Comparison")


def test_backends_refuses_an_unknown_device(cli):
    from fa3_numerics.engine.backends import available_backends

    code, _, err = cli(*["backends", "--device", "tpu"])
    one_line_exit_2(code, err, "--device 'tpu' is not a device here; use cpu, cuda or cuda:N")
    assert all(why is not None for why in available_backends("tpu").values())
    assert available_backends("cpu")["emulate"] is None


# -- recorded values are the values used --------------------------------------------------------

@pytest.mark.slow
def test_rows_beyond_seqlen_record_the_rows_evaluated(tmp_path, cli):
    out = tmp_path / "o"
    code, _, err = cli(*["run", "outliers", "--seqlen", "64,128", "--heads", "1", "--batch", "1", "--rows", "100",
                        "--variants", "fa3-fp8", "--out", str(out)])
    assert code == 0, err
    assert "--rows 100 >= seqlen 64" in err
    ds = read(out / "outliers.nc")
    assert ds["rows"].dims == ("seqlen",) and list(ds["rows"].values) == [64, 100]


@pytest.mark.slow
def test_captured_suffix_parameters_are_recorded(tmp_path, cli):
    pytest.importorskip("safetensors")
    from fa3_numerics.testing import write_capture

    path = tmp_path / "cap.safetensors"
    write_capture(path, heads=2, kv_heads=1, tokens=96)
    out = tmp_path / "o"
    code, _, err = cli(*["run", "outliers", "--dist", f"captured:{path}@rope=0,layer=1", "--heads", "2",
                        "--kv-heads", "1", "--head-dim", "64", "--seqlen", "128", "--batch", "1", "--rows", "16",
                        "--variants", "fa3-fp8", "--out", str(out)])
    assert code == 0, err
    ds = read(out / "outliers.nc")
    assert float(ds["rope"]) == 0.0 and float(ds["layer"]) == 1.0
    assert ds.attrs["dist"] == f"captured:{path}"


def test_ctrl_c_says_what_is_kept(tmp_path, cli, monkeypatch):
    import fa3_numerics.studies.outliers as outliers

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(outliers, "compute_experiment", interrupted)
    code, _, err = cli(*["run", "outliers", *SMALL, "--out", str(tmp_path / "o")])
    assert code == 130
    assert "interrupted; finished results are kept" in err


def test_non_finite_inputs_are_refused_with_the_cell(tmp_path, cli, inf_k):
    """An Inf in K would make the descale fall back to 1 and the cast saturate: every FP8 output
    finite while the reference is NaN. The engine refuses the inputs instead."""
    code, _, err = cli("run", "outliers", "--dist", inf_k, "--seqlen", "64", "--heads", "1", "--batch", "1",
                       "--rows", "8", "--variants", "fa3-fp8", "--out", str(tmp_path / "o"))
    one_line_exit_2(code, err, "inf-k(where=0) at single cell, seed 0: 1 non-finite value(s) in K", after_start=True)


def test_inputs_that_overflow_float64_attention_are_refused(tmp_path, cli):
    # A family's own parameter check may refuse it up front (outliers' sigma does); the engine
    # refuses whatever gets through: here K's outlier channels at 1e300 make Q K^T overflow.
    code, _, err = cli(*["run", "outliers", "--dist", "channel-outliers", "--scale", "1e300", "--seqlen", "64",
                        "--heads", "1", "--batch", "1", "--rows", "8", "--variants", "fa3-fp8", "--out",
                        str(tmp_path / "o")])
    one_line_exit_2(code, err, "overflow float64 attention", after_start=True)


def test_an_in_process_run_leaves_no_import_running(tmp_path, cli, monkeypatch):
    """Called in-process, `run` imports the report's modules in a thread beside its runs; that
    thread must be done when the command returns. One still importing changed sys.modules under
    the next pytest test ("dictionary changed size during iteration", seen on a loaded machine).
    A module that takes 2 s to import, last in the list, would outlive the command without it."""
    import threading

    import fa3_numerics.engine.prefetch as prefetch

    (tmp_path / "fa3n_slow_import.py").write_text("import time\ntime.sleep(2.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fa3n_slow_import", raising=False)
    real, started = prefetch.prefetch, []

    def spy(modules, interval=prefetch.SWITCH_INTERVAL):
        started.append(real((*modules, "fa3n_slow_import"), interval))
        return started[-1]

    monkeypatch.setattr(prefetch, "prefetch", spy)
    code, _, err = cli("run", "outliers", *SMALL, "--out", tmp_path / "o")
    assert code == 0, err
    assert started and not any(t.is_alive() for t in started)
    assert "fa3n_slow_import" in sys.modules
    assert not [t for t in threading.enumerate() if t.name == "fa3n-prefetch"]
