"""Audit a captured model: FP8 attention error per layer x head, and the statistics that explain it.

Exposed: ``DEFAULT_VARIANTS``, ``RANK_METRICS``, ``plan``, ``audit``, ``tasks``, ``recipe_cost``, ``rank``,
``recommend``, ``cost_order``, ``check_recommendations``, ``STAT_DEFINITIONS``.

``audit(capture)`` runs every variant on every (layer, head) of a capture (``fa3_numerics.data.capture``)
against the float64 reference, causal as the model is and with the model's softmax scale, through
the one engine (``fa3_numerics.engine.runner``): one task per layer, its inputs the recorded
tensors, its probe the statistics of ``fa3_numerics.studies.audit_stats`` (which also give the
reference). Per (layer, head) the dataset holds every registered metric (dims layer, head,
variant) and every statistic (``STAT_DEFINITIONS``, also in the variables' attributes).

Heads of a layer are evaluated together as one [1, heads, seq, dim] problem (K, V with kv_heads:
GQA). Query rows are independent given K and V, so ``rows`` > 0 evaluates a seeded random
subset of rows (the same for every layer, ``fa3_numerics.engine.sampling``), exact for those
rows; 0 evaluates all.

``rank`` orders (layer, head) by risk; ``recommend`` picks per layer the cheapest variant (by
``recipe_cost``, read from the recipe-key registry) whose error, max over the layer's heads,
meets a budget. Both are read off the measured table, so the recommendation agrees with the
measured errors by construction; ``check_recommendations`` verifies that on the dataset. A
non-finite error is never skipped: it ranks riskiest and never meets a budget.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.checks import check_backend, check_rows
from ..engine.inputs import CaptureInputs
from ..engine.runner import Job, Task, run_tasks
from ..engine.sampling import ROWS_SAMPLING, check_seed, effective_rows
from ..engine.study import Study
from ..errors import require
from ..numerics.keys import keys
from ..numerics.metrics import METRICS, metrics
from ..numerics.recipe import PRESETS, Recipe, parse_recipes
from ..numerics.tiles import check_head_dim, fa3_tiles
from .stored import StoredFindings
from .audit_stats import SINK_TOKENS, STAT_DEFINITIONS

# The paper's FP8 rows, then the remedies of the field (issue 11): the public kernel with K smoothed,
# SageAttention2 (INT8) and 3 (NVFP4), and FA3's pipeline in MXFP8.
DEFAULT_VARIANTS = ("baseline-fp8", "fa3-fp8", "fa3-fp8-no-block-quant", "fa3-fp8-no-incoherent",
                    "fa3-fp8-kernel,smooth=k", "sage2-int8", "sage3-nvfp4", "fa3-mxfp8")
AUDIT_FORMAT = "fa3-numerics-audit/1"
PROBE = "fa3_numerics.studies.audit_stats:probe"


def __getattr__(name: str):
    if name == "RANK_METRICS":  # error metrics of the registry, larger = worse
        return rank_metrics()
    raise AttributeError(name)


def rank_metrics() -> tuple[str, ...]:
    """Metrics an audit can rank by: registered errors where larger is worse (rel_l2 first: fair
    across layers of different output scale)."""
    names = [m.name for m in metrics().values() if m.worse == "higher"]
    return tuple(sorted(names, key=lambda n: (n != "rel_l2", names.index(n))))


def recipe_cost(recipe: Recipe) -> int:
    """Relative cost of a recipe over the public FA3 FP8 kernel with one descale per tensor: the
    sum of each recipe key's registered cost. Scales: per tensor 0, per (kv-)head 1 (the kernel's
    descale shape), per block or per thread 3 (needs a kernel change), per token 4; V per channel
    (``vgran=channel``) 1. Rotation: a random Hadamard on Q and K costs 2 (an extra O(d log d)
    pass), a dense orthogonal rotation 4. ``algo=standard`` (S and P materialised) adds 6, 16-bit
    Q/K instead of a one-byte format adds 8 (half the tensor-core throughput).

    Recipes of the field: INT8/INT4 Q/K 0 (same or higher throughput than FP8); microscaling
    (MXFP8/NVFP4) Q/K 1 and V 1 (block scales to write and a block-scaled MMA), P 2 (a block
    amax per KV tile in registers); smoothing K 1 (a mean over tokens, fused into the quantizer),
    Q and K 3 (block means, the bias GEMM and a bias tile per KV tile); FlashAttention's per-tile
    normalisation (``norm=tile``) 2. Keys of rounding rules (``ties``, ``mxscale``, ``pmatch``,
    ``nvts``, ``sbias``) and accumulators cost 0. Costs order implementation effort and overhead on
    the hardware each recipe needs; they do not compare GPUs (the presets' ``variants`` text says
    which). Ties keep the order given."""
    return sum(k.cost(getattr(recipe, k.field)) for k in keys() if k.cost is not None)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _layers(cap, layers) -> list[int]:
    from ..data.capture import parse_layers

    if layers is None or isinstance(layers, str):
        sel = parse_layers(layers) if layers is not None else None
        sel = cap.layers if sel is None else sel
    else:
        sel = sorted(set(int(i) for i in layers))
    missing = [i for i in sel if i not in cap.layers]
    require(not missing, f"--layers asks for {missing}, not in the capture (layers "
            f"{','.join(map(str, cap.layers))}); pick from those")
    return sel


def tasks(cap, recipes: list[tuple[str, Recipe]], layers: list[int], *, backend: str, rows: int, seed: int,
          device: str, capture_sha256: str = "") -> list[Task]:
    """One engine task per layer: the recorded tensors, every variant, the statistics probe.
    With ``capture_sha256`` (the file's) every variant's result has a cache key, so that an audit
    into the same folder resumes (the statistics probe is recomputed: it is cheap beside the variants)."""
    from ..engine.cache import cache_key
    from ..engine.inputs import TensorInputs

    out = []
    for layer in layers:
        inputs = CaptureInputs(str(cap.path), layer) if cap.path else TensorInputs.of(*cap.qkv(layer))
        opts = cap.attention_options(layer)
        cell = {"layer": layer, "causal": cap.causal, "softmax_scale": cap.scale, "tokens": cap.tokens}
        if opts:  # only then, so that the cache keys of plain layers are the ones they always were
            cell["masking"] = cap.attention_options_text(layer)
        keys = [cache_key(f"capture:{capture_sha256}", cell, seed, r.spec(), batch=1, heads=cap.heads,
                          kv_heads=cap.kv_heads, rows=rows, backend=backend, device=device,
                          study=(__name__, "fa3_numerics.studies.audit_stats"))
                if capture_sha256 else "" for _, r in recipes]
        out.append(Task(inputs, cap.causal, seed, rows, backend, device,
                        [Job(i, r, key=k) for i, ((_, r), k) in enumerate(zip(recipes, keys))], hist_key=None,
                        where=f"layer {layer}", softmax_scale=cap.scale, probe=PROBE, masking=opts))
    return out


def plan(capture, *, variants: str | list[str] | None = None, backend: str = "emulate", rows: int = 256,
         layers: str | list[int] | None = None, seed: int = 0, device: str = "cpu"):
    """Every check of an audit before it computes: (capture, [(label, recipe)], layers)."""
    from ..data.capture import Capture, load_capture

    check_rows(rows)
    check_seed(seed, "--seed")
    cap: Capture = capture if isinstance(capture, Capture) else load_capture(capture)
    if variants is None:
        variants = list(DEFAULT_VARIANTS)
    recipes = parse_recipes(variants if isinstance(variants, str) else ";".join(variants))
    check_head_dim(cap.head_dim)
    sel = _layers(cap, layers)
    check_backend(backend, device, recipes)
    return cap, recipes, sel


def audit(capture, *, variants: str | list[str] | None = None, backend: str = "emulate", rows: int = 256,
          layers: str | list[int] | None = None, seed: int = 0, device: str = "cpu",
          progress: Callable[[str], None] = _progress, cache_dir: Path | None = None,
          budget: float | None = None, budget_metric: str = "rmse", rank_by: str = "worst",
          rank_metric: str = "rel_l2", top: int = 10) -> "xarray.Dataset":  # noqa: F821
    """Audit ``capture`` (a ``Capture`` or a path) and return the dataset (see module docstring).
    ``cache_dir``: where finished (layer, variant) results are kept, so that a rerun resumes.
    ``budget`` .. ``top``: what the findings stored in the dataset rank and recommend by
    (``studies.audit_findings``; recorded as attributes, which a report of the dataset follows)."""
    from ..engine.provenance import provenance

    t_start = time.perf_counter()
    cap, recipes, sel = plan(capture, variants=variants, backend=backend, rows=rows, layers=layers, seed=seed,
                             device=device)
    d, n, H, Hkv = cap.head_dim, cap.tokens, cap.heads, cap.kv_heads
    bm, bn = fa3_tiles(d, fp8=True)
    r_eval = effective_rows(n, rows)
    L, V = len(sel), len(recipes)
    progress(f"audit of {cap.path or 'capture'}: {L} layers x {H} heads ({Hkv} KV heads), seq {n}, "
             f"{r_eval} query rows, {V} variants, backend {backend} on {device}")
    sha = _sha256(cap.path) if cache_dir is not None and cap.path and Path(cap.path).is_file() else ""
    run = run_tasks(tasks(cap, recipes, sel, backend=backend, rows=rows, seed=seed, device=device, capture_sha256=sha),
                    progress=progress, cache_dir=Path(cache_dir) if sha else None)
    err = {m: np.full((L, H, V), np.nan) for m in METRICS}
    stats: dict[str, np.ndarray] = {}
    for li, (res, extra) in enumerate(zip(run.results, run.extras)):
        for vi, vals in res.items():
            for m in METRICS:
                err[m][li, :, vi] = vals[m][0]
        for name, val in extra.items():
            if name not in stats:
                stats[name] = np.full((L,) + np.shape(val), np.nan)
            stats[name][li] = val

    labels = [lab for lab, _ in recipes]
    coords = {
        "layer": sel, "head": np.arange(H), "variant": labels, "kv_head": np.arange(Hkv), "channel": np.arange(d),
        "spec": ("variant", [r.spec() for _, r in recipes]),
        "cost": ("variant", [recipe_cost(r) for _, r in recipes]),
        "paper_rmse": ("variant", [PRESETS[lab].paper_rmse if lab in PRESETS and PRESETS[lab].paper_rmse
                                   else np.nan for lab in labels]),
        "kv_head_of": ("head", np.arange(H) // (H // Hkv)),
    }
    attrs = provenance(device)
    cap_path = cap.path or ""
    attrs.update({
        "kind": "audit", "audit_format": AUDIT_FORMAT, "experiment": "audit",
        "description": f"FP8 attention audit of {cap.meta.get('model', '?')}",
        "dist": f"capture of {cap.meta.get('model', '?')} ({cap.meta.get('text_source', '?')}, {n} tokens)",
        "backend": backend, "seeds": json.dumps([seed]), "rotation_seed": seed,
        "rows": rows, "rows_evaluated": r_eval,
        "rows_sampling": ("all query rows" if r_eval == n else
                          f"{r_eval} of {n} rows: {ROWS_SAMPLING.replace('seqlen', str(n))}, the same rows in every "
                          "layer"),
        "capture_path": str(Path(cap_path).resolve()) if cap_path else "",
        "capture_sha256": sha or (_sha256(cap_path) if cap_path and Path(cap_path).is_file() else ""),
        "capture_meta": json.dumps(cap.meta, sort_keys=True),
        "model": cap.meta.get("model", ""), "tokens": n, "heads": H, "kv_heads": Hkv, "head_dim": d,
        "causal": str(cap.causal).lower(), "softmax_scale": repr(cap.scale),
        "tiles_fp8": json.dumps([bm, bn]), "sink_tokens": SINK_TOKENS,
        "reference": "float64 attention, chunked over queries, causal as captured, the capture's softmax scale",
        "stat_definitions": json.dumps(STAT_DEFINITIONS),
    })
    from ..engine.dataset import to_dataset  # xarray: not needed to build the command line

    ds = to_dataset(err, dims=["layer", "head", "variant"], coords=coords, attrs=attrs)
    ds = ds.assign_coords(q_block=np.arange(stats["q_block_amax"].shape[-1]),
                          k_block=np.arange(stats["k_block_amax"].shape[-1]))
    for name, arr in stats.items():
        tensor, _, key = name.partition("_")
        if name in ("sink_mass", "p_underflow", "p_underflow_final", "out_rms"):
            dims, key = ["layer", "head"], name
        else:
            hd = "head" if tensor == "q" else "kv_head"
            dims = ["layer", hd] + (["channel"] if key == "amax" else
                                    [f"{'q' if tensor == 'q' else 'k'}_block"] if key == "block_amax" else [])
        desc = STAT_DEFINITIONS.get(key, "RMS of the float64 reference output" if name == "out_rms" else "")
        if tensor == "v" and key == "block_amax":
            dims = ["layer", "kv_head", "k_block"]
        ds[name] = (dims, arr, {"description": (f"{tensor.upper()}: " if name != key else "") + desc})
    ds.attrs["wall_seconds"] = round(time.perf_counter() - t_start, 3)
    ds.attrs.update({"budget": "" if budget is None else float(budget), "budget_metric": budget_metric,
                     "rank_by": rank_by, "rank_metric": rank_metric, "top": int(top)})
    from .audit_findings import with_findings

    return with_findings(ds)


# --------------------------------------------------------------------------------------------
# ranking and recommendation (read off the measured table)
# --------------------------------------------------------------------------------------------

def rank(ds, *, by: str = "worst", metric: str = "rel_l2", top: int | None = 10) -> list[dict]:
    """(layer, head) pairs, riskiest first: the ``metric`` of variant ``by`` (or the worst variant)."""
    names = rank_metrics()
    require(metric in names, f"--rank-metric must be one of {', '.join(names)}, got {metric!r}")
    labels = [str(v) for v in ds["variant"].values]
    err = ds[metric]
    if by == "worst":
        score = err.max("variant", skipna=False)  # a non-finite variant makes the head non-finite
    else:
        require(by in labels, f"--rank-by {by!r} is not an audited variant; use worst or one of {', '.join(labels)}")
        score = err.sel(variant=by)
    flat = score.stack(lh=("layer", "head"))
    # Non-finite scores rank riskiest (first), never dropped.
    order = np.argsort(-np.nan_to_num(flat.values, nan=np.inf), kind="stable")
    if top:
        order = order[:top]
    rows = []
    for rnk, i in enumerate(order, 1):
        layer, head = (int(x) for x in flat["lh"].values[i])
        kvh = int(ds["kv_head_of"].sel(head=head))
        sel, ksel = dict(layer=layer, head=head), dict(layer=layer, kv_head=kvh)
        e = err.sel(**sel)
        bad = [lab for lab, x in zip(labels, e.values) if not np.isfinite(x)]
        worst_variant = bad[0] if bad else str(e.idxmax("variant").values)
        rows.append({
            "rank": rnk, "layer": layer, "head": head, "kv_head": kvh, "score": float(flat.values[i]),
            "worst_variant": worst_variant, "nonfinite": bad,
            "errors": {lab: float(err.sel(**sel, variant=lab)) for lab in labels},
            "rmse": {lab: float(ds["rmse"].sel(**sel, variant=lab)) for lab in labels},
            "q_hot": int(ds["q_hot_channel"].sel(**sel)), "q_hot_pair": int(ds["q_hot_pair"].sel(**sel)),
            "q_hot_ratio": float(ds["q_hot_ratio"].sel(**sel)),
            "k_hot": int(ds["k_hot_channel"].sel(**ksel)), "k_hot_pair": int(ds["k_hot_pair"].sel(**ksel)),
            "k_hot_ratio": float(ds["k_hot_ratio"].sel(**ksel)),
            "q_max_over_rms": float(ds["q_max_over_rms"].sel(**sel)),
            "k_max_over_rms": float(ds["k_max_over_rms"].sel(**ksel)),
            "v_max_over_rms": float(ds["v_max_over_rms"].sel(**ksel)),
            "k_mu_max": float(ds["k_mu_max"].sel(**ksel)), "k_mu_rot_max": float(ds["k_mu_rot_max"].sel(**ksel)),
            "q_kurtosis": float(ds["q_kurtosis"].sel(**sel)), "k_kurtosis": float(ds["k_kurtosis"].sel(**ksel)),
            "sink_mass": float(ds["sink_mass"].sel(**sel)), "p_underflow": float(ds["p_underflow"].sel(**sel)),
            "k_block_ratio": float(ds["k_block_ratio"].sel(**ksel)),
        })
    return rows


def cost_order(ds) -> list[str]:
    """Variants cheapest first: by ``cost``, ties in the order given."""
    labels = [str(v) for v in ds["variant"].values]
    costs = [int(c) for c in ds["cost"].values]
    return [lab for _, _, lab in sorted(zip(costs, range(len(labels)), labels))]


def recommend(ds, budget: float, *, metric: str = "rmse") -> dict:
    """Per layer, the cheapest variant whose ``metric`` (max over the layer's heads) is <= ``budget``.

    Returns {"layers": [row per layer], "overall": the cheapest variant meeting the budget in every
    layer (or None), "order": cost order, "metric", "budget"}.
    """
    names = rank_metrics()
    require(metric in names, f"--budget-metric must be one of {', '.join(names)}, got {metric!r}")
    require(math.isfinite(budget) and budget > 0, f"--budget must be a positive number, got {budget}")
    order = cost_order(ds)
    worst = ds[metric].max("head", skipna=False)  # (layer, variant); NaN (non-finite) never meets a budget
    rows = []
    for layer in ds["layer"].values:
        vals = {lab: float(worst.sel(layer=layer, variant=lab)) for lab in order}
        ok = [lab for lab in order if vals[lab] <= budget]
        best = min(vals, key=lambda lab: vals[lab] if math.isfinite(vals[lab]) else math.inf)
        rows.append({"layer": int(layer), "recommended": ok[0] if ok else None, "best": best, "values": vals,
                     "meets": {lab: vals[lab] <= budget for lab in order}})
    overall = None
    for lab in order:
        if all(r["meets"][lab] for r in rows):
            overall = lab
            break
    return {"layers": rows, "overall": overall, "order": order, "metric": metric, "budget": budget}


def check_recommendations(ds, rec: dict) -> list[str]:
    """Problems (empty when consistent): each recommendation meets the budget in the measured
    table and every cheaper variant does not."""
    problems = []
    worst = ds[rec["metric"]].max("head", skipna=False)
    for row in rec["layers"]:
        pick = row["recommended"]
        measured = {lab: float(worst.sel(layer=row["layer"], variant=lab)) for lab in rec["order"]}
        if pick is None:
            if any(v <= rec["budget"] for v in measured.values()):
                problems.append(f"layer {row['layer']}: none recommended but a variant meets the budget")
            continue
        if not measured[pick] <= rec["budget"]:
            problems.append(f"layer {row['layer']}: {pick} measures {measured[pick]:.3g} > budget")
        for lab in rec["order"][:rec["order"].index(pick)]:
            if measured[lab] <= rec["budget"]:
                problems.append(f"layer {row['layer']}: cheaper {lab} also meets the budget")
    return problems


class AuditStudy(StoredFindings, Study):
    """An audit of a capture on the ``engine.study`` protocol: ``plan`` checks the capture and the
    options when the study is made; each (layer, variant) cell is cached in OUT/.cells."""

    kind = "audit"
    stem = "audit"

    def __init__(self, capture, *, variants=None, backend: str = "emulate", rows: int = 256, layers=None,
                 seed: int = 0, device: str = "cpu", settings: dict | None = None):
        self.cap, self.recipes, _ = plan(capture, variants=variants, backend=backend, rows=rows, layers=layers,
                                         seed=seed, device=device)
        self.options = dict(variants=variants, backend=backend, rows=rows, layers=layers, seed=seed, device=device)
        self.settings = dict(settings or {})  # the report's budget and ranking, kept in the dataset

    def describe(self) -> str:
        return (f"audit: {len(self.recipes)} variant(s), backend {self.options['backend']} on "
                f"{self.options['device']}")

    def run(self, ctx):
        # the report's settings go in, so the stored findings are the ones the report shows
        st = self.settings
        report = {"budget": None if st.get("budget", "") == "" else float(st["budget"]),
                  **{k: st[k] for k in ("budget_metric", "rank_by", "rank_metric", "top") if k in st}}
        return audit(self.cap, progress=ctx.progress, cache_dir=ctx.cache, **self.options, **report)

    def assemble(self, ds):
        return ds

    def nonfinite(self, ds) -> list:
        from ..engine.nonfinite import scan

        return scan(ds, sample_dims=("head",))


__all__ = ["AuditStudy", "DEFAULT_VARIANTS", "STAT_DEFINITIONS", "RANK_METRICS", "plan", "audit", "tasks", "recipe_cost", "rank",
           "rank_metrics", "recommend", "cost_order", "check_recommendations"]
