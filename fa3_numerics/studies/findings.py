"""What a study found, stored in its dataset: the one place a report reads its answer from.

Exposed: ``FINDINGS_ATTR``, ``store``, ``stored``, ``upgrade``, ``read``, ``UPGRADES``.

Every study computes its findings (the recipe to use on this data and what it costs against
FP16/BF16, what to avoid, pass/fail, rankings, per-layer recommendations, the tables behind
them) when its dataset is assembled, and stores them as one JSON-valued attribute,
``findings`` (a CF-valid global attribute: a string). A report renders what that attribute holds
and computes nothing. ``findings["verdict"]["lines"]`` is the boxed answer every report opens
with; the rest is each study's own layout (its ``*_findings`` module says which keys).

A dataset written before findings were stored is upgraded on load: ``read(path)`` (and
``upgrade(ds)`` on an open one) computes the findings of its kind (``UPGRADES``) where the
attribute is missing or was computed for other report settings, and leaves the file as it is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
import xarray as xr

FINDINGS_ATTR = "findings"


def _plain(o):
    """``o`` as JSON-able Python (numpy scalars and arrays, NaN and infinities as None)."""
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if isinstance(o, np.ndarray):
        return [_plain(v) for v in o.tolist()]
    if isinstance(o, (np.bool_, bool)):
        return bool(o)
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating, float)):
        x = float(o)
        return x if math.isfinite(x) else None
    return o


def store(ds: xr.Dataset, findings: dict) -> xr.Dataset:
    """``ds`` with ``findings`` as its ``findings`` attribute (JSON; NaN as null)."""
    ds.attrs[FINDINGS_ATTR] = json.dumps(_plain(findings), allow_nan=False, ensure_ascii=False)
    return ds


def stored(ds: xr.Dataset) -> dict | None:
    """The findings ``ds`` holds, or None for a dataset written before they were stored."""
    raw = ds.attrs.get(FINDINGS_ATTR)
    return json.loads(raw) if raw else None


def _kind(ds: xr.Dataset) -> str | None:
    """The study that wrote ``ds``: the ``kind`` it records, else what its layout says."""
    from ..engine.dataset import dataset_kind

    kind = ds.attrs.get("kind")
    if kind in ("impact", "recommend", "backward", "audit", "validation"):
        return str(kind)
    return dataset_kind(ds)


def _upgrader(kind: str) -> Callable[[xr.Dataset], xr.Dataset] | None:
    # each study's module, imported when a dataset of its kind is read (a run's report need not
    # import the audit's statistics)
    if kind == "run":
        from .run_findings import with_findings
    elif kind == "ablation":
        from .ablation_findings import with_findings
    elif kind == "audit":
        from .audit_findings import with_findings
    elif kind == "validation":
        from .validate_findings import with_findings
    elif kind == "backward":
        from .backward_findings import with_findings
    elif kind == "impact":
        from .impact_findings import with_findings
    else:  # recommend stores its findings as it assembles; nothing older exists
        return None
    return with_findings


UPGRADES = ("run", "ablation", "audit", "validation", "backward", "impact")


def upgrade(ds: xr.Dataset, kind: str | None = None) -> xr.Dataset:
    """``ds`` with its study's findings: computed here where the dataset lacks them (written
    before they were stored) or holds them for other report settings; otherwise as it is.
    ``kind``: the study, where the caller knows it (else read off the dataset)."""
    kind = kind or _kind(ds)
    fn = _upgrader(kind) if kind else None
    return fn(ds) if fn is not None else ds


def read(path: str | Path) -> xr.Dataset:
    """A saved dataset of any study, with its findings (upgraded on load where it predates them):
    ``engine.dataset.read``, which reaches each study's ``upgrade`` through the registry."""
    from ..engine.dataset import read as read_dataset

    return read_dataset(path, kinds=None)


__all__ = ["FINDINGS_ATTR", "store", "stored", "upgrade", "read", "UPGRADES"]
