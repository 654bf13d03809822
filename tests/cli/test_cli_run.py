"""`fa3-numerics run outliers` end to end: determinism, resume, and one-line errors."""

import subprocess
import sys

import numpy as np
import pytest
import xarray as xr

from fa3_numerics.cli import main
from fa3_numerics.engine.dataset import read

SMALL = ["--seqlen", "256", "--heads", "2", "--rows", "64", "--variants", "fa3-fp8,baseline-fp16"]


pytestmark = pytest.mark.slow  # end-to-end CLI runs


def run(args, capsys=None):
    with pytest.raises(SystemExit) as exc:
        main(["run", "outliers", *args])
    return exc.value.code


def test_same_seed_twice_gives_identical_values(tmp_path, capsys):
    for d in ("a", "b"):
        assert run(SMALL + ["--seeds", "0,1", "--out", str(tmp_path / d)]) in (0, None)
    a, b = read(tmp_path / "a" / "outliers.nc"), read(tmp_path / "b" / "outliers.nc")
    for m in ("rmse", "max_abs", "abs_hist"):
        np.testing.assert_array_equal(a[m].values, b[m].values)
    assert list(a.attrs["seeds"]) == [0, 1] and "command" in a.attrs and "git_commit" in a.attrs
    assert a["rmse"].dims == ("variant", "seed", "batch", "head")
    assert set(a["variant"].values) == {"fa3-fp8", "baseline-fp16"}
    # a different seed gives different numbers
    assert not np.array_equal(a["rmse"].sel(seed=0).values, a["rmse"].sel(seed=1).values)


def test_rerun_resumes_from_cache(tmp_path, capsys):
    out = tmp_path / "r"
    run(SMALL + ["--out", str(out)])
    first = read(out / "outliers.nc")
    cells = {p: p.stat().st_mtime_ns for p in (out / ".cells").rglob("*") if p.is_file()}
    assert cells
    run(SMALL + ["--out", str(out)])
    # no cached cell was rewritten, and the dataset is the same
    assert {p: p.stat().st_mtime_ns for p in (out / ".cells").rglob("*") if p.is_file()} == cells
    np.testing.assert_array_equal(first["rmse"].values, read(out / "outliers.nc")["rmse"].values)


def test_sweep_gives_one_dim_per_swept_parameter(tmp_path):
    out = tmp_path / "s"
    run(["--p", "0.001,0.01", "--seqlen", "128,256", "--heads", "1", "--rows", "32", "--variants", "fa3-fp8",
         "--out", str(out)])
    ds = read(out / "outliers.nc")
    assert ds["rmse"].dims == ("p", "seqlen", "variant", "seed", "batch", "head")
    assert ds["rmse"].sel(p=0.01).mean() > ds["rmse"].sel(p=0.001).mean()


@pytest.mark.parametrize("args,words", [
    (["--p", "2"], "--p must lie in [0, 1]"),
    (["--sigma", "-1"], "--sigma must be"),
    (["--head-dim", "100"], "head dim 100 is not supported"),
    (["--variants", "nope"], "unknown variant"),
    (["--p", ","], "empty list"),
    (["--seqlen", "abc"], "expects int"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, words):
    out = tmp_path / "bad"
    proc = subprocess.run([sys.executable, "-m", "fa3_numerics.cli", "run", "outliers", *args, "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not out.exists()


def test_console_entry_keeps_exit_codes_and_flushes_output():
    """The console script exits without the interpreter's teardown: its exit code must still be
    main's (2 for bad input with one line on stderr, 0 for help) and piped output must not be
    lost to the skipped flush."""
    import subprocess
    import sys

    def entry(*args):
        return subprocess.run([sys.executable, "-c", "from fa3_numerics.cli import entry; entry()", *args],
                              capture_output=True, text=True, timeout=120)

    bad = entry("run", "outliers", "--p", "2")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1
    ok = entry("run", "outliers", "--help")
    assert ok.returncode == 0 and "--p" in ok.stdout and ok.stdout.endswith("\n")


def test_console_run_writes_the_same_dataset_from_its_report_process(tmp_path):
    """The console script writes the dataset and report from a process forked before the runs
    (engine.report_process): same files, same numbers and same exit codes as in one process,
    including exit 3 with every file written for non-finite results."""
    import xarray as xr

    def console(out, *args, env=None):
        import os

        return subprocess.run([sys.executable, "-c", "from fa3_numerics.cli import entry; entry()", "run", "outliers",
                               "--seqlen", "64", "--batch", "1", "--heads", "2", "--rows", "16", *args,
                               "--out", str(out), "--fresh"],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))

    forked = console(tmp_path / "a", "--variants", "fa3-fp8,fa3-fp16")
    single = console(tmp_path / "b", "--variants", "fa3-fp8,fa3-fp16", env={"FA3N_FORKS": "0"})
    assert forked.returncode == single.returncode == 0, forked.stderr + single.stderr
    assert "fa3-fp8" in forked.stdout and "wrote 8 file(s)" in forked.stdout
    with xr.open_dataset(tmp_path / "a" / "outliers.nc") as a, xr.open_dataset(tmp_path / "b" / "outliers.nc") as b:
        np.testing.assert_array_equal(a["rmse"].values, b["rmse"].values)
    for name in ("summary.md", "report.html", "figures/variants.png"):
        assert (tmp_path / "a" / name).is_file()
    # The figures drawn in forked processes (engine.forking.forked_map) are the in-process bytes.
    figs = sorted(p.name for p in (tmp_path / "a" / "figures").iterdir())
    assert len(figs) >= 4 and figs == sorted(p.name for p in (tmp_path / "b" / "figures").iterdir())
    for name in figs:
        assert (tmp_path / "a" / "figures" / name).read_bytes() == (tmp_path / "b" / "figures" / name).read_bytes(), name
    bad = console(tmp_path / "c", "--p", "0.01", "--sigma", "300", "--variants", "baseline-fp16,sscale=after")
    assert bad.returncode == 3, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and (tmp_path / "c" / "report.html").is_file()
