"""Tests of sweeps in `run`: one dataset dim per swept parameter, the same seed stream in
every cell, a progress line per cell, and one-line errors for empty lists."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fa3_numerics.cli import main
from fa3_numerics.studies.outliers import load_experiment, run_experiment

BASE = dict(batch=1, heads=2, rows=32, variants=["baseline-fp8,fa3-fp8"])


pytestmark = pytest.mark.slow  # swept CLI runs


@pytest.fixture(scope="module")
def swept():
    lines: list[str] = []
    exp = load_experiment("outliers", BASE | dict(p=[0.0, 0.01], sigma=[3.0, 10.0], seqlen=[64, 128], seeds=[0, 1]))
    return run_experiment(exp, progress=lines.append), lines


def test_one_dim_per_swept_parameter(swept):
    ds, _ = swept
    assert ds["rmse"].dims == ("p", "sigma", "seqlen", "variant", "seed", "batch", "head")
    assert ds["abs_hist"].dims == ("p", "sigma", "seqlen", "seed", "tensor", "abs_bin")
    assert list(ds["p"].values) == [0.0, 0.01] and list(ds["seqlen"].values) == [64, 128]
    # unswept parameters stay scalar coords
    assert ds.coords["head_dim"].ndim == 0 and ds.coords["causal"].ndim == 0
    assert np.isfinite(ds["rmse"].values).all()


def test_progress_line_per_cell_and_seed(swept):
    _, lines = swept
    assert len(lines) == 8 * 2
    seen = set()
    for line in lines:
        m = re.match(r"\[(\d+)/16\] (p=.*, sigma=.*, seqlen=\d+), seed (\d)", line)
        assert m, line
        seen.add((m.group(2), int(m.group(3))))
    want = {(f"p={p}, sigma={s}, seqlen={n}", seed) for p in (0.0, 0.01) for s in (3.0, 10.0) for n in (64, 128)
            for seed in (0, 1)}
    assert seen == want
    assert lines[-1].startswith("[16/16]")


def test_same_seed_stream_in_every_cell(swept):
    """A cell of a sweep equals a one-cell run of that setting: nothing depends on the cell's position."""
    ds, _ = swept
    one = run_experiment(load_experiment("outliers", BASE | dict(p=[0.01], sigma=[10.0], seqlen=[128], seeds=[0, 1])),
                         progress=lambda m: None)
    cell = ds.sel(p=0.01, sigma=10.0, seqlen=128)
    np.testing.assert_array_equal(cell["rmse"].values, one["rmse"].values)
    np.testing.assert_array_equal(cell["abs_hist"].values, one["abs_hist"].values)
    # p = 0 cells draw the same N(0,1) bulk for every sigma
    np.testing.assert_array_equal(ds["rmse"].sel(p=0.0, sigma=3.0).values, ds["rmse"].sel(p=0.0, sigma=10.0).values)


@pytest.mark.parametrize("opt", ["--p", "--sigma", "--seqlen", "--head-dim", "--causal", "--seeds"])
def test_empty_sweep_list_is_one_line_exit_2(opt, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "outliers", opt, ",", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and "empty list" in err[0], err
    assert not (tmp_path / "o" / "outliers.nc").exists()
