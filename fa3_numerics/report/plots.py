"""What every report figure shares: the theme, a figure without pyplot state, PNG and SVG bytes.

Exposed: ``Figure``, ``DPI``, ``theme``, ``colorblind``, ``new_fig``, ``finish``, ``plain_ticks``.

Figures are drawn on ``matplotlib.figure.Figure`` (Agg canvas, no pyplot state, so nothing leaks
between reports) and saved as PNG (embedded in the HTML) and SVG (beside it, for print and zoom)
without timestamps, so the same dataset always gives the same bytes. The theme switches off
matplotlib's offset notation: an axis of values near 1 would otherwise read "+1" and ticks of
0.001 and 0.002, which is how an interval around a ratio of 1 was shown before.
"""

from __future__ import annotations

import dataclasses
import io
import re

DPI = 100


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str  # file stem: <name>.png and <name>.svg
    title: str
    caption: str
    png: bytes
    svg: bytes = b""
    alt: str = ""  # alternative text (default: the title)


# seaborn 0.13's ``set_theme(context, style="whitegrid", palette="colorblind", font_scale)``,
# written out: drawing a run's report then imports no seaborn, whose import brings pyplot,
# scipy.cluster and its plotting modules (0.8 s of the 15 s `run outliers` on the H200 machine).
# The figures are the same bytes as with seaborn's own theme (seaborn 0.13.2). Reports that draw
# with seaborn (heatmaps) still import it themselves.
COLORBLIND = ("#0173B2", "#DE8F05", "#029E73", "#D55E00", "#CC78BC", "#CA9161", "#FBAFE4", "#949494", "#ECE133",
              "#56B4E9")
_WHITEGRID = {
    "figure.facecolor": "white", "axes.labelcolor": ".15", "xtick.direction": "out", "ytick.direction": "out",
    "xtick.color": ".15", "ytick.color": ".15", "axes.axisbelow": True, "grid.linestyle": "-", "text.color": ".15",
    "font.family": "sans-serif",
    "font.sans-serif": ["Arial", "DejaVu Sans", "Liberation Sans", "Bitstream Vera Sans", "sans-serif"],
    "lines.solid_capstyle": "round", "patch.edgecolor": "w", "patch.force_edgecolor": True, "xtick.top": False,
    "ytick.right": False, "axes.grid": True, "axes.facecolor": "white", "axes.edgecolor": ".8", "grid.color": ".8",
    "axes.spines.left": True, "axes.spines.bottom": True, "axes.spines.right": True, "axes.spines.top": True,
    "xtick.bottom": False, "ytick.left": False,
}
_CONTEXT = {  # seaborn's "notebook" sizes; other contexts scale them, fonts scale by font_scale too
    "axes.linewidth": 1.25, "grid.linewidth": 1, "lines.linewidth": 1.5, "lines.markersize": 6, "patch.linewidth": 1,
    "xtick.major.width": 1.25, "ytick.major.width": 1.25, "xtick.minor.width": 1, "ytick.minor.width": 1,
    "xtick.major.size": 6, "ytick.major.size": 6, "xtick.minor.size": 4, "ytick.minor.size": 4, "font.size": 12,
    "axes.labelsize": 12, "axes.titlesize": 12, "xtick.labelsize": 11, "ytick.labelsize": 11, "legend.fontsize": 11,
    "legend.title_fontsize": 12,
}
_FONT_KEYS = ("font.size", "axes.labelsize", "axes.titlesize", "xtick.labelsize", "ytick.labelsize",
              "legend.fontsize", "legend.title_fontsize")
_SCALING = {"paper": 0.8, "notebook": 1, "talk": 1.5, "poster": 2}
# seaborn's color codes: "b", "g", "r", "m", "y", "c" from its colorblind6 palette, "k" dark grey.
_CODES = dict(zip("bgrmyck", ("#0173B2", "#029E73", "#D55E00", "#CC78BC", "#ECE133", "#56B4E9", (0.1, 0.1, 0.1))))


def colorblind(n: int = len(COLORBLIND)) -> list[tuple[float, float, float]]:
    """seaborn's ``color_palette("colorblind", n)``: RGB tuples, repeating after 10."""
    from matplotlib.colors import to_rgb

    return [to_rgb(COLORBLIND[i % len(COLORBLIND)]) for i in range(n)]


def theme(context: str = "notebook", font_scale: float = 0.95) -> None:
    """seaborn's whitegrid/colorblind theme plus the rcParams every report figure shares (call
    inside rc_context)."""
    import matplotlib as mpl
    from matplotlib.colors import colorConverter, to_rgb

    # set_context, set_style, set_palette in seaborn's order and arithmetic (same floats)
    ctx = {k: v * _SCALING[context] for k, v in _CONTEXT.items()}
    ctx.update({k: ctx[k] * font_scale for k in _FONT_KEYS})
    mpl.rcParams.update(ctx)
    style = dict(_WHITEGRID)
    if "rocket" in mpl.colormaps:  # seaborn's default colormap, registered once seaborn is imported
        style["image.cmap"] = "rocket"
    mpl.rcParams.update(style)
    mpl.rcParams["axes.prop_cycle"] = mpl.cycler("color", colorblind())
    for code, color in _CODES.items():  # global, as seaborn's set_color_codes
        colorConverter.colors[code] = to_rgb(color)
    mpl.rcParams.update({
        "svg.hashsalt": "fa3", "svg.fonttype": "none",  # stable ids; text stays text in the SVG
        "figure.dpi": DPI, "savefig.dpi": DPI, "axes.titleweight": "bold",
        "legend.frameon": True, "legend.framealpha": 0.9,
        "axes.formatter.useoffset": False,  # no "+1" offset labels
        "axes.formatter.limits": (-4, 5),  # plain numbers from 1e-4 to 1e5 on linear axes
    })


def new_fig(w: float, h: float, nrows: int = 1, ncols: int = 1, **kw):
    """(figure, axes[nrows, ncols]) with constrained layout, outside pyplot."""
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(w, h), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _bytes(fig, fmt: str) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    meta = {"Software": None} if fmt == "png" else {"Date": None, "Creator": None}
    fig.savefig(buf, format=fmt, dpi=DPI, metadata=meta, bbox_inches="tight", pad_inches=0.08)
    return buf.getvalue()


_DECADE = re.compile(r"^\$\\mathdefault\{10\^\{([-\u2212]?\d+)\}\}\$$")  # LogFormatterSciNotation's 10^n
_SUP = str.maketrans("-\u22120123456789", "\u207b\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")


def _lighten_log_axes(fig) -> None:
    """Spare log axes the work that draws nothing: minor ticks with no mark (the whitegrid theme
    hides tick marks), no grid line and no label (the default log formatter labels no minor tick
    once an axis spans more than a decade) are dropped, and decade labels skip mathtext. On the
    input histogram (two log-log panels) this took the figure from 1.4 s to 0.5 s; the PNG shows
    the same ticks, labels and grid."""
    import matplotlib as mpl
    from matplotlib.ticker import Formatter, LogFormatterSciNotation, NullFormatter, NullLocator

    class DecadeLabels(Formatter):
        """The default log formatter with its 10^n labels as plain text with superscript digits
        ("10⁻³"), not mathtext: parsing mathtext cost about a fifth of a log-scaled figure's
        drawing. Which labels are shown or hidden stays the inner formatter's decision."""

        def __init__(self, inner):
            self.inner = inner

        def set_axis(self, axis):
            super().set_axis(axis)
            self.inner.set_axis(axis)

        def set_locs(self, locs):
            super().set_locs(locs)
            self.inner.set_locs(locs)

        def get_offset(self):
            return self.inner.get_offset()

        def __call__(self, x, pos=None):
            label = self.inner(x, pos)
            m = _DECADE.match(label) if isinstance(label, str) else None
            return "10" + m.group(1).translate(_SUP) if m else label

    rc = mpl.rcParams
    for ax in fig.axes:
        for axis, marks in ((ax.xaxis, ("xtick.bottom", "xtick.top")), (ax.yaxis, ("ytick.left", "ytick.right"))):
            if axis.get_scale() != "log":
                continue
            major = axis.get_major_formatter()
            if type(major) is LogFormatterSciNotation:
                axis.set_major_formatter(DecadeLabels(major))
            kw = axis._minor_tick_kw  # what set_tick_params / grid(which="minor") asked of minor ticks
            lo, hi = sorted(axis.get_view_interval())
            unlabelled = isinstance(axis.get_minor_formatter(), NullFormatter) or (
                type(axis.get_minor_formatter()) is LogFormatterSciNotation and lo > 0 and hi / lo > 20)
            invisible = (not any(rc[k] for k in marks) and not kw.get("tick1On") and not kw.get("tick2On")
                         and rc["axes.grid.which"] == "major" and not kw.get("gridOn"))
            if unlabelled and invisible:
                axis.set_minor_locator(NullLocator())


def finish(fig, name: str, title: str, caption: str, alt: str = "") -> Figure:
    """The drawn ``fig`` as a ``Figure`` with PNG and SVG bytes."""
    _lighten_log_axes(fig)
    png = _bytes(fig, "png")
    # Drawing the PNG placed every axes (the constrained layout); the SVG keeps that placement
    # instead of solving the layout again, which cost a third of the figure's time (the PNG is
    # unchanged; the SVG's layout is the PNG's, from Agg's text metrics).
    fig.set_layout_engine("none")
    return Figure(name, title, caption, png, _bytes(fig, "svg"), alt or title)


def plain_ticks(ax, axis: str = "y", minor: bool = False) -> None:
    """Readable tick labels on a log axis that spans at most four decades, in plain numbers
    (0.02, 0.05 rather than 2 x 10^-2: 3 significant digits), never a single label:

    - less than about a decade and a half (ratios near 1, one decade of RMSE): evenly spaced
      round values (0.9, 1, 1.1; or 2e-3, 4e-3, 6e-3), at least three of them;
    - up to four decades: 1, 2 and 5 of each decade (1 and 3 past two decades).

    A wider axis keeps matplotlib's 10^n labels: one format for all ticks, where plain numbers
    would mix 1e-05 with 0.0001. ``minor`` is accepted for callers that asked for minor labels
    on narrow axes; the rules above label every axis that spans less than four decades."""
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

    target = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    lo, hi = min(lo, hi), max(lo, hi)
    if not (0 < lo < hi) or hi / lo > 1e4 or lo < 1e-6:
        return
    decades = math.log10(hi / lo)
    sig = FuncFormatter(lambda v, _: f"{v:.3g}")
    if decades < 1.2:
        for nbins in (4, 6, 8, 10):
            locs = [v for v in MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
                    if lo <= v <= hi and v > 0]
            if len(locs) >= 3:
                break
        target.set_major_locator(FixedLocator(locs))
    else:
        subs = (1.0, 2.0, 5.0) if decades <= 2.2 else (1.0, 3.0)
        target.set_major_locator(LogLocator(base=10, subs=subs))
    target.set_major_formatter(sig)
    target.set_minor_locator(NullLocator())
    target.set_minor_formatter(NullFormatter())


def spread_labels(fig, labels, step_pt: float = 8.0, tries: int = 12) -> None:
    """Move point labels (``Annotation``s in offset points) down, then up, a step at a time until
    none overlaps a label placed before it: labels of points that cluster (verified assignments
    of nearly the same cost and KL) would print on one another."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    placed = []
    for lab in labels:
        x0, y0 = lab.xyann
        for k in range(tries + 1):
            dy = step_pt * ((k + 1) // 2) * (-1 if k % 2 else 1)
            lab.xyann = (x0, y0 + dy)
            box = lab.get_window_extent(r)
            if not any(box.overlaps(b) for b in placed):
                break
        placed.append(lab.get_window_extent(r))


def colorbar_ticks(cb) -> None:
    """A log colour bar labelled as ``plain_ticks`` labels a log axis: a few round values in
    plain numbers, no crowded minor labels (over a narrow range the default labels every minor
    tick in scientific notation, one on top of the next)."""
    import math

    from matplotlib.ticker import LogLocator, MaxNLocator

    lo, hi = (float(cb.norm.vmin), float(cb.norm.vmax)) if cb.norm is not None else (0.0, 0.0)
    if not (0 < lo < hi) or hi / lo > 1e4 or getattr(cb.norm, "__class__", type).__name__ != "LogNorm":
        return
    decades = math.log10(hi / lo)
    if decades < 1.2:
        locs = []
        for nbins in (4, 6, 8):
            locs = [v for v in MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi) if lo <= v <= hi]
            if len(locs) >= 3:
                break
    else:
        subs = (1.0, 2.0, 5.0) if decades <= 2.2 else (1.0, 3.0)
        locs = [v for v in LogLocator(base=10, subs=subs).tick_values(lo, hi) if lo <= v <= hi]
    cb.minorticks_off()
    cb.set_ticks(locs, labels=[f"{v:.3g}" for v in locs])


__all__ = ["Figure", "DPI", "theme", "colorblind", "COLORBLIND", "new_fig", "finish", "plain_ticks", "colorbar_ticks",
           "spread_labels"]
