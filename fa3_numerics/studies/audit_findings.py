"""What an audit of a capture found, for its dataset.

Exposed: ``findings``, ``with_findings``, ``settings_of``, ``EXPLAIN_STATS``.

``findings(ds)`` follows the report settings the audit recorded (``budget``, ``budget_metric``,
``rank_by``, ``rank_metric``, ``top``; ``settings``) and holds: ``ranking`` (the riskiest
(layer, head) pairs, ``studies.audit.rank``), ``recommendation`` (per layer the cheapest
variant meeting the budget, ``studies.audit.recommend``, with ``problems`` from checking it
against the measured table), ``variants`` (pooled error, worst head per variant), ``explain``
(Spearman rank correlation of each statistic with each variant's error), ``rope_check``,
``lines`` (the findings in words) and ``verdict``: the recipe for the whole model, or per layer,
and where no variant meets the budget, the closest one by name.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..text import column_format, md_code
from .findings import store, stored

EXPLAIN_STATS = ("q_max_over_rms", "k_max_over_rms", "v_max_over_rms", "q_kurtosis", "k_kurtosis", "q_hot_ratio",
                 "k_hot_ratio", "q_mu_max", "k_mu_max", "k_mu_rot_max", "sink_mass", "p_underflow", "k_block_ratio",
                 "out_rms")


def settings_of(ds: xr.Dataset) -> dict:
    """The report settings the audit recorded (``fa3-numerics audit`` writes them as attributes)."""
    a = ds.attrs
    budget = a.get("budget", "")
    return {"budget": float(budget) if budget not in ("", None) else None,
            "budget_metric": str(a.get("budget_metric", "rmse")), "rank_by": str(a.get("rank_by", "worst")),
            "rank_metric": str(a.get("rank_metric", "rel_l2")), "top": int(a.get("top", 10))}


def _err_fmt(values):
    fmt = column_format(values)
    return lambda x: fmt(x) if np.isfinite(x) else "non-finite"


def per_head(ds, name):
    """A (layer, head) array; K/V statistics (layer, kv_head) are mapped onto their query heads."""
    da = ds[name]
    if "kv_head" in da.dims:
        da = da.sel(kv_head=ds["kv_head_of"]).drop_vars("kv_head", errors="ignore")
    return da.transpose("layer", "head").values


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3:
        return float("nan")
    ra = np.argsort(np.argsort(a[ok])).astype(float)
    rb = np.argsort(np.argsort(b[ok])).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _explain(ds, metric: str) -> dict:
    """Spearman rank correlation over all (layer, head) between each statistic and each variant's error."""
    labels = [str(v) for v in ds["variant"].values]
    errs = {lab: ds[metric].sel(variant=lab).transpose("layer", "head").values.ravel() for lab in labels}
    return {name: {lab: _spearman(per_head(ds, name).ravel(), errs[lab]) for lab in labels}
            for name in EXPLAIN_STATS if name in ds}


def _rope_pair_check(ds) -> str:
    """Correlation of per-channel amax between RoPE partners (c, c + d/2) versus neighbours (c, c xor 1)."""
    d = ds.sizes["channel"]
    c = np.arange(d // 2)
    out = []
    for name in ("q_amax", "k_amax"):
        a = ds[name].values.reshape(-1, d)
        half = float(np.corrcoef(a[:, c].ravel(), a[:, c + d // 2].ravel())[0, 1])
        ev = np.arange(0, d, 2)
        nb = float(np.corrcoef(a[:, ev].ravel(), a[:, ev + 1].ravel())[0, 1])
        out.append(f"{name[0].upper()}: corr(amax[c], amax[c + d/2]) = {half:.2f} versus corr(amax[c], amax[c xor 1]) "
                   f"= {nb:.2f}")
    return "; ".join(out)


def _variants(ds) -> list[dict]:
    from ..numerics.metrics import nonfinite_samples, pooled

    out = []
    for i, lab in enumerate(ds["variant"].values):
        rm = ds["rmse"].sel(variant=lab).values
        rl = ds["rel_l2"].sel(variant=lab).transpose("layer", "head")
        v = rl.values
        # the worst head: a non-finite one first, else the largest error
        flat = int(np.argmax(np.isnan(v))) if np.isnan(v).any() else int(np.argmax(v))
        bad, n = nonfinite_samples(rm)
        out.append({"variant": str(lab), "cost": int(ds["cost"].values[i]), "rmse_pooled": pooled("rmse", rm),
                    "nonfinite": bad, "samples": n, "rel_l2_mean": float(rl.mean(skipna=False)),
                    "rel_l2_max": float(rl.max(skipna=False)),
                    "worst": [int(rl["layer"].values[flat // v.shape[1]]), int(rl["head"].values[flat % v.shape[1]])],
                    "paper_rmse": float(ds["paper_rmse"].values[i]), "spec": str(ds["spec"].values[i])})
    return out


def _layer_summary(ds, metric: str) -> str:
    """Worst head per layer for each variant, compactly: the layers ordered by risk."""
    worst = ds[metric].max("head", skipna=False).max("variant", skipna=False)
    order = np.argsort(-np.nan_to_num(worst.values, nan=np.inf), kind="stable")
    fmt = _err_fmt(worst.values)
    return ", ".join(f"{int(ds['layer'].values[i])} ({fmt(float(worst.values[i]))})" for i in order[:8])


def _lines(ds, ranking, rec, explain, rank_by, rank_metric) -> list[str]:
    labels = [str(v) for v in ds["variant"].values]
    fmt = _err_fmt([r["score"] for r in ranking[:3]])
    by = "the worst variant" if rank_by == "worst" else md_code(rank_by)
    top3 = ", ".join(f"layer {r['layer']} head {r['head']} ({rank_metric} {fmt(r['score'])}, worst "
                     f"{md_code(r['worst_variant'])})" for r in ranking[:3])
    out = [f"Riskiest heads (ranked by {rank_metric} of {by}): {top3}.",
           f"Riskiest layers (worst head, worst variant, {rank_metric}): {_layer_summary(ds, rank_metric)}."]
    for a_, b_, what in (("fa3-fp8-no-incoherent", "fa3-fp8", "the Hadamard rotation (no-incoherent / fa3-fp8)"),
                         ("fa3-fp8-no-block-quant", "fa3-fp8", "block quantization (no-block-quant / fa3-fp8)"),
                         ("baseline-fp8", "fa3-fp8", "FA3 FP8 over the per-tensor baseline (baseline / fa3-fp8)")):
        if a_ in labels and b_ in labels:
            r_ = (ds[rank_metric].sel(variant=a_) / ds[rank_metric].sel(variant=b_)).values.ravel()
            r_ = r_[np.isfinite(r_)]
            if r_.size:
                out.append(f"Effect of {what}: {rank_metric} ratio median {np.median(r_):.2f}, range "
                           f"{r_.min():.2f}-{r_.max():.2f} over the {r_.size} heads.")
    rhos = sorted(((float(np.nanmean(list(per.values()))), name) for name, per in explain.items()
                   if np.isfinite(list(per.values())).any()), reverse=True)
    if rhos:
        out.append(f"Statistics that track the error best (Spearman rho with {rank_metric}, mean over variants): "
                   + ", ".join(f"{md_code(n)} {r:+.2f}" for r, n in rhos[:3]) + ".")
    if rec is not None:
        overall = rec["overall"]
        n_none = sum(1 for r in rec["layers"] if r["recommended"] is None)
        counts: dict[str, int] = {}
        for r in rec["layers"]:
            if r["recommended"]:
                counts[r["recommended"]] = counts.get(r["recommended"], 0) + 1
        out.append(f"Budget {rec['metric']} <= {rec['budget']:g} (max over a layer's heads): "
                   + ", ".join(f"{md_code(k)} in {v} layers" for k, v in counts.items())
                   + (f", none of the variants in {n_none} layers" if n_none else "")
                   + (f"; one recipe for the whole model: {md_code(overall)}." if overall else
                      "; no single audited recipe meets it in every layer."))
    return out


def _verdict(ds, variants: list[dict], rec: dict | None) -> dict:
    from .run_findings import precision_class

    fmt = _err_fmt([v["rmse_pooled"] for v in variants])
    ok = [v for v in variants if not v["nonfinite"] and math.isfinite(v["rmse_pooled"])]
    sixteen = [v for v in ok if precision_class(v["spec"]) == "16-bit"]
    ref16 = min(sixteen, key=lambda v: v["rmse_pooled"]) if sixteen else None
    by_label = {v["variant"]: v for v in variants}

    def cost16(label: str) -> str:
        v = by_label.get(label)
        if ref16 is None or v is None or not ref16["rmse_pooled"] > 0 or label == ref16["variant"]:
            return ""
        return (f"; RMSE over every layer and head {fmt(v['rmse_pooled'])}, ×{v['rmse_pooled'] / ref16['rmse_pooled']:.2f} "
                f"that of {md_code(ref16['variant'])}")

    lines: list[str] = []
    out: dict = {"use": None, "per_layer": [], "none_meet": [], "avoid": [], "lines": lines}
    if rec is not None:
        b = f"{rec['metric']} ≤ {rec['budget']:g} (worst head of each layer)"
        if rec["overall"]:
            out["use"] = rec["overall"]
            lines.append(f"**Use {md_code(rec['overall'])}** in every layer: the cheapest audited recipe that meets "
                         f"{b} everywhere{cost16(rec['overall'])}.")
        else:
            picks: dict[str, list[int]] = {}
            for r in rec["layers"]:
                if r["recommended"]:
                    picks.setdefault(r["recommended"], []).append(r["layer"])
            out["per_layer"] = [{"variant": k, "layers": v} for k, v in picks.items()]
            if picks:
                lines.append("**Per layer** (no single audited recipe meets " + b + " everywhere): " + "; ".join(
                    f"{md_code(k)} in layers {_span(v)}" for k, v in picks.items()) + ".")
        none = [r for r in rec["layers"] if r["recommended"] is None]
        if none:
            closest: dict[str, list[tuple[int, float]]] = {}
            for r in none:
                closest.setdefault(r["best"], []).append((r["layer"], r["values"][r["best"]]))
            out["none_meet"] = [{"closest": k, "layers": [x[0] for x in v], "values": [x[1] for x in v]}
                                for k, v in closest.items()]
            f2 = _err_fmt([x[1] for v in closest.values() for x in v])
            lines.append(f"**No audited variant meets the budget in {len(none)} of {len(rec['layers'])} layers**; the "
                         "closest: " + "; ".join(
                             f"{md_code(k)} in layers {_span([x[0] for x in v])} (worst head up to "
                             f"{f2(max(x[1] for x in v))})" for k, v in closest.items())
                         + ". Keep those layers in 16-bit or audit a stronger recipe.")
    else:
        low = [v for v in ok if precision_class(v["spec"]) == "low"]
        if low:
            best = min(low, key=lambda v: v["rmse_pooled"])
            out["use"] = best["variant"]
            lines.append(f"**Use {md_code(best['variant'])}**: the lowest RMSE of the {len(low)} low-precision "
                         f"variant(s) over every layer and head, {fmt(best['rmse_pooled'])}{cost16(best['variant'])}. "
                         "No budget was given: `--budget` recommends a recipe per layer.")
    low = [v for v in ok if precision_class(v["spec"]) == "low"]
    if len(low) > 1:
        worst = max(low, key=lambda v: v["rmse_pooled"])
        if worst["variant"] != out["use"]:
            out["avoid"].append(worst["variant"])
            lines.append(f"**Avoid {md_code(worst['variant'])}**: the highest RMSE over every layer and head, "
                         f"{fmt(worst['rmse_pooled'])}, worst head rel_l2 {worst['rel_l2_max']:.3g} at layer "
                         f"{worst['worst'][0]}, head {worst['worst'][1]}.")
    broken = [v["variant"] for v in variants if v["nonfinite"]]
    if broken:
        out["avoid"] += broken
        lines.append("**Avoid** " + ", ".join(md_code(v) for v in broken) + ": non-finite outputs in some heads.")
    return out


def _span(layers: list[int]) -> str:
    """0, 1, 2, 5, 7, 8 as '0-2, 5, 7-8'."""
    out, run = [], []
    for x in sorted(layers):
        if run and x == run[-1] + 1:
            run.append(x)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [x]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def findings(ds: xr.Dataset, settings: dict | None = None) -> dict:
    from .audit import check_recommendations, rank, recommend
    from .audit_stats import STAT_DEFINITIONS

    s = settings or settings_of(ds)
    ranking = rank(ds, by=s["rank_by"], metric=s["rank_metric"], top=max(s["top"], 3))
    rec = recommend(ds, s["budget"], metric=s["budget_metric"]) if s["budget"] is not None else None
    explain = _explain(ds, s["rank_metric"])
    variants = _variants(ds)
    return {"kind": "audit", "settings": s, "ranking": ranking[:s["top"]], "ranking_top3": ranking[:3],
            "recommendation": rec, "problems": check_recommendations(ds, rec) if rec is not None else [],
            "variants": variants, "explain": explain, "rope_check": _rope_pair_check(ds),
            "stat_definitions": dict(STAT_DEFINITIONS),
            "lines": _lines(ds, ranking, rec, explain, s["rank_by"], s["rank_metric"]),
            "verdict": _verdict(ds, variants, rec)}


def with_findings(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with findings for the settings it records (recomputed where they were stored for others)."""
    got = stored(ds)
    if got is not None and got.get("settings") == settings_of(ds):
        return ds
    return store(ds, findings(ds))


__all__ = ["findings", "with_findings", "settings_of", "per_head", "EXPLAIN_STATS"]
