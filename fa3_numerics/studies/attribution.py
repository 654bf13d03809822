"""Error attribution: each stage of an FP8 attention recipe switched to low precision alone.

Exposed: ``STAGES``, ``stage_recipe``, ``exact_recipe``, ``attribution_table``.

For a recipe R and a stage s, ``stage_recipe(R, s)`` keeps only that stage of R in low
precision and runs everything else in float32 (same algorithm, same tiles, no rotation
where the stage does not involve Q and K):

- ``qk``: Q and K rotated and quantized as R does (format, granularity, rotation);
- ``p``: P cast to R's P format with R's P handling (offset or scale);
- ``v``: V quantized as R does (format, granularity);
- ``acc``: the accumulator. The Hopper MMA model (acc=fp22 or two-level, on both GEMMs)
  applies only to FP8 operands, so it cannot run alone on float32 ones; its stage error is
  the MSE increase of R over R with a float32 accumulator (per sample, mean clipped at 0),
  and ``stage_recipe(R, "acc")`` is that float32-accumulator recipe. An FP32 accumulator's
  stage is the float32 floor (``exact_recipe``);
- ``out``: the output rounded to R's output format (BF16 for FP8 inputs).

On the same inputs each stage's error is measured against the float64 reference. A stage's
share is its MSE divided by the sum of the stage MSEs, so shares add to 1; the ratio of the
full recipe's MSE to that sum says how additive the stages are (1 = independent errors).
``exact_recipe`` (every stage float32) gives the emulator's own floor.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import xarray as xr

from ..numerics.keys import KEEP, keys
from ..numerics.recipe import Recipe

STAGES = {
    "qk": "Q/K quantization (with rotation)",
    "p": "P cast",
    "v": "V quantization",
    "acc": "P.V accumulation",
    "out": "output rounding",
}


def exact_recipe(r: Recipe) -> Recipe:
    """R with every stage in float32: each key at its registered ``exact`` value (algorithm,
    order and tiles keep R's)."""
    return dataclasses.replace(r, **{k.field: k.exact for k in keys() if k.exact is not KEEP})


def stage_recipe(r: Recipe, stage: str) -> Recipe:
    """R with only ``stage`` in low precision: the float32 recipe with R's value of every key
    registered for that stage (see module docstring; the accumulator is the exception)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    e = exact_recipe(r)
    if stage == "acc":
        # FP32: the float32 floor itself. MMA model: the baseline its error is measured against.
        return e if r.acc == "fp32" else dataclasses.replace(r, acc="fp32")
    return dataclasses.replace(e, **{k.field: getattr(r, k.field) for k in keys() if stage in k.stages})


def stage_label(stage: str, r: Recipe) -> str:
    """Variant label of a stage recipe in an ablation dataset."""
    return f"{stage}:{r.short_str()}"


def _mse(ds: xr.Dataset, label: str) -> xr.DataArray:
    return (ds["rmse"].sel(variant=label) ** 2)


def attribution_table(ds: xr.Dataset, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> "pandas.DataFrame":  # noqa: F821
    """One row per (cell, full variant, stage): the stage's MSE and share, with BCa intervals
    (``scipy.stats.bootstrap``) over (seed, batch, head) samples, plus the full recipe's MSE and
    the additivity ratio full / sum of stages. Needs an ablation dataset with ``stage`` and
    ``stage_of_*`` coordinates (``fa3_numerics.studies.ablation``)."""
    import pandas as pd

    from ..numerics.metrics.bootstrap import bca

    rmse = ds["rmse"].stack(sample=("seed", "batch", "head")).transpose(..., "variant", "sample")
    cell_dims = [d for d in rmse.dims if d not in ("variant", "sample")]
    full = [str(v) for v, s in zip(ds["variant"].values, ds["stage"].values) if s == "full"]
    labels = [str(v) for v in ds["variant"].values]
    pos = {v: i for i, v in enumerate(labels)}
    arr = rmse.values  # [..cells.., variant, sample]
    ia = list(STAGES).index("acc")
    stage_idx = {v: [pos[str(ds[f"stage_of_{s}"].sel(variant=v).item())] for s in STAGES] for v in full}
    # MMA accumulator: its stage is the MSE increase over the float32-accumulator recipe
    acc_diff = {v: str(ds["stage"].values[stage_idx[v][ia]]) != "exact" for v in full}

    def stat(sq, axis=-1):
        """sq [variants, stages + full, samples] squared errors -> [variants, shares + full MSE +
        additivity]: shares of the summed stage MSEs, the full recipe's MSE, full / sum."""
        mse = sq.mean(axis=axis)  # [variants, stages + 1, ...]
        st = mse[:, :-1].copy()
        st[:, ia] = np.maximum(st[:, ia], 0.0)  # a difference can dip below 0 by sampling noise
        total = st.sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.concatenate([st / total, mse[:, -1:], mse[:, -1:] / total], axis=1)

    rows = []
    for cidx in np.ndindex(*arr.shape[:-2]):
        where = {d: _item(rmse.coords[d].values[i]) for d, i in zip(cell_dims, cidx)}
        sub = arr[cidx]  # [variant, sample]
        todo, sq = [], []
        for v in full:
            fv = sub[pos[v]]
            st = sub[stage_idx[v]] ** 2  # [stage, sample]
            if acc_diff[v]:
                st[ia] = fv ** 2 - st[ia]
            if np.isfinite(fv).all() and np.isfinite(st).all():
                todo.append(v)
                sq.append(np.concatenate([st, fv[None] ** 2]))
        if not todo:
            continue
        # One BCa call per cell, every variant of it at once (they share the samples).
        est, lo, hi = bca(stat, (np.stack(sq),), level=level, n_boot=n_boot, seed=seed)
        mse = np.stack(sq).mean(axis=-1)
        ns = len(STAGES)
        for j, v in enumerate(todo):
            stage_mse = mse[j, :ns].copy()
            stage_mse[ia] = max(stage_mse[ia], 0.0)
            for k, s in enumerate(STAGES):
                rows.append({**where, "variant": v, "stage": s, "stage_variant": labels[stage_idx[v][k]],
                             "measured": "difference" if (s == "acc" and acc_diff[v]) else "alone",
                             "mse": float(stage_mse[k]), "share": float(est[j, k]),
                             "share_lo": float(lo[j, k]), "share_hi": float(hi[j, k]),
                             "full_mse": float(est[j, ns]), "full_lo": float(lo[j, ns]),
                             "full_hi": float(hi[j, ns]), "additivity": float(est[j, ns + 1]),
                             "additivity_lo": float(lo[j, ns + 1]), "additivity_hi": float(hi[j, ns + 1])})
    return pd.DataFrame(rows)


def _item(v):
    v = np.asarray(v)
    return v.item() if v.shape == () else v
