"""The recipe study (issue 11): every low-precision attention recipe of the field on one page.

Exposed: ``FIELD_VARIANTS``, ``KBIAS_VARIANTS``, ``operand_bits``, ``hardware``, ``variant_table``,
``audit_table``, ``ratio``.

Definition: the recipes (``FIELD_VARIANTS``: FA1/FA2 FP16, the FA3 paper's and the public FA3
kernel's FP8 recipes, SageAttention 1/2/3, MXFP8) and the k-bias contrasts (``KBIAS_VARIANTS``:
per-head FP8 and per-block INT8 with and without K smoothing and the Hadamard rotation, in the
full pipeline and with Q/K alone in low precision). The runs are ordinary ``run outliers`` and
``audit`` commands (``reports/recipes/run.sh``); this module turns their datasets into the
tables the report shows: per variant the pooled error with its 95% BCa interval, the bits per
element of its operands and its cost (``studies.audit.recipe_cost``).

``operand_bits`` is the mean storage width of the four GEMM operands, (2 Q/K + V + P) / 4, block
scales included (``numerics.families.bits_per_element``): FP16 16, FP8 8, INT8 Q/K with FP8 P/V 8,
NVFP4 4.5. It is what the tensor-core throughput of a recipe mostly follows; it is not its speed.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..numerics.families import bits_per_element
from ..numerics.metrics import bootstrap_ci, pooled
from ..numerics.recipe import PRESETS, Recipe
from .audit import recipe_cost

# (variant, short label for figures). Specs after a preset override it; the spec is the truth.
FIELD_VARIANTS = (
    ("fa2-fp16", "FA2 FP16"),
    ("fa1-fp16", "FA1 FP16"),
    ("baseline-fp8", "baseline FP8"),
    ("fa3-fp8", "FA3 FP8 (paper)"),
    ("fa3-fp8-kernel", "FA3 kernel"),
    ("fa3-fp8-kernel-hadamard", "FA3 kernel +H"),
    ("fa3-fp8-kernel,smooth=k", "FA3 kernel +smooth K"),
    ("sage1", "Sage1 INT8"),
    ("sage2-int8", "Sage2 INT8"),
    ("sage2-int8,smooth=k", "Sage2 INT8 (public: K only)"),
    ("sage2-int4", "Sage2 INT4"),
    ("sage3-nvfp4", "Sage3 NVFP4"),
    ("fa3-mxfp8", "FA3 MXFP8"),
)

_QK_ONLY = "v=fp32,p=fp32,out=fp32,poff=0"
# The k-bias question: does K smoothing lower per-head FP8's error several times, and the
# Hadamard rotation alone not? Full pipeline (FA3 kernel at acc=fp32) and Q/K alone.
KBIAS_VARIANTS = tuple(
    (f"{base}{extra}", f"{label}{tag}")
    for base, label in (("fa3-fp8-kernel,acc=fp32", "FP8 per-head"),
                        (f"qk=e4m3,{_QK_ONLY}", "FP8 per-head, Q/K only"),
                        ("qk=int8,gran=block,bm=128,bn=64,acc=fp32", "INT8 per-block"),
                        (f"qk=int8,gran=block,bm=128,bn=64,{_QK_ONLY}", "INT8 per-block, Q/K only"))
    for extra, tag in (("", ""), (",smooth=k", " +smooth K"), (",rot=hadamard", " +H"),
                       (",rot=hadamard,smooth=k", " +H +smooth K"))
)


def operand_bits(recipe: Recipe) -> float:
    """(2 x bits(Q/K) + bits(V) + bits(P)) / 4, block scales included (module docstring)."""
    return (2 * bits_per_element(recipe.qk) + bits_per_element(recipe.v) + bits_per_element(recipe.p)) / 4


# Presets that predate the "Requires:" notes (FA2 needs Ampere; FP8 tensor cores start at sm89).
_HARDWARE = {"fa2-fp16": "sm80+", "fa3-fp16": "sm90", "baseline-fp16": "any", "baseline-fp8": "sm89+ (FP8)",
             "fa3-fp8": "sm90", "fa3-fp8-no-block-quant": "sm90", "fa3-fp8-no-incoherent": "sm90",
             "fa3-fp8-kernel": "sm90", "fa3-fp8-kernel-hadamard": "sm90", "exact": "any"}


def hardware(variant: str) -> str:
    """The "Requires: ..." note of the preset a variant starts from ("" for a bare spec)."""
    name = variant.split(",", 1)[0]
    if "=" in name or name not in PRESETS:
        return ""
    m = re.search(r"Requires: (.*)$", PRESETS[name].description)
    return m.group(1) if m else _HARDWARE.get(name, "")


def _row(variant: str, values: np.ndarray, metric: str, n_boot: int) -> dict:
    r = Recipe.from_str(variant)
    v = np.asarray(values, dtype=np.float64).ravel()
    lo, hi = bootstrap_ci(metric, v, n_boot=n_boot) if v.size > 1 else (math.nan, math.nan)
    return {"variant": variant, "value": pooled(metric, v), "lo": lo, "hi": hi, "samples": int(v.size),
            "bits": operand_bits(r), "cost": recipe_cost(r), "hardware": hardware(variant)}


def variant_table(ds, *, metric: str = "rmse", n_boot: int = 2000) -> "pandas.DataFrame":  # noqa: F821
    """One row per (swept parameter value, variant) of a ``run outliers`` dataset: the metric pooled
    over (seed, batch, head) with its 95% BCa interval, operand bits and cost."""
    import pandas as pd

    da = ds[metric]
    sample = [d for d in ("seed", "batch", "head") if d in da.dims]
    swept = [d for d in da.dims if d not in sample and d != "variant"]
    rows = []
    for idx in np.ndindex(*(da.sizes[d] for d in swept)):
        where = {d: da[d].values[i] for d, i in zip(swept, idx)}
        cell = da.isel({d: i for d, i in zip(swept, idx)})
        for v in da["variant"].values:
            row = _row(str(v), cell.sel(variant=v).values, metric, n_boot)
            rows.append({**{d: (x.item() if hasattr(x, "item") else x) for d, x in where.items()}, **row})
    return pd.DataFrame(rows)


def audit_table(ds, *, metric: str = "rel_l2") -> "pandas.DataFrame":  # noqa: F821
    """One row per variant of an audit: the metric over every (layer, head): median, 25th and 75th
    percentiles, max and the layer holding it; operand bits and cost."""
    import pandas as pd

    rows = []
    for v in ds["variant"].values:
        x = ds[metric].sel(variant=v)
        flat = x.values.ravel()
        worst = x.max("head")
        r = Recipe.from_str(str(v))
        rows.append({"variant": str(v), "median": float(np.median(flat)), "q25": float(np.quantile(flat, 0.25)),
                     "q75": float(np.quantile(flat, 0.75)), "max": float(flat.max()),
                     "worst_layer": int(worst["layer"].values[int(np.argmax(worst.values))]),
                     "bits": operand_bits(r), "cost": recipe_cost(r), "hardware": hardware(str(v))})
    return pd.DataFrame(rows)


def ratio(table, a: str, b: str, **where) -> float:
    """value(a) / value(b) in a ``variant_table`` (rows selected by ``where``, e.g. bias=8)."""
    t = table
    for k, x in where.items():
        t = t[np.isclose(t[k], x)] if isinstance(x, float) else t[t[k] == x]
    va = float(t[t["variant"] == a]["value"].iloc[0])
    vb = float(t[t["variant"] == b]["value"].iloc[0])
    return va / vb


__all__ = ["FIELD_VARIANTS", "KBIAS_VARIANTS", "operand_bits", "hardware", "variant_table", "audit_table", "ratio"]
