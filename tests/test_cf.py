"""Every dataset the toolkit writes passes the CF 1.10 check of compliance-checker with no errors.

Datasets of each kind: a fresh tiny run (the outliers study, seqlen 64), and the committed
datasets of the other studies (ablation, audit, validation, backward, impact, recommend, the
Triton Table 3 and a dataset written before the conventions) read with their study's reader and
written again through ``engine.dataset.write``, the one writer every study uses. The checker runs
where it is installed (``pip install -e '.[dev]'``); the checks of ``test_written_run_*`` need no
checker.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import xarray as xr

from fa3_numerics.engine.dataset import read, summary_table, write

ROOT = Path(__file__).resolve().parents[1]
# Units the project's datasets may carry: UDUNITS accepts each ("1": dimensionless).
CF_UNITS = {"1", "count", "s"}


def _checker_errors(path: Path) -> list[str]:
    """compliance-checker's high-priority failures (its errors) of the cf:1.10 check of ``path``."""
    runner = pytest.importorskip("compliance_checker.runner",
                                 reason="compliance-checker is not installed (pip install -e '.[dev]')")
    runner.CheckSuite.load_all_available_checkers()
    out = path.with_suffix(".cf.json")
    runner.ComplianceChecker.run_checker(str(path), ["cf:1.10"], 0, "normal", output_filename=str(out),
                                         output_format="json")
    result = json.loads(out.read_text())["cf:1.10"]
    return [f"{r['name']}: {m}" for r in result["high_priorities"] for m in r["msgs"]]


@pytest.fixture(scope="module")
def run_nc(tmp_path_factory) -> Path:
    """A tiny outliers run (2 p values, seqlen 64, 2 heads, 2 seeds) written as `run` writes it."""
    from fa3_numerics.studies.outliers import load_experiment, run_experiment

    exp = load_experiment("outliers", {"p": [0.001, 0.01], "seqlen": [64], "heads": 2, "batch": 1, "rows": 16,
                                       "variants": ["fa3-fp8", "baseline-fp16"], "seeds": [0, 1]})
    ds = run_experiment(exp, progress=lambda m: None)
    return write(ds, tmp_path_factory.mktemp("cf") / "outliers.nc")


def _reread(rel: str, tmp_path: Path) -> Path:
    """The committed dataset ``rel`` through its study's reader, written again by ``write``."""
    from fa3_numerics.studies.impact_dataset import read_impact
    from fa3_numerics.studies.recommend_dataset import read_recommend

    path = ROOT / rel
    if path.name.startswith("impact"):
        ds = read_impact(path)
    elif path.name == "recommend.nc":
        ds = read_recommend(path)
    elif path.name == "backward.nc":
        ds = xr.load_dataset(path, engine="h5netcdf")  # the backward report opens it as it is
    else:
        ds = read(path)
    return write(ds, tmp_path / path.name)


def test_written_run_has_long_names_units_conventions_and_no_coordinate_fill(run_nc):
    raw = xr.load_dataset(run_nc, engine="h5netcdf")  # as any xarray session sees it, no upgrade
    assert raw.attrs["Conventions"] == "CF-1.10"
    for name in list(raw.data_vars) + list(raw.coords):
        attrs = raw[name].attrs
        assert attrs.get("long_name"), name
        if raw[name].dtype.kind in "fiu":
            assert attrs.get("units") in CF_UNITS, (name, attrs.get("units"))
    # what the old units said lives on in long_name; decibels, which CF has no unit for, in a comment
    assert raw["rmse"].attrs["long_name"].endswith("in the units of V")
    assert raw["seqlen"].attrs["long_name"] == "sequence length (tokens)"
    assert "decibels" in raw["sqnr_db"].attrs["comment"]
    with h5py.File(run_nc) as f:  # the file itself: xarray hides a _FillValue on reading
        coords = [n for n in raw.coords if n in f]
        assert {"p", "abs_bin", "seed", "variant"} <= set(coords)
        assert [n for n in coords if "_FillValue" in f[n].attrs] == []
        assert "_FillValue" in f["rmse"].attrs  # the data keep theirs (NaN marks a cell that did not run)


def test_the_stored_pooling_rule_gives_the_reports_estimate(run_nc):
    """``pooling`` (cell_methods syntax) says how samples combine; applied as written it gives
    summary_table's value, which ``ds.rmse.mean()`` does not."""
    ds = read(run_nc)
    methods = {"root_mean_square": lambda x, d: np.sqrt((x ** 2).mean(d)), "maximum": lambda x, d: x.max(d),
               "sum": lambda x, d: x.sum(d), "mean": lambda x, d: x.mean(d)}
    assert ds["rmse"].attrs["pooling"] == "seed: batch: head: root_mean_square"
    assert ds["max_abs"].attrs["pooling"] == "seed: batch: head: maximum"
    assert ds["nonfinite"].attrs["pooling"] == "seed: batch: head: sum"
    for metric in ("rmse", "max_abs", "rel_l2"):
        *names, method = ds[metric].attrs["pooling"].split()
        dims = [n.rstrip(":") for n in names]
        stored = methods[method](ds[metric], dims)
        rows = summary_table(ds, metric)
        assert rows
        for row in rows:
            got = float(stored.sel(variant=row["variant"], p=row["p"]))
            assert got == pytest.approx(row["value"], rel=1e-12), (metric, row)
    mean = ds["rmse"].mean(["seed", "batch", "head"])
    rms = np.sqrt((ds["rmse"] ** 2).mean(["seed", "batch", "head"]))
    assert not np.allclose(mean, rms, rtol=1e-6)  # negative control: the plain mean is not the estimate


def test_a_dataset_from_before_compliance_is_upgraded(tmp_path):
    """Units UDUNITS rejects, written by older versions, become "1" with their meaning in long_name."""
    old = ROOT / "tests" / "fixtures" / "h200_table3_before_conventions.nc"
    assert xr.load_dataset(old, engine="h5netcdf")["rmse"].attrs.get("units") in (None, "output units")
    ds = xr.load_dataset(write(read(old), tmp_path / "old.nc"), engine="h5netcdf")
    for name in list(ds.data_vars) + list(ds.coords):
        if ds[name].dtype.kind in "fiu":
            assert ds[name].attrs.get("units") in CF_UNITS, (name, ds[name].attrs.get("units"))
    assert ds["abs_bin"].attrs["long_name"].endswith("in the units of Q, K, V as drawn")
    assert ds["rmse"].attrs["long_name"].count("in the units of V") == 1  # idempotent: not appended twice
    again = xr.load_dataset(write(read(tmp_path / "old.nc"), tmp_path / "again.nc"), engine="h5netcdf")
    assert again["rmse"].attrs == ds["rmse"].attrs


def test_fresh_run_passes_the_cf_check(run_nc):
    assert _checker_errors(run_nc) == []


def test_the_checker_finds_errors_in_datasets_from_before(tmp_path):
    """Negative control: datasets as older versions wrote them fail the check, so a pass means something:
    one from before the conventions (no long names), one from before CF compliance (units, fill values)."""
    errors = _checker_errors(_copy(ROOT / "tests" / "fixtures" / "h200_table3_before_conventions.nc", tmp_path))
    assert any("long_name" in e and "rmse" in e for e in errors), errors
    committed = ROOT / "reports" / "outliers" / "default" / "outliers.nc"
    raw = xr.load_dataset(committed, engine="h5netcdf")
    if raw["rmse"].attrs.get("units") != "output units":
        pytest.skip(f"{committed} has been written again since CF compliance")
    errors = _checker_errors(_copy(committed, tmp_path))
    assert any("UDUNITS" in e and "rmse" in e for e in errors), errors
    assert any("_FillValue" in e and "abs_bin" in e for e in errors), errors


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    dst.write_bytes(src.read_bytes())
    return dst


# One committed dataset per kind the project writes; the large ones take the checker ~30 s.
KINDS = {
    "validation": "reports/h200/validation.nc",
    "table3-triton": "reports/h200/triton/table3_hardware.nc",
    "before-conventions": "tests/fixtures/h200_table3_before_conventions.nc",
    "backward": "reports/backward/k-bias/backward.nc",
    "recommend": "reports/recommend-smollm2/recommend.nc",
    "audit": "reports/audit-smollm2/audit.nc",
    "ablation": "reports/ablation/ablation.nc",
    "impact": "reports/impact-smollm2/impact.nc",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_passes_the_cf_check(kind, tmp_path):
    # skip before the re-write: rewriting the committed ablation dataset alone takes ~140 s, all wasted
    # on a machine without the checker (the README's test command installs none)
    pytest.importorskip("compliance_checker.runner", reason="compliance-checker is not installed (pip install -e '.[dev]')")
    assert _checker_errors(_reread(KINDS[kind], tmp_path)) == []
