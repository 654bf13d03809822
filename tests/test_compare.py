"""Tests of `fa3-numerics compare`: alignment by variant and swept values, ratios with
intervals, and one-line errors. Datasets are tiny runs written with ``dataset.write``."""

from __future__ import annotations

from pathlib import Path

import pytest
import xarray as xr

from fa3_numerics.studies.compare import compare
from fa3_numerics.engine.dataset import read, write
from fa3_numerics.studies.outliers import load_experiment, run_experiment

VARIANTS = "baseline-fp16,baseline-fp8,fa3-fp8"


pytestmark = pytest.mark.slow  # runs written and compared through the CLI


def _make(path: Path, **over) -> Path:
    o = dict(seqlen=[128], batch=1, heads=4, rows=32, variants=[VARIANTS]) | over
    return write(run_experiment(load_experiment("outliers", o), progress=lambda m: None), path)


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


def test_ratios_of_known_scalings_and_pooling_by_hand(pair):
    """B is A with each variant's per-sample RMSE scaled by a known factor: the pooled RMSE
    (sqrt of the mean square over samples, computed here by hand) scales by it, so B/A is the
    factor; every paired resample has the same ratio, so the interval is the factor itself,
    and it covers 1 only where the factor is 1."""
    import numpy as np

    a = read(pair[0])
    factors = {"baseline-fp16": 1.0, "baseline-fp8": 1.5, "fa3-fp8": 0.5}
    b = a.copy()
    b["rmse"] = a["rmse"] * xr.DataArray(list(factors.values()), dims="variant",
                                         coords={"variant": list(factors)})
    res = compare(a, b)
    assert res["paired"]
    for r in res["rows"]:
        c = factors[r["variant"]]
        by_hand = float(np.sqrt(np.mean(a["rmse"].sel(variant=r["variant"]).values ** 2)))
        assert r["a"] == pytest.approx(by_hand, rel=1e-12) and r["b"] == pytest.approx(c * by_hand, rel=1e-12)
        assert r["ratio"] == pytest.approx(c, rel=1e-12)
        assert r["ratio_lo"] == pytest.approx(c, rel=1e-9) and r["ratio_hi"] == pytest.approx(c, rel=1e-9)
        assert r["covers_1"] == (c == 1.0)


def test_cli_prints_table_and_writes_markdown(pair, tmp_path, cli):
    out_md = tmp_path / "cmp.md"
    rc, out, err = cli("compare", pair[0], pair[1], "--out", out_md)
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
def test_bad_input_is_one_line_exit_2(case, pair, tmp_path, cli):
    a, b = pair
    if case == "no_common_variants":
        b = _make(tmp_path / "c.nc", seqlen=[64], heads=2, variants=["exact"])
    elif case == "missing":
        b = tmp_path / "nope.nc"
    else:
        b = tmp_path / "junk.nc"
        b.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    rc, out, err = cli("compare", a, b)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    if case == "no_common_variants":
        assert "no variants in common" in lines[0]


# -- hardware variants, settings that differ, gates -------------------------------------------

def _hardware(ds, prefix="fa3"):
    """``ds`` as the H200 script writes hardware runs: variants named BACKEND:VARIANT."""
    names = [f"{prefix}:{v}" for v in ds["variant"].values]
    return ds.assign_coords(variant=names, backend=("variant", [prefix] * len(names)))


def test_hardware_variants_match_the_recipe_they_run(pair, tmp_path):
    a = read(pair[0])
    b = read(write(_hardware(a), tmp_path / "hw.nc"))
    res = compare(a, b)
    assert [(r["variant_a"], r["variant_b"]) for r in res["rows"]] == [(v, f"fa3:{v}") for v in VARIANTS.split(",")]
    assert all(r["same_spec"] for r in res["rows"]) and not res["only_a"] and not res["only_b"]
    # the same numbers and the same samples: paired, so every resample gives exactly 1
    assert res["paired"] and all(r["ratio_lo"] == r["ratio"] == r["ratio_hi"] == pytest.approx(1.0) for r in res["rows"])


def test_a_hardware_label_matches_by_spec_before_name(pair, tmp_path):
    a = read(pair[0])
    b = a.assign_coords(variant=["sdpa-math:renamed", "fa3:baseline-fp8", "triton:fa3-fp8"])
    pairs = [(r["variant_a"], r["variant_b"]) for r in compare(a, b)["rows"]]
    assert pairs == [("baseline-fp16", "sdpa-math:renamed"), ("baseline-fp8", "fa3:baseline-fp8"),
                     ("fa3-fp8", "triton:fa3-fp8")]


def test_differing_settings_are_a_warning_at_the_top(pair, tmp_path, cli):
    a = read(pair[0])
    b = write(a.assign_coords(sigma=30.0), tmp_path / "sigma30.nc")
    rc, out, err = cli("compare", pair[0], b, "--out", tmp_path / "c.html")
    assert rc == 0, err
    assert out.splitlines()[0] == "warning: SETTINGS DIFFER between the runs (the ratios compare different " \
                                  "settings): sigma: A 10.0, B 30.0."
    html = (tmp_path / "c.html").read_text()
    assert html.index("SETTINGS DIFFER") < html.index("<table")
    assert out.strip().splitlines()[-1] == f"wrote 1 file(s): {tmp_path / 'c.html'}"


def test_gates_fail_with_exit_1_and_pass_with_0(pair, tmp_path, cli):
    a = read(pair[0])
    worse = a.copy()
    worse["rmse"] = a["rmse"] * xr.where(a["variant"] == "fa3-fp8", 1.2, 1.0)
    b = write(worse, tmp_path / "worse.nc")
    rc, out, err = cli("compare", pair[0], b, "--fail-above", "1.1")
    assert rc == 1
    failed = [line for line in err.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 1 and failed[0].startswith("FAILED: fa3-fp8 at single cell: B/A = 1.2 > 1.1")
    assert err.strip().splitlines()[-1] == "error: 1 comparison(s) failed the gate --fail-above 1.1"
    rc, _, err = cli("compare", pair[0], b, "--fail-above", "1.25")
    assert rc == 0, err
    # a 20% change on the same samples is far outside the paired interval: not covered
    rc, _, err = cli("compare", pair[0], b, "--fail-if-not-covered")
    assert rc == 1 and "excludes 1" in err
    rc, _, err = cli("compare", pair[0], pair[0], "--fail-if-not-covered", "--fail-above", "1.0001")
    assert rc == 0, err
    rc, _, err = cli("compare", pair[0], b, "--fail-above", "1.1", "--metric", "cosine")
    assert rc == 2 and "applies to error metrics" in err and len(err.strip().splitlines()) == 1


def test_few_samples_are_warned(tmp_path, cli):
    a = _make(tmp_path / "few.nc", seqlen=[64], heads=2, variants=["fa3-fp8"])
    rc, out, _ = cli("compare", a, a)
    assert rc == 0 and "A's intervals rest on 2 sample(s), fewer than 8" in out
