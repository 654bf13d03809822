"""Figures of the audit report, each a ``Figure`` (PNG and SVG bytes) drawn outside pyplot.

Exposed: ``heatmap_errors``, ``heatmap_stats``, ``channel_amax_figure``, ``per_head``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .plots import Figure, colorbar_ticks, finish, new_fig, theme


@contextlib.contextmanager
def _style():
    import warnings

    import matplotlib as mpl
    import seaborn as sns

    with mpl.rc_context(), warnings.catch_warnings():
        # A panel of a non-finite result is all NaN; the report says so in words, seaborn need not warn.
        warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)
        theme(context="paper", font_scale=1.1)
        sns.set_style("white")
        yield sns


def per_head(ds, name):
    """A (layer, head) array; K/V statistics (layer, kv_head) are mapped onto their query heads."""
    da = ds[name]
    if "kv_head" in da.dims:
        da = da.sel(kv_head=ds["kv_head_of"]).drop_vars("kv_head", errors="ignore")
    return da.transpose("layer", "head").values


def heatmap_errors(ds, metric: str) -> Figure:
    from matplotlib.colors import LogNorm

    with _style() as sns:
        return _heatmap_errors(ds, metric, sns, LogNorm)


def _heatmap_errors(ds, metric, sns, LogNorm) -> Figure:
    labels = [str(v) for v in ds["variant"].values]
    vals = ds[metric].transpose("layer", "head", "variant").values
    pos = vals[np.isfinite(vals) & (vals > 0)]
    norm = LogNorm(vmin=pos.min(), vmax=pos.max()) if pos.size else None
    n = len(labels)
    cols = min(n, 4)
    rows_ = -(-n // cols)
    nl = ds.sizes["layer"]
    fig, axes = new_fig(3.0 * cols + 1.4, 0.2 * nl * rows_ + 1.8, rows_, cols, sharey=True)
    for i, lab in enumerate(labels):
        ax = axes[i // cols][i % cols]
        sns.heatmap(vals[:, :, i], ax=ax, cmap="viridis", norm=norm, cbar=i == n - 1,
                    cbar_kws={"label": metric} if i == n - 1 else None,
                    xticklabels=[str(h) for h in ds["head"].values],
                    yticklabels=[str(v) for v in ds["layer"].values])
        if i == n - 1 and ax.collections and ax.collections[0].colorbar is not None:
            colorbar_ticks(ax.collections[0].colorbar)
        ax.set_title(lab, fontsize=9.5)
        ax.set_xlabel("head")
        if i % cols == 0:
            ax.set_ylabel("layer")
        ax.tick_params(labelsize=8)
    for j in range(n, rows_ * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"{metric} against float64, per layer x head (log colour scale)", fontsize=10.5)
    return finish(fig, f"heatmap_{metric}", f"{metric} per layer x head",
                  f"{metric} of each variant against float64 attention, per layer (rows) and head (columns), on one "
                  "logarithmic colour scale; a blank cell is a non-finite result.", alt=f"{metric} heatmaps")


def heatmap_stats(ds) -> Figure:
    with _style() as sns:
        return _heatmap_stats(ds, sns)


def _heatmap_stats(ds, sns) -> Figure:
    panels = [("sink_mass", "sink mass (first 4 tokens)", "cividis"),
              ("p_underflow", "P~ underflow to 0 in e4m3", "cividis"),
              ("q_max_over_rms", "Q max/rms", "viridis"), ("k_max_over_rms", "K max/rms (its KV head)", "viridis"),
              ("k_mu_max", "K incoherence mu, max over tokens", "viridis"),
              ("k_mu_rot_max", "K mu after Hadamard", "viridis")]
    nl = ds.sizes["layer"]
    fig, axes = new_fig(2.6 * len(panels), 0.2 * nl + 1.8, 1, len(panels), sharey=True)
    axes = axes[0]
    mu_hi = float(max(np.nanmax(per_head(ds, "k_mu_max")), np.nanmax(per_head(ds, "k_mu_rot_max"))))
    for ax, (name, title, cmap) in zip(axes, panels):
        v = per_head(ds, name)
        kw = {"vmin": 1.0, "vmax": mu_hi} if name.startswith("k_mu") else {}
        sns.heatmap(v, ax=ax, cmap=cmap, cbar=True, xticklabels=[str(h) for h in ds["head"].values],
                    yticklabels=[str(x) for x in ds["layer"].values], **kw)
        ax.set_title(title, fontsize=8.5)
        ax.set_xlabel("head")
        ax.tick_params(labelsize=7.5)
    axes[0].set_ylabel("layer")
    fig.suptitle("What explains the errors: statistics per layer x head", fontsize=10.5)
    return finish(fig, "stats_heatmap", "Statistics per layer x head",
                  "The statistics that explain the errors, per layer and head (K statistics of the head's KV head): "
                  "attention-sink mass, the share of P~ that underflows in e4m3, max/rms of Q and K, and K's "
                  "incoherence before and after the Hadamard rotation.", alt="statistics")


def channel_amax_figure(ds, ranking: list[dict], n_heads: int = 3) -> Figure:
    with _style() as sns:
        return _channel_amax(ds, ranking, n_heads, sns)


def _channel_amax(ds, ranking, n_heads, sns) -> Figure:
    from matplotlib.figure import Figure as MplFigure

    pal = sns.color_palette("colorblind")
    d = ds.sizes["channel"]
    picks = ranking[:n_heads]
    fig = MplFigure(figsize=(11, 3.4 + 2.0 * len(picks)), layout="constrained")
    gs = fig.add_gridspec(1 + len(picks), 2, height_ratios=[2.2] + [1] * len(picks))
    for col, (name, title) in enumerate((("q_amax", "Q amax per channel (max over heads)"),
                                         ("k_amax", "K amax per channel (max over KV heads)"))):
        ax = fig.add_subplot(gs[0, col])
        hd = "head" if name == "q_amax" else "kv_head"
        m = ds[name].max(hd).transpose("layer", "channel").values
        sns.heatmap(m, ax=ax, cmap="viridis", cbar_kws={"label": "amax"},
                    xticklabels=8, yticklabels=[str(x) for x in ds["layer"].values])
        ax.axvline(d / 2, color="white", lw=0.8, ls="--")
        ax.set_title(title + "; dashed: d/2 (RoPE pairs c, c+d/2)", fontsize=9)
        ax.set_xlabel("channel")
        ax.set_ylabel("layer")
        ax.tick_params(labelsize=7.5)
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
                         f"(red), RoPE pair {pair} (orange)", fontsize=8.5)
            ax.set_xlim(-1, d)
            ax.tick_params(labelsize=7.5)
            if col == 0:
                ax.set_ylabel("amax", fontsize=8.5)
    fig.suptitle("Per-channel amax of post-RoPE Q and K; bottom rows: the riskiest heads", fontsize=10.5)
    return finish(fig, "channel_amax", "Per-channel amax of Q and K",
                  "Top: amax per channel and layer of post-RoPE Q (max over heads) and K (max over KV heads); the "
                  "dashed line is d/2, so a hot channel c and its RoPE partner c + d/2 sit symmetrically. Below: "
                  "the riskiest heads' channels, the hottest in red and its RoPE pair in orange.", alt="channel amax")


__all__ = ["heatmap_errors", "heatmap_stats", "channel_amax_figure", "per_head"]
