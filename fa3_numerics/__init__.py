"""fa3-numerics: numerical accuracy toolkit for FP8 attention, built around FlashAttention-3.

Use it from Python (``import fa3_numerics as fa3n``; docs/api.md has the whole page):

Attention of your own tensors
    emulate(q, k, v, recipe="fa3-fp8", layout="bhsd"|"bshd", causal=False, softmax_scale=None)
        the output a recipe computes, rounded as the kernel rounds it, in the caller's layout
    reference(q, k, v, layout=..., causal=..., softmax_scale=...)
        float64 attention: what every error is measured against
    evaluate(q, k, v, variants=[...], layout=..., rows=0, seed=0, backend="emulate") -> xarray.Dataset
        every variant against the float64 reference, every registered metric per (batch, head),
        laid out as a ``run`` dataset (``fa3-numerics report`` and ``compare`` read it)
    summary(ds, metric="rmse") -> pandas.DataFrame
        per variant: the pooled metric with its 95% bootstrap interval

Studies and datasets
    validate(grid="small", backend="fa3", device="cuda", ...) -> xarray.Dataset
        the emulator against the compiled kernel, case by case (``fa3-numerics validate``)
    compare(a, b, metric="rmse") -> dict, gate(result, fail_above=...) -> failing rows
        two runs side by side, ratios B/A with intervals (``fa3-numerics compare``)
    open_dataset(path) -> xarray.Dataset
        any dataset the package writes (run, ablation, audit, validation, impact)
    read_impact(path), load_capture(path)
        an impact dataset; a capture of a model's post-RoPE Q, K, V
    recommend(model, target="fa3", ...) -> (xarray.Dataset, dict)
        the recipe to deploy for a model on a target, verified end to end (``fa3-numerics recommend``)

Recipes and errors
    Recipe, Preset, PRESETS, get_recipe: recipes by name or spec (``fa3-numerics variants``)
    UsageError (bad input, one line naming the fix), NonFiniteError (NaN or Inf in a result)

Tensors are (batch, heads, seqlen, head_dim) for layout="bhsd" (the default, PyTorch's SDPA) and
(batch, seqlen, heads, head_dim) for layout="bshd" (FA3's flash_attn_func); K and V may have
fewer heads than Q (GQA); any floating dtype.

Importing the package loads none of this: each name imports its module on first use, so the
command line starts as fast as before.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> "module:attribute", imported on first access (PEP 562).
_PUBLIC = {
    "emulate": "fa3_numerics.api:emulate",
    "reference": "fa3_numerics.api:reference",
    "evaluate": "fa3_numerics.api:evaluate",
    "summary": "fa3_numerics.api:summary",
    "validate": "fa3_numerics.api:validate",
    "open_dataset": "fa3_numerics.api:open_dataset",
    "as_recipe": "fa3_numerics.api:as_recipe",
    "LAYOUTS": "fa3_numerics.api:LAYOUTS",
    "compare": "fa3_numerics.studies.compare:compare",
    "gate": "fa3_numerics.studies.compare:gate",
    "read_impact": "fa3_numerics.studies.impact_dataset:read_impact",
    "load_capture": "fa3_numerics.data.capture:load_capture",
    "Recipe": "fa3_numerics.numerics.recipe:Recipe",
    "Preset": "fa3_numerics.numerics.recipe:Preset",
    "PRESETS": "fa3_numerics.numerics.recipe:PRESETS",
    "get_recipe": "fa3_numerics.numerics.recipe:get_recipe",
    "UsageError": "fa3_numerics.errors:UsageError",
    "NonFiniteError": "fa3_numerics.errors:NonFiniteError",
    "recommend": "fa3_numerics.api:recommend",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    target = _PUBLIC.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = target.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
