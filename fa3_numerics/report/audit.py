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
from .audit_figures import channel_amax_figure, heatmap_errors, heatmap_stats
from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text
from .stored import findings_of, verdict_block
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


def _n(x) -> float:
    """A stored number (JSON keeps NaN as null)."""
    return float("nan") if x is None else float(x)


def _variant_table(f: dict) -> Table:
    from ..text import fmt_value

    stats = f["variants"]
    f_rmse = _err_fmt([_n(s["rmse_pooled"]) for s in stats] + [_n(s["paper_rmse"]) for s in stats])
    f_rel = _err_fmt([_n(x) for s in stats for x in (s["rel_l2_mean"], s["rel_l2_max"])])
    rows = []
    for s in stats:
        paper = _n(s["paper_rmse"])
        rows.append([md_code(s["variant"]), str(s["cost"]),
                     fmt_value(_n(s["rmse_pooled"]), s["nonfinite"], s["samples"], fmt=f_rmse),
                     f_rel(_n(s["rel_l2_mean"])), f_rel(_n(s["rel_l2_max"])), f"({s['worst'][0]}, {s['worst'][1]})",
                     f_rmse(paper) if np.isfinite(paper) else "-"])
    return Table(["variant", "cost", "RMSE (pooled over layers x heads)", "mean rel_l2", "max rel_l2",
                  "worst (layer, head)", "paper Table 3 RMSE"], rows, [False, True, True, True, True, False, True],
                 caption="`cost` orders recipes from cheapest (`fa3_numerics.studies.audit.recipe_cost`: per-tensor < "
                         "per-head < +Hadamard (2) < per-block (3); materialising S and P adds 6). Paper values are "
                         "for random inputs (N(0,1) + outliers, seqlen 8192, dim 128, non-causal), for scale only.")


def _ranking_tables(ds, ranking: list[dict], metric: str) -> list[Table]:
    """The riskiest heads as two tables that each fit the page: their errors per variant, then
    the statistics that explain them (one table of both ran past 1400 px)."""
    labels = [str(v) for v in ds["variant"].values]
    fmt = _err_fmt([_n(r["errors"][lab]) for r in ranking for lab in labels])
    errors, stats = [], []
    for r in ranking:
        key = [str(r["rank"]), str(r["layer"]), str(r["head"])]
        errors.append(key + [f"**{fmt(_n(r['errors'][lab]))}**" if lab == r["worst_variant"] else fmt(_n(r["errors"][lab]))
                             for lab in labels])
        stats.append(key + [f"{r['q_hot']} ({r['q_hot_pair']}), {r['q_hot_ratio']:.1f}",
                            f"{r['k_hot']} ({r['k_hot_pair']}), {r['k_hot_ratio']:.1f}",
                            f"{r['q_max_over_rms']:.1f}", f"{r['k_max_over_rms']:.1f}", f"{r['v_max_over_rms']:.1f}",
                            f"{r['k_mu_max']:.1f} -> {r['k_mu_rot_max']:.1f}", f"{r['sink_mass']:.2f}",
                            f"{r['p_underflow']:.3f}", f"{r['k_block_ratio']:.2f}"])
    key = ["rank", "layer", "head"]
    return [Table(key + [f"{metric} {md_code(lab)}" for lab in labels], errors, [True] * (3 + len(labels)),
                  caption=f"{metric} of each variant; the worst variant of each head in bold."),
            Table(key + ["Q hot ch (pair), hot/median", "K hot ch (pair), hot/median", "Q max/rms", "K max/rms",
                         "V max/rms", "K mu max -> after H", "sink mass", "P~ underflow", "K block amax max/median"],
                  stats, [True, True, True, False, False, True, True, True, False, True, True, True],
                  caption="What the same heads hold (K statistics of the head's KV head).")]


def _recommendation_table(rec: dict) -> Table:
    order = rec["order"]
    fmt = _err_fmt([_n(row["values"][lab]) for row in rec["layers"] for lab in order])
    body = []
    for row in rec["layers"]:
        pick = row["recommended"]
        cols = [str(row["layer"]), md_code(pick) if pick else f"none (closest: {md_code(row['best'])})"]
        for lab in order:
            v = fmt(_n(row["values"][lab])) + (" ok" if row["meets"][lab] else " over")
            cols.append(f"**{v}**" if lab == pick else v)
        body.append(cols)
    # open, not collapsed: the per-layer answer is what an audit with a budget is for
    return Table(["layer", "recommended (cheapest meeting the budget)"] + [md_code(lab) for lab in order], body,
                 [True, False] + [True] * len(order))


def _explain_table(f: dict, labels: list[str]) -> Table:
    body = [[md_code(name)] + [f"{_n(per[lab]):+.2f}" for lab in labels] for name, per in f["explain"].items()]
    return Table(["statistic"] + [md_code(lab) for lab in labels], body, [False] + [True] * len(labels))


def audit_document(ds, *, top: int = 10, budget: float | None = None, budget_metric: str = "rmse",
                   rank_by: str = "worst", rank_metric: str = "rel_l2") -> Document:
    """The audit report with these settings (the audit records them; ``settings_document``
    renders with the recorded ones)."""
    settings = {"budget": None if budget is None else float(budget), "budget_metric": budget_metric,
                "rank_by": rank_by, "rank_metric": rank_metric, "top": int(top)}
    if (json.loads(ds.attrs["findings"]).get("settings") if ds.attrs.get("findings") else None) != settings:
        ds = ds.copy()  # the settings asked for, recorded where the study's findings read them
        ds.attrs.update({**settings, "budget": "" if budget is None else budget})
    return audit_report_document(ds, findings_of(ds, settings, kind="audit"))


def _recorded(ds) -> dict:
    """The report settings recorded in the audit's attributes (``fa3-numerics audit`` writes them
    after the audit ran): the findings must be those of these settings."""
    a = ds.attrs
    budget = a.get("budget", "")
    return {"budget": float(budget) if budget not in ("", None) else None,
            "budget_metric": str(a.get("budget_metric", "rmse")), "rank_by": str(a.get("rank_by", "worst")),
            "rank_metric": str(a.get("rank_metric", "rel_l2")), "top": int(a.get("top", 10))}


def audit_report_document(ds, f: dict | None = None) -> Document:
    """The audit report of ``ds`` from the findings it holds (what ``report`` renders for kind ``audit``)."""
    from .summary import provenance_items

    f = findings_of(ds, _recorded(ds), kind="audit") if f is None else f
    s = f["settings"]
    rank_by, rank_metric = s["rank_by"], s["rank_metric"]
    ranking, rec = f["ranking"], f["recommendation"]
    labels = [str(v) for v in ds["variant"].values]

    a = ds.attrs
    meta = json.loads(a.get("capture_meta", "{}"))
    L, H = ds.sizes["layer"], ds.sizes["head"]
    tiles = attr_list(ds, "tiles_fp8", [0, 0])
    bm, bn = (tiles + [0, 0])[:2]
    by = "the worst variant" if rank_by == "worst" else md_code(rank_by)
    doc = Document(f"FP8 attention audit: {md_text(meta.get('model', a.get('model', '?')))}", verdict_block(f))
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
    doc.lead.append(Bullets(f["lines"], "headline"))
    figs = [heatmap_errors(ds, rank_metric)]
    if rank_metric != "rmse":
        figs.append(heatmap_errors(ds, "rmse"))
    stats_fig = heatmap_stats(ds)
    channels = channel_amax_figure(ds, f["ranking_top3"])
    doc.sections.append(Section("Errors per variant", [_variant_table(f)] + [Fig(x) for x in figs]))
    doc.sections.append(Section("What explains the errors", [
        Fig(stats_fig), Fig(channels),
        Para(f"Spearman rank correlation, over all {L} x {H} (layer, head) pairs, between each statistic (K and V "
             f"statistics of the head's KV head) and each variant's {rank_metric}:"),
        _explain_table(f, labels)]))
    doc.sections.append(Section("Riskiest layers and heads", [
        Para(f"Ranked by {rank_metric} (= ||O - O_ref|| / ||O_ref||, fair across layers whose outputs differ in "
             f"scale by 100x; RMSE is in the dataset) of {by}; the worst variant of each head in bold. K statistics "
             "are those of the head's KV head."),
        *_ranking_tables(ds, ranking, rank_metric)]))
    if rec is not None:
        problems = f["problems"]
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
             f"Measured on this capture: {f['rope_check']}."),
        Bullets([f"{md_code(k)}: {v}" for k, v in f["stat_definitions"].items()])]))
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
    return audit_report_document(ds)


__all__ = ["audit_document", "audit_report_document", "settings_document", "write_report", "nonfinite_lines"]
