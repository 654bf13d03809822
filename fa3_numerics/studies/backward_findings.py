"""What a backward study (``run backward``) found, for its dataset.

Exposed: ``findings``, ``with_findings``.

Per cell of the sweep (``cells``, each with its ``where``): for each variant and gradient (O,
dQ, dK, dV of the full recipe) the pooled rel_l2 and cosine over the (seed, batch, head) samples
with their 95% BCa intervals, or the count of non-finite samples (``gradients``); where the study
ran the attribution stages, the share of each stage in the summed stage MSE, the additivity ratio
and ``fwd+s``'s MSE relative to the full recipe's (``attribution``). ``verdict``: at the first
cell, the low-precision recipe with the lowest worst-gradient rel_l2 and its ratio to the best
16-bit recipe, and the one to avoid.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..text import md_code
from .findings import store, stored

_SAMPLE = ("seed", "batch", "head", "kv_head")


def _cells(ds):
    sweep = [d for d in ds["o_rmse"].dims if d not in _SAMPLE + ("variant", "stage")]
    for idx in np.ndindex(*(ds.sizes[d] for d in sweep)):
        yield {d: ds[d].values[i].item() for d, i in zip(sweep, idx)}


def _figure(values: np.ndarray, metric: str) -> dict:
    from ..numerics.metrics import bootstrap_ci, nonfinite_samples, pooled

    bad, n = nonfinite_samples(values)
    if bad:
        return {"value": None, "lo": None, "hi": None, "nonfinite": bad, "n": n}
    est = pooled(metric, values)
    lo, hi = bootstrap_ci(metric, values) if n > 1 else (math.nan, math.nan)
    return {"value": est, "lo": lo, "hi": hi, "nonfinite": 0, "n": n}


def _gradients(ds, where: dict) -> dict:
    from .backward import GRADS

    return {metric: {str(v): {g: _figure(ds[f"{g}_{metric}"].sel(variant=v, stage="full", **where).values.ravel(),
                                         metric) for g in GRADS} for v in ds["variant"].values}
            for metric in ("rel_l2", "cosine")}


def _attribution(ds, where: dict) -> list[dict]:
    from .backward import GRAD_NAMES, SHARE_STAGES, stage_shares

    sub = ds.sel(**where) if where else ds
    rows = []
    for v in ds["variant"].values:
        for g in ("dq", "dk", "dv"):
            sh = stage_shares(sub, g, str(v))
            full = float(np.nanmean(sub[f"{g}_rmse"].sel(variant=v, stage="full").values ** 2))
            both = float(np.nanmean(sub[f"{g}_rmse"].sel(variant=v, stage="fwd+s").values ** 2))
            top = max(SHARE_STAGES, key=lambda s: sh[s] if np.isfinite(sh[s]) else -1)
            rows.append({"variant": str(v), "grad": GRAD_NAMES[g], "shares": {s: sh[s] for s in SHARE_STAGES},
                         "additivity": sh["additivity"], "fwd_s_over_full": both / full if full > 0 else None,
                         "largest": top})
    return rows


def _verdict(ds, cell: dict) -> dict:
    from .run_findings import precision_class

    specs = {str(v): str(s) for v, s in zip(ds["variant"].values, ds["spec"].values)}
    rel = cell["gradients"]["rel_l2"]
    worst = {}
    for v, per in rel.items():
        vals = [per[g]["value"] for g in ("dq", "dk", "dv")]
        worst[v] = max(vals) if all(x is not None for x in vals) else None
    ok = {v: w for v, w in worst.items() if w is not None}
    low = {v: w for v, w in ok.items() if precision_class(specs[v]) == "low"}
    sixteen = {v: w for v, w in ok.items() if precision_class(specs[v]) == "16-bit"}
    where = ", ".join(f"{k}={v}" for k, v in cell["where"].items())
    lines = []
    out = {"use": None, "reference": None, "avoid": [], "lines": lines}
    if low:
        use = min(low, key=low.get)
        out["use"] = use
        line = (f"**Use {md_code(use)}**{f' at {where}' if where else ''}: of the {len(low)} low-precision recipe(s), the "
                f"lowest worst-gradient rel_l2 (max over dQ, dK, dV), {low[use]:.3g}")
        if sixteen:
            ref = min(sixteen, key=sixteen.get)
            out["reference"] = ref
            line += f"; ×{low[use] / sixteen[ref]:.2f} that of {md_code(ref)} ({sixteen[ref]:.3g})" if sixteen[ref] > 0 else ""
        lines.append(line + ".")
        if len(low) > 1:
            bad = max(low, key=low.get)
            out["avoid"].append(bad)
            lines.append(f"**Avoid {md_code(bad)}**: worst-gradient rel_l2 {low[bad]:.3g}, ×{low[bad] / low[use]:.2f} "
                         f"that of {md_code(use)}.")
    broken = [v for v, w in worst.items() if w is None]
    if broken:
        out["avoid"] += broken
        lines.append("**Avoid** " + ", ".join(md_code(v) for v in broken) + ": non-finite gradients in some samples.")
    if lines:
        n = next(iter(next(iter(rel.values())).values()))["n"]
        lines.append(f"Intervals in the tables: 95% BCa bootstrap over {n} (seed, batch, head) sample(s).")
    return out


def findings(ds: xr.Dataset) -> dict:
    attribution = "stage" in ds.coords and "fwd" in [str(s) for s in ds["stage"].values]
    cells = [{"where": where, "gradients": _gradients(ds, where),
              "attribution": _attribution(ds, where) if attribution else []} for where in _cells(ds)]
    from .backward import GRAD_NAMES, GRADS, SHARE_STAGES, STAGES

    return {"kind": "backward", "grads": {g: GRAD_NAMES[g] for g in GRADS}, "stages": dict(STAGES),
            "share_stages": list(SHARE_STAGES), "cells": cells,
            "verdict": _verdict(ds, cells[0]) if cells else {"lines": []}}


def with_findings(ds: xr.Dataset) -> xr.Dataset:
    if stored(ds) is not None:
        return ds
    return store(ds, findings(ds))


__all__ = ["findings", "with_findings"]
