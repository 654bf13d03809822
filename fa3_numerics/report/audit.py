"""The audit report: Markdown with layer x head heatmaps, a channel-amax figure, the risk ranking
and the per-layer recommendation table.

Exposed: ``write_report(ds, out, *, top=10, budget=None, budget_metric="rmse", rank_by="worst",
rank_metric="rel_l2") -> Path``, ``markdown``, ``nonfinite_lines``. Reads only the dataset
written by ``fa3_numerics.studies.audit.audit``; every file is written whole or not at all
(``fa3_numerics.engine.files``). seaborn and matplotlib are imported inside the functions.
Non-finite errors are listed at the top and marked in the ranking, never left out silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..engine.files import atomic_path, atomic_write
from ..studies.audit import check_recommendations, rank, recommend
from ..studies.audit_stats import STAT_DEFINITIONS
from .format import fmt_e as _e


def _save_fig(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)


def nonfinite_lines(ds) -> list[str]:
    """The (layer, variant) results holding NaN or Inf, as Markdown (empty when none)."""
    from ..engine.nonfinite import scan

    found = scan(ds, sample_dims=("head",))
    if not found:
        return []
    return ([f"**Non-finite results.** {len(found)} (layer, variant) result(s) hold NaN or Inf. Those heads rank "
             "riskiest below and meet no budget:", ""] + [f"- {f.line()}" for f in found] + [""])


def _setup():
    import warnings

    import matplotlib

    # A panel of a non-finite result is all NaN; the report says so in words, seaborn need not warn.
    warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="white", context="paper", palette="colorblind")
    return plt, sns


def _per_head(ds, name):
    """A (layer, head) array; K/V statistics (layer, kv_head) are mapped onto their query heads."""
    da = ds[name]
    if "kv_head" in da.dims:
        da = da.sel(kv_head=ds["kv_head_of"]).drop_vars("kv_head", errors="ignore")
    return da.transpose("layer", "head").values


def heatmap_errors(ds, metric: str, path: Path) -> None:
    from matplotlib.colors import LogNorm

    plt, sns = _setup()
    labels = [str(v) for v in ds["variant"].values]
    vals = ds[metric].transpose("layer", "head", "variant").values
    pos = vals[np.isfinite(vals) & (vals > 0)]
    norm = LogNorm(vmin=pos.min(), vmax=pos.max()) if pos.size else None
    n = len(labels)
    cols = min(n, 4)
    rows_ = -(-n // cols)
    nl = ds.sizes["layer"]
    fig, axes = plt.subplots(rows_, cols, figsize=(2.6 * cols + 1.2, 0.18 * nl * rows_ + 1.6), squeeze=False,
                             sharey=True, layout="constrained")
    for i, lab in enumerate(labels):
        ax = axes[i // cols][i % cols]
        sns.heatmap(vals[:, :, i], ax=ax, cmap="viridis", norm=norm, cbar=i == n - 1,
                    cbar_kws={"label": metric} if i == n - 1 else None,
                    xticklabels=[str(h) for h in ds["head"].values],
                    yticklabels=[str(v) for v in ds["layer"].values])
        ax.set_title(lab, fontsize=8)
        ax.set_xlabel("head")
        if i % cols == 0:
            ax.set_ylabel("layer")
        ax.tick_params(labelsize=6)
    for j in range(n, rows_ * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"{metric} against float64, per layer x head (log colour scale)", fontsize=9)
    _save_fig(fig, path)


def heatmap_stats(ds, path: Path) -> None:
    plt, sns = _setup()
    panels = [("sink_mass", "sink mass (first 4 tokens)", "cividis"),
              ("p_underflow", "P~ underflow to 0 in e4m3", "cividis"),
              ("q_max_over_rms", "Q max/rms", "viridis"), ("k_max_over_rms", "K max/rms (its KV head)", "viridis"),
              ("k_mu_max", "K incoherence mu, max over tokens", "viridis"),
              ("k_mu_rot_max", "K mu after Hadamard", "viridis")]
    nl = ds.sizes["layer"]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.3 * len(panels), 0.18 * nl + 1.6), sharey=True,
                             layout="constrained")
    mu_hi = float(max(np.nanmax(_per_head(ds, "k_mu_max")), np.nanmax(_per_head(ds, "k_mu_rot_max"))))
    for ax, (name, title, cmap) in zip(axes, panels):
        v = _per_head(ds, name)
        kw = {"vmin": 1.0, "vmax": mu_hi} if name.startswith("k_mu") else {}
        sns.heatmap(v, ax=ax, cmap=cmap, cbar=True, xticklabels=[str(h) for h in ds["head"].values],
                    yticklabels=[str(x) for x in ds["layer"].values], **kw)
        ax.set_title(title, fontsize=7)
        ax.set_xlabel("head")
        ax.tick_params(labelsize=6)
    axes[0].set_ylabel("layer")
    fig.suptitle("What explains the errors: statistics per layer x head", fontsize=9)
    _save_fig(fig, path)


def channel_amax_figure(ds, ranking: list[dict], path: Path, n_heads: int = 3) -> None:
    plt, sns = _setup()
    pal = sns.color_palette("colorblind")
    d = ds.sizes["channel"]
    picks = ranking[:n_heads]
    fig = plt.figure(figsize=(11, 3.2 + 1.9 * len(picks)))
    gs = fig.add_gridspec(1 + len(picks), 2, height_ratios=[2.2] + [1] * len(picks))
    for col, (name, title) in enumerate((("q_amax", "Q amax per channel (max over heads)"),
                                         ("k_amax", "K amax per channel (max over KV heads)"))):
        ax = fig.add_subplot(gs[0, col])
        hd = "head" if name == "q_amax" else "kv_head"
        m = ds[name].max(hd).transpose("layer", "channel").values
        sns.heatmap(m, ax=ax, cmap="viridis", cbar_kws={"label": "amax"},
                    xticklabels=8, yticklabels=[str(x) for x in ds["layer"].values])
        ax.axvline(d / 2, color="white", lw=0.8, ls="--")
        ax.set_title(title + "; dashed: d/2 (RoPE pairs c, c+d/2)", fontsize=8)
        ax.set_xlabel("channel")
        ax.set_ylabel("layer")
        ax.tick_params(labelsize=6)
    for row, r in enumerate(picks, start=1):
        for col, (name, hot, pair, who) in enumerate((("q_amax", r["q_hot"], r["q_hot_pair"], f"head {r['head']}"),
                                                      ("k_amax", r["k_hot"], r["k_hot_pair"],
                                                       f"KV head {r['kv_head']}"))):
            ax = fig.add_subplot(gs[row, col])
            sel = {"layer": r["layer"], ("head" if name == "q_amax" else "kv_head"):
                   (r["head"] if name == "q_amax" else r["kv_head"])}
            a = ds[name].sel(**sel).values
            colors = [pal[3] if c == hot else pal[1] if c == pair else pal[0] for c in range(d)]
            ax.bar(np.arange(d), a, color=colors, width=0.85)
            ax.set_title(f"#{r['rank']}: layer {r['layer']} {who} {name[0].upper()}; hot channel {hot} "
                         f"(red), RoPE pair {pair} (orange)", fontsize=7)
            ax.set_xlim(-1, d)
            ax.tick_params(labelsize=6)
            if col == 0:
                ax.set_ylabel("amax", fontsize=7)
    fig.suptitle("Per-channel amax of post-RoPE Q and K; bottom rows: the riskiest heads", fontsize=9)
    fig.tight_layout()
    _save_fig(fig, path)


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------

def _variant_summary(ds) -> str:
    from ..numerics.metrics import nonfinite_samples, pooled
    from .format import fmt_value

    lines = ["| variant | cost | RMSE (pooled over layers x heads) | mean rel_l2 | max rel_l2 | worst (layer, head) "
             "| paper Table 3 RMSE |", "|---|---|---|---|---|---|---|"]
    for i, lab in enumerate(ds["variant"].values):
        rm = ds["rmse"].sel(variant=lab).values
        rl = ds["rel_l2"].sel(variant=lab).transpose("layer", "head")
        v = rl.values
        # the worst head: a non-finite one first, else the largest error
        flat = int(np.argmax(np.isnan(v))) if np.isnan(v).any() else int(np.argmax(v))
        wl, wh = int(rl["layer"].values[flat // v.shape[1]]), int(rl["head"].values[flat % v.shape[1]])
        lines.append(f"| `{lab}` | {int(ds['cost'].values[i])} | {fmt_value(pooled('rmse', rm), *nonfinite_samples(rm))} | "
                     f"{_err(float(rl.mean(skipna=False)))} | {_err(float(rl.max(skipna=False)))} | ({wl}, {wh}) | "
                     f"{_e(float(ds['paper_rmse'].values[i]))} |")
    return "\n".join(lines)


def _err(x: float) -> str:
    return _e(x) if np.isfinite(x) else "non-finite"


def _ranking_table(ds, ranking: list[dict], metric: str) -> str:
    labels = [str(v) for v in ds["variant"].values]
    head = (["rank", "layer", "head"] + [f"{metric} `{lab}`" for lab in labels] +
            ["Q hot ch (pair), hot/median", "K hot ch (pair), hot/median", "Q max/rms", "K max/rms", "V max/rms",
             "K mu max -> after H", "sink mass", "P~ underflow", "K block amax max/median"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ranking:
        cols = [str(r["rank"]), str(r["layer"]), str(r["head"])]
        cols += [("**" + _err(r["errors"][lab]) + "**") if lab == r["worst_variant"] else _err(r["errors"][lab])
                 for lab in labels]
        cols += [f"{r['q_hot']} ({r['q_hot_pair']}), {r['q_hot_ratio']:.1f}",
                 f"{r['k_hot']} ({r['k_hot_pair']}), {r['k_hot_ratio']:.1f}",
                 f"{r['q_max_over_rms']:.1f}", f"{r['k_max_over_rms']:.1f}", f"{r['v_max_over_rms']:.1f}",
                 f"{r['k_mu_max']:.1f} -> {r['k_mu_rot_max']:.1f}", f"{r['sink_mass']:.2f}",
                 f"{r['p_underflow']:.3f}", f"{r['k_block_ratio']:.2f}"]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _recommendation_table(rec: dict) -> str:
    order = rec["order"]
    head = ["layer", "recommended (cheapest meeting the budget)"] + [f"`{lab}`" for lab in order]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rec["layers"]:
        pick = row["recommended"]
        cols = [str(row["layer"]), f"`{pick}`" if pick else f"none (best: `{row['best']}`)"]
        for lab in order:
            v = _e(row["values"][lab]) + (" ok" if row["meets"][lab] else " over")
            cols.append(f"**{v}**" if lab == pick else v)
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _layer_summary(ds, metric: str) -> str:
    """Worst head per layer for each variant, compactly: the layers ordered by risk."""
    worst = ds[metric].max("head", skipna=False).max("variant", skipna=False)
    order = np.argsort(-np.nan_to_num(worst.values, nan=np.inf), kind="stable")
    top = [f"{int(ds['layer'].values[i])} ({_err(float(worst.values[i]))})" for i in order[:8]]
    return ", ".join(top)


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


def _explain_table(ds, metric: str) -> str:
    """Spearman rank correlation over all (layer, head) between each statistic and each variant's error."""
    labels = [str(v) for v in ds["variant"].values]
    head = ["statistic"] + [f"`{lab}`" for lab in labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    errs = {lab: ds[metric].sel(variant=lab).transpose("layer", "head").values.ravel() for lab in labels}
    for name in EXPLAIN_STATS:
        if name not in ds:
            continue
        x = _per_head(ds, name).ravel()
        lines.append(f"| `{name}` | " + " | ".join(f"{_spearman(x, errs[lab]):+.2f}" for lab in labels) + " |")
    return "\n".join(lines)


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


def markdown(ds, *, ranking: list[dict], rec: dict | None, rank_by: str, rank_metric: str,
             figures: dict[str, str]) -> str:
    from .summary import provenance_block

    a = ds.attrs
    meta = json.loads(a.get("capture_meta", "{}"))
    L, H = ds.sizes["layer"], ds.sizes["head"]
    bm, bn = json.loads(a.get("tiles_fp8", "[0, 0]"))
    top3 = ", ".join(f"layer {r['layer']} head {r['head']} ({rank_metric} {_err(r['score'])}, worst "
                     f"`{r['worst_variant']}`)" for r in ranking[:3])
    by = "the worst variant" if rank_by == "worst" else f"`{rank_by}`"
    parts = [
        f"# FP8 attention audit: {meta.get('model', a.get('model', '?'))}",
        "",
        f"Capture: `{Path(a.get('capture_path', '?')).name}`, {meta.get('tokens', '?')} tokens of "
        f"{meta.get('text_source', '?')}, {L} layers x {H} heads ({a.get('kv_heads')} KV heads), head dim "
        f"{a.get('head_dim')}, causal {a.get('causal')}, softmax scale {a.get('softmax_scale')}. Every error is "
        f"against float64 attention on the same post-RoPE Q, K, V; query rows: {a.get('rows_sampling')}. "
        f"Backend `{a.get('backend')}`; FP8 tiles {bm}x{bn} (kBlockM x kBlockN).",
        "",
        *nonfinite_lines(ds),
        "## Findings",
        "",
        f"- Riskiest heads (ranked by {rank_metric} of {by}): {top3}.",
        f"- Riskiest layers (worst head, worst variant, {rank_metric}): {_layer_summary(ds, rank_metric)}.",
    ]
    labels = [str(v) for v in ds["variant"].values]
    for a_, b_, what in (("fa3-fp8-no-incoherent", "fa3-fp8", "the Hadamard rotation (no-incoherent / fa3-fp8)"),
                         ("fa3-fp8-no-block-quant", "fa3-fp8", "block quantization (no-block-quant / fa3-fp8)"),
                         ("baseline-fp8", "fa3-fp8", "FA3 FP8 over the per-tensor baseline (baseline / fa3-fp8)")):
        if a_ in labels and b_ in labels:
            r_ = (ds[rank_metric].sel(variant=a_) / ds[rank_metric].sel(variant=b_)).values.ravel()
            r_ = r_[np.isfinite(r_)]
            parts.append(f"- Effect of {what}: {rank_metric} ratio median {np.median(r_):.2f}, range "
                         f"{r_.min():.2f}-{r_.max():.2f} over the {r_.size} heads.")
    rhos = []
    for name in EXPLAIN_STATS:
        if name in ds:
            x = _per_head(ds, name).ravel()
            rhos.append((np.nanmean([_spearman(x, ds[rank_metric].sel(variant=lab).transpose("layer", "head")
                                               .values.ravel()) for lab in labels]), name))
    rhos = sorted((r for r in rhos if np.isfinite(r[0])), reverse=True)
    if rhos:
        parts.append("- Statistics that track the error best (Spearman rho with " + rank_metric + ", mean over "
                     "variants): " + ", ".join(f"`{n}` {r:+.2f}" for r, n in rhos[:3]) + ".")
    if rec is not None:
        overall = rec["overall"]
        n_none = sum(1 for r in rec["layers"] if r["recommended"] is None)
        counts: dict[str, int] = {}
        for r in rec["layers"]:
            if r["recommended"]:
                counts[r["recommended"]] = counts.get(r["recommended"], 0) + 1
        parts.append(f"- Budget {rec['metric']} <= {rec['budget']:g} (max over a layer's heads): "
                     + ", ".join(f"`{k}` in {v} layers" for k, v in counts.items())
                     + (f", none of the variants in {n_none} layers" if n_none else "")
                     + (f"; one recipe for the whole model: `{overall}`." if overall else
                        "; no single audited recipe meets it in every layer."))
    parts += [
        "",
        "## Errors per variant",
        "",
        _variant_summary(ds),
        "",
        f"`cost` orders recipes from cheapest (see `fa3_numerics.studies.audit.recipe_cost`: per-tensor < per-head < "
        f"+Hadamard (2) < per-block (3); materialising S and P adds 6). Paper values are for random inputs "
        f"(N(0,1) + outliers, seqlen 8192, dim 128, non-causal), shown for scale only.",
        "",
        f"![{rank_metric} heatmaps]({figures['heat_rank']})",
        "",
        f"![rmse heatmaps]({figures['heat_rmse']})" if figures.get("heat_rmse") else "",
        "",
        "## Riskiest layers and heads",
        "",
        f"Ranked by {rank_metric} (= ||O - O_ref|| / ||O_ref||, fair across layers whose outputs differ in "
        f"scale by 100x; RMSE is in the dataset) of {by}; the worst variant of each head in bold. K statistics "
        f"are those of the head's KV head.",
        "",
        _ranking_table(ds, ranking, rank_metric),
        "",
        "## What explains the errors",
        "",
        f"Spearman rank correlation, over all {L} x {H} (layer, head) pairs, between each statistic (K and V "
        f"statistics of the head's KV head) and each variant's {rank_metric}:",
        "",
        _explain_table(ds, rank_metric),
        "",
        f"![statistics]({figures['stats']})",
        "",
        f"![channel amax]({figures['channels']})",
        "",
    ]
    if rec is not None:
        problems = check_recommendations(ds, rec)
        parts += [
            "## Recommendation per layer",
            "",
            f"Budget: {rec['metric']} <= {rec['budget']:g}, the max over the layer's {H} heads. Candidates "
            f"cheapest first: {', '.join(f'`{x}`' for x in rec['order'])}. The recommendation is read off the "
            "measured table below (each cell: that variant's worst-head error in the layer), so it agrees with "
            "the measured errors by construction; "
            + ("checked: in every layer the recommended variant meets the budget and every cheaper one does not."
               if not problems else "CHECK FAILED: " + "; ".join(problems)),
            "",
            _recommendation_table(rec),
            "",
        ]
    defs = "\n".join(f"- `{k}`: {v}" for k, v in STAT_DEFINITIONS.items())
    spec_lines = "\n".join(f"- `{v}`: `{s}`" for v, s in zip(ds["variant"].values, ds["spec"].values))
    parts += [
        "## Statistics (definitions)",
        "",
        "RoPE pairs: transformers' Llama `apply_rotary_pos_emb` uses `rotate_half` (x1 = x[:d/2], x2 = x[d/2:]), "
        "so channel c rotates with channel c + d/2 mod d; GGUF weights are un-permuted to this layout on load. "
        f"Measured on this capture: {_rope_pair_check(ds)}.",
        "",
        defs,
        "",
        "## Provenance",
        "",
        provenance_block(ds),
        f"- capture sha256 `{a.get('capture_sha256', '?')}`; model file `{meta.get('model_file', '?')}` "
        f"({meta.get('model_origin', '?')}), transformers {meta.get('transformers_version', '?')}",
        "",
        "## Variants (full recipe specs)",
        "",
        spec_lines,
        "",
    ]
    return "\n".join(parts)


def write_report(ds, out: str | Path, *, top: int = 10, budget: float | None = None, budget_metric: str = "rmse",
                 rank_by: str = "worst", rank_metric: str = "rel_l2") -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ranking = rank(ds, by=rank_by, metric=rank_metric, top=top)
    rec = recommend(ds, budget, metric=budget_metric) if budget is not None else None
    figures = {"heat_rank": f"heatmap_{rank_metric}.png", "stats": "stats_heatmap.png",
               "channels": "channel_amax.png"}
    heatmap_errors(ds, rank_metric, out / figures["heat_rank"])
    if rank_metric != "rmse":
        figures["heat_rmse"] = "heatmap_rmse.png"
        heatmap_errors(ds, "rmse", out / figures["heat_rmse"])
    heatmap_stats(ds, out / figures["stats"])
    channel_amax_figure(ds, rank(ds, by=rank_by, metric=rank_metric, top=3), out / figures["channels"])
    return atomic_write(out / "audit.md", markdown(ds, ranking=ranking, rec=rec, rank_by=rank_by,
                                                   rank_metric=rank_metric, figures=figures))


__all__ = ["write_report", "markdown", "nonfinite_lines", "heatmap_errors", "heatmap_stats", "channel_amax_figure"]
