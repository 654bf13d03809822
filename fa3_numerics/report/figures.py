"""Figures of a run's dataset, chosen by the dims it has; PNG bytes, deterministic.

Exposed: ``Figure``, ``figure_plan``, ``make_figures``, ``reference_cell``, ``swept_dims``.

Which figures a dataset gets (``figure_plan``):

- ``variants``: bar chart of every variant at one cell (the paper's setting when the
  sweep contains it), 95% bootstrap intervals, the FA3 paper's Table 3 values marked;
- ``seqlen``: error against sequence length, log-log, one line per variant (when seqlen
  is swept), faceted over up to two other swept parameters;
- ``heatmap_p_sigma``: one heatmap over (p, sigma) per variant (when both are swept);
- ``vs_<dim>``: error against any other swept parameter not covered above;
- ``inputs_hist``: histogram of |Q| and |K| entries, with the N(0,1) bulk for reference.

Every error figure carries the percentile-bootstrap intervals of
``fa3_numerics.engine.dataset.summary_table`` (over (seed, batch, head) samples). matplotlib and
seaborn are imported inside functions; figures are drawn on ``matplotlib.figure.Figure``
(Agg canvas, no pyplot state) and saved without timestamps, so the same dataset always
gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import xarray as xr

from ..engine.dataset import PAPER_SETTING, SAMPLE_DIMS

DPI = 100
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "<", ">", "h", "p")
LABELS = {
    "p": "outlier probability p (per entry)",
    "sigma": "outlier std σ (× the N(0,1) bulk)",
    "seqlen": "sequence length (tokens)",
    "head_dim": "head dim (channels)",
    "causal": "causal mask",
}
SYMBOL = {"p": "p", "sigma": "σ", "seqlen": "seqlen", "head_dim": "head dim", "causal": "causal"}
METRIC_LABEL = {
    "rmse": "RMSE vs float64 reference (output units)",
    "rel_l2": "relative L2 error (dimensionless)",
    "rel_l1": "relative L1 error (dimensionless)",
    "max_abs": "max |O − O_ref| (output units)",
}


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str  # file stem: figures/<name>.png
    title: str
    caption: str
    png: bytes


def paper_setting_text() -> str:
    """The paper's setting (``dataset.PAPER_SETTING``) in words, e.g. 'p=0.001, σ=10, ...'."""
    return ", ".join(f"{SYMBOL.get(k, k)}={_fmt_val(v)}" for k, v in PAPER_SETTING.items())


def swept_dims(ds: xr.Dataset) -> list[str]:
    """Swept parameters, in the dataset's order (dims of ``rmse`` before ``variant``)."""
    return [d for d in ds["rmse"].dims if d not in SAMPLE_DIMS and d != "variant"]


def reference_cell(ds: xr.Dataset) -> dict:
    """The cell shown where a figure fixes a swept parameter: the paper's value when the
    sweep has it, the longest sequence for seqlen, else the middle value."""
    ref = {}
    for d in swept_dims(ds):
        vals = list(ds.coords[d].values)
        pick = None
        if d in PAPER_SETTING:
            hits = [v for v in vals if np.isclose(float(v), float(PAPER_SETTING[d]))]
            pick = hits[0] if hits else None
        if pick is None:
            pick = max(vals) if d == "seqlen" else vals[len(vals) // 2]
        ref[d] = _py(pick)
    return ref


def figure_plan(ds: xr.Dataset) -> list[str]:
    """Names of the figures ``make_figures`` draws for this dataset, in order."""
    sw = [d for d in swept_dims(ds) if ds.sizes[d] > 1]  # a one-value dim has nothing to plot against
    plan = ["variants"]
    if "seqlen" in sw:
        plan.append("seqlen")
    heat = "p" in sw and "sigma" in sw
    if heat:
        plan.append("heatmap_p_sigma")
    plan += [f"vs_{d}" for d in sw if d != "seqlen" and not (heat and d in ("p", "sigma"))]
    if "abs_hist" in ds and "abs_bin_lo" in ds.coords:
        plan.append("inputs_hist")
    return plan


def make_figures(ds: xr.Dataset, rows: list[dict], metric: str = "rmse") -> list[Figure]:
    """Draw every figure of ``figure_plan``; ``rows`` is ``summary_table(ds, metric)``."""
    import matplotlib as mpl

    with mpl.rc_context():
        _theme()
        ctx = _Ctx(ds, rows, metric)
        out = []
        for name in figure_plan(ds):
            if name == "variants":
                out.append(_variants(ctx))
            elif name == "seqlen":
                out.append(_seqlen(ctx))
            elif name == "heatmap_p_sigma":
                out.append(_heatmaps(ctx))
            elif name.startswith("vs_"):
                out.append(_versus(ctx, name[3:]))
            elif name == "inputs_hist":
                out.append(_inputs_hist(ctx))
        return out


# -- helpers -----------------------------------------------------------------------------

def _theme() -> None:
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind", font_scale=0.95)
    import matplotlib as mpl

    mpl.rcParams.update({"svg.hashsalt": "fa3", "figure.dpi": DPI, "savefig.dpi": DPI, "axes.titleweight": "bold",
                         "legend.frameon": True, "legend.framealpha": 0.9})


class _Ctx:
    def __init__(self, ds: xr.Dataset, rows: list[dict], metric: str):
        import seaborn as sns

        self.ds, self.rows, self.metric = ds, rows, metric
        self.variants = [str(v) for v in ds["variant"].values]
        pal = sns.color_palette("colorblind", max(len(self.variants), 1))
        if len(self.variants) > len(pal):  # colorblind has 10 colours; repeat with other markers
            pal = [pal[i % len(pal)] for i in range(len(self.variants))]
        self.color = {v: pal[i] for i, v in enumerate(self.variants)}
        self.marker = {v: MARKERS[i % len(MARKERS)] for i, v in enumerate(self.variants)}
        self.sweep = swept_dims(ds)
        self.varying = [d for d in self.sweep if ds.sizes[d] > 1]
        self.ref = reference_cell(ds)
        self.ylabel = METRIC_LABEL.get(metric, metric)

    def select(self, keep: tuple[str, ...] = (), fixed: dict | None = None) -> list[dict]:
        """Rows whose swept dims not in ``keep`` equal the reference cell (or ``fixed``)."""
        want = {d: v for d, v in self.ref.items() if d not in keep} | (fixed or {})
        return [r for r in self.rows if all(_eq(r[d], v) for d, v in want.items())]

    def where(self, keep: tuple[str, ...] = ()) -> str:
        parts = [f"{SYMBOL.get(d, d)}={_fmt_val(v)}" for d, v in self.ref.items() if d not in keep]
        return ", ".join(parts)

    def fixed_text(self) -> str:
        ds = self.ds
        keys = [k for k in ("p", "sigma", "seqlen", "head_dim", "causal") if k in ds.coords and ds.coords[k].ndim == 0]
        return ", ".join(f"{SYMBOL.get(k, k)}={_fmt_val(_py(ds.coords[k].values))}" for k in keys)


def _py(v):
    v = np.asarray(v)
    return v.item() if v.shape == () else v.tolist()


def _eq(a, b) -> bool:
    if isinstance(a, (bool, np.bool_)) or isinstance(b, (bool, np.bool_)):
        return bool(a) == bool(b)
    try:
        return bool(np.isclose(float(a), float(b)))
    except (TypeError, ValueError):
        return a == b


def _fmt_val(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v)).lower()
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e6:
        return str(int(v))
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def _sci(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.2e}" if (abs(x) < 0.01 or abs(x) >= 1000) else f"{x:.3g}"


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _new_fig(w: float, h: float, nrows: int = 1, ncols: int = 1, **kw):
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(w, h), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _err(rows: list[dict]) -> np.ndarray:
    v = np.array([r["value"] for r in rows], dtype=float)
    lo = np.array([r["lo"] for r in rows], dtype=float)
    hi = np.array([r["hi"] for r in rows], dtype=float)
    lo = np.where(np.isfinite(lo), lo, v)
    hi = np.where(np.isfinite(hi), hi, v)
    return np.vstack([np.clip(v - lo, 0, None), np.clip(hi - v, 0, None)])


def _positive(values) -> list[float]:
    return [float(x) for x in values if x is not None and math.isfinite(x) and x > 0]


def _samples_text(ctx: _Ctx) -> str:
    ds = ctx.ds
    n = int(np.prod([ds.sizes[d] for d in SAMPLE_DIMS if d in ds.sizes]))
    return (f"Error bars: 95% percentile-bootstrap intervals over {n} (seed, batch, head) samples "
            f"({ds.sizes.get('seed', 1)} seed(s) × {ds.sizes.get('batch', 1)} batch × {ds.sizes.get('head', 1)} heads).")


# -- figures -----------------------------------------------------------------------------

def _variants(ctx: _Ctx) -> Figure:
    rows = ctx.select()
    n = len(rows)
    ds = ctx.ds
    # the paper's values: solid where this cell is the paper's setting (summary_table gives
    # them), hollow grey where the dataset differs from it (named in the legend)
    table3 = {str(v): float(x) for v, x in zip(ds["variant"].values, ds["paper_rmse"].values)} \
        if "paper_rmse" in ds.coords and ctx.metric == "rmse" and ds.attrs.get("dist") == "outliers" else {}
    in_setting = any(math.isfinite(r["paper"]) for r in rows)
    paper = {r["variant"]: (r["paper"] if in_setting else table3.get(r["variant"], math.nan)) for r in rows}
    differs = [] if in_setting else _differs_from_paper(ctx)
    fig, axes = _new_fig(9.5, 0.55 * n + 1.9)
    ax = axes[0, 0]
    y = np.arange(n)[::-1]
    pos = _positive([r["value"] for r in rows] + [r["lo"] for r in rows] + list(paper.values()))
    left = 10 ** math.floor(math.log10(min(pos))) if pos else 1e-6
    top = max(pos) if pos else 1.0
    ax.set_xscale("log")
    for yi, r in zip(y, rows):
        c = ctx.color[r["variant"]]
        if math.isfinite(r["value"]) and r["value"] > 0:
            ax.barh(yi, r["value"] - left, left=left, height=0.62, color=c, edgecolor="black", linewidth=0.6)
            ax.errorbar(r["value"], yi, xerr=_err([r]), fmt="none", ecolor="black", elinewidth=1.2, capsize=4)
    marked = [(yi, paper[r["variant"]]) for yi, r in zip(y, rows) if math.isfinite(paper[r["variant"]])]
    if marked:
        label = "FA3 paper, Table 3" if in_setting else \
            "FA3 paper, Table 3 (at " + ", ".join(f"{k}={v}" for k, v in differs) + "; not this cell)"
        ax.scatter([x for _, x in marked], [yi for yi, _ in marked], marker="D", s=70, zorder=5,
                   facecolor="white" if in_setting else "none", edgecolor="black" if in_setting else "0.45",
                   linewidth=1.6 if in_setting else 1.2, label=label)
        ax.legend(loc="lower right", fontsize=8.5)
    for yi, r in zip(y, rows):
        txt = _sci(r["value"])
        if math.isfinite(r["ratio"]):
            txt += f"  (paper {_sci(r['paper'])}, ×{r['ratio']:.2f})"
        xr_ = max(_positive([r["value"], r["hi"], paper[r["variant"]]]) or [float("nan")])
        if math.isfinite(xr_) and xr_ > 0:
            ax.text(xr_ * 1.35, yi, txt, va="center", ha="left", fontsize=8.5)
    ax.set_xlim(left, top * 10 ** (1.9 if in_setting else 1.1))
    ax.set_ylim(-0.7 - (0.9 if marked else 0), n - 0.3)
    ax.set_yticks(y)
    ax.set_yticklabels([r["variant"] for r in rows])
    ax.set_xlabel(ctx.ylabel + ", log scale")
    setting = ", ".join(x for x in (ctx.where(), ctx.fixed_text()) if x)
    ax.set_title(f"{ctx.metric.upper()} per variant" + (f"\n{setting}" if setting else ""))
    caption = (f"{ctx.metric.upper()} of each variant against the float64 reference at {setting or 'the run'}; "
               f"bars are pooled values. " + _samples_text(ctx))
    if marked and in_setting:
        caption += (" White diamonds: the FA3 paper's Table 3; this cell is the paper's setting "
                    f"({paper_setting_text()}), and the labels give ours / paper.")
    elif marked:
        caption += (" Hollow grey diamonds: the FA3 paper's Table 3, for orientation only: the paper's setting is "
                    f"{paper_setting_text()}; this cell differs from it in {', '.join(k for k, _ in differs)}, so no ratio is given.")
    return Figure("variants", "Error per variant", caption, _png(fig))


def _differs_from_paper(ctx: _Ctx) -> list[tuple[str, str]]:
    """Parameters of the bar chart's cell that differ from the paper's setting: (name, paper's value)."""
    have = dict(ctx.ref)
    for k in PAPER_SETTING:
        if k not in have and k in ctx.ds.coords and ctx.ds.coords[k].ndim == 0:
            have[k] = _py(ctx.ds.coords[k].values)
    return [(SYMBOL.get(k, k), _fmt_val(want)) for k, want in PAPER_SETTING.items()
            if k not in have or not _eq(have[k], want)]


def _facets(ctx: _Ctx, exclude: tuple[str, ...]) -> tuple[list[str], list[list]]:
    """Up to two other swept dims (with at most 4 values each) become facet rows/cols."""
    dims = [d for d in ctx.varying if d not in exclude and ctx.ds.sizes[d] <= 4][:2]
    return dims, [[_py(v) for v in ctx.ds.coords[d].values] for d in dims]


def _seqlen(ctx: _Ctx) -> Figure:
    fdims, fvals = _facets(ctx, ("seqlen",))
    # columns: the first facet dim (p when swept), rows: the second (sigma)
    col_d, col_v = (fdims[0], fvals[0]) if fdims else (None, [None])
    row_d, row_v = (fdims[1], fvals[1]) if len(fdims) > 1 else (None, [None])
    nr, nc = len(row_v), len(col_v)
    fig, axes = _new_fig(3.6 * nc + 0.6 + _legend_width(ctx.variants), 3.0 * nr + 0.9, nr, nc, sharex=True, sharey=True)
    seqlens = [int(v) for v in ctx.ds.coords["seqlen"].values]
    nv = len(ctx.variants)
    for i, rv in enumerate(row_v):
        for j, cv in enumerate(col_v):
            ax = axes[i, j]
            fixed = {}
            if col_d:
                fixed[col_d] = cv
            if row_d:
                fixed[row_d] = rv
            rows = ctx.select(keep=("seqlen",) + tuple(fdims), fixed=fixed)
            for k, v in enumerate(ctx.variants):
                rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seqlen"])
                if not rs:
                    continue
                shift = 2 ** (0.04 * (k - (nv - 1) / 2))  # dodge error bars of overlapping lines
                x = np.array([r["seqlen"] for r in rs], dtype=float) * shift
                ax.errorbar(x, [r["value"] for r in rs], yerr=_err(rs), color=ctx.color[v], marker=ctx.marker[v],
                            markersize=5, linewidth=1.5, capsize=3, elinewidth=1, label=v)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(seqlens)
            ax.set_xticklabels([str(s) for s in seqlens])
            t = ", ".join(f"{SYMBOL.get(d, d)}={_fmt_val(val)}" for d, val in ((col_d, cv), (row_d, rv)) if d)
            if t:
                ax.set_title(t, fontsize=10)
            if i == nr - 1:
                ax.set_xlabel(LABELS["seqlen"])
            if j == 0:
                ax.set_ylabel(METRIC_LABEL.get(ctx.metric, ctx.metric) if nr == 1 else ctx.metric.upper())
    for ax in axes.flat:
        ax.xaxis.set_minor_locator(_null_locator())
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", title="variant", ncols=1 + len(labels) // 16,
               fontsize=9 if len(labels) <= 16 else 7)
    other = ctx.where(keep=("seqlen",) + tuple(fdims))
    fixed = ctx.fixed_text()
    setting = ", ".join(x for x in (other, fixed) if x)
    fig.suptitle(f"{ctx.metric.upper()} against sequence length (log-log)" + (f"\n{setting}" if setting else ""),
                 fontweight="bold")
    caption = (f"{ctx.metric.upper()} against sequence length on log-log axes, one line per variant"
               + (f"; panels over {' and '.join(SYMBOL.get(d, d) for d in fdims)}" if fdims else "")
               + (f"; {setting}" if setting else "") + ". Points of different variants are shifted slightly "
               "sideways so that their error bars do not overlap. " + _samples_text(ctx))
    return Figure("seqlen", "Error against sequence length", caption, _png(fig))


def _legend_width(labels: list[str]) -> float:
    """Inches a figure legend of ``labels`` needs (one column per 16 entries)."""
    ncols = 1 + len(labels) // 16
    char = 0.075 if len(labels) <= 16 else 0.06
    return ncols * (0.6 + char * max((len(t) for t in labels), default=8))


def nv_many(ctx) -> bool:
    return len(ctx.variants) > 16


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _heatmaps(ctx: _Ctx) -> Figure:
    import seaborn as sns
    from matplotlib.colors import LogNorm

    ds = ctx.ds
    ps = [_py(v) for v in ds.coords["p"].values]
    sigmas = [_py(v) for v in ds.coords["sigma"].values]
    rows = ctx.select(keep=("p", "sigma"))
    nv = len(ctx.variants)
    ncol = min(nv, 4)
    nrow = math.ceil(nv / ncol)
    fig, axes = _new_fig(3.3 * ncol + 1.2, 3.0 * nrow + 1.0, nrow, ncol)
    pos = _positive(r["value"] for r in rows)
    vmin, vmax = (min(pos), max(pos)) if pos else (1e-6, 1.0)
    if vmax <= vmin:
        vmax = vmin * 10
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = "viridis"
    for k, v in enumerate(ctx.variants):
        ax = axes[k // ncol, k % ncol]
        grid = np.full((len(sigmas), len(ps)), np.nan)
        annot = np.full(grid.shape, "", dtype=object)
        for r in rows:
            if r["variant"] != v:
                continue
            i = next(ii for ii, s in enumerate(sigmas) if _eq(s, r["sigma"]))
            j = next(jj for jj, p in enumerate(ps) if _eq(p, r["p"]))
            grid[i, j] = r["value"]
            half = (r["hi"] - r["lo"]) / 2 / r["value"] if r["value"] and math.isfinite(r["hi"]) else float("nan")
            annot[i, j] = _sci(r["value"]) + ("" if not math.isfinite(half) else f"\n±{100 * half:.2g}%")
        # sigma grows upwards: first row of the array is drawn at the top
        sns.heatmap(grid[::-1], ax=ax, norm=norm, cmap=cmap, cbar=False, annot=annot[::-1], fmt="",
                    annot_kws={"fontsize": 7.5}, linewidths=0.5, linecolor="white", square=False,
                    xticklabels=[_fmt_val(p) for p in ps], yticklabels=[_fmt_val(s) for s in sigmas[::-1]])
        ax.set_title(v, fontsize=10)
        ax.set_xlabel("p (outlier probability)" if k // ncol == nrow - 1 else "")
        ax.set_ylabel("σ (outlier std)" if k % ncol == 0 else "")
        ax.tick_params(axis="y", rotation=0)
    for k in range(nv, nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    from matplotlib.cm import ScalarMappable

    sm = ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, ax=axes.ravel().tolist(), fraction=0.025, pad=0.02)
    cb.set_label(f"{ctx.metric.upper()} (log colour scale)")
    setting = ", ".join(x for x in (ctx.where(keep=("p", "sigma")), ctx.fixed_text()) if x)
    fig.suptitle(f"{ctx.metric.upper()} over outlier probability p and outlier std σ"
                 + (f"\n{setting}" if setting else ""), fontweight="bold")
    caption = (f"{ctx.metric.upper()} per variant over (p, σ), one shared logarithmic colour scale"
               + (f"; {setting}" if setting else "") + ". Each cell shows the pooled value and the half-width "
               "of its 95% bootstrap interval relative to the value. " + _samples_text(ctx))
    return Figure("heatmap_p_sigma", "Error over (p, σ)", caption, _png(fig))


def _versus(ctx: _Ctx, dim: str) -> Figure:
    vals = [_py(v) for v in ctx.ds.coords[dim].values]
    rows = ctx.select(keep=(dim,))
    fig, axes = _new_fig(6.5 + _legend_width(ctx.variants), 4.6 + (0.08 * len(ctx.variants) if nv_many(ctx) else 0))
    ax = axes[0, 0]
    x = np.arange(len(vals), dtype=float)
    nv = len(ctx.variants)
    for k, v in enumerate(ctx.variants):
        rs = [next((r for r in rows if r["variant"] == v and _eq(r[dim], val)), None) for val in vals]
        keep = [(xi, r) for xi, r in zip(x, rs) if r is not None]
        if not keep:
            continue
        xs = np.array([xi for xi, _ in keep]) + min(0.05, 0.5 / nv) * (k - (nv - 1) / 2)
        rr = [r for _, r in keep]
        ax.errorbar(xs, [r["value"] for r in rr], yerr=_err(rr), color=ctx.color[v], marker=ctx.marker[v],
                    markersize=5, linewidth=1.5, capsize=3, elinewidth=1, label=v)
    ax.set_yscale("log")
    ax.set_xticks(x)
    labels = [_fmt_val(v) for v in vals]
    long = max(len(t) for t in labels) * len(labels) > 60
    ax.set_xticklabels(labels, rotation=25 if long else 0, ha="right" if long else "center")
    ax.set_xlabel(LABELS.get(dim, dim) + " (evenly spaced categories)")
    ax.set_ylabel(METRIC_LABEL.get(ctx.metric, ctx.metric))
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right center", title="variant", ncols=1 + len(names) // 16,
               fontsize=9 if len(names) <= 16 else 7)
    setting = ", ".join(x for x in (ctx.where(keep=(dim,)), ctx.fixed_text()) if x)
    ax.set_title(f"{ctx.metric.upper()} against {SYMBOL.get(dim, dim)}" + (f"\n{setting}" if setting else ""))
    caption = (f"{ctx.metric.upper()} against {LABELS.get(dim, dim)}, one line per variant"
               + (f"; {setting}" if setting else "") + ". " + _samples_text(ctx))
    return Figure(f"vs_{dim}", f"Error against {SYMBOL.get(dim, dim)}", caption, _png(fig))


def _inputs_hist(ctx: _Ctx) -> Figure:
    import seaborn as sns

    ds = ctx.ds
    h = ds["abs_hist"]
    hue_dim = "p" if "p" in ctx.varying else ("sigma" if "sigma" in ctx.varying else None)
    fix = {d: v for d, v in ctx.ref.items() if d in h.dims and d != hue_dim}
    for d, v in fix.items():
        idx = next(i for i, c in enumerate(ds.coords[d].values) if _eq(_py(c), v))
        h = h.isel({d: idx})
    h = h.sum("seed") if "seed" in h.dims else h
    first_of = []
    for d in [d for d in h.dims if d not in (hue_dim, "tensor", "abs_bin")]:  # e.g. inputs kept per variant
        if d in h.coords and h.sizes[d] > 1:
            first_of.append(f"{d}={_fmt_val(_py(h.coords[d].values[0]))}")
        h = h.isel({d: 0})
    lo = np.asarray(ds.coords["abs_bin_lo"].values, dtype=float)
    # bins [lo_i, lo_{i+1}); the first ([0, 1e-3)) and the open last one cannot sit on a log axis
    edges = lo[1:]
    centers = np.sqrt(edges[:-1] * edges[1:])
    hue_vals = [_py(v) for v in ds.coords[hue_dim].values] if hue_dim else [None]
    pal = sns.color_palette("colorblind", max(len(hue_vals), 1))
    fig, axes = _new_fig(11, 4.4, 1, 2, sharey=True)
    tensors = [str(t) for t in ds.coords["tensor"].values]
    notes = []
    thr_i = int(np.searchsorted(lo, 5.0))
    thr = lo[thr_i] if thr_i < len(lo) else float("inf")
    for j, name in enumerate(("Q", "K")):
        ax = axes[0, j]
        if name not in tensors:
            ax.set_visible(False)
            continue
        ti = tensors.index(name)
        total = None
        for k, hv in enumerate(hue_vals):
            counts = h.isel(tensor=ti)
            if hue_dim:
                counts = counts.isel({hue_dim: k})
            counts = np.asarray(counts.values, dtype=float)
            total = counts.sum()
            y = counts[1:-1].copy()
            y[y <= 0] = np.nan
            label = f"{SYMBOL.get(hue_dim, hue_dim)}={_fmt_val(hv)}" if hue_dim else "sampled entries"
            ax.plot(centers, y, drawstyle="steps-mid", color=pal[k], linewidth=1.6, label=label)
            big = counts[thr_i:].sum() if thr_i < len(counts) else 0.0
            notes.append(f"{name}{' at ' + label if hue_dim else ''}: {int(big)} of {int(total)} entries "
                         f"({100 * big / total:.3g}%) have |x| ≥ {thr:.3g}")
        if ds.attrs.get("dist") == "outliers" and total:
            cdf = np.array([math.erf(e / math.sqrt(2)) for e in edges])
            expect = total * np.diff(cdf)
            expect[expect < 0.5] = np.nan
            ax.plot(centers, expect, color="black", linestyle="--", linewidth=1.2,
                    label="N(0,1) bulk alone (expected)")
        ax.axvline(thr, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"|{name}| entry magnitude (N(0,1) units), log scale")
        if j == 0:
            ax.set_ylabel("entries per bin (count), log scale")
        ax.set_title(f"|{name}| entries")
        ax.legend(loc="lower left", fontsize=8)
    setting = ", ".join(x for x in (ctx.where(keep=(hue_dim,) if hue_dim else ()), ctx.fixed_text()) if x)
    fig.suptitle("Where the outliers are: histogram of |Q| and |K|" + (f"\n{setting}" if setting else ""),
                 fontweight="bold")
    caption = ("Counts of |Q| and |K| entries per logarithmic bin (10 per decade), summed over seeds"
               + (f" (inputs of {', '.join(first_of)})" if first_of else "")
               + (f"; {setting}" if setting else "") + ". The dashed line is what N(0,1) alone would give; "
               "the excess to the right of it is the outliers. Dotted line: |x| = " + f"{thr:.3g}. "
               + "; ".join(notes) + ".")
    return Figure("inputs_hist", "Histogram of |Q| and |K|", caption, _png(fig))
