"""Results as xarray Datasets: layout, netCDF I/O (atomic), and validation.

Exposed: ``FORMAT``, ``VALIDATION_FORMAT``, ``SAMPLE_DIMS``, ``to_dataset``, ``results_dataset``,
``write``, ``read``, ``dataset_kind``, ``summary_table``, ``paper_setting``, ``PAPER_SETTING``,
``attr_list``.

Layout of a run's dataset: one data variable per metric (``fa3_numerics.numerics.metrics``) with
dims (*swept parameters, variant, seed, batch, head); coordinates for every parameter
(swept ones as dims, the others as scalars); ``spec`` (variant -> canonical recipe
string) and ``paper_rmse`` (variant -> FA3 paper value, NaN where none); attrs with
provenance. Plotting and reports live elsewhere and only read this layout.

Every dataset follows the CF/xarray conventions of ``fa3_numerics.engine.conventions`` (long
names and units, integer counts, list attributes as arrays, an index on every dimension):
``to_dataset`` and ``write`` apply them, and ``read`` upgrades datasets written before them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import xarray as xr

from ..errors import UsageError
from ..numerics.metrics import METRICS, bootstrap_ci, nonfinite_samples, pooled
from .conventions import attr_list  # noqa: F401  re-exported
from .conventions import apply_conventions, cf_attributes, cf_encoding, upgrade
from .files import atomic_path
from .inputs import HIST_EDGES

FORMAT = "fa3-numerics-dataset/1"
VALIDATION_FORMAT = "fa3-numerics-validation/1"
SAMPLE_DIMS = ("seed", "batch", "head")
KINDS = ("run", "ablation", "audit", "validation")


def write(ds: xr.Dataset, path: str | Path) -> Path:
    """Write ``ds`` as netCDF (h5netcdf) to ``path`` whole or not at all (temp file + rename),
    with the conventions of ``fa3_numerics.engine.conventions`` (``ds`` itself is not changed).
    Every dataset, whatever study wrote it (impact, recommend, ...), leaves here CF 1.10 compliant:
    long names, UDUNITS units, ``Conventions``, no fill value on coordinates."""
    ds = apply_conventions(ds) if ds.attrs.get("format") in (FORMAT, VALIDATION_FORMAT) else cf_attributes(ds.copy())
    encoding = cf_encoding(ds)
    for name, enc in _compression(ds).items():
        encoding[name] = encoding.get(name, {}) | enc
    for name, enc in encoding.items():  # an encoding given here replaces the variable's: keep its types
        kept = {k: v for k, v in ds[name].encoding.items() if k in _TYPE_ENCODING}
        encoding[name] = kept | enc
    with atomic_path(path) as tmp:
        ds.to_netcdf(tmp, engine="h5netcdf", encoding=encoding)
    return Path(path)


_TYPE_ENCODING = ("dtype", "_FillValue", "missing_value")


def _compression(ds: xr.Dataset) -> dict:
    """gzip for every numeric array of some size: factorial grids are mostly NaN padding and
    repeated coordinates, so datasets shrink 3-10x and the committed reports stay small enough
    to travel to the GPU machine beside the kernel wheel. Lossless, and any netCDF4/HDF5
    reader (xarray, netCDF4, h5py) decompresses transparently."""
    enc = {}
    for name, var in ds.variables.items():
        if var.dtype.kind in "fiub" and var.size >= 256 and var.ndim > 0:
            enc[name] = {"zlib": True, "complevel": 4, "shuffle": True}
    return enc


def py_value(v):
    """A coordinate's value (a NumPy scalar or array) as a Python scalar or list."""
    v = np.asarray(v)
    return v.item() if v.shape == () else v.tolist()


def same_value(a, b) -> bool:
    """Whether two coordinate values name the same cell: booleans as booleans, numbers within
    floating-point closeness, anything else by equality."""
    if isinstance(a, (bool, np.bool_)) or isinstance(b, (bool, np.bool_)):
        return bool(a) == bool(b)
    try:
        return bool(np.isclose(float(a), float(b)))
    except (TypeError, ValueError):
        return a == b


def dataset_kind(ds: xr.Dataset) -> str | None:
    """Which study wrote ``ds`` (None: not ours): its ``kind`` attribute, written by
    ``engine.study.run_study`` for every study; a dataset from before that attribute is told by
    its format (validation) or coordinates (an ablation has stages, a run has not)."""
    kind = ds.attrs.get("kind")
    if isinstance(kind, str) and kind:
        return kind
    if ds.attrs.get("format") == VALIDATION_FORMAT:
        return "validation"
    if ds.attrs.get("format") != FORMAT or "rmse" not in ds or "variant" not in ds.dims:
        return None
    return "ablation" if "stage" in ds.coords else "run"


def open_netcdf(path: str | Path, hint: str) -> xr.Dataset:
    """Load the netCDF file ``path`` whole; a one-line ``UsageError`` ending in ``hint`` (what to
    give instead) when it is missing or not netCDF. Every reader of the project's datasets starts here."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.nc"))
        inside = f", e.g. {path / found[0]}" if found else ""
        raise UsageError(f"{path} is a folder; pass a dataset file inside it{inside}")
    if not path.is_file():
        raise UsageError(f"no such file: {path}; {hint}")
    try:
        return xr.load_dataset(path, engine="h5netcdf")
    except Exception:  # noqa: BLE001 - any decoder failure means "not our file"
        raise UsageError(f"{path} is not a netCDF dataset; {hint}") from None


def read(path: str | Path, kinds: tuple[str, ...] | None = KINDS) -> xr.Dataset:
    """Open a dataset written by any study (``kinds`` None) or one of ``kinds``, upgraded to the
    current layout (``conventions.upgrade``, then the study's own ``upgrade`` where its class has
    one, found through the study registry); one-line errors for anything else."""
    path = Path(path)
    hint = "give the .nc written by `fa3-numerics run`, `impact`, `recommend`, `audit` or `validate`"
    ds = open_netcdf(path, hint)
    kind = dataset_kind(ds)
    if kind is None:
        raise UsageError(f"{path} is not an fa3-numerics dataset (no '{FORMAT}' marker or study kind); {hint}")
    if kinds is not None and kind not in kinds:
        raise UsageError(f"{path} is a {kind} dataset; this command takes {' or '.join(kinds)} datasets")
    if ds.attrs.get("format") in (FORMAT, VALIDATION_FORMAT):
        ds = upgrade(ds)
    from .study import get_study

    try:
        study = get_study(kind)
    except KeyError:
        return ds
    reader = getattr(study, "upgrade", None)
    return reader(ds) if reader is not None else ds


def _attr(v):
    """netCDF attributes: scalars and strings as they are, lists as arrays, anything else JSON."""
    if isinstance(v, (str, int, float, np.number)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str, np.number)) for x in v):
        return [x.item() if hasattr(x, "item") else x for x in v]  # written as an attribute array
    return json.dumps(v)


def to_dataset(metrics: dict[str, np.ndarray], *, dims: list[str], coords: dict, attrs: dict) -> xr.Dataset:
    data_vars = {m: (dims, np.asarray(metrics[m], dtype=np.float64), {"description": METRICS.get(m, "")})
                 for m in metrics}
    ds = xr.Dataset(data_vars, coords=coords)
    ds.attrs.update({k: _attr(v) for k, v in attrs.items()})
    ds.attrs["format"] = FORMAT
    return apply_conventions(ds)


def results_dataset(metrics: dict[str, np.ndarray], *, dims: list[str], coords: dict, attrs: dict,
                    hist: np.ndarray | None = None, hist_dims: list[str] | None = None) -> xr.Dataset:
    """A study's dataset: one variable per metric over ``dims``, and the inputs' |x| histogram
    (``hist`` over ``hist_dims`` + [tensor, abs_bin]) when given."""
    ds = to_dataset(metrics, dims=dims, coords=coords, attrs=attrs)
    if hist is not None:
        ds["abs_hist"] = (list(hist_dims) + ["tensor", "abs_bin"], hist,
                          {"description": "count of entries with |x| in [abs_bin, next abs_bin) for Q, K, V; "
                                          "the last bin is open"})
        ds = ds.assign_coords(tensor=["Q", "K", "V"], abs_bin=("abs_bin", HIST_EDGES))
    return apply_conventions(ds)


def summary_table(ds: xr.Dataset, metric: str = "rmse", level: float = 0.95) -> list[dict]:
    """One row per (swept cell, variant): pooled metric, bootstrap interval over samples,
    paper value and ratio. Samples are (seed, batch, head); ``n`` counts them and
    ``nonfinite`` how many hold NaN, in which case value and interval are NaN (not an estimate
    over the rest)."""
    sweep = [d for d in ds[metric].dims if d not in SAMPLE_DIMS and d != "variant"]
    stacked = ds[metric].stack(cell=sweep) if sweep else ds[metric].expand_dims(cell=[0])
    rows = []
    for cell in range(stacked.sizes["cell"]):
        sub = stacked.isel(cell=cell)
        where = {d: _scalar(sub.coords[d].values) for d in sweep}
        for variant in ds["variant"].values:
            vals = sub.sel(variant=variant).values
            est = pooled(metric, vals)
            lo, hi = bootstrap_ci(metric, vals, level=level)
            paper = float(ds["paper_rmse"].sel(variant=variant)) if paper_setting(ds, where) else float("nan")
            bad, n = nonfinite_samples(vals)
            rows.append({**where, "variant": str(variant), "value": est, "lo": lo, "hi": hi,
                         "n": n, "nonfinite": bad, "paper": paper,
                         "ratio": est / paper if metric == "rmse" and np.isfinite(paper) else float("nan")})
    return rows


# The FA3 paper's Table 3 setting; its values are compared only where a cell matches it.
# The paper gives no shape: seqlen 8192 is inferred from the H200 measurements (reports/h200/),
# and errors grow with seqlen, so other lengths are not compared.
PAPER_SETTING = {"p": 0.001, "sigma": 10.0, "head_dim": 128, "causal": False, "seqlen": 8192}


def paper_setting(ds: xr.Dataset, where: dict | None = None) -> bool:
    """True when the (cell of the) dataset is the paper's distribution and setting."""
    if ds.attrs.get("dist") != "outliers" or "paper_rmse" not in ds:
        return False
    where = where or {}
    for k, want in PAPER_SETTING.items():
        have = where[k] if k in where else (ds.coords[k].values.item() if k in ds.coords and ds.coords[k].ndim == 0 else None)
        if have is None or not np.isclose(float(have), float(want)):
            return False
    return True


def _scalar(v):
    v = np.asarray(v)
    return v.item() if v.shape == () else v.tolist()
