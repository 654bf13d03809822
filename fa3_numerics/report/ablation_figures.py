"""Figures of the ablation report, each a ``Figure`` (PNG and SVG bytes) drawn outside pyplot.

Exposed: ``fig_main_effects``, ``fig_interactions``, ``fig_seqlen``, ``fig_attribution``, ``fig_block``,
``fig_per_data``.

They read the tables the ablation's study stored in its dataset (``studies.ablation_findings``:
every interval there is BCa); every estimate is a dot with its interval, never a bar on a log
axis (the attribution's shares are fractions on a linear axis, so they stack). Facets are
seaborn's (``FacetGrid``) where one panel per level fits; log axes get readable tick labels
(``plots.plain_ticks``); legends sit outside the panels, never over a title.
"""

from __future__ import annotations

import numpy as np

from .plots import Figure, finish, new_fig, plain_ticks, theme


def _bars(est, lo, hi):
    """Error-bar lengths [below, above] of intervals: a BCa interval may sit beside its estimate
    (a strong bias correction), and a missing end draws no bar."""
    est, lo, hi = (np.atleast_1d(np.asarray(a, dtype=float)) for a in (est, lo, hi))
    below = np.nan_to_num(np.clip(est - lo, 0, None))
    above = np.nan_to_num(np.clip(hi - est, 0, None))
    return [below, above]


def _setup():
    import matplotlib as mpl
    import seaborn as sns

    ctx = mpl.rc_context()
    ctx.__enter__()
    theme(context="paper", font_scale=1.15)
    return ctx, sns


def _done(ctx, fig, name, title, caption, alt="") -> Figure:
    try:
        return finish(fig, name, title, caption, alt)
    finally:
        ctx.__exit__(None, None, None)


def fig_main_effects(me) -> Figure:
    ctx, sns = _setup()
    factors = list(dict.fromkeys(me["factor"]))
    cols = min(4, len(factors))
    rows = -(-len(factors) // cols)
    # rotated level names hang below each panel: rows grow with the longest one
    longest = max((len(str(x)) for x in me["level"]), default=4)
    fig, axes = new_fig(3.6 * cols, (2.6 + 0.055 * longest) * rows, rows, cols)
    pal = sns.color_palette()
    for ax, f in zip(axes.flat, factors):
        sub = me[me["factor"] == f]
        x = np.arange(len(sub))
        ax.errorbar(x, sub["ratio"], yerr=_bars(sub["ratio"], sub["lo"], sub["hi"]), fmt="o",
                    color=pal[0], capsize=3)
        ax.axhline(1, color="0.5", lw=0.8)
        ax.set_xticks(x, sub["level"], rotation=35, ha="right", fontsize=8.5)
        if sub["hi"].max() / sub["lo"].min() > 3:  # wide (e.g. data): log axis
            ax.set_yscale("log")
            plain_ticks(ax, "y", minor=True)
        ax.set_title(f"{f} (×{sub['size'].iloc[0]:.2f}, {int(sub['sets'].iloc[0])} sets)", fontsize=10)
    for ax in list(axes.flat)[len(factors):]:
        ax.axis("off")
    # one label for the figure: per panel it stood under the level names of the panel beside it
    fig.supylabel("RMSE / matched-set mean", fontsize=10)
    fig.suptitle("Main effects on RMSE (geometric, matched sets; 95% BCa intervals)", fontsize=11)
    return _done(ctx, fig, "main_effects", "Main effects",
                 "Each level's RMSE relative to the geometric mean over the factor's levels in the same matched set "
                 "(cells equal in every other factor), with its 95% BCa interval; the title gives the factor's size "
                 "(max/min level) and the number of matched sets.")


def fig_interactions(means: list[dict]) -> Figure:
    """``means``: per factor pair, the geometric-mean RMSE (log10) per pair of levels with intervals."""
    ctx, sns = _setup()
    n = len(means)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = new_fig(5.8 * cols, 3.4 * rows, rows, cols)
    for ax, pair in zip(axes.flat, means):
        lf, lg = pair["lf"], pair["lg"]
        m, lo, hi = (np.asarray(pair[k], dtype=float) for k in ("m", "lo", "hi"))
        x = np.arange(len(lf))
        pal = sns.color_palette("colorblind", len(lg))
        for j, lev in enumerate(lg):
            y, ylo, yhi = 10 ** m[:, j], 10 ** lo[:, j], 10 ** hi[:, j]
            ax.errorbar(x + (j - (len(lg) - 1) / 2) * 0.05, y, yerr=_bars(y, ylo, yhi), marker="o", ms=3.5,
                        capsize=2, color=pal[j], label=str(lev))
        ax.set_xticks(x, lf, rotation=30, ha="right", fontsize=8.5)
        ax.set_yscale("log")
        plain_ticks(ax, "y", minor=True)
        ax.set_title(f"{pair['f']} × {pair['g']} ({pair['sets']} sets)", fontsize=10)
        ax.set_ylabel("geometric-mean RMSE")
        ax.legend(fontsize=7.5, title=pair["g"], title_fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("Two-way interactions (95% BCa intervals)", fontsize=11)
    return _done(ctx, fig, "interactions", "Interaction plots (the nine largest interactions)",
                 "Geometric-mean RMSE per pair of levels over the matched sets complete in both factors; parallel "
                 "lines mean no interaction.")


def fig_seqlen(tab) -> Figure:
    from .figures import coinciding

    ctx, sns = _setup()
    every = list(dict.fromkeys(tab["data"]))
    # a data that ran at one seqlen has no trend to draw: named in the caption, in seqlen.csv
    data = [d for d in every if tab[tab["data"] == d]["seqlen"].nunique() > 1]
    single = {d: int(tab[tab["data"] == d]["seqlen"].iloc[0]) for d in every if d not in data}
    if not data:
        ctx.__exit__(None, None, None)
        return None
    cols = min(3, len(data))
    rows = -(-len(data) // cols)
    fig, axes = new_fig(4.4 * cols + 2.6, 3.2 * rows, rows, cols, sharex=True)
    names = list(dict.fromkeys(tab["name"]))
    pal = dict(zip(names, sns.color_palette("colorblind", len(names))))
    markers = dict(zip(names, ("o", "s", "D", "^", "v", "P", "X", "*")))
    for ax, d in zip(axes.flat, data):
        sub = {nm: tab[(tab["data"] == d) & (tab["name"] == nm)].sort_values("seqlen") for nm in names}
        groups = coinciding({nm: list(s["rmse"]) for nm, s in sub.items() if len(s)})
        for k, group in enumerate(groups):
            s = sub[group[0]]
            x = s["seqlen"] * 2 ** (0.04 * (k - (len(groups) - 1) / 2))
            ax.errorbar(x, s["rmse"], yerr=_bars(s["rmse"], s["lo"], s["hi"]), marker=markers[group[0]],
                        ms=4, capsize=2, color=pal[group[0]], label=" = ".join(group),
                        markerfacecolor="white" if len(group) > 1 else pal[group[0]])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        seqs = sorted(tab[tab["data"] == d]["seqlen"].unique())
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.minorticks_off()
        plain_ticks(ax, "y")
        ax.set_title(d, fontsize=10)
        ax.set_xlabel("seqlen (tokens)")
        ax.set_ylabel("RMSE (output units)")
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="outside right center", fontsize=8.5, title="recipe")
    fig.suptitle("RMSE against seqlen (95% BCa intervals over seed, batch, head)", fontsize=11)
    return _done(ctx, fig, "seqlen", "Error against seqlen",
                 "RMSE of the named recipes against sequence length, per data, at the base shape; recipes with "
                 "identical values are drawn once (hollow markers) and named together."
                 + (" Not drawn (one seqlen each, no trend; their values are in seqlen.csv): "
                    + ", ".join(f"{d} (seqlen {s})" for d, s in single.items()) + "." if single else ""))


TOP_ROWS = 24  # recipes an attribution figure shows: the named ones, then the largest errors


def fig_attribution(att, variants: list[str], title: str, name: str, labels: dict | None = None,
                    stages: dict | None = None, keep: list[str] = (), short: str = "") -> Figure | None:
    """Stacked shares per recipe (left) and the full recipe's RMSE with CI (right): the named
    recipes (``keep``) and the others with the largest RMSE, up to ``TOP_ROWS``, worst first,
    each labelled by the factors where it differs from the defaults (``labels``)."""
    labels = labels or {}
    stages = stages or {}
    sub = att[att["variant"].isin(variants)]
    have = set(sub["variant"])
    if not have:
        return None
    rmse = sub[sub["stage"] == "qk"].set_index("variant")["full_mse"]
    ranked = sorted(have, key=lambda v: -float(rmse.get(v, 0.0)))
    chosen = [v for v in keep if v in have]
    chosen += [v for v in ranked if v not in chosen][:max(0, TOP_ROWS - len(chosen))]
    order = sorted(chosen, key=lambda v: -float(rmse.get(v, 0.0)))
    ctx, sns = _setup()
    h = 0.3 * len(order) + 2.4
    fig, axes = new_fig(13, h, 1, 2, sharey=True, gridspec_kw={"width_ratios": [2.2, 1]})
    a1, a2 = axes[0]
    y = np.arange(len(order))
    left = np.zeros(len(order))
    pal = sns.color_palette("Set2", len(stages))
    for k, s in enumerate(stages):
        share = np.array([sub[(sub["variant"] == v) & (sub["stage"] == s)]["share"].iloc[0] for v in order])
        a1.barh(y, share, left=left, color=pal[k], label=stages[s])
        left += share
    a1.set_yticks(y, [labels.get(v, v) for v in order], fontsize=8)
    a1.invert_yaxis()
    a1.set_xlim(0, 1)
    a1.set_xlabel("share of the summed single-stage MSE")
    handles, names = a1.get_legend_handles_labels()
    first = sub[sub["stage"] == "qk"].set_index("variant").loc[order]
    rm, lo, hi = np.sqrt(first["full_mse"]), np.sqrt(first["full_lo"]), np.sqrt(first["full_hi"])
    a2.errorbar(rm, y, xerr=_bars(rm, lo, hi), fmt="o", ms=3.5, capsize=2, color="k", label="full recipe")
    a2.plot(np.sqrt(first["full_mse"] / first["additivity"]), y, "o", mfc="none", color="C3", ms=4.5,
            label="√(sum of stage MSEs)")
    a2.set_xscale("log")
    plain_ticks(a2, "x")
    a2.set_xlabel("RMSE (95% BCa interval)")
    a2.legend(fontsize=8, loc="lower right")
    fig.suptitle(title + f" ({len(order)} of {len(have)} recipes)", fontsize=10.5)
    # below the panels: above them it would sit on the title
    fig.legend(handles, names, loc="outside lower center", ncols=min(3, len(stages)), fontsize=8.5, frameon=False,
               title="stage alone in low precision", title_fontsize=8.5)
    return _done(ctx, fig, name, short or title,
                 f"The {len(order)} recipes shown are the named ones and those with the largest RMSE, worst at the "
                 f"top, each labelled by the factors where it differs from the defaults; all {len(have)} are in "
                 "attribution.csv. Left: each stage's share of the summed single-stage MSE (each stage alone in low "
                 "precision, the rest float32). Right: the full recipe's RMSE with its interval, and the square root "
                 "of the summed stage MSEs (equal when the stages' errors add).")


def fig_block(blk) -> Figure | None:
    b = blk[(blk["vs"] == "tensor") & (blk["p"] == "offset8")]
    if "scale" in b and (b["scale"] == "amax").any():
        b = b[b["scale"] == "amax"]
    if not len(b):
        return None
    ctx, sns = _setup()
    data = list(dict.fromkeys(b["data"]))
    rots = list(dict.fromkeys(b["rot"]))
    seqs = sorted(b["seqlen"].unique())
    fig, axes = new_fig(max(7, 1.5 * len(data)), 3.9)
    ax = axes[0, 0]
    pal = sns.color_palette("colorblind", len(rots))
    width = 0.8 / (len(rots) * len(seqs))
    for i, d in enumerate(data):
        for j, r in enumerate(rots):
            for k, s in enumerate(seqs):
                row = b[(b["data"] == d) & (b["rot"] == r) & (b["seqlen"] == s)]
                if not len(row):
                    continue
                row = row.iloc[0]
                x = i - 0.4 + width * (j * len(seqs) + k + 0.5)
                ax.errorbar(x, row["ratio"], yerr=_bars(row["ratio"], row["lo"], row["hi"]),
                            fmt="o", ms=3.5, capsize=2, color=pal[j], alpha=0.5 + 0.5 * k / max(1, len(seqs) - 1),
                            label=r if (i == 0 and k == len(seqs) - 1) else None)
    ax.axhspan(0.9, 1.1, color="0.88", zorder=0)
    ax.axhline(1, color="0.4", lw=0.8)
    ax.set_xticks(range(len(data)), data, rotation=20, ha="right", fontsize=9)
    ax.set_ylabel("RMSE(block) / RMSE(per-tensor)")
    ax.set_yscale("log")
    plain_ticks(ax, "y", minor=True)
    ax.legend(title="rotation (seqlen rising: darker)", fontsize=8, title_fontsize=8.5)
    ax.set_title("Block quantization against one scale per tensor (amax scales, P offset 8)", fontsize=10.5)
    return _done(ctx, fig, "block_quant", "Block quantization by data",
                 "RMSE with per-block scales (the kernel's tiles) over RMSE with one scale per tensor, per data, "
                 "rotation and seqlen, with 95% BCa intervals; the grey band is ±10%. Every setting is in "
                 "block_quant.csv.")


def fig_per_data(per_data, factors=()) -> Figure:
    ctx, sns = _setup()
    t = per_data.drop_duplicates(["data", "factor"]).pivot(index="data", columns="factor", values="size")
    t = t[[c for c in list(factors) + ["seqlen", "head_dim", "causal"] if c in t.columns]]
    t = t.loc[[d for d in dict.fromkeys(per_data["data"]) if d in t.index]]
    fig, axes = new_fig(1.3 * t.shape[1] + 3.2, 0.5 * t.shape[0] + 1.6)
    ax = axes[0, 0]
    sns.heatmap(np.log10(t.astype(float)), annot=t.map(lambda v: f"×{v:.2f}"), fmt="", cmap="rocket_r", ax=ax,
                annot_kws={"fontsize": 10}, cbar_kws={"label": "log10 (max/min level RMSE)"})
    ax.tick_params(labelsize=9.5)
    ax.set_title("Size of each factor's main effect within each data", fontsize=10.5)
    return _done(ctx, fig, "effects_per_data", "Which factor matters where",
                 "Each factor's main-effect size (max/min level RMSE ratio over matched sets) within each data; the "
                 "intervals are in the table below and in effects_per_data.csv.")


__all__ = ["fig_main_effects", "fig_interactions", "fig_seqlen", "fig_attribution", "fig_block", "fig_per_data"]
