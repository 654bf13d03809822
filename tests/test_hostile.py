"""Hostile inputs and faults, tried as a hostile user would: each class of fault with the
behaviour that replaced the lost file, the silent NaN, the raw markup or the traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fa3_numerics.engine.files import OutputFolder, atomic_path, clean_dead_temps, clean_stale_temps, is_own_temp

TINY = ["--seqlen", "64", "--heads", "1", "--batch", "1", "--rows", "8", "--variants", "fa3-fp8"]


def one_line(code, err, words, exit_code=2, after_start=False):
    """Exit ``exit_code`` with one error line holding ``words`` (after the start line, for faults found while running)."""
    lines = err.strip().splitlines()
    assert code == exit_code, err
    assert len(lines) == 1 + after_start and lines[-1].startswith("error: ") and words in lines[-1], err


# -- clean-up removes only this tool's temp files ------------------------------------------------

def test_every_temp_file_the_tool_makes_has_its_name(tmp_path):
    target = tmp_path / "outliers.nc"
    with atomic_path(target) as tmp:
        assert is_own_temp(tmp.name, "outliers.nc") and tmp.parent == tmp_path
        tmp.write_text("x")
    with atomic_path(target, hold=True) as tmp:
        holder = tmp.parent
        assert is_own_temp(holder.name, "outliers.nc") and holder.parent == tmp_path
        tmp.write_text("y")
    assert target.read_text() == "y" and sorted(p.name for p in tmp_path.iterdir()) == ["outliers.nc"]
    # negative controls: a user's hidden .tmp files are not the tool's
    for name in (".thesis.tmp", ".a.png.1.tmp", ".x.fa3n-short.tmp", ".x.fa3n-ABCDEFGH.tmp", "x.fa3n-abcdefgh.tmp"):
        assert not is_own_temp(name), name


def test_clean_up_of_an_interrupted_run_keeps_the_users_tmp_files(tmp_path):
    out = tmp_path / "X"
    (out / ".cells").mkdir(parents=True)
    (out / "figures").mkdir()
    mine = [out / ".thesis.tmp", out / ".cells" / ".notes.tmp", out / "figures" / ".draft.png.tmp"]
    for f in mine:
        f.write_text("draft")
    stale = [out / ".outliers.nc.fa3n-k3j2h1ab.tmp", out / ".cells" / ".0123.npz.fa3n-x9y8_zzz.tmp"]
    for f in stale:
        f.write_bytes(b"")
    with OutputFolder(out) as path:
        assert path == out
    assert all(f.read_text() == "draft" for f in mine)
    assert not any(f.exists() for f in stale)


@pytest.mark.slow
def test_a_run_counts_only_its_own_temp_files(tmp_path, cli):
    out = tmp_path / "X"
    out.mkdir()
    mine = out / ".thesis.tmp"
    mine.write_text("draft")
    (out / ".summary.md.fa3n-abcdefgh.tmp").write_bytes(b"")
    code, _, err = cli("run", "outliers", *TINY, "--out", out)
    assert code == 0, err
    assert "removed 1 temp file(s) of an interrupted run" in err
    assert mine.read_text() == "draft"


_HOLDER = """
import sys, time
from fa3_numerics.engine.files import atomic_path
with atomic_path(sys.argv[1], hold=True) as tmp:
    tmp.write_bytes(b"half a capture")
    print(tmp, flush=True)
    time.sleep(120)
"""


def test_a_killed_captures_temp_files_are_removed_by_the_next_capture(tmp_path):
    pytest.importorskip("safetensors")
    from fa3_numerics.data.capture import load_capture
    from fa3_numerics.testing import write_capture

    target = tmp_path / "cap.safetensors"
    other = tmp_path / "other.safetensors"
    writers = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(p)], stdout=subprocess.PIPE, text=True)
               for p in (target, other)]
    try:
        temps = [os.path.dirname(w.stdout.readline().strip()) for w in writers]
        assert all(is_own_temp(os.path.basename(t)) for t in temps)
        assert clean_dead_temps(target) == []  # its writer is alive: kept
        writers[0].kill()  # SIGKILL: nothing of its own clean-up runs
        writers[0].wait(timeout=10)
        assert os.path.isdir(temps[0])
        write_capture(target, heads=2, kv_heads=1, tokens=8, layers=(0,))
        assert not os.path.exists(temps[0])
        assert os.path.isdir(temps[1])  # another name's writer, still running: untouched
        assert load_capture(target).tokens == 8
    finally:
        for w in writers:
            w.kill()
            w.wait(timeout=10)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".other")) == ["cap.safetensors"]


# -- a refused run leaves no empty --out behind --------------------------------------------------

def test_a_run_refused_while_running_removes_the_out_it_created(tmp_path, cli, inf_k):
    out = tmp_path / "a" / "b" / "out"
    code, _, err = cli("run", "outliers", *TINY, "--dist", inf_k, "--out", out)
    one_line(code, err, "non-finite value(s) in K", after_start=True)
    assert not (tmp_path / "a").exists()
    # an --out that existed before is kept, with what was in it
    keep = tmp_path / "mine"
    keep.mkdir()
    code, _, err = cli("run", "outliers", *TINY, "--dist", inf_k, "--out", keep)
    assert code == 2 and keep.is_dir()


def test_output_folder_removes_only_what_it_created_and_left_empty(tmp_path):
    with pytest.raises(RuntimeError):
        with OutputFolder(tmp_path / "x" / "y") as path:
            (path / ".cells").mkdir()
            raise RuntimeError("refused")
    assert list(tmp_path.iterdir()) == []
    with OutputFolder(tmp_path / "z") as path:
        (path / ".cells").mkdir()
        (path / ".cells" / "cell.npz").write_bytes(b"a finished cell")
    assert (tmp_path / "z" / ".cells" / "cell.npz").exists()  # a finished cell is a result: kept
