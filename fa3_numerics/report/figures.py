"""Figures of a run's dataset, chosen by the dims it has; PNG and SVG bytes, deterministic.

Exposed: ``Figure``, ``figure_plan``, ``make_figures``, ``reference_cell``, ``swept_dims``,
``paper_setting_text``.

Which figures a dataset gets (``figure_plan``):

- ``variants``: every variant at one cell (the paper's setting when the sweep contains it) as a
  dot with its 95% interval on a log axis (a bar's length on a log axis depends on where the
  axis starts, so there are no bars), the FA3 paper's Table 3 values marked;
- ``seqlen``: error against sequence length, log-log, one line per variant (when seqlen
  is swept), faceted over up to two other swept parameters (``figures_sweep``);
- ``heatmap_p_sigma``: one heatmap over (p, sigma) per variant (when both are swept);
- ``vs_<dim>``: error against any other swept parameter not covered above;
- ``inputs_hist``: histogram of |Q| and |K| entries, with the N(0,1) bulk for reference.

Every error figure carries the BCa bootstrap intervals of
``fa3_numerics.engine.dataset.summary_table`` (over (seed, batch, head) samples). Variants whose
values coincide in every point (fa2-fp16 and fa3-fp16 compute the same numbers at the FA3 tiles
of some shapes) are drawn once and named together in the legend, so no line hides under another.
matplotlib is imported inside functions (``fa3_numerics.report.plots``); seaborn only by the sweep
heatmaps (``figures_sweep``): the theme and palette are written out in ``plots``.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..engine.dataset import PAPER_SETTING, SAMPLE_DIMS, py_value, same_value
from ..text import fmt_coord
from .plots import Figure, colorblind, finish, new_fig, theme

MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "<", ">", "h", "p")


class _Labels(dict):
    """The shape's labels, and every distribution parameter's from its family's registry entry
    (``fa3_numerics.data.distributions``: p, σ and the rest are the family's words, not ours)."""

    def __init__(self, shape: dict, index: int):
        super().__init__(shape)
        self.index = index

    def __missing__(self, key):
        from ..data.distributions import param_label, param_symbol

        got = param_symbol(key) if self.index == 0 else param_label(key)
        return got or key

    def get(self, key, default=None):  # every key has a label: the name itself at worst
        return self[key]


LABELS = _Labels({"seqlen": "sequence length (tokens)", "head_dim": "head dim (channels)", "causal": "causal mask"}, 1)
SYMBOL = _Labels({"seqlen": "seqlen", "head_dim": "head dim", "causal": "causal"}, 0)
METRIC_LABEL = {
    "rmse": "RMSE vs float64 reference (output units)",
    "rel_l2": "relative L2 error (dimensionless)",
    "rel_l1": "relative L1 error (dimensionless)",
    "max_abs": "max |O − O_ref| (output units)",
}


def paper_setting_text() -> str:
    """The paper's setting (``dataset.PAPER_SETTING``) in words, e.g. 'p=0.001, σ=10, ...'."""
    return ", ".join(f"{SYMBOL.get(k, k)}={fmt_coord(v)}" for k, v in PAPER_SETTING.items())


def swept_dims(ds: xr.Dataset) -> list[str]:
    """Swept parameters, in the dataset's order (dims of ``rmse`` before ``variant``)."""
    return [d for d in ds["rmse"].dims if d not in SAMPLE_DIMS and d != "variant"]


def reference_cell(ds: xr.Dataset) -> dict:
    """The cell shown where a figure fixes a swept parameter, as the run's study chose it (the
    paper's value when the sweep has it, the longest sequence, else the middle value)."""
    from .stored import findings_of

    return dict(findings_of(ds, kind="run")["reference_cell"])


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
    if "abs_hist" in ds and ("abs_bin" in ds.indexes or "abs_bin_lo" in ds.coords):
        plan.append("inputs_hist")
    return plan


def make_figures(ds: xr.Dataset, rows: list[dict], metric: str = "rmse") -> list[Figure]:
    """Draw every figure of ``figure_plan``; ``rows`` is ``summary_table(ds, metric)``."""
    import functools

    import matplotlib as mpl

    from ..engine.forking import forked_map
    from . import figures_sweep as sweep

    with mpl.rc_context():
        theme()
        ctx = _Ctx(ds, rows, metric)
        calls = []
        for name in figure_plan(ds):
            if name == "variants":
                calls.append(functools.partial(_variants, ctx))
            elif name == "seqlen":
                calls.append(functools.partial(sweep.seqlen, ctx))
            elif name == "heatmap_p_sigma":
                calls.append(functools.partial(sweep.heatmaps, ctx))
            elif name.startswith("vs_"):
                calls.append(functools.partial(sweep.versus, ctx, name[3:]))
            elif name == "inputs_hist":
                calls.append(functools.partial(_inputs_hist, ctx))
        # Each figure in its own process where the command line allows forks (the same bytes:
        # every figure is drawn from the dataset alone, with the theme set above).
        return forked_map(calls)


# -- helpers -----------------------------------------------------------------------------

class _Ctx:
    def __init__(self, ds: xr.Dataset, rows: list[dict], metric: str):
        self.ds, self.rows, self.metric = ds, rows, metric
        self.variants = [str(v) for v in ds["variant"].values]
        pal = colorblind(max(len(self.variants), 1))
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
        return [r for r in self.rows if all(same_value(r[d], v) for d, v in want.items())]

    def where(self, keep: tuple[str, ...] = ()) -> str:
        parts = [f"{SYMBOL.get(d, d)}={fmt_coord(v)}" for d, v in self.ref.items() if d not in keep]
        return ", ".join(parts)

    def fixed_text(self) -> str:
        ds = self.ds
        keys = [k for k in ("p", "sigma", "seqlen", "head_dim", "causal") if k in ds.coords and ds.coords[k].ndim == 0]
        return ", ".join(f"{SYMBOL.get(k, k)}={fmt_coord(py_value(ds.coords[k].values))}" for k in keys)








def _sci(x: float) -> str:
    from ..text import fmt_e

    return "–" if x is None or not math.isfinite(x) else fmt_e(x)


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
    few = " (fewer than 8: the intervals are rough)" if n < 8 else ""
    return (f"Intervals: 95% BCa bootstrap over {n} (seed, batch, head) samples "
            f"({ds.sizes.get('seed', 1)} seed(s) × {ds.sizes.get('batch', 1)} batch × {ds.sizes.get('head', 1)} "
            f"heads){few}.")


def coinciding(series: dict[str, list[float]]) -> list[list[str]]:
    """Groups of labels whose values are equal at every point (to 1e-12 relative), in order:
    such lines would hide one another, so each group is drawn once."""
    groups: list[list[str]] = []
    for label, vals in series.items():
        v = np.asarray(vals, dtype=float)
        for g in groups:
            w = np.asarray(series[g[0]], dtype=float)
            if v.shape == w.shape and np.allclose(v, w, rtol=1e-12, atol=0, equal_nan=True):
                g.append(label)
                break
        else:
            groups.append([label])
    return groups


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
    fig, axes = new_fig(9.5, 0.5 * n + 1.9)
    ax = axes[0, 0]
    y = np.arange(n)[::-1]
    pos = _positive([r["value"] for r in rows] + [r["lo"] for r in rows] + list(paper.values()))
    left = 10 ** math.floor(math.log10(min(pos)) - 0.02) if pos else 1e-6
    top = max(pos) if pos else 1.0
    ax.set_xscale("log")
    for yi, r in zip(y, rows):
        c = ctx.color[r["variant"]]
        if math.isfinite(r["value"]) and r["value"] > 0:
            ax.errorbar(r["value"], yi, xerr=_err([r]), fmt=ctx.marker[r["variant"]], color=c, markersize=9,
                        markeredgecolor="black", markeredgewidth=0.6, ecolor=c, elinewidth=2.4, capsize=5, zorder=4)
    marked = [(yi, paper[r["variant"]]) for yi, r in zip(y, rows) if math.isfinite(paper[r["variant"]])]
    if marked:
        label = "FA3 paper, Table 3" if in_setting else \
            "FA3 paper, Table 3 (at " + ", ".join(f"{k}={v}" for k, v in differs) + "; not this cell)"
        # A third of a row below the variant's own dot: where ours matches the paper, a diamond on
        # the same row would cover the dot and its interval.
        ax.scatter([x for _, x in marked], [yi - 0.32 for yi, _ in marked], marker="D", s=46, zorder=3,
                   facecolor="white" if in_setting else "none", edgecolor="black" if in_setting else "0.45",
                   linewidth=1.4 if in_setting else 1.1, label=label + " (just below each variant)")
        ax.legend(loc="lower right", fontsize=8.5)
    from ..text import column_format, fmt_interval

    fmt = column_format([x for r in rows for x in (r["value"], r["lo"], r["hi"], r["paper"])])
    for yi, r in zip(y, rows):
        txt = f"{fmt(r['value'])} {fmt_interval(r['lo'], r['hi'], fmt)}" if not r["nonfinite"] else \
            f"non-finite ({r['nonfinite']} of {r['n']})"
        if math.isfinite(r["ratio"]):
            txt += f"  (paper {fmt(r['paper'])}, ×{r['ratio']:.2f})"
        xr_ = max(_positive([r["value"], r["hi"], paper[r["variant"]]]) or [float("nan")])
        if math.isfinite(xr_) and xr_ > 0:
            ax.text(xr_ * 1.35, yi, txt, va="center", ha="left", fontsize=8.5)
    ax.set_xlim(left, top * 10 ** (2.4 if in_setting else 1.6))
    ax.set_ylim(-0.8 - (0.9 if marked else 0), n - 0.4)
    ax.set_yticks(y)
    ax.set_yticklabels([r["variant"] for r in rows])
    ax.set_xlabel(ctx.ylabel + ", log scale")
    from .plots import plain_ticks

    plain_ticks(ax, "x")
    setting = ", ".join(x for x in (ctx.where(), ctx.fixed_text()) if x)
    ax.set_title(f"{ctx.metric.upper()} per variant" + (f"\n{setting}" if setting else ""))
    caption = (f"{ctx.metric.upper()} of each variant against the float64 reference at {setting or 'the run'}: "
               f"a dot per pooled value with its interval (no bars: on a log axis a bar's length depends on where "
               f"the axis starts). " + _samples_text(ctx))
    if marked and in_setting:
        caption += (" White diamonds, just below each variant: the FA3 paper's Table 3; this cell is the paper's setting "
                    f"({paper_setting_text()}), and the labels give ours / paper.")
    elif marked:
        caption += (" Hollow grey diamonds, just below each variant: the FA3 paper's Table 3, for orientation only: the paper's setting is "
                    f"{paper_setting_text()}; this cell differs from it in {', '.join(k for k, _ in differs)}, so no "
                    "ratio is given.")
    return finish(fig, "variants", "Error per variant", caption)


def _differs_from_paper(ctx: _Ctx) -> list[tuple[str, str]]:
    """Parameters of the bar chart's cell that differ from the paper's setting: (name, paper's value)."""
    have = dict(ctx.ref)
    for k in PAPER_SETTING:
        if k not in have and k in ctx.ds.coords and ctx.ds.coords[k].ndim == 0:
            have[k] = py_value(ctx.ds.coords[k].values)
    return [(SYMBOL.get(k, k), fmt_coord(want)) for k, want in PAPER_SETTING.items()
            if k not in have or not same_value(have[k], want)]


class _NoFamily:
    name, histogram, bulk = "inputs", "", False


def _family(ds: xr.Dataset):
    """The registry entry of the distribution the run drew from (what its histogram says)."""
    from ..data import distributions
    from ..errors import UsageError

    try:
        return distributions.get(str(ds.attrs.get("dist", "")))
    except UsageError:  # several distributions (an ablation), or one no longer registered
        return _NoFamily()


def _inputs_hist(ctx: _Ctx) -> Figure:
    ds = ctx.ds
    h = ds["abs_hist"]
    hue_dim = "p" if "p" in ctx.varying else ("sigma" if "sigma" in ctx.varying else None)
    fix = {d: v for d, v in ctx.ref.items() if d in h.dims and d != hue_dim}
    for d, v in fix.items():
        idx = next(i for i, c in enumerate(ds.coords[d].values) if same_value(py_value(c), v))
        h = h.isel({d: idx})
    h = h.sum("seed") if "seed" in h.dims else h
    first_of = []
    for d in [d for d in h.dims if d not in (hue_dim, "tensor", "abs_bin")]:  # e.g. inputs kept per variant
        if d in h.coords and h.sizes[d] > 1:
            first_of.append(f"{d}={fmt_coord(py_value(h.coords[d].values[0]))}")
        h = h.isel({d: 0})
    # bins [lo_i, lo_{i+1}); datasets before the CF conventions kept the edges in abs_bin_lo
    lo = np.asarray(ds.coords["abs_bin" if "abs_bin" in ds.indexes else "abs_bin_lo"].values, dtype=float)
    # bins [lo_i, lo_{i+1}); the first ([0, 1e-3)) and the open last one cannot sit on a log axis
    edges = lo[1:]
    centers = np.sqrt(edges[:-1] * edges[1:])
    hue_vals = [py_value(v) for v in ds.coords[hue_dim].values] if hue_dim else [None]
    pal = colorblind(max(len(hue_vals), 1))
    fig, axes = new_fig(11, 4.4, 1, 2, sharey=True)
    tensors = [str(t) for t in ds.coords["tensor"].values]
    dist = _family(ds)
    notes = []
    thr_i = int(np.searchsorted(lo, 5.0))
    thr = lo[thr_i] if thr_i < len(lo) else float("inf")
    drawn = False  # a positive count on the log axes (inputs all zero, or all huge, leave none)
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
            drawn = drawn or bool(np.isfinite(y).any())
            label = f"{SYMBOL.get(hue_dim, hue_dim)}={fmt_coord(hv)}" if hue_dim else "sampled entries"
            ax.plot(centers, y, drawstyle="steps-mid", color=pal[k], linewidth=1.6, label=label)
            big = counts[thr_i:].sum() if thr_i < len(counts) else 0.0
            share = f" ({100 * big / total:.3g}%)" if total > 0 else ""
            notes.append(f"{name}{' at ' + label if hue_dim else ''}: {int(big)} of {int(total)} entries"
                         f"{share} have |x| ≥ {thr:.3g}")
        if dist.bulk and total:
            cdf = np.array([math.erf(e / math.sqrt(2)) for e in edges])
            expect = total * np.diff(cdf)
            expect[expect < 0.5] = np.nan
            ax.plot(centers, expect, color="black", linestyle="--", linewidth=1.2,
                    label="N(0,1) bulk alone (expected)")
        ax.axvline(thr, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        if drawn:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no entry lies in the bins drawn\n(every |x| below 1e-3 or beyond the last bin)",
                    transform=ax.transAxes, ha="center", va="center", fontsize=10)
        ax.set_xlabel(f"|{name}| entry magnitude (N(0,1) units), log scale")
        if j == 0:
            ax.set_ylabel("entries per bin (count)" + (", log scale" if drawn else ""))
        ax.set_title(f"|{name}| entries")
        ax.legend(loc="lower left", fontsize=8)
    setting = ", ".join(x for x in (ctx.where(keep=(hue_dim,) if hue_dim else ()), ctx.fixed_text()) if x)
    fig.suptitle(f"Histogram of |Q| and |K|: {dist.name}" + (f"\n{setting}" if setting else ""), fontweight="bold")
    caption = ("Counts of |Q| and |K| entries per logarithmic bin (10 per decade), summed over seeds"
               + (f" (inputs of {', '.join(first_of)})" if first_of else "")
               + (f"; {setting}" if setting else "") + f". {dist.histogram + ' ' if dist.histogram else ''}"
               "Dotted line: |x| = " + f"{thr:.3g}. " + "; ".join(notes) + ".")
    return finish(fig, "inputs_hist", "Histogram of |Q| and |K|", caption)
