"""benchmarks/bench_gpus.py's comparison of two sweeps' datasets (its verdict "bit-identical")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import xarray as xr

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpus.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpus", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ds(rmse, hostname="a"):
    return xr.Dataset({"rmse": ("variant", np.array(rmse)), "spec": ("variant", np.array(["x", "y"]))},
                      coords={"variant": ["bf16", "fp8"], "paper_rmse": ("variant", [np.nan, np.nan])},
                      attrs={"hostname": hostname, "seeds": "0,1"})


def test_nan_coordinates_and_volatile_attrs_are_not_differences():
    # The ablation's paper_rmse coordinate is NaN everywhere: NaN == NaN for this comparison.
    assert _bench()._differences(_ds([1.0, 2.0]), _ds([1.0, 2.0], hostname="b")) == []


def test_a_changed_value_or_attribute_is_named():
    b = _bench()
    assert b._differences(_ds([1.0, 2.0]), _ds([1.0, 2.0000001])) == ["rmse"]
    other = _ds([1.0, 2.0])
    other.attrs["seeds"] = "0"
    assert b._differences(_ds([1.0, 2.0]), other) == ["attr seeds"]
