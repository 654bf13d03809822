"""CF / xarray conventions for every dataset the toolkit writes, and reading older ones.

Exposed: ``CONVENTIONS``, ``apply_conventions``, ``cf_attributes``, ``cf_encoding``, ``upgrade``,
``attr_list``, ``meta_of``.

Every dataset passes compliance-checker's CF 1.10 check (tests/test_cf.py). ``apply_conventions(ds)``
makes a run or validation dataset read well in any xarray session (``ds.rmse.plot()`` labels itself
"RMSE against the float64 reference, in the units of V [1]"):

- ``long_name`` and ``units`` on every data variable and coordinate: metrics from the metric
  registry, distribution parameters from the distribution registry, ablation factors from the
  factor registry, the rest from ``_META`` below. Units are UDUNITS strings: Q, K, V and the
  outputs have no physical unit, so their scales are "1" with the scale named in long_name
  ("in the units of V"), as are sequence lengths and head dims; decibels, which CF has no unit
  for, are "1" with a ``comment``. Older files' "output units", "input units", "tokens",
  "channels" and "dB" are rewritten so;
- ``nan_reason`` on a metric that can be undefined on finite data (the metric's ``undefined``:
  "NaN where O_ref is all zeros ..."), so that a NaN read back says why it is there;
- ``pooling`` on a metric: how a cell's samples combine into the estimate the reports give, in
  cell_methods syntax ("seed: batch: head: root_mean_square"; ``numerics.metrics.pooled``). It is
  not ``cell_methods`` because the stored values are the samples themselves, not pooled;
- ``Conventions``, ``title``, ``history``, ``source`` and ``references`` attributes;
- lists stored as arrays, not JSON strings (``seeds``, ``factors``, ``tiles_fp8``);
- an index coordinate on every dimension (``abs_bin``: the lower edge of each |x| bin);
- counts (``units == "count"``) stored as integers. A count of a cell that never ran is missing:
  such a variable is written as int32 with ``_FillValue`` -1, which xarray reads back as float
  with NaN; a count with no missing cell is int64 in memory and on disk.

``cf_attributes(ds)`` is the attribute part alone, which ``engine.dataset.write`` gives every
other dataset (impact, recommend, backward); ``cf_encoding(ds)`` keeps ``_FillValue`` off the
coordinates, which CF forbids there.

``upgrade(ds)`` brings a dataset written before these conventions (JSON-string lists, an
``abs_bin`` dimension without an index, float counts, units UDUNITS rejects) to the current
layout; ``read`` applies it, so reports and ``compare`` read old and new datasets alike. Both
are idempotent.
"""

from __future__ import annotations

import json

import numpy as np
import xarray as xr

CONVENTIONS = "CF-1.10"
REFERENCES = ("Shah et al. 2024, FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision, "
              "arXiv:2407.08608 (Table 3)")
# Attributes that hold lists; older datasets stored them as JSON strings.
LIST_ATTRS = ("seeds", "factors", "tiles_fp8")
# Q, K, V as drawn (N(0,1) units for the synthetic data) and attention outputs (convex
# combinations of V rows) carry no physical unit: CF's "1", with the scale named in long_name.
IN_INPUT_UNITS = ", in the units of Q, K, V as drawn"
IN_OUTPUT_UNITS = ", in the units of V"
# Units that datasets written before CF 1.10 compliance carry and UDUNITS rejects: each becomes
# "1" and its meaning moves into long_name (or, for decibels, which CF gives no unit, a comment).
_LEGACY_UNITS = {"output units": IN_OUTPUT_UNITS, "input units": IN_INPUT_UNITS, "tokens": " (tokens)",
                 "channels": " (channels)", "dB": ""}
DB_COMMENT = ("in decibels: 10 log10 of a power ratio; CF has no unit for dB (UDUNITS rejects it), so "
              "units is '1'")
# How the samples of one cell combine into its estimate (``numerics.metrics.pooled``), in CF
# cell_methods words; stored as ``pooling`` because the stored values are the unpooled samples.
POOLED_DIMS = ("seed", "batch", "head", "kv_head")  # a run's samples (backward's dK, dV: per kv_head)
_POOL_METHODS = {"rms": "root_mean_square", "max": "maximum", "sum": "sum", "mean": "mean"}

# name -> (long_name, units); units None: a label (strings, flags) that takes none.
_META: dict[str, tuple[str, str | None]] = {
    "variant": ("variant (recipe label)", None),
    "spec": ("canonical recipe spec", None),
    "paper_rmse": ("RMSE in the FA3 paper, Table 3" + IN_OUTPUT_UNITS, "1"),
    "backend": ("backend that computed the variant", None),
    "seed": ("seed of the inputs, the query-row sample and the rotations", "1"),
    "batch": ("batch index", "1"),
    "head": ("query head index", "1"),
    "kv_head": ("key/value head index", "1"),
    "kv_head_of": ("key/value head of the query head", "1"),
    "layer": ("layer index", "1"),
    "channel": ("head-dim channel", "1"),
    "q_block": ("query block (the kernel's kBlockM rows)", "1"),
    "k_block": ("key block (the kernel's kBlockN keys)", "1"),
    "tensor": ("attention input", None),
    "abs_bin": ("lower edge of the |x| histogram bin" + IN_INPUT_UNITS, "1"),
    "abs_bin_lo": ("lower edge of the |x| histogram bin" + IN_INPUT_UNITS, "1"),
    "abs_hist": ("entries of Q, K, V with |x| in the bin", "count"),
    "seqlen": ("sequence length (tokens)", "1"),
    "head_dim": ("head dimension (channels)", "1"),
    "causal": ("causal mask", None),
    "heads": ("query heads", "1"),
    "kv_heads": ("key/value heads", "1"),
    "batch_size": ("batch size", "1"),
    "rows": ("query rows evaluated per (batch, head)", "1"),
    "data": ("input data", None),
    "dist": ("input distribution", None),
    "data_params": ("distribution parameters (JSON)", None),
    "paper_data": ("the FA3 paper's data", None),
    "stage": ("attribution stage of the variant (full: the whole recipe)", None),
    "cost": ("recipe cost (cheapest first)", "1"),
    # validation
    "case": ("validation case", None),
    "acc": ("emulator accumulator model", None),
    "sample": ("(batch, head) sample index", "1"),
    "dtype": ("input format", None),
    "gran": ("scale granularity", None),
    "rot": ("rotation", None),
    "params": ("distribution parameters", None),
    "fidelity": ("F = RMSE(emulator - kernel) / RMSE(kernel - float64)", "1"),
    "fidelity_sample": ("F per (batch, head) sample", "1"),
    "identical": ("share of bit-identical outputs", "1"),
    "identical_sample": ("share of bit-identical outputs per (batch, head) sample", "1"),
    "rmse_emulator": ("RMSE of the emulator against float64" + IN_OUTPUT_UNITS, "1"),
    "rmse_kernel": ("RMSE of the kernel against float64" + IN_OUTPUT_UNITS, "1"),
    "max_rel_diff": ("max |emulator - kernel| / |kernel|", "1"),
    "seconds": ("wall time of the case", "s"),
    "nonfinite_kernel": ("non-finite outputs of the kernel", "count"),
    "nonfinite_emulator": ("non-finite outputs of the emulator", "count"),
    "nonfinite_emulator_only": ("outputs non-finite in the emulator where the kernel's are finite", "count"),
    # audit
    "out_rms": ("RMS of the float64 reference output" + IN_OUTPUT_UNITS, "1"),
    "sink_mass": ("attention mass on the first tokens (sinks)", "1"),
    "p_underflow": ("share of P~ that underflows to 0 in e4m3", "1"),
    "p_underflow_final": ("share of final P that underflows to 0 in e4m3", "1"),
}
# Long names of the metrics; units come from the metric registry.
_METRIC_NAMES = {
    "rmse": "RMSE against the float64 reference",
    "rel_l2": "relative L2 error against the float64 reference",
    "rel_l1": "relative L1 error against the float64 reference",
    "max_abs": "max absolute error against the float64 reference",
    "cosine": "cosine similarity with the float64 reference",
    "sqnr_db": "SQNR against the float64 reference",
    "nonfinite": "non-finite output or reference values",
}


_TITLES = {"validation": "FP8 attention emulator against the compiled kernel, case by case",
           "audit": "FP8 attention audit of a captured model"}


def meta_of(name: str, da: xr.DataArray | None = None) -> tuple[str, str | None]:
    """(long_name, units) of a variable or coordinate called ``name``."""
    from ..numerics.metrics import metrics

    if name == "batch" and da is not None and da.dims == ("case",):  # validation: per case
        return "batch size", "1"
    m = metrics().get(name)
    if m is not None:
        long, units = _METRIC_NAMES.get(name, m.description), (m.units or "1")
        if units in _LEGACY_UNITS:  # the registry's words for dimensionless scales
            long, units = long + _LEGACY_UNITS[units], "1"
        return long, units
    if name in _META:
        return _META[name]
    if name.startswith("stage_of_"):
        return f"variant of the {name[len('stage_of_'):]} attribution stage", None
    if da is not None and "variant" in da.dims and _factor(name):  # ablation's "p" is P handling
        return _factor(name), None
    dist = _dist_param(name)
    if dist:
        return dist, "1"
    factor = _factor(name)
    if factor:
        return factor, None
    desc = str(da.attrs.get("description", "")) if da is not None else ""
    long = desc or name.replace("_", " ")
    if da is not None and da.dtype.kind in "OUSb":
        return long, None
    # audit statistics: amax values carry the inputs' units, the rest are ratios or indices
    return (long + IN_INPUT_UNITS, "1") if name.endswith("amax") else (long, "1")


def _dist_param(name: str) -> str:
    from ..data import distributions

    return distributions.param_long_name(name)


def _factor(name: str) -> str:
    from ..numerics.keys import factors

    f = factors().get(name)
    return f"ablation factor: {f.help.split(':')[0]}" if f is not None else ""


def attr_json(ds: xr.Dataset, key: str, default=None):
    """An attribute that holds JSON, decoded (``default`` when absent or empty)."""
    raw = ds.attrs.get(key, "")
    return json.loads(raw) if raw else default


def attr_list(ds: xr.Dataset, key: str, default=()) -> list:
    """An attribute that holds a list, as a list: arrays, scalars (netCDF reads a one-element
    list back as a scalar) and the JSON strings of older datasets alike."""
    if key not in ds.attrs:
        return list(default)
    v = ds.attrs[key]
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("["):
            try:
                return list(json.loads(text))
            except ValueError:
                pass
        return [v]
    if isinstance(v, (list, tuple)):
        return list(v)
    arr = np.atleast_1d(np.asarray(v))
    return [x.item() if hasattr(x, "item") else x for x in arr]


def _as_attr(v):
    """A list attribute as a plain list of numbers or strings: netCDF stores it as an attribute
    array (not a JSON string), and in memory it compares like any list."""
    if isinstance(v, (list, tuple)):
        return [x.item() if hasattr(x, "item") else x for x in v]
    return v


def _set(da_attrs: dict, long_name: str, units: str | None) -> None:
    da_attrs.setdefault("long_name", long_name)
    if units is not None:
        da_attrs.setdefault("units", units)
    old = da_attrs.get("units")
    if isinstance(old, str) and old in _LEGACY_UNITS:  # written before CF compliance: UDUNITS rejects it
        da_attrs["units"] = "1"
        meaning = _LEGACY_UNITS[old]
        if meaning and not str(da_attrs["long_name"]).endswith(meaning):
            da_attrs["long_name"] = f"{da_attrs['long_name']}{meaning}"
        if old == "dB":
            da_attrs.setdefault("comment", DB_COMMENT)


def _counts(ds: xr.Dataset, name: str) -> None:
    """A count variable as integers: int64 when complete, int32 with a fill value when not."""
    da = ds[name]
    if da.dtype.kind in "iu":
        return
    vals = np.asarray(da.values, dtype=np.float64)
    ok = np.isfinite(vals)
    if not np.array_equal(vals[ok], np.round(vals[ok])):
        return  # not whole numbers: leave it as it is rather than round a value away
    # An encoding read from an older file would write the float type back: drop it.
    enc = {k: v for k, v in da.encoding.items() if k not in ("dtype", "_FillValue", "missing_value")}
    if ok.all():
        ds[name] = da.copy(data=vals.astype(np.int64))
        ds[name].encoding = enc
    else:
        da.encoding = enc | {"dtype": "int32", "_FillValue": np.int32(-1)}


def _undefined(name: str) -> str:
    from ..numerics.metrics import metrics

    m = metrics().get(name)
    return m.undefined if m is not None else ""


def _metric_of(ds: xr.Dataset, name: str) -> str:
    """The registered metric a data variable holds ('' for none): ``rmse``, or backward's ``dq_rmse``."""
    from ..numerics.metrics import metrics

    if name in metrics():
        return name
    if ds.attrs.get("kind") == "backward" and "_" in name and name.split("_", 1)[1] in metrics():
        return name.split("_", 1)[1]
    return ""


def _pooling(ds: xr.Dataset, name: str) -> str:
    """How a metric's samples pool into a cell's estimate, in cell_methods syntax
    ("seed: batch: head: root_mean_square"): the reports' RMS-pooled RMSE is not ``ds.rmse.mean()``."""
    from ..numerics.metrics import pool_rule

    metric = _metric_of(ds, name)
    if not metric:
        return ""
    over = ("layer", "head") if ds.attrs.get("kind") == "audit" else POOLED_DIMS
    dims = [d for d in ds[name].dims if d in over]
    if not dims:
        return ""
    return " ".join(f"{d}:" for d in dims) + f" {_POOL_METHODS[pool_rule(metric)]}"


def cf_attributes(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` (changed in place, and returned) with the attributes CF 1.10 asks of every dataset
    the toolkit writes, whatever its study: ``long_name`` and UDUNITS ``units`` on every data
    variable and coordinate (``meta_of``, else the variable's ``description``), ``nan_reason``
    and ``pooling`` on metrics, and the global ``Conventions``, ``title``, ``history``, ``source``
    and ``references``. Units older files carry that UDUNITS rejects are rewritten."""
    for name in list(ds.data_vars) + list(ds.coords):
        long, units = meta_of(str(name), ds[name])
        _set(ds[name].attrs, long, units)
        if name not in ds.data_vars:
            continue
        metric = _metric_of(ds, str(name))
        if metric and _units_of(metric) == "dB":
            ds[name].attrs.setdefault("comment", DB_COMMENT)
        why = _undefined(str(name))
        if why:
            ds[name].attrs.setdefault("nan_reason", why)
        pooling = _pooling(ds, str(name))
        if pooling:
            ds[name].attrs.setdefault("pooling", pooling)
    a = ds.attrs
    a.setdefault("Conventions", CONVENTIONS)
    a.setdefault("title", str(a.get("description") or _TITLES.get(str(a.get("kind", ""))) or a.get("experiment")
                              or "fa3-numerics dataset"))
    if "history" not in a:
        a["history"] = f"{a.get('created_utc', '')} {a.get('command', '')}".strip()
    a.setdefault("source", f"fa3-numerics {a.get('version_fa3_numerics', '?')} (backend {a.get('backend', '?')}, "
                           f"{a.get('device_name', a.get('device', '?'))})")
    a.setdefault("references", REFERENCES)
    return ds


def cf_encoding(ds: xr.Dataset) -> dict:
    """netCDF encoding CF asks for: no ``_FillValue`` on coordinates (a coordinate has no missing
    values; xarray would add NaN as the fill of every float one)."""
    return {name: {"_FillValue": None} for name in ds.coords}


def _units_of(metric: str) -> str:
    from ..numerics.metrics import metrics

    m = metrics().get(metric)
    return m.units if m is not None else ""


def apply_conventions(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with the conventions of the module docstring (a new Dataset; data shared)."""
    ds = ds.copy()
    if "abs_bin" in ds.dims and "abs_bin" not in ds.indexes:
        if "abs_bin_lo" in ds.coords:
            ds = ds.assign_coords(abs_bin=("abs_bin", np.asarray(ds.coords["abs_bin_lo"].values)))
            ds = ds.drop_vars("abs_bin_lo")
            for var in ds.variables.values():  # a 'coordinates' read from the file would still name it
                var.encoding.pop("coordinates", None)
    for d in ds.dims:  # an index on every dimension, so that .sel and plots have labels
        if d not in ds.indexes:
            ds = ds.assign_coords({d: np.arange(ds.sizes[d])})
    for name in list(ds.data_vars):
        if meta_of(str(name), ds[name])[1] == "count":
            _counts(ds, name)
    a = ds.attrs
    for key in LIST_ATTRS:
        if key in a:
            a[key] = _as_attr(attr_list(ds, key))
    return cf_attributes(ds)


def upgrade(ds: xr.Dataset) -> xr.Dataset:
    """A dataset written before these conventions, in the current layout (see the docstring)."""
    return apply_conventions(ds)


__all__ = ["CONVENTIONS", "apply_conventions", "cf_attributes", "cf_encoding", "upgrade", "attr_list", "attr_json", "meta_of",
           "LIST_ATTRS"]
