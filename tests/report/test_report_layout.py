"""Every kind of report reads on one screen: a verdict box first, no two text boxes of a figure
overlapping (titles, legends, tick labels, axis labels, measured with matplotlib's renderer), no
table wider than the page, and, where headless Chromium is installed, a page no wider than its
screenshot's viewport.

Each kind renders from a real dataset: a small fresh run and sweep, the synthetic ablation, a
fresh audit of a synthetic capture, a validation against the mock kernel, and the committed
backward, impact and recommend datasets (read through their study's reader). The overlap check
hooks ``report.plots._bytes``, through which every figure of every report is saved, and measures
the figure as drawn for its PNG.
"""

from __future__ import annotations

import html as htmllib
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fa3_numerics.testing import run_cli

ROOT = Path(__file__).resolve().parents[2]
PAGE_PX = 1180  # report.html.j2: body max-width
CELL_PX_PER_CHAR = 7.6  # .86em of 16 px in a sans-serif face: the average advance of a character
CELL_PAD_PX = 2 * 0.55 * 13.8 + 1  # th/td padding (.55em each side at .86em) and the border

pytestmark = pytest.mark.slow  # renders a report of every kind


# -- what the checks measure --------------------------------------------------------------------

def _text_boxes(fig):
    """(name, bbox in pixels) of every visible title, axis label, tick label and legend of ``fig``,
    as drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    out = []

    def add(name, artist):
        if artist is not None and artist.get_visible() and (not hasattr(artist, "get_text") or artist.get_text()):
            out.append((name, artist.get_window_extent(r)))

    add("suptitle", fig._suptitle)  # matplotlib keeps it there; there is no getter
    for k, leg in enumerate(fig.legends):
        add(f"figure legend {k}", leg)
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.axison:
            continue
        # the three title slots; matplotlib names only the centre one publicly
        for loc, artist in (("center", ax.title), ("left", ax._left_title), ("right", ax._right_title)):
            add(f"axes {i} title {loc}", artist)
        add(f"axes {i} legend", ax.get_legend())
        for axis, which in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            add(f"axes {i} {which}label", axis.label)
            lo, hi = sorted(axis.get_view_interval())
            for kind, ticks in (("major", axis.get_major_ticks()), ("minor", axis.get_minor_ticks())):
                for t in ticks:
                    loc = t.get_loc()
                    # each bound's own tolerance: on a log axis a span-wide one would admit decades
                    if loc is None or not (lo - 1e-9 * abs(lo) <= loc <= hi + 1e-9 * abs(hi)):
                        continue  # outside the view: not drawn
                    for lab in (t.label1, t.label2):
                        if lab.get_visible() and lab.get_text():
                            out.append((f"axes {i} {which} {kind} tick {lab.get_text()!r}", lab.get_window_extent(r)))
    return out


def text_overlaps(fig, slack: float = 1.0) -> list[str]:
    """Pairs of text boxes of ``fig`` that overlap by more than ``slack`` pixels each way."""
    boxes = _text_boxes(fig)
    bad = []
    for (na, a), (nb, b) in itertools.combinations(boxes, 2):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        if w > slack and h > slack:
            bad.append(f"{na} overlaps {nb} ({w:.0f} x {h:.0f} px)")
    return bad


@pytest.fixture
def overlaps(monkeypatch):
    """Every figure saved while the test runs: {figure title text: overlapping pairs}."""
    from fa3_numerics.report import plots

    found: dict[str, list[str]] = {}
    save = plots._bytes

    def checked(fig, fmt):
        if fmt == "png":
            name = fig._suptitle.get_text() if fig._suptitle else (fig.axes[0].get_title() if fig.axes else "?")
            found[f"{len(found)}: {name}"] = text_overlaps(fig)
        return save(fig, fmt)

    monkeypatch.setattr(plots, "_bytes", checked)
    return found


def _cell_text(cell: str) -> str:
    return htmllib.unescape(re.sub(r"<[^>]+>", "", cell)).strip()


def table_widths(page: str) -> list[tuple[int, float]]:
    """(columns, estimated width in px) of every table of an HTML page: each column as wide as its
    longest body cell (cells do not wrap: white-space nowrap) or its header's longest word
    (headers wrap), plus padding."""
    out = []
    for table in re.findall(r"<table>(.*?)</table>", page, flags=re.S):
        rows = [re.findall(r"<(t[hd])[^>]*>(.*?)</t[hd]>", tr, flags=re.S) for tr in
                re.findall(r"<tr>(.*?)</tr>", table, flags=re.S)]
        ncol = max(len(r) for r in rows)
        widths = [0.0] * ncol
        for r in rows:
            for j, (tag, c) in enumerate(r):
                text = _cell_text(c)
                chars = max((len(w) for w in text.split()), default=0) if tag == "th" else len(text)
                widths[j] = max(widths[j], chars * CELL_PX_PER_CHAR + CELL_PAD_PX)
        out.append((ncol, sum(widths)))
    return out


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def check_page(doc, tmp_path: Path, overlaps: dict, stem: str) -> str:
    """Render ``doc`` to HTML and Markdown; assert the verdict box leads, no figure's text boxes
    overlap, no table is wider than the page. Returns the HTML."""
    from fa3_numerics.report.document import Verdict, render

    assert doc.lead and isinstance(doc.lead[0], Verdict) and doc.lead[0].items, f"{stem}: no verdict box first"
    page = render(doc, "html")
    md = render(doc, "md")
    assert md.split("\n\n", 2)[1].startswith("> **Verdict**"), f"{stem}: the Markdown does not open with the verdict"
    assert page.index('class="verdict"') < page.index("</h1>") + 200
    bad = {k: v for k, v in overlaps.items() if v}
    assert not bad, f"{stem}: overlapping text in figures: {bad}"
    wide = [(n, w) for n, w in table_widths(page) if w > PAGE_PX]
    assert not wide, f"{stem}: tables wider than the {PAGE_PX} px page (columns, px): {wide}"
    (tmp_path / f"{stem}.html").write_text(page)
    return page


# -- a report of every kind ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_ds():
    from fa3_numerics.studies.outliers import load_experiment, run_experiment

    exp = load_experiment("outliers", {"p": [0.001, 0.01], "sigma": [10.0, 30.0], "seqlen": [64, 128], "heads": 2,
                                       "batch": 1, "rows": 16, "seeds": [0, 1],
                                       "variants": ["fa3-fp8", "baseline-fp8", "fa3-fp16", "fa3-fp8-kernel"]})
    return run_experiment(exp, progress=lambda m: None)


def test_run_report(run_ds, tmp_path, overlaps):
    from fa3_numerics.report.run import run_report_document

    doc = run_report_document(run_ds)
    assert len(overlaps) >= 3  # variants, seqlen, heatmaps (and the histogram)
    page = check_page(doc, tmp_path, overlaps, "run")
    verdict = " ".join(doc.lead[0].items)
    # the best low-precision recipe, not the 16-bit one, and its cost against FP16
    assert "Use `fa3-fp16`" not in verdict and "**Use `" in verdict and "the error of `fa3-fp16`" in verdict
    assert "BCa" in verdict
    assert "<strong>Use <code>" in page


def test_ablation_report(synthetic_ablation, tmp_path, overlaps):
    from fa3_numerics.report.ablation import ablation_document

    ds = synthetic_ablation(noise=0.02)
    ds.attrs.update({"description": "synthetic", "designs": "{}", "base_recipe": "fa3-fp8-kernel"})
    ds = ds.assign_coords(heads=4, batch_size=1, rows=16)
    doc, _ = ablation_document(ds, n_boot=100)
    assert len(overlaps) >= 4
    check_page(doc, tmp_path, overlaps, "ablation")
    assert any("What matters most" in x for x in doc.lead[0].items)


def test_audit_report(tmp_path, capsys, overlaps):
    pytest.importorskip("safetensors")
    from fa3_numerics.studies.findings import read
    from fa3_numerics.testing import write_capture

    write_capture(tmp_path / "c.safetensors", layers=(0, 1), tokens=96)
    code, _, err = run_cli(["audit", str(tmp_path / "c.safetensors"), "--rows", "32", "--budget", "0.001",
                            "--variants", "fa3-fp8,fa3-fp8-no-block-quant,baseline-fp8", "--out",
                            str(tmp_path / "out")], capsys)
    assert code == 0, err
    from fa3_numerics.report.audit import settings_document

    overlaps.clear()
    doc = settings_document(read(tmp_path / "out" / "audit.nc"))
    check_page(doc, tmp_path, overlaps, "audit")
    # a budget nothing meets: the verdict says so and names the closest variant
    verdict = " ".join(doc.lead[0].items)
    assert "No audited variant meets the budget" in verdict and "the closest" in verdict


def test_validation_report(tmp_path, capsys, overlaps):
    from fa3_numerics.report.validation import validation_document
    from fa3_numerics.studies.findings import read

    code, _, err = run_cli(["validate", "--grid", "tiny", "--backend", "fa3-mock", "--device", "cpu", "--acc",
                            "fp32,fp22", "--out", str(tmp_path / "v")], capsys)
    assert code == 0, err
    overlaps.clear()
    doc = validation_document(read(tmp_path / "v" / "validation.nc"))
    check_page(doc, tmp_path, overlaps, "validation")
    assert re.match(r"\*\*(PASS|FAIL)\*\*", doc.lead[0].items[0])


@pytest.mark.parametrize("kind, rel", [("impact", "reports/impact-smollm2/impact.nc"),
                                       ("recommend", "reports/recommend-smollm2/recommend.nc"),
                                       ("backward", "reports/backward/k-bias/backward.nc")])
def test_committed_study_reports(kind, rel, tmp_path, overlaps):
    from fa3_numerics.studies.findings import read

    ds = read(ROOT / rel)
    if kind == "impact":
        from fa3_numerics.report.impact import impact_document as document
    elif kind == "recommend":
        from fa3_numerics.report.recommend import recommend_document as document
    else:
        from fa3_numerics.report.backward import backward_document as document
    check_page(document(ds), tmp_path, overlaps, kind)


def test_compare_report(run_ds, tmp_path, overlaps):
    from fa3_numerics.report.compare import compare_document
    from fa3_numerics.studies.compare import compare

    b = run_ds.copy()
    b["rmse"] = b["rmse"] * 1.2  # a planted 20% regression
    doc = compare_document(compare(run_ds, b), run_ds, b, "a.nc", "b.nc")
    check_page(doc, tmp_path, overlaps, "compare")
    assert doc.lead[0].items[0].startswith("**B is worse than A**")


# -- the checks catch what they look for ----------------------------------------------------------

def test_the_overlap_check_finds_a_legend_on_a_title():
    """Negative control: a legend placed over the title is reported; moved below, it is not."""
    from matplotlib.figure import Figure

    def draw(where):
        fig = Figure(figsize=(5, 3), layout="constrained")
        ax = fig.subplots()
        ax.plot([1, 2], [1, 2], label="a line with a long legend label")
        fig.suptitle("A title across the top of the figure")
        fig.legend(loc=where)
        return fig

    assert any("suptitle" in x and "legend" in x for x in text_overlaps(draw("upper center")))
    assert not text_overlaps(draw("outside lower center"))


def test_the_width_check_finds_a_wide_table():
    from fa3_numerics.report.document import Document, Section, Table, render

    wide = Table([f"column {i}" for i in range(12)], [["0.000123 [0.000101, 0.000145]"] * 12])
    narrow = Table(["a", "b"], [["1", "2"]])
    (w_cols, w_px), (n_cols, n_px) = table_widths(render(Document("t", [], [Section("s", [wide, narrow])]), "html"))
    assert (w_cols, n_cols) == (12, 2) and w_px > PAGE_PX > n_px


def test_page_width_in_headless_chromium(run_ds, tmp_path):
    """The rendered page, screenshot at the page's width: nothing wider than the viewport (a
    wider table scrolls inside its box; the page itself must not)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium): the page-width screenshot "
                    "check needs it")
    from PIL import Image

    from fa3_numerics.report import render_report

    render_report(run_ds, tmp_path / "r")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1400,3000", (tmp_path / "r" / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    img = Image.open(shot).convert("L")
    w, h = img.size
    assert w == 1400
    # the right margin (outside the page's 1180 px body) holds no ink: nothing spills over it
    margin = img.crop((1180 + (1400 - 1180) // 2 + 10, 0, w, h))
    assert margin.getextrema()[0] > 200, "content reaches past the page's right edge"
