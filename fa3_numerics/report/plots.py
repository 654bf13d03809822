"""What every report figure shares: the theme, a figure without pyplot state, PNG and SVG bytes.

Exposed: ``Figure``, ``DPI``, ``theme``, ``new_fig``, ``finish``, ``plain_ticks``.

Figures are drawn on ``matplotlib.figure.Figure`` (Agg canvas, no pyplot state, so nothing leaks
between reports) and saved as PNG (embedded in the HTML) and SVG (beside it, for print and zoom)
without timestamps, so the same dataset always gives the same bytes. The theme switches off
matplotlib's offset notation: an axis of values near 1 would otherwise read "+1" and ticks of
0.001 and 0.002, which is how an interval around a ratio of 1 was shown before.
"""

from __future__ import annotations

import dataclasses
import io

DPI = 100


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str  # file stem: <name>.png and <name>.svg
    title: str
    caption: str
    png: bytes
    svg: bytes = b""
    alt: str = ""  # alternative text (default: the title)


def theme(context: str = "notebook", font_scale: float = 0.95) -> None:
    """seaborn's theme plus the rcParams every report figure shares (call inside rc_context)."""
    import matplotlib as mpl
    import seaborn as sns

    sns.set_theme(context=context, style="whitegrid", palette="colorblind", font_scale=font_scale)
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


def finish(fig, name: str, title: str, caption: str, alt: str = "") -> Figure:
    """The drawn ``fig`` as a ``Figure`` with PNG and SVG bytes."""
    return Figure(name, title, caption, _bytes(fig, "png"), _bytes(fig, "svg"), alt or title)


def plain_ticks(ax, axis: str = "y", minor: bool = False) -> None:
    """Plain tick labels on a log axis that spans at most four decades (0.02, 0.05 rather than
    2 x 10^-2: 3 significant digits), minor labels only where it spans less than a factor of 6
    (more crowd a decade). A wider axis keeps matplotlib's 10^n labels: one format for all ticks,
    where plain numbers would mix 1e-05 with 0.0001."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
    target = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    if not (0 < lo < hi) or hi / lo > 1e4 or lo < 1e-4:
        return
    target.set_major_formatter(fmt)
    target.set_minor_formatter(fmt if minor and hi < 2.5 * lo else NullFormatter())


__all__ = ["Figure", "DPI", "theme", "new_fig", "finish", "plain_ticks"]
