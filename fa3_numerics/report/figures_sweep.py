"""Figures of a sweep: error against seqlen, heatmaps over (p, σ), error against any other swept
parameter. Drawn from the context of ``fa3_numerics.report.figures`` (rows, colours, markers,
reference cell).

Exposed: ``seqlen``, ``heatmaps``, ``versus``.

Lines of variants whose values coincide at every point are drawn once and named together
("fa2-fp16 = fa3-fp16"), so none hides under another; the rest are shifted slightly sideways so
that their intervals do not overlap.
"""

from __future__ import annotations

import math

import numpy as np

from ..engine.dataset import py_value, same_value
from ..text import fmt_coord
from .figures import LABELS, METRIC_LABEL, SYMBOL, _err, _positive, _samples_text, coinciding
from .plots import Figure, colorbar_ticks, finish, new_fig, plain_ticks


def _facets(ctx, exclude: tuple[str, ...]) -> tuple[list[str], list[list]]:
    """Up to two other swept dims (with at most 4 values each) become facet rows/cols."""
    dims = [d for d in ctx.varying if d not in exclude and ctx.ds.sizes[d] <= 4][:2]
    return dims, [[py_value(v) for v in ctx.ds.coords[d].values] for d in dims]


def _legend_width(labels: list[str]) -> float:
    """Inches a figure legend of ``labels`` needs (one column per 16 entries)."""
    ncols = 1 + len(labels) // 16
    char = 0.075 if len(labels) <= 16 else 0.06
    return ncols * (0.6 + char * max((len(t) for t in labels), default=8))


def _series(ctx, rows: list[dict], dim: str, values: list) -> dict[str, list[dict | None]]:
    """variant -> its row at each value of ``dim`` (None where missing)."""
    return {v: [next((r for r in rows if r["variant"] == v and same_value(r[dim], x)), None) for x in values]
            for v in ctx.variants}


NEAR = 0.02  # lines closer than this (relative, at every point) would hide one another


def _near(a: list[float], b: list[float]) -> float | None:
    """The largest relative difference of two lines when below ``NEAR`` at every point, else None."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b) & (b != 0)
    if not ok.any():
        return None
    d = float(np.max(np.abs(a[ok] / b[ok] - 1)))
    return d if d < NEAR else None


def _draw_lines(ax, ctx, series: dict[str, list], xs: np.ndarray, shift) -> None:
    """One line per group of coinciding variants, labelled 'a = b' when several; a line within
    ``NEAR`` of one drawn before it is dashed with hollow markers on top of it, and its label
    says so, so that neither hides the other."""
    values = {v: [r["value"] if r else math.nan for r in rs] for v, rs in series.items()}
    groups = coinciding(values)
    ng = len(groups)
    drawn: list[str] = []
    for k, group in enumerate(groups):
        v = group[0]
        keep = [(x, r) for x, r in zip(xs, series[v]) if r is not None]
        if not keep:
            continue
        x = shift(np.array([x for x, _ in keep], dtype=float), k, ng)
        rr = [r for _, r in keep]
        label = v if len(group) == 1 else " = ".join(group) + " (identical)"
        close = [(w, d) for w in drawn if (d := _near(values[v], values[w])) is not None]
        style = {"markerfacecolor": "white" if len(group) > 1 or close else ctx.color[v]}
        if close:
            label += f" (dashed where within {100 * NEAR:.0f}% of {close[0][0]})"
            style.update(linestyle="--", markersize=7.5, markeredgewidth=1.4, zorder=3)
        ax.errorbar(x, [r["value"] for r in rr], yerr=_err(rr), color=ctx.color[v], marker=ctx.marker[v],
                    markersize=style.pop("markersize", 5.5), linewidth=1.6, capsize=3, elinewidth=1, label=label,
                    **style)
        drawn.append(v)


def seqlen(ctx) -> Figure:
    fdims, fvals = _facets(ctx, ("seqlen",))
    # columns: the first facet dim (p when swept), rows: the second (sigma)
    col_d, col_v = (fdims[0], fvals[0]) if fdims else (None, [None])
    row_d, row_v = (fdims[1], fvals[1]) if len(fdims) > 1 else (None, [None])
    nr, nc = len(row_v), len(col_v)
    fig, axes = new_fig(3.7 * nc + 0.6 + _legend_width(ctx.variants), 3.1 * nr + 1.0, nr, nc, sharex=True,
                        sharey=True)
    seqlens = [int(v) for v in ctx.ds.coords["seqlen"].values]
    merged = set()
    for i, rv in enumerate(row_v):
        for j, cv in enumerate(col_v):
            ax = axes[i, j]
            fixed = {d: v for d, v in ((col_d, cv), (row_d, rv)) if d}
            rows = ctx.select(keep=("seqlen",) + tuple(fdims), fixed=fixed)
            series = _series(ctx, rows, "seqlen", seqlens)
            merged |= {tuple(g) for g in coinciding({v: [r["value"] if r else math.nan for r in rs]
                                                      for v, rs in series.items()}) if len(g) > 1}
            # dodge the intervals of neighbouring lines by a few percent of an octave
            _draw_lines(ax, ctx, series, np.array(seqlens, dtype=float),
                        lambda x, k, n: x * 2 ** (0.04 * (k - (n - 1) / 2)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(seqlens)
            ax.set_xticklabels([str(s) for s in seqlens])
            ax.xaxis.set_minor_locator(_null_locator())
            plain_ticks(ax, "y")
            t = ", ".join(f"{SYMBOL.get(d, d)}={fmt_coord(val)}" for d, val in ((col_d, cv), (row_d, rv)) if d)
            if t:
                ax.set_title(t, fontsize=10.5)
            if i == nr - 1:
                ax.set_xlabel(LABELS["seqlen"])
            if j == 0:
                ax.set_ylabel(METRIC_LABEL.get(ctx.metric, ctx.metric) if nr == 1 else ctx.metric.upper())
    handles, labels = _legend_entries(axes)
    fig.legend(handles, labels, title="variant", **_legend_spot(fig, labels, 3.7 * nc + 0.6))
    other = ctx.where(keep=("seqlen",) + tuple(fdims))
    setting = ", ".join(x for x in (other, ctx.fixed_text()) if x)
    fig.suptitle(f"{ctx.metric.upper()} against sequence length (log-log)" + (f"\n{setting}" if setting else ""),
                 fontweight="bold")
    caption = (f"{ctx.metric.upper()} against sequence length on log-log axes, one line per variant"
               + (f"; panels over {' and '.join(SYMBOL.get(d, d) for d in fdims)}" if fdims else "")
               + (f"; {setting}" if setting else "") + ". Points of different lines are shifted slightly "
               "sideways so that their intervals do not overlap. " + _merged_text(merged) + _samples_text(ctx))
    return finish(fig, "seqlen", "Error against sequence length", caption)


def _legend_spot(fig, labels: list[str], base_width: float) -> dict:
    """Where the figure legend of ``labels`` goes, the figure resized to hold it: to the right of
    the panels while it is short and narrow, below them in two columns (one for labels past 60
    characters) when it has many or long entries, which beside the panels stood taller or wider
    than the axes they explain. Returns the ``fig.legend`` keywords."""
    longest = max((len(t) for t in labels), default=0)
    if len(labels) <= 10 and longest <= 40:
        need = 0.24 * len(labels) + 1.3  # inches: entries at 9 pt with spacing, the title, the margins
        if fig.get_figheight() < need:
            fig.set_figheight(need)
        return {"loc": "outside right center", "ncols": 1, "fontsize": 9}
    ncols = 1 if longest > 60 else 2
    rows = -(-len(labels) // ncols)
    fig.set_figwidth(max(base_width, min(16.0, 0.075 * longest * ncols + 1.0)))
    fig.set_figheight(fig.get_figheight() + 0.22 * rows + 0.5)
    return {"loc": "outside lower center", "ncols": ncols, "fontsize": 8}


def _legend_entries(axes):
    """Handles and labels of every panel, each line once: panels may style a line differently
    (dashed where it runs close to another); the annotated entry then stands for it."""
    seen: dict[str, tuple[object, str]] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            base = label.split(" (dashed")[0]
            if base not in seen or ("(dashed" in label and "(dashed" not in seen[base][1]):
                seen[base] = (h, label)
    return [h for h, _ in seen.values()], [lab for _, lab in seen.values()]


def _merged_text(merged: set) -> str:
    text = (f"A line within {100 * NEAR:.0f}% of another at every point is dashed with hollow markers and its "
            "legend entry names the other. ")
    if not merged:
        return text
    names = "; ".join(" and ".join(g) for g in sorted(merged))
    return (text + f"Variants with identical values at every point are drawn as one line with hollow markers and "
            f"named together in the legend ({names}). ")


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def heatmaps(ctx) -> Figure:
    import seaborn as sns
    from matplotlib.colors import LogNorm

    from ..text import column_format

    ds = ctx.ds
    ps = [py_value(v) for v in ds.coords["p"].values]
    sigmas = [py_value(v) for v in ds.coords["sigma"].values]
    rows = ctx.select(keep=("p", "sigma"))
    nv = len(ctx.variants)
    ncol = min(nv, 4)
    nrow = math.ceil(nv / ncol)
    fig, axes = new_fig(4.1 * ncol + 1.3, 3.6 * nrow + 1.1, nrow, ncol)
    pos = _positive(r["value"] for r in rows)
    vmin, vmax = (min(pos), max(pos)) if pos else (1e-6, 1.0)
    if vmax <= vmin:
        vmax = vmin * 10
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = "viridis"
    fmt = column_format([r["value"] for r in rows])
    for k, v in enumerate(ctx.variants):
        ax = axes[k // ncol, k % ncol]
        grid = np.full((len(sigmas), len(ps)), np.nan)
        annot = np.full(grid.shape, "", dtype=object)
        for r in rows:
            if r["variant"] != v:
                continue
            i = next(ii for ii, s in enumerate(sigmas) if same_value(s, r["sigma"]))
            j = next(jj for jj, p in enumerate(ps) if same_value(p, r["p"]))
            grid[i, j] = r["value"]
            half = (r["hi"] - r["lo"]) / 2 / r["value"] if r["value"] and math.isfinite(r["hi"]) else float("nan")
            annot[i, j] = fmt(r["value"]) + ("" if not math.isfinite(half) else f"\n±{100 * half:.2g}%")
        # sigma grows upwards: first row of the array is drawn at the top
        sns.heatmap(grid[::-1], ax=ax, norm=norm, cmap=cmap, cbar=False, annot=annot[::-1], fmt="",
                    annot_kws={"fontsize": 10}, linewidths=0.6, linecolor="white", square=False,
                    xticklabels=[fmt_coord(p) for p in ps], yticklabels=[fmt_coord(s) for s in sigmas[::-1]])
        ax.set_title(v, fontsize=11.5)
        ax.set_xlabel(LABELS["p"] if k // ncol == nrow - 1 else "", fontsize=10.5)
        ax.set_ylabel(LABELS["sigma"] if k % ncol == 0 else "", fontsize=10.5)
        ax.tick_params(axis="both", labelsize=10)
        ax.tick_params(axis="y", rotation=0)
    for k in range(nv, nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    from matplotlib.cm import ScalarMappable

    sm = ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, ax=axes.ravel().tolist(), fraction=0.025, pad=0.02)
    cb.set_label(f"{ctx.metric.upper()} (log colour scale)", fontsize=10.5)
    colorbar_ticks(cb)
    setting = ", ".join(x for x in (ctx.where(keep=("p", "sigma")), ctx.fixed_text()) if x)
    fig.suptitle(f"{ctx.metric.upper()} over {SYMBOL['p']} and {SYMBOL['sigma']}"
                 + (f"\n{setting}" if setting else ""), fontweight="bold")
    caption = (f"{ctx.metric.upper()} per variant over ({SYMBOL['p']}, {SYMBOL['sigma']}), one shared logarithmic colour scale"
               + (f"; {setting}" if setting else "") + ". Each cell shows the pooled value and the half-width "
               "of its 95% interval relative to the value. " + _samples_text(ctx))
    return finish(fig, "heatmap_p_sigma", f"Error over ({SYMBOL['p']}, {SYMBOL['sigma']})", caption)


def versus(ctx, dim: str) -> Figure:
    vals = [py_value(v) for v in ctx.ds.coords[dim].values]
    rows = ctx.select(keep=(dim,))
    fig, axes = new_fig(6.5 + _legend_width(ctx.variants), 4.6)
    ax = axes[0, 0]
    series = _series(ctx, rows, dim, vals)
    step = lambda n: min(0.05, 0.5 / max(n, 1))  # noqa: E731
    _draw_lines(ax, ctx, series, np.arange(len(vals), dtype=float), lambda x, k, n: x + step(n) * (k - (n - 1) / 2))
    merged = {tuple(g) for g in coinciding({v: [r["value"] if r else math.nan for r in rs]
                                             for v, rs in series.items()}) if len(g) > 1}
    ax.set_yscale("log")
    plain_ticks(ax, "y")
    ax.set_xticks(np.arange(len(vals)))
    labels = [fmt_coord(v) for v in vals]
    long = max(len(t) for t in labels) * len(labels) > 60
    ax.set_xticklabels(labels, rotation=25 if long else 0, ha="right" if long else "center")
    ax.set_xlabel(LABELS.get(dim, dim) + " (evenly spaced categories)")
    ax.set_ylabel(METRIC_LABEL.get(ctx.metric, ctx.metric))
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, title="variant", **_legend_spot(fig, names, 6.5))
    setting = ", ".join(x for x in (ctx.where(keep=(dim,)), ctx.fixed_text()) if x)
    ax.set_title(f"{ctx.metric.upper()} against {SYMBOL.get(dim, dim)}" + (f"\n{setting}" if setting else ""))
    caption = (f"{ctx.metric.upper()} against {LABELS.get(dim, dim)}, one line per variant"
               + (f"; {setting}" if setting else "") + ". " + _merged_text(merged) + _samples_text(ctx))
    return finish(fig, f"vs_{dim}", f"Error against {SYMBOL.get(dim, dim)}", caption)


__all__ = ["seqlen", "heatmaps", "versus"]
