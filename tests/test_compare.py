"""Tests of `fa3-numerics compare`: alignment by variant and swept values, ratios with
intervals, and one-line errors. Datasets are tiny runs written with ``dataset.write``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fa3_numerics.cli import main
from fa3_numerics.studies.compare import compare
from fa3_numerics.engine.dataset import read, write
from fa3_numerics.studies.outliers import load_experiment, run_experiment

VARIANTS = "baseline-fp16,baseline-fp8,fa3-fp8"


def _make(path: Path, **over) -> Path:
    o = dict(seqlen=[128], batch=1, heads=4, rows=32, variants=[VARIANTS]) | over
    return write(run_experiment(load_experiment("outliers", o), progress=lambda m: None), path)


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code or 0, out, err


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cmp")
    return _make(d / "a.nc", seeds=[0, 1, 2]), _make(d / "b.nc", seeds=[3, 4, 5])


def test_two_seeds_agree_within_intervals(pair):
    a, b = (read(p) for p in pair)
    res = compare(a, b)
    rows = res["rows"]
    assert [r["variant"] for r in rows] == VARIANTS.split(",")
    for r in rows:
        assert 0.5 < r["ratio"] < 2.0, r
        assert r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"]
        assert r["a_lo"] <= r["a"] <= r["a_hi"] and r["b_lo"] <= r["b"] <= r["b_hi"]
        assert r["n_a"] == r["n_b"] == 12
    assert sum(r["covers_1"] for r in rows) >= 2, rows


def test_same_dataset_has_ratio_one(pair):
    a = read(pair[0])
    for r in compare(a, a)["rows"]:
        assert r["ratio"] == pytest.approx(1.0)
        assert r["covers_1"]


def test_cli_prints_table_and_writes_markdown(pair, tmp_path, capsys):
    out_md = tmp_path / "cmp.md"
    rc, out, err = cli(capsys, "compare", pair[0], pair[1], "--out", out_md)
    assert rc == 0, err
    assert "B/A" in out and "covers 1" in out and "fa3-fp8" in out
    assert "ratio intervals" in out and str(pair[0]) in out and str(pair[1]) in out
    assert read(pair[0]).attrs["device_name"] in out
    md = out_md.read_text()
    assert md.startswith("# Comparison of rmse") and "| variant |" in md and "baseline-fp8" in md


def test_aligns_swept_and_fixed_values(tmp_path):
    a = read(_make(tmp_path / "a.nc", p=[0.0, 0.01], seqlen=[64], heads=2, variants=["fa3-fp8,baseline-fp8"]))
    b = read(_make(tmp_path / "b.nc", p=[0.01], seqlen=[64], heads=2, variants=["baseline-fp8,exact"]))
    res = compare(a, b)
    assert res["dims"] == ["p"]
    assert [(r["p"], r["variant"]) for r in res["rows"]] == [(0.01, "baseline-fp8")]
    assert res["rows"][0]["ratio"] == pytest.approx(1.0)  # same seeds, same cell
    assert res["only_a"] == ["fa3-fp8"] and res["only_b"] == ["exact"]


@pytest.mark.parametrize("case", ["no_common_variants", "missing", "not_ours"])
def test_bad_input_is_one_line_exit_2(case, pair, tmp_path, capsys):
    a, b = pair
    if case == "no_common_variants":
        b = _make(tmp_path / "c.nc", seqlen=[64], heads=2, variants=["exact"])
    elif case == "missing":
        b = tmp_path / "nope.nc"
    else:
        b = tmp_path / "junk.nc"
        b.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    rc, out, err = cli(capsys, "compare", a, b)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    if case == "no_common_variants":
        assert "no variants in common" in lines[0]
