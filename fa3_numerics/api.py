"""The public Python API: your own Q, K, V through a recipe, against float64, as a dataset.

Exposed: ``emulate``, ``reference``, ``evaluate``, ``summary``, ``validate``, ``open_dataset``,
``as_recipe``, ``LAYOUTS``.

Everything here is a thin, checked front over what the command line runs: ``emulate`` is the
emulator (``fa3_numerics.numerics.emulator``), ``reference`` the float64 attention every error is
measured against (``numerics.reference``), ``evaluate`` one engine task
(``fa3_numerics.engine.runner``) whose dataset has the layout of a ``run`` dataset (dims variant,
seed, batch, head; every registered metric; provenance attributes), so ``summary``, ``compare``,
``fa3-numerics report`` and ``fa3-numerics compare`` read it as they read a run's.

Tensors come in either layout, named by ``layout``: ``"bhsd"`` (batch, heads, seqlen, head_dim:
PyTorch's ``scaled_dot_product_attention``) or ``"bshd"`` (batch, seqlen, heads, head_dim: the
FA3 kernel's ``flash_attn_func``); outputs come back in the caller's layout. K and V may have fewer
heads than Q (grouped-query attention). Any floating dtype is accepted and widened to float64
exactly before anything is rounded. Bad input is refused before any computation with a one-line
``UsageError`` naming the fix: wrong rank, mismatched batch/heads/head dim, a head dim the FA3
kernel does not compile, NaN or Inf in Q, K or V, a recipe that is not one.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import time
import warnings
from typing import Callable, Iterable

import torch

from .errors import NonFiniteError, UsageError, require

LAYOUTS = {"bhsd": "(batch, heads, seqlen, head_dim)", "bshd": "(batch, seqlen, heads, head_dim)"}


# -- recipes --------------------------------------------------------------------------------------

def as_recipe(recipe) -> tuple[str, "Recipe"]:  # noqa: F821
    """(label, Recipe) of a preset name, a spec string (``"fa3-fp8,acc=fp22"``), a ``Recipe`` or a
    ``Preset``; the label is what a dataset calls the variant."""
    from .engine.progress import short_name
    from .numerics.recipe import Preset, Recipe

    if isinstance(recipe, Preset):
        return recipe.name, recipe.recipe
    if isinstance(recipe, Recipe):
        return short_name(recipe), recipe
    if isinstance(recipe, str):
        return recipe.strip(), Recipe.from_str(recipe)
    raise UsageError(f"recipe must be a preset name, a spec string, a Recipe or a Preset, not "
                     f"{type(recipe).__name__}; see `fa3-numerics variants`")


def _recipes(variants) -> list[tuple[str, "Recipe"]]:  # noqa: F821
    from .numerics.recipe import parse_recipes

    if isinstance(variants, str):
        return parse_recipes(variants)  # "a,b" presets or "spec;spec", as --variants takes them
    try:
        items = list(variants)
    except TypeError:
        items = [variants]  # one Recipe or Preset
    require(len(items) > 0, "variants is empty; give presets (see `fa3-numerics variants`), specs or Recipes")
    out = [as_recipe(x) for x in items]
    labels = [label for label, _ in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    require(not dup, f"variants repeat: {', '.join(dup)}; give each once")
    return out


# -- tensors --------------------------------------------------------------------------------------

def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            import numpy as np

            x = torch.from_numpy(np.asarray(x))
        except (TypeError, ValueError):
            raise UsageError(f"{name} must be a torch tensor or a NumPy array, not {type(x).__name__}") from None
    require(x.is_floating_point(), f"{name} has dtype {x.dtype}; give a floating-point tensor (float16, bfloat16, "
                                   "float32, float64, float8)")
    return x


def _layout(layout: str | None, k: torch.Tensor) -> str:
    if layout is None:
        # A bshd tensor read as bhsd runs without error and answers for the wrong attention: say
        # so where the shape suggests it (fewer keys than KV heads is rare in bhsd, usual in bshd).
        if k.dim() == 4 and k.shape[2] < k.shape[1]:
            warnings.warn(f"K of shape {tuple(k.shape)} is read as layout='bhsd' ({k.shape[1]} KV heads, "
                          f"{k.shape[2]} keys); pass layout='bshd' for FA3's (batch, seqlen, heads, head_dim), "
                          "or layout='bhsd' to silence this", UserWarning, stacklevel=3)
        return "bhsd"
    require(layout in LAYOUTS, f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")
    return layout


def _bhsd(q, k, v, layout: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Q, K, V checked and as float64 (batch, heads, seqlen, head_dim) views of the caller's data."""
    from .numerics.tiles import check_head_dim

    q, k, v = _tensor(q, "Q"), _tensor(k, "K"), _tensor(v, "V")
    layout = _layout(layout, k)
    for name, t in (("Q", q), ("K", k), ("V", v)):
        require(t.dim() == 4, f"{name} has shape {tuple(t.shape)}; give 4-D tensors {LAYOUTS[layout]} "
                              f"(layout={layout!r})")
    require(q.device == k.device == v.device, f"Q, K, V are on {q.device}, {k.device}, {v.device}; put them on one "
                                              "device")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    (b, h, n, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = q.shape, k.shape, v.shape
    shapes = f"Q {tuple(q.shape)}, K {tuple(k.shape)}, V {tuple(v.shape)} as (batch, heads, seqlen, head_dim)"
    other = "bshd" if layout == "bhsd" else "bhsd"
    hint = f" (layout={layout!r}; are they {other}?)"
    require(b == bk == bv, f"batch sizes differ: {shapes}{hint}")
    require((hk, nk) == (hv, nv), f"K and V differ in heads or seqlen: {shapes}{hint}")
    require(d == dk == dv, f"head dims differ: {shapes}; Q, K and V need one head dim{hint}")
    require(min(n, nk) >= 1 and b >= 1 and hk >= 1, f"empty tensors: {shapes}; give at least one query and key")
    require(h % hk == 0, f"Q's {h} heads are not a multiple of K/V's {hk} heads: {shapes}{hint}")
    check_head_dim(d)
    # detached: the emulator is not differentiable, and a graph would hold every intermediate
    return (*(t.detach().to(torch.float64) for t in (q, k, v)), layout)


def _scale(softmax_scale, head_dim: int) -> float | None:
    import numpy as np

    if softmax_scale is None:
        return None
    ok = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, (bool, np.bool_))
    require(ok and math.isfinite(softmax_scale) and softmax_scale > 0,
            f"softmax_scale must be a positive finite number (None: 1/sqrt(head_dim) = {head_dim ** -0.5:.6g}), "
            f"got {softmax_scale!r}")
    return float(softmax_scale)


def _checked(q, k, v, layout, causal, softmax_scale, what: str):
    import numpy as np

    from .engine.inputs import check_inputs, default_scale

    q, k, v, layout = _bhsd(q, k, v, layout)
    require(isinstance(causal, (bool, np.bool_)), f"causal must be True or False, got {causal!r}")
    causal = bool(causal)
    scale = _scale(softmax_scale, q.shape[-1])
    check_inputs(q, k, v, scale=default_scale(q.shape[-1], scale), where=what)
    return q, k, v, layout, scale, causal


def _back(o: torch.Tensor, layout: str) -> torch.Tensor:
    return o.transpose(1, 2).contiguous() if layout == "bshd" else o


# -- attention -----------------------------------------------------------------------------------

def emulate(q, k, v, recipe="fa3-fp8", *, layout: str | None = None, causal: bool = False,
            softmax_scale: float | None = None, seed: int = 0) -> torch.Tensor:
    """The attention output ``recipe`` computes on Q, K, V, as the kernel rounds it.

    ``recipe``: a preset name (``fa3-fp8``; ``fa3-numerics variants`` lists them), a spec string
    (``"fa3-fp8,acc=fp22"``, ``"qk=e4m3,v=e4m3,p=e4m3,gran=head"``), a ``Recipe`` or a ``Preset``.
    ``layout``: ``"bhsd"`` (the default) or ``"bshd"``; the output has the caller's layout.
    ``seed`` draws the random Hadamard signs of recipes that rotate Q and K.

    Returns float64 holding values of the recipe's output format (BF16 for the FP8 presets:
    ``.to(torch.bfloat16)`` is exact), on the inputs' device.
    """
    from .engine.sampling import check_seed
    from .numerics.emulator import emulate as _emulate

    _, r = as_recipe(recipe)
    q, k, v, layout, scale, causal = _checked(q, k, v, layout, causal, softmax_scale, "emulate")
    check_seed(seed, "seed")
    return _back(_emulate(r, q, k, v, causal=causal, softmax_scale=scale, rotation_seed=seed), layout)


def reference(q, k, v, *, layout: str | None = None, causal: bool = False,
              softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V in float64 (causal aligned bottom-right, as FlashAttention), in the
    caller's layout: what every error of this package is measured against."""
    from .numerics.reference import reference_attention

    q, k, v, layout, scale, causal = _checked(q, k, v, layout, causal, softmax_scale, "reference")
    return _back(reference_attention(q, k, v, causal=causal, softmax_scale=scale), layout)


def evaluate(q, k, v, variants=None, *, layout: str | None = None, causal: bool = False,
             softmax_scale: float | None = None, rows: int = 0, seed: int = 0, backend: str = "emulate",
             allow_nonfinite: bool = False, progress: bool | Callable[[str], None] = False):
    """Every variant on Q, K, V against the float64 reference: an ``xarray.Dataset`` laid out as a
    ``run`` dataset (one variable per registered metric over (variant, seed, batch, head); ``spec``
    per variant; the inputs' |x| histogram; provenance attributes), one sample per (batch, head).

    ``variants``: a list of preset names, specs, Recipes or Presets, or one string as ``run
    --variants`` takes it (default: the FA3 paper's seven Table 3 rows). ``rows`` > 0 evaluates a
    seeded random sample of that many query rows per (batch, head) (exact outputs for those rows;
    0: every row); ``seed`` picks it and the rotations. ``backend``: where the variants are
    computed (``fa3-numerics backends``). ``summary(ds)`` gives the pooled metric with its 95%
    interval per variant.

    A NaN or Inf in an output raises ``NonFiniteError`` (its ``dataset`` attribute holds the
    dataset) unless ``allow_nonfinite``, which warns instead.
    """
    from .engine.checks import check_backend
    from .engine.inputs import TensorInputs
    from .engine.runner import Job, Task, run_tasks
    from .engine.sampling import check_seed
    from .numerics.recipe import TABLE3

    t0 = time.perf_counter()
    recipes = _recipes(list(TABLE3) if variants is None else variants)
    q, k, v, layout_in, scale, causal = _checked(q, k, v, layout, causal, softmax_scale, "evaluate")
    require(isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0,
            f"rows must be an integer >= 0 (0 = every query row), got {rows!r}")
    check_seed(seed, "seed")
    device = str(q.device)
    check_backend(backend, device, recipes)
    task = Task(TensorInputs(q, k, v), causal, seed, rows, backend, device,
                [Job(i, r) for i, (_, r) in enumerate(recipes)], hist_key="", where="tensors",
                softmax_scale=scale)
    say = progress if callable(progress) else (_stderr if progress else (lambda m: None))
    run = run_tasks([task], progress=say)
    ds = _dataset(q, k, v, recipes, run, layout=layout_in, causal=causal, scale=scale, rows=rows, seed=seed,
                  backend=backend, device=device, wall=time.perf_counter() - t0)
    _nonfinite(ds, allow_nonfinite)
    return ds


def _stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def _sha256(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()


def _dataset(q, k, v, recipes, run, *, layout, causal, scale, rows, seed, backend, device, wall):
    """The run-layout dataset of one task (``studies.outliers`` builds a run's the same way)."""
    import numpy as np

    from .engine.dataset import results_dataset
    from .engine.provenance import provenance
    from .engine.sampling import ROWS_SAMPLING, effective_rows
    from .numerics.metrics import METRICS
    from .numerics.recipe import PRESETS

    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    res = run.results[0]
    metrics = {m: np.stack([res[i][m] for i in range(len(recipes))])[:, None] for m in METRICS}
    labels = [label for label, _ in recipes]
    coords = {
        "variant": labels, "seed": [seed], "batch": np.arange(b), "head": np.arange(h),
        "spec": ("variant", [r.spec() for _, r in recipes]),
        "paper_rmse": ("variant", [PRESETS[x].paper_rmse if x in PRESETS and PRESETS[x].paper_rmse else np.nan
                                   for x in labels]),
        "seqlen": n, "head_dim": d, "causal": causal, "heads": h, "kv_heads": hkv, "batch_size": b,
        "rows": effective_rows(n, rows),
    }
    attrs = provenance(device)
    call = (f"fa3_numerics.evaluate(q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)} as bhsd, "
            f"variants={labels!r}, layout={layout!r}, causal={causal}, softmax_scale={scale!r}, rows={rows}, "
            f"seed={seed}, backend={backend!r})")
    attrs.update({
        "experiment": "evaluate", "description": f"attention of the caller's tensors ({n} queries, {nk} keys)",
        "dist": "tensors", "data": "the caller's Q, K, V (fa3_numerics.evaluate)", "backend": backend,
        "seeds": json.dumps([seed]), "rows_sampling": ROWS_SAMPLING, "rotation_seed": "seed",
        "data_seed": "none: the caller's tensors", "inputs_sha256": _sha256(q, k, v), "layout": layout,
        "seqlen_k": nk, "softmax_scale": repr(scale if scale is not None else d ** -0.5),
        "wall_seconds": round(wall, 3), "cells_reused": 0, "command": call,
        "reference": "float64 attention, chunked over queries",
    })
    return results_dataset(metrics, dims=["variant", "seed", "batch", "head"], coords=coords, attrs=attrs,
                           hist=run.hists[0][None], hist_dims=["seed"])


def _nonfinite(ds, allow: bool) -> None:
    from .engine.nonfinite import scan, summary_line

    found = scan(ds)
    if not found:
        return
    if allow:
        for f in found:
            warnings.warn(f.line(), RuntimeWarning, stacklevel=3)
        return
    exc = NonFiniteError(f"{summary_line(found)}: {found[0].line()}; the dataset is the exception's .dataset, "
                         "or pass allow_nonfinite=True")
    exc.dataset = ds
    raise exc


def summary(ds, metric: str = "rmse", level: float = 0.95):
    """One row per (swept cell, variant) of a run-layout dataset: the metric pooled over samples by
    its rule (RMSE: root mean square), its BCa bootstrap interval (``lo``, ``hi``), ``n`` samples,
    ``nonfinite`` ones, the paper's value where the setting is the paper's; a pandas DataFrame."""
    import pandas as pd

    from .engine.dataset import summary_table
    from .numerics.metrics import get_metric

    get_metric(metric)
    require(metric in ds, f"the dataset has no metric {metric!r}")
    return pd.DataFrame(summary_table(ds, metric, level))


# -- studies --------------------------------------------------------------------------------------

def validate(grid: str = "small", *, dist: str | None = None, backend: str = "fa3", device: str = "cuda",
             accs: Iterable[str] | None = None, layers: str | None = None, rows: int = 0,
             progress: bool | Callable[[str], None] = False):
    """The emulator against a hardware backend case by case, as ``fa3-numerics validate``: an
    ``xarray.Dataset`` (dims case, acc, sample) of the fidelity F = RMSE(emulator, kernel) /
    RMSE(kernel, float64), the bit-identical share and both RMSEs.

    ``grid``: tiny, small, stress or full; ``dist``: the data of every case (``"outliers:p=0.01"``,
    ``"student-t:df=3"``) or ``"captured:FILE"`` for a capture's layers (``layers``, ``rows``);
    ``backend="fa3-mock", device="cpu"`` runs the whole path anywhere with a float32 stand-in.
    """
    from .engine.backends import check_device
    from .studies.validate import captured_cases, grid as make_grid, run_validation, with_dist

    check_device(device, "device")
    if dist and dist.strip().startswith("captured:"):
        cases = captured_cases(dist.strip()[len("captured:"):], layers=layers, rows=rows)
    else:
        require(layers is None, "layers is for dist='captured:FILE'")
        cases = make_grid(grid)
        if dist:
            cases = with_dist(cases, dist)
    say = progress if callable(progress) else (_stderr if progress else (lambda m: None))
    return run_validation(cases, device=device, backend=backend, accs=list(accs) if accs else None, progress=say)


# -- datasets -------------------------------------------------------------------------------------

def open_dataset(path):
    """Any dataset this package writes (every study's: run, ablation, audit, validation, impact,
    recommend, backward, train), loaded, upgraded to the current layout and holding its findings;
    a one-line ``UsageError`` for anything else."""
    from .engine.dataset import read

    return read(path, kinds=None)


# -- recommend -----------------------------------------------------------------------------------

def recommend(model: str = "smollm2", **options):
    """The recipe to deploy for ``model`` on a target, verified end to end: ``fa3-numerics
    recommend`` from Python. Options as the command's (``target``, ``text``, ``calib_text``,
    ``tokens``, ``budget_kl``, ``budget_ppl``, ``budget_top1``, ``add``, ``drop``, ...). Returns
    ``(dataset, artifact)``, the artifact being what ``recommend.json`` holds; raises
    ``studies.recommend.BudgetNotMet`` (carrying both) when no measured candidate meets the budget."""
    from .studies.recommend import recommend as run

    return run(model=model, **options)


__all__ = ["LAYOUTS", "as_recipe", "emulate", "reference", "evaluate", "summary", "validate", "open_dataset",
           "recommend"]
