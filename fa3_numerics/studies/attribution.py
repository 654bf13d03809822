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


def attribution_table(ds: xr.Dataset, *, n_boot: int = 400, level: float = 0.95, seed: int = 0) -> "pandas.DataFrame":  # noqa: F821
    """One row per (cell, full variant, stage): the stage's MSE and share, with bootstrap
    intervals over (seed, batch, head) samples, plus the full recipe's MSE and the
    additivity ratio full / sum of stages. Needs an ablation dataset with ``stage`` and
    ``stage_of_*`` coordinates (``fa3_numerics.studies.ablation``)."""
    import pandas as pd

    rmse = ds["rmse"].stack(sample=("seed", "batch", "head")).transpose(..., "variant", "sample")
    cell_dims = [d for d in rmse.dims if d not in ("variant", "sample")]
    full = [str(v) for v, s in zip(ds["variant"].values, ds["stage"].values) if s == "full"]
    labels = [str(v) for v in ds["variant"].values]
    pos = {v: i for i, v in enumerate(labels)}
    arr = rmse.values  # [..cells.., variant, sample]
    n_s = arr.shape[-1]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_s, size=(n_boot, n_s))
    lo_q, hi_q = (1 - level) / 2, (1 + level) / 2
    rows = []
    cell_shape = arr.shape[:-2]
    for cidx in np.ndindex(*cell_shape):
        where = {d: _item(rmse.coords[d].values[i]) for d, i in zip(cell_dims, cidx)}
        sub = arr[cidx]  # [variant, sample]
        for v in full:
            fv = sub[pos[v]]
            if not np.isfinite(fv).all():
                continue
            stage_idx = [pos[str(ds[f"stage_of_{s}"].sel(variant=v).item())] for s in STAGES]
            st = sub[stage_idx] ** 2  # [stage, sample]
            ia = list(STAGES).index("acc")
            acc_diff = str(ds["stage"].values[stage_idx[ia]]) != "exact"
            if acc_diff:  # MMA accumulator: the MSE increase over the float32-accumulator recipe
                st[ia] = fv ** 2 - st[ia]
            if not np.isfinite(st).all():
                continue
            mse = st.mean(axis=1)
            boot = st[:, idx].mean(axis=2)  # [stage, boot]
            mse[ia], boot[ia] = max(mse[ia], 0.0), np.maximum(boot[ia], 0.0)
            share_b = boot / boot.sum(axis=0, keepdims=True)
            full_mse = float(np.mean(fv ** 2))
            full_b = (fv[idx] ** 2).mean(axis=1)
            add_b = full_b / boot.sum(axis=0)
            for k, s in enumerate(STAGES):
                rows.append({**where, "variant": v, "stage": s, "stage_variant": labels[stage_idx[k]],
                             "measured": "difference" if (s == "acc" and acc_diff) else "alone",
                             "mse": float(mse[k]), "share": float(mse[k] / mse.sum()),
                             "share_lo": float(np.quantile(share_b[k], lo_q)),
                             "share_hi": float(np.quantile(share_b[k], hi_q)),
                             "full_mse": full_mse, "full_lo": float(np.quantile(full_b, lo_q)),
                             "full_hi": float(np.quantile(full_b, hi_q)),
                             "additivity": full_mse / float(mse.sum()),
                             "additivity_lo": float(np.quantile(add_b, lo_q)),
                             "additivity_hi": float(np.quantile(add_b, hi_q))})
    return pd.DataFrame(rows)


def _item(v):
    v = np.asarray(v)
    return v.item() if v.shape == () else v
