"""The audit report: findings, layer x head heatmaps, a channel-amax figure, the risk ranking and
the per-layer recommendation, as ``audit.html`` and ``audit.md``.

Exposed: ``audit_document(ds, *, top=10, budget=None, budget_metric="rmse", rank_by="worst",
rank_metric="rel_l2")``, ``write_report`` (same arguments, plus the folder; returns audit.md's
path), ``nonfinite_lines``. Reads only the dataset written by ``fa3_numerics.studies.audit.audit``
(``fa3-numerics report audit.nc`` renders it with the settings the audit recorded); every file is
written whole or not at all. Non-finite errors are listed at the top and marked in the ranking,
never left out silently. Figures (``audit_figures``) come before the long tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..engine.conventions import attr_list
from ..studies.audit import check_recommendations, rank, recommend
from ..studies.audit_stats import STAT_DEFINITIONS
from .audit_figures import channel_amax_figure, heatmap_errors, heatmap_stats, per_head
from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text
from ..text import column_format


def nonfinite_lines(ds) -> list[str]:
    """The (layer, variant) results holding NaN or Inf: a heading line, then one per result."""
    from ..engine.nonfinite import scan

    found = scan(ds, sample_dims=("head",))
    if not found:
        return []
    return ([f"**Non-finite results.** {len(found)} (layer, variant) result(s) hold NaN or Inf. Those heads rank "
             "riskiest below and meet no budget:"] + [f.line() for f in found])


def _err_fmt(values) -> callable:
    fmt = column_format(values)
    return lambda x: fmt(x) if np.isfinite(x) else "non-finite"


def _variant_table(ds) -> Table:
    from ..numerics.metrics import nonfinite_samples, pooled
    from ..text import fmt_value

    rows, stats = [], []
    for i, lab in enumerate(ds["variant"].values):
        rm = ds["rmse"].sel(variant=lab).values
        rl = ds["rel_l2"].sel(variant=lab).transpose("layer", "head")
        v = rl.values
        # the worst head: a non-finite one first, else the largest error
        flat = int(np.argmax(np.isnan(v))) if np.isnan(v).any() else int(np.argmax(v))
        wl, wh = int(rl["layer"].values[flat // v.shape[1]]), int(rl["head"].values[flat % v.shape[1]])
        stats.append((lab, int(ds["cost"].values[i]), pooled("rmse", rm), nonfinite_samples(rm),
                      float(rl.mean(skipna=False)), float(rl.max(skipna=False)), (wl, wh),
                      float(ds["paper_rmse"].values[i])))
    f_rmse = _err_fmt([s[2] for s in stats] + [s[7] for s in stats])
    f_rel = _err_fmt([x for s in stats for x in (s[4], s[5])])
    for lab, cost, prm, nf, mean, mx, worst, paper in stats:
        rows.append([md_code(lab), str(cost), fmt_value(prm, *nf, fmt=f_rmse), f_rel(mean), f_rel(mx),
                     f"({worst[0]}, {worst[1]})", f_rmse(paper) if np.isfinite(paper) else "-"])
    return Table(["variant", "cost", "RMSE (pooled over layers x heads)", "mean rel_l2", "max rel_l2",
                  "worst (layer, head)", "paper Table 3 RMSE"], rows, [False, True, True, True, True, False, True],
                 caption="`cost` orders recipes from cheapest (`fa3_numerics.studies.audit.recipe_cost`: per-tensor < "
                         "per-head < +Hadamard (2) < per-block (3); materialising S and P adds 6). Paper values are "
                         "for random inputs (N(0,1) + outliers, seqlen 8192, dim 128, non-causal), for scale only.")


def _ranking_table(ds, ranking: list[dict], metric: str) -> Table:
    labels = [str(v) for v in ds["variant"].values]
    fmt = _err_fmt([r["errors"][lab] for r in ranking for lab in labels])
    head = (["rank", "layer", "head"] + [f"{metric} {md_code(lab)}" for lab in labels] +
            ["Q hot ch (pair), hot/median", "K hot ch (pair), hot/median", "Q max/rms", "K max/rms", "V max/rms",
             "K mu max -> after H", "sink mass", "P~ underflow", "K block amax max/median"])
    body = []
    for r in ranking:
        cols = [str(r["rank"]), str(r["layer"]), str(r["head"])]
        cols += [f"**{fmt(r['errors'][lab])}**" if lab == r["worst_variant"] else fmt(r["errors"][lab])
                 for lab in labels]
        cols += [f"{r['q_hot']} ({r['q_hot_pair']}), {r['q_hot_ratio']:.1f}",
                 f"{r['k_hot']} ({r['k_hot_pair']}), {r['k_hot_ratio']:.1f}",
                 f"{r['q_max_over_rms']:.1f}", f"{r['k_max_over_rms']:.1f}", f"{r['v_max_over_rms']:.1f}",
                 f"{r['k_mu_max']:.1f} -> {r['k_mu_rot_max']:.1f}", f"{r['sink_mass']:.2f}",
                 f"{r['p_underflow']:.3f}", f"{r['k_block_ratio']:.2f}"]
        body.append(cols)
    numeric = [True, True, True] + [True] * len(labels) + [False, False, True, True, True, False, True, True, True]
    return Table(head, body, numeric)


def _recommendation_table(rec: dict) -> Table:
    order = rec["order"]
    fmt = _err_fmt([row["values"][lab] for row in rec["layers"] for lab in order])
    body = []
    for row in rec["layers"]:
        pick = row["recommended"]
        cols = [str(row["layer"]), md_code(pick) if pick else f"none (best: {md_code(row['best'])})"]
        for lab in order:
            v = fmt(row["values"][lab]) + (" ok" if row["meets"][lab] else " over")
            cols.append(f"**{v}**" if lab == pick else v)
        body.append(cols)
    return Table(["layer", "recommended (cheapest meeting the budget)"] + [md_code(lab) for lab in order], body,
                 [True, False] + [True] * len(order), long=len(body) > 12, summary="The recommendation of every layer")


def _layer_summary(ds, metric: str) -> str:
    """Worst head per layer for each variant, compactly: the layers ordered by risk."""
    worst = ds[metric].max("head", skipna=False).max("variant", skipna=False)
    order = np.argsort(-np.nan_to_num(worst.values, nan=np.inf), kind="stable")
    fmt = _err_fmt(worst.values)
    return ", ".join(f"{int(ds['layer'].values[i])} ({fmt(float(worst.values[i]))})" for i in order[:8])


EXPLAIN_STATS = ("q_max_over_rms", "k_max_over_rms", "v_max_over_rms", "q_kurtosis", "k_kurtosis", "q_hot_ratio",
                 "k_hot_ratio", "q_mu_max", "k_mu_max", "k_mu_rot_max", "sink_mass", "p_underflow", "k_block_ratio",
                 "out_rms")


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3:
        return float("nan")
    ra = np.argsort(np.argsort(a[ok])).astype(float)
    rb = np.argsort(np.argsort(b[ok])).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _explain_table(ds, metric: str) -> Table:
    """Spearman rank correlation over all (layer, head) between each statistic and each variant's error."""
    labels = [str(v) for v in ds["variant"].values]
    errs = {lab: ds[metric].sel(variant=lab).transpose("layer", "head").values.ravel() for lab in labels}
    body = []
    for name in EXPLAIN_STATS:
        if name in ds:
            x = per_head(ds, name).ravel()
            body.append([md_code(name)] + [f"{_spearman(x, errs[lab]):+.2f}" for lab in labels])
    return Table(["statistic"] + [md_code(lab) for lab in labels], body, [False] + [True] * len(labels))


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


def _findings(ds, ranking, rec, rank_by, rank_metric) -> list[str]:
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
    rhos = []
    for name in EXPLAIN_STATS:
        if name in ds:
            x = per_head(ds, name).ravel()
            rhos.append((np.nanmean([_spearman(x, ds[rank_metric].sel(variant=lab).transpose("layer", "head")
                                               .values.ravel()) for lab in labels]), name))
    rhos = sorted((r for r in rhos if np.isfinite(r[0])), reverse=True)
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


def _settings(ds) -> dict:
    """The report settings the audit recorded (``fa3-numerics audit`` writes them as attributes)."""
    a = ds.attrs
    budget = a.get("budget", "")
    return {"budget": float(budget) if budget not in ("", None) else None,
            "budget_metric": a.get("budget_metric", "rmse"), "rank_by": a.get("rank_by", "worst"),
            "rank_metric": a.get("rank_metric", "rel_l2")}


def audit_document(ds, *, top: int = 10, budget: float | None = None, budget_metric: str = "rmse",
                   rank_by: str = "worst", rank_metric: str = "rel_l2") -> Document:
    from .summary import provenance_items

    a = ds.attrs
    meta = json.loads(a.get("capture_meta", "{}"))
    L, H = ds.sizes["layer"], ds.sizes["head"]
    tiles = attr_list(ds, "tiles_fp8", [0, 0])
    bm, bn = (tiles + [0, 0])[:2]
    ranking = rank(ds, by=rank_by, metric=rank_metric, top=top)
    rec = recommend(ds, budget, metric=budget_metric) if budget is not None else None
    by = "the worst variant" if rank_by == "worst" else md_code(rank_by)
    doc = Document(f"FP8 attention audit: {md_text(meta.get('model', a.get('model', '?')))}")
    doc.lead.append(Para(
        f"**Capture:** {md_code(Path(a.get('capture_path', '?')).name)}, {md_text(meta.get('tokens', '?'))} tokens of "
        f"{md_text(meta.get('text_source', '?'))}, {L} layers x {H} heads ({md_text(a.get('kv_heads'))} KV heads), head dim "
        f"{md_text(a.get('head_dim'))}, causal {md_text(a.get('causal'))}, softmax scale {md_text(a.get('softmax_scale'))}. Every error is "
        f"against float64 attention on the same post-RoPE Q, K, V; query rows: {md_text(a.get('rows_sampling'))}. "
        f"**Where it ran:** {md_text(a.get('device_name', '?'))}, backend {md_code(a.get('backend'))}; FP8 tiles {bm}x{bn} "
        f"(kBlockM x kBlockN). **Command:** {md_code(a.get('command', '?'))}", "where"))
    nf = nonfinite_lines(ds)
    if nf:
        doc.lead += [Para(nf[0], "warning"), Bullets(nf[1:], "warning")]
    doc.lead.append(Bullets(_findings(ds, ranking, rec, rank_by, rank_metric), "headline"))
    figs = [heatmap_errors(ds, rank_metric)]
    if rank_metric != "rmse":
        figs.append(heatmap_errors(ds, "rmse"))
    stats_fig = heatmap_stats(ds)
    channels = channel_amax_figure(ds, rank(ds, by=rank_by, metric=rank_metric, top=3))
    doc.sections.append(Section("Errors per variant", [_variant_table(ds)] + [Fig(f) for f in figs]))
    doc.sections.append(Section("What explains the errors", [
        Fig(stats_fig), Fig(channels),
        Para(f"Spearman rank correlation, over all {L} x {H} (layer, head) pairs, between each statistic (K and V "
             f"statistics of the head's KV head) and each variant's {rank_metric}:"),
        _explain_table(ds, rank_metric)]))
    doc.sections.append(Section("Riskiest layers and heads", [
        Para(f"Ranked by {rank_metric} (= ||O - O_ref|| / ||O_ref||, fair across layers whose outputs differ in "
             f"scale by 100x; RMSE is in the dataset) of {by}; the worst variant of each head in bold. K statistics "
             "are those of the head's KV head."),
        _ranking_table(ds, ranking, rank_metric)]))
    if rec is not None:
        problems = check_recommendations(ds, rec)
        doc.sections.append(Section("Recommendation per layer", [
            Para(f"Budget: {rec['metric']} <= {rec['budget']:g}, the max over the layer's {H} heads. Candidates "
                 f"cheapest first: {', '.join(f'{md_code(x)}' for x in rec['order'])}. The recommendation is read off the "
                 "measured table below (each cell: that variant's worst-head error in the layer), so it agrees with "
                 "the measured errors by construction; "
                 + ("checked: in every layer the recommended variant meets the budget and every cheaper one does not."
                    if not problems else "CHECK FAILED: " + "; ".join(problems))),
            _recommendation_table(rec)]))
    doc.sections.append(Section("Statistics (definitions)", [
        Para("RoPE pairs: transformers' Llama `apply_rotary_pos_emb` uses `rotate_half` (x1 = x[:d/2], x2 = x[d/2:]), "
             "so channel c rotates with channel c + d/2 mod d; GGUF weights are un-permuted to this layout on load. "
             f"Measured on this capture: {_rope_pair_check(ds)}."),
        Bullets([f"{md_code(k)}: {v}" for k, v in STAT_DEFINITIONS.items()])]))
    doc.sections.append(Section("Provenance", [Bullets(provenance_items(ds) + [
        f"capture sha256 {md_code(a.get('capture_sha256', '?'))}; model file {md_code(meta.get('model_file', '?'))} "
        f"({md_text(meta.get('model_origin', '?'))}), transformers {md_text(meta.get('transformers_version', '?'))}"])]))
    doc.sections.append(Section("Variants (full recipe specs)", [
        Bullets([f"{md_code(v)}: {md_code(s)}" for v, s in zip(ds["variant"].values, ds["spec"].values)])]))
    return doc


def write_report(ds, out: str | Path, *, top: int = 10, budget: float | None = None, budget_metric: str = "rmse",
                 rank_by: str = "worst", rank_metric: str = "rel_l2", formats=("html", "md")) -> Path:
    """``audit.md``, ``audit.html`` and the figures (PNG, SVG) in ``out``; returns audit.md's path."""
    from .document import write_document

    doc = audit_document(ds, top=top, budget=budget, budget_metric=budget_metric, rank_by=rank_by,
                         rank_metric=rank_metric)
    write_document(doc, out, stem="audit", formats=formats, figure_dir="")
    return Path(out) / "audit.md"


def settings_document(ds) -> Document:
    """The audit report with the settings the audit recorded (what ``report audit.nc`` renders)."""
    return audit_document(ds, **_settings(ds))


__all__ = ["audit_document", "settings_document", "write_report", "nonfinite_lines", "EXPLAIN_STATS"]
