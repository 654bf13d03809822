"""What an impact study (a model's predictions under attention recipes) found, for its dataset.

Exposed: ``findings``, ``with_findings``.

``findings(ds)`` holds ``lines`` (the checks, the range of the all-layer FP8 KL, the BF16
scale, which layers matter, additivity, how the audit's rel_l2 predicts per-layer KL, decode,
the budget's answer), ``layers`` (per FP8 variant: the layers by mean KL, the share of the top
three, the sum of one-layer KLs over the all-layer KL), ``assignments`` (per assignment: the
additive prediction and whether it meets the budget) and ``verdict``: the FP8 recipe to use in
every layer and its mean KL against the model's own BF16 SDPA, the one to avoid, and the
budget's cheapest verified assignment where the study searched one.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..engine.conventions import attr_json
from ..text import fmt_e, fmt_pct, md_code
from .findings import store, stored


def _f(x) -> str:
    return fmt_e(float(x))




def _sel(ds, name, **kw) -> float:
    return float(ds[name].sel(**kw))




def _predicted(ds, recipes: list[str]) -> float:
    """The additive prediction of an assignment's mean KL: the sum of its layers' one-layer KLs
    (NaN unless the sweep covers every layer and every recipe of the assignment)."""
    if "layer_kl_mean" not in ds or ds.sizes["layer"] != ds.sizes["model_layer"]:
        return math.nan
    known = set(str(v) for v in ds["variant"].values)
    if not set(recipes) <= known:
        return math.nan
    return float(sum(_sel(ds, "layer_kl_mean", variant=r, layer=i) for i, r in enumerate(recipes)))



def _lines(ds) -> list[str]:
    """The headline facts, one bullet each."""
    out = []
    v_all = [str(v) for v in ds["variant"].values]
    kl_all = {v: _sel(ds, "kl_mean", variant=v, mask="all") for v in v_all}
    if "exact" in v_all:
        e = kl_all["exact"]
        out.append(f"Check: `exact` (FP32 tile-by-tile attention) has mean KL {_f(e)} (max "
                   f"{_f(_sel(ds, 'kl_max', variant='exact', mask='all'))}) against the float64 reference: "
                   + ("passes" if e <= 1e-6 else "FAILS") + " the <= 1e-6 check.")
    none = float(np.abs(ds["kl"].sel(mask="none")).max())
    out.append(f"Check: with no layer running a recipe the KL is {'exactly 0' if none == 0 else _f(none)} at every token "
               + ("(passes)." if none == 0 else "(FAILS: the passes are not deterministic)."))
    fp8 = [v for v in v_all if int(ds["fp8"].sel(variant=v))]
    if fp8:
        best, worst = min(fp8, key=kl_all.get), max(fp8, key=kl_all.get)
        out.append(f"Every layer in FP8 (prefill): mean KL from {_f(kl_all[best])} ({md_code(best)}, top-1 "
                   f"{fmt_pct(_sel(ds, 'top1_agree', variant=best, mask='all'))}, Δppl "
                   f"{_sel(ds, 'ppl_delta', variant=best, mask='all'):+.3f}) to {_f(kl_all[worst])} ({md_code(worst)}, top-1 "
                   f"{fmt_pct(_sel(ds, 'top1_agree', variant=worst, mask='all'))}, Δppl "
                   f"{_sel(ds, 'ppl_delta', variant=worst, mask='all'):+.3f}); reference ppl {float(ds.attrs['ref_ppl']):.4f}.")
    if "baseline" in ds.dims and "model-sdpa-bf16" in ds["baseline"].values:
        b = _sel(ds, "base_kl_mean", baseline="model-sdpa-bf16")
        ratio = ", ".join(f"{md_code(v)} {kl_all[v] / b:.0f}x" for v in fp8) if b > 0 else ""
        out.append(f"For scale, the model's own BF16 SDPA has mean KL {_f(b)} (top-1 "
                   f"{fmt_pct(_sel(ds, 'base_top1_agree', baseline='model-sdpa-bf16'))}); FP8 over BF16: {ratio}.")
    if "layer_kl_mean" in ds and fp8 and ds.sizes["layer"] > 0:
        v = max(fp8, key=kl_all.get)
        kl = ds["layer_kl_mean"].sel(variant=v).values
        order = np.argsort(-kl)[:5]
        out.append(f"Which layers matter ({md_code(v)}, one layer at a time): "
                   + ", ".join(f"layer {int(ds['layer'].values[i])} ({_f(kl[i])})" for i in order)
                   + f"; the quietest is layer {int(ds['layer'].values[np.argmin(kl)])} ({_f(kl.min())}).")
        if ds.sizes["layer"] == ds.sizes["model_layer"]:
            r = [float(ds["kl_mean_sum_of_layers"].sel(variant=x)) / kl_all[x] for x in fp8 if kl_all[x] > 0]
            out.append(f"Additivity: the sum of the one-layer KLs is {min(r):.2f}-{max(r):.2f}x the all-layer KL over "
                       "the FP8 variants (1 = the layers' effects add up).")
    if "spearman_rho" in ds:
        pooled = attr_json(ds, "spearman_pooled", {}) or {}
        fit = attr_json(ds, "kl_from_rel_l2_fit", {}) or {}
        rhos = ", ".join(f"{md_code(v)} {float(ds['spearman_rho'].sel(variant=v)):+.2f}" for v in fp8)
        txt = f"Audit rel_l2 vs per-layer KL, Spearman ρ over layers: {rhos}"
        if pooled:
            txt += f"; pooled over layers x variants ρ = {pooled['rho']:+.2f} (n = {pooled['n']})"
        if fit and math.isfinite(fit.get("b", math.nan)):
            txt += (f"; KL ≈ {10 ** fit['a']:.3g} · rel_l2^{fit['b']:.2f} (90% of points within "
                    f"{fit['spread']:.1f}x)")
            # Layers the audit under-rates: measured KL far above what their rel_l2 predicts.
            x = ds["audit_rel_l2"].sel(variant=fp8).values
            y = ds["layer_kl_mean"].sel(variant=fp8).values
            with np.errstate(divide="ignore", invalid="ignore"):
                resid = np.nanmedian(np.log10(y) - (fit["a"] + fit["b"] * np.log10(x)), axis=0)  # per layer
            if np.isfinite(resid).any():
                worst = np.argsort(-np.nan_to_num(resid, nan=-np.inf))[:3]
                txt += ("; layers the audit under-rates most (median over FP8 variants of measured / fitted KL): "
                        + ", ".join(f"{int(ds['layer'].values[i])} ({10 ** resid[i]:.1f}x)" for i in worst))
        out.append(txt + ".")
    if "gain_pred_rho" in ds and fp8:
        cal = ds.attrs.get("gain_calibration", "")
        g = ds["layer_gain"].sel(variant=fp8).median("variant").values
        top = np.argsort(-np.nan_to_num(g, nan=-np.inf))[:3]
        rho = [float(ds["gain_pred_rho"].sel(variant=v)) for v in fp8]
        spread = [float(ds["gain_pred_spread"].sel(variant=v)) for v in fp8]
        ratio = [float(ds["gain_pred_ratio"].sel(variant=v)) for v in fp8]
        out.append(f"Per-layer KL ≈ g_L · rel_l2_L²: the gain g_L is a property of the layer. With g from {md_code(cal)}'s "
                   f"sweep, the audit's rel_l2 of each FP8 recipe predicts its per-layer KL with Spearman ρ "
                   f"{min(rho):.2f}-{max(rho):.2f} (rel_l2 alone: the ρ above), median measured / predicted "
                   f"{min(ratio):.2f}-{max(ratio):.2f}, 90% of layers within {max(spread):.2f}x. Layers that amplify "
                   "most (median g over FP8 recipes): " + ", ".join(
                       f"{int(ds['layer'].values[i])} (g = {g[i]:.3g})" for i in top)
                   + f"; median layer {np.nanmedian(g):.3g}.")
    if "dec_kl_mean" in ds:
        parts = []
        for v in ds["dvariant"].values:
            parts.append(f"{md_code(v)} prefill {_f(kl_all[str(v)])}, " + ", ".join(
                f"per-{kv} cache {_f(_sel(ds, 'dec_kl_mean', dvariant=v, kv=kv))}" for kv in ds["kv"].values))
        out.append("Decode (one query row against an FP8 KV cache), mean KL: " + "; ".join(parts) + ".")
    budget = attr_json(ds, "budget", None)
    if budget:
        best = budget.get("best")
        if best:
            uni = [u for u in budget["uniform"] if u["meets"]]
            cheapest_uni = min(uni, key=lambda u: u["cost"]) if uni else None
            counts = ""
            if best["kind"] == "assignment" and best.get("labels"):
                tally: dict[str, int] = {}
                for lab in best["labels"]:
                    tally[lab] = tally.get(lab, 0) + 1
                counts = ": " + ", ".join(f"{n} layers {md_code(lab)}" for lab, n in sorted(tally.items(), key=lambda x: -x[1]))
            out.append(f"Budget KL {budget['stat']} <= {budget['budget']:g}: cheapest verified assignment"
                       f"{counts} (cost {best['cost']}, measured {_f(best['measured'])}; "
                       + (f"the cheapest single recipe that meets it, {md_code(cheapest_uni['label'])} everywhere, costs "
                          f"{cheapest_uni['cost']}" if cheapest_uni else "no single recipe meets it")
                       + f"; {len(budget['attempts'])} candidates verified by full runs). The map: {md_code(best['label'])}.")
        else:
            out.append(f"Budget KL {budget['stat']} <= {budget['budget']:g}: no candidate met it in "
                       f"{len(budget['attempts'])} verified runs, nor any recipe used everywhere.")
    return out


def _layers(ds, top: int = 8) -> list[dict]:
    if "layer_kl_mean" not in ds or ds.sizes.get("layer", 0) == 0:
        return []
    out = []
    for v in [v for v in ds["variant"].values if int(ds["fp8"].sel(variant=v))]:
        kl = ds["layer_kl_mean"].sel(variant=v).values
        order = np.argsort(-kl)
        layers = ds["layer"].values
        total = float(np.sum(kl))
        full = _sel(ds, "kl_mean", variant=v, mask="all")
        every = ds.sizes["layer"] == ds.sizes["model_layer"]  # the sum predicts the all-layer KL only then
        out.append({"variant": str(v), "top": [[int(layers[i]), float(kl[i])] for i in order[:top]],
                    "top3_share": float(np.sum(kl[order[:3]])) / total if total > 0 else None,
                    "sum_over_all": float(ds["kl_mean_sum_of_layers"].sel(variant=v)) / full
                    if full > 0 and every else None})
    return out


def _assignments(ds) -> list[dict]:
    if "asg_kl" not in ds:
        return []
    budget = attr_json(ds, "budget", None)
    stat = {"mean": "kl_mean", "p99": "kl_p99", "max": "kl_max"}[budget["stat"]] if budget else None
    return [{"assignment": str(a), "predicted": _predicted(ds, [str(x) for x in ds["asg_recipe"].sel(assignment=a).values]),
             "meets": None if budget is None else bool(_sel(ds, f"asg_{stat}", assignment=a) <= budget["budget"])}
            for a in ds["assignment"].values]


def _verdict(ds) -> dict:
    v_all = [str(v) for v in ds["variant"].values]
    kl = {v: _sel(ds, "kl_mean", variant=v, mask="all") for v in v_all}
    fp8 = [v for v in v_all if int(ds["fp8"].sel(variant=v)) and math.isfinite(kl[v])]
    lines = []
    out = {"use": None, "avoid": [], "bf16_kl_mean": None, "lines": lines}
    b = _sel(ds, "base_kl_mean", baseline="model-sdpa-bf16") if "baseline" in ds.dims and \
        "model-sdpa-bf16" in ds["baseline"].values else math.nan
    out["bf16_kl_mean"] = b
    if fp8:
        best = min(fp8, key=kl.get)
        out["use"] = best
        line = (f"**Use {md_code(best)}** in every layer: the lowest mean KL of the {len(fp8)} FP8 recipe(s), "
                f"{_f(kl[best])} (top-1 {fmt_pct(_sel(ds, 'top1_agree', variant=best, mask='all'))}, Δppl "
                f"{_sel(ds, 'ppl_delta', variant=best, mask='all'):+.4f})")
        if math.isfinite(b) and b > 0:
            line += f"; ×{kl[best] / b:.1f} the KL of the model's own BF16 SDPA ({_f(b)})"
        lines.append(line + ".")
        if len(fp8) > 1:
            worst = max(fp8, key=kl.get)
            out["avoid"].append(worst)
            lines.append(f"**Avoid {md_code(worst)}**: mean KL {_f(kl[worst])}, ×{kl[worst] / kl[best]:.1f} that of "
                         f"{md_code(best)}" + (f", ×{kl[worst] / b:.0f} BF16's" if math.isfinite(b) and b > 0 else "")
                         + ".")
    budget = attr_json(ds, "budget", None)
    if budget and budget.get("best"):
        best = budget["best"]
        lines.append(f"Budget KL {budget['stat']} ≤ {budget['budget']:g}: the cheapest verified assignment costs "
                     f"{best['cost']} (measured {_f(best['measured'])}): {md_code(best['label'])}.")
    elif budget:
        lines.append(f"Budget KL {budget['stat']} ≤ {budget['budget']:g}: no candidate met it.")
    lines.append(f"Measured on {ds.sizes['token']} tokens of one text: a single sample of text, no interval across texts.")
    return out


def findings(ds: xr.Dataset) -> dict:
    return {"kind": "impact", "lines": _lines(ds), "layers": _layers(ds), "assignments": _assignments(ds),
            "verdict": _verdict(ds)}


def with_findings(ds: xr.Dataset) -> xr.Dataset:
    if stored(ds) is not None:
        return ds
    return store(ds, findings(ds))


__all__ = ["findings", "with_findings"]
