"""Datasets follow the CF/xarray conventions (engine/conventions.py), and older datasets still load.

One tiny run (2 p values, seqlen 64, 2 heads) is written through the CLI; the committed
tests/fixtures/h200_table3_before_conventions.nc stands for a dataset written before the conventions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from fa3_numerics.engine.conventions import attr_list, upgrade
from fa3_numerics.engine.dataset import read, write

# reports/h200/table3_emulator.nc as the H200 script wrote it before the conventions (git 16ba9d8^);
# kept here because the committed reports have since been rewritten in the new conventions.
OLD = Path(__file__).resolve().parents[1] / "fixtures" / "h200_table3_before_conventions.nc"


pytestmark = pytest.mark.slow  # datasets written through the CLI


@pytest.fixture(scope="module")
def run_nc(tmp_path_factory) -> Path:
    from fa3_numerics.cli import main

    out = tmp_path_factory.mktemp("cf")
    with pytest.raises(SystemExit) as exc:
        main(["run", "outliers", "--p", "0.001,0.01", "--seqlen", "64", "--heads", "2", "--batch", "1", "--rows",
              "16", "--variants", "fa3-fp8,baseline-fp16", "--seeds", "0,1", "--out", str(out)])
    assert (exc.value.code or 0) == 0
    return out / "outliers.nc"


def test_every_variable_and_coordinate_has_long_name_and_units(run_nc):
    raw = xr.load_dataset(run_nc, engine="h5netcdf")  # as any xarray session sees it, no upgrade
    for name in list(raw.data_vars) + list(raw.coords):
        attrs = raw[name].attrs
        assert attrs.get("long_name"), name
        if raw[name].dtype.kind in "fiu" and name not in ("causal",):
            assert "units" in attrs, name
    # CF units (UDUNITS): dimensionless scales are "1", their meaning in long_name; dB in a comment
    assert raw["rmse"].attrs["units"] == "1" and raw["rmse"].attrs["long_name"].startswith("RMSE")
    assert raw["sqnr_db"].attrs["units"] == "1" and "decibels" in raw["sqnr_db"].attrs["comment"]
    assert raw["rel_l2"].attrs["units"] == "1"
    assert raw["p"].attrs["long_name"] == "outlier probability per entry" and raw["p"].attrs["units"] == "1"
    assert raw["sigma"].attrs["units"] == "1" and raw["seqlen"].attrs["units"] == "1"
    assert raw.attrs["Conventions"] == "CF-1.10"
    assert raw.attrs["title"].startswith("FA3 paper Table 3")
    assert raw.attrs["command"] in raw.attrs["history"]


def test_lists_are_arrays_counts_integers_every_dim_indexed(run_nc):
    raw = xr.load_dataset(run_nc, engine="h5netcdf")
    assert isinstance(raw.attrs["seeds"], np.ndarray) and raw.attrs["seeds"].tolist() == [0, 1]  # not "[0, 1]"
    assert read(run_nc).attrs["seeds"] == [0, 1]
    assert raw["nonfinite"].dtype.kind == "i" and raw["abs_hist"].dtype.kind == "i"
    assert set(raw.dims) <= set(raw.indexes), set(raw.dims) - set(raw.indexes)
    # abs_bin is indexed by its bins' lower edges: 0, then 10 per decade from 1e-3
    edges = raw["abs_bin"].values
    assert edges[0] == 0 and edges[1] == pytest.approx(1e-3) and np.allclose(np.diff(np.log10(edges[1:])), 0.1)
    # the histogram counts every entry of Q, K and V once: batch x heads x seqlen x head_dim each
    assert (raw["abs_hist"].sum("abs_bin") == 1 * 2 * 64 * 128).all()


def test_rmse_plot_labels_itself(run_nc):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = xr.load_dataset(run_nc, engine="h5netcdf")
    try:
        plt.figure()
        raw.rmse.plot()  # 5 dims: a histogram of every sample, its x axis named and in units
        label = lambda text: " ".join(text.split())  # noqa: E731  xarray wraps long labels
        assert label(plt.gca().get_xlabel()) == "RMSE against the float64 reference, in the units of V [1]"
        plt.figure()
        line = raw["rmse"].sel(variant="fa3-fp8").mean(["seed", "batch", "head"], keep_attrs=True).plot()
        ax = line[0].axes
        assert label(ax.get_ylabel()) == "RMSE against the float64 reference, in the units of V [1]"
        assert label(ax.get_xlabel()) == "outlier probability per entry [1]"
    finally:
        plt.close("all")


def test_attr_list_reads_old_and_new_spellings():
    ds = xr.Dataset(attrs={"a": "[0, 1]", "b": np.int64(3), "c": np.array([4, 5]), "d": ["x", "y"], "e": "x"})
    assert attr_list(ds, "a") == [0, 1] and attr_list(ds, "b") == [3] and attr_list(ds, "c") == [4, 5]
    assert attr_list(ds, "d") == ["x", "y"] and attr_list(ds, "e") == ["x"] and attr_list(ds, "z", [7]) == [7]


def test_a_dataset_written_before_the_conventions_loads_upgraded(tmp_path):
    raw = xr.load_dataset(OLD, engine="h5netcdf")
    assert raw.attrs["seeds"] == "[0]" and "abs_bin" not in raw.indexes and raw["nonfinite"].dtype.kind == "f"
    ds = read(OLD)
    assert attr_list(ds, "seeds") == [0] and "abs_bin" in ds.indexes and "abs_bin_lo" not in ds.coords
    assert ds["nonfinite"].dtype.kind == "i" and ds["rmse"].attrs["units"] == "1"
    np.testing.assert_array_equal(ds["rmse"].values, raw["rmse"].values)  # numbers untouched
    np.testing.assert_array_equal(ds["abs_bin"].values, raw["abs_bin_lo"].values)
    # written again, it reads back the same (the upgrade is idempotent)
    again = read(write(ds, tmp_path / "again.nc"))
    xr.testing.assert_identical(upgrade(again), again)
    np.testing.assert_array_equal(again["abs_hist"].values, raw["abs_hist"].values)


def test_missing_counts_are_stored_as_integers_with_a_fill_value(tmp_path):
    """A count of a cell that never ran is missing: int32 with _FillValue on disk, NaN in xarray."""
    from fa3_numerics.engine.dataset import FORMAT

    counts = np.array([[0.0, 2.0], [np.nan, 1.0]])
    ds = xr.Dataset({"rmse": (("variant", "seed"), np.ones((2, 2))), "nonfinite": (("variant", "seed"), counts)},
                    coords={"variant": ["a", "b"], "seed": [0, 1]}, attrs={"format": FORMAT})
    path = write(ds, tmp_path / "x.nc")
    import h5py

    with h5py.File(path) as f:
        assert f["nonfinite"].dtype == np.int32 and f["nonfinite"][1, 0] == -1
    back = xr.load_dataset(path, engine="h5netcdf")
    np.testing.assert_array_equal(back["nonfinite"].values, counts)

