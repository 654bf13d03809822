"""Tests of the report (figures, self-contained HTML, Markdown) and `fa3-numerics report`.

One small 3 p x 3 sigma x 2 seqlen sweep is run once through the CLI (which renders the
report as `run` does); tests then parse and re-render it. Shapes are tiny (seqlen 64/128,
2 heads, 16 query rows, 2 variants), so the module takes seconds.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fa3_numerics.cli import main
from fa3_numerics.engine.dataset import read
from fa3_numerics.report import figure_plan, render_report

TINY = ["--batch", "1", "--heads", "2", "--rows", "16", "--variants", "baseline-fp8,fa3-fp8"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.slow  # end-to-end runs and rendered reports


def _run(out: Path, *extra) -> Path:
    with pytest.raises(SystemExit) as exc:
        main(["run", "outliers", *TINY, *extra, "--out", str(out)])
    assert (exc.value.code or 0) == 0
    return out / "outliers.nc"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    return _run(out, "--p", "0,0.001,0.01", "--sigma", "3,10,30", "--seqlen", "64,128")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    return _run(out, "--seqlen", "64")


class _Audit(HTMLParser):
    """Collects img sources and every URL-bearing attribute and tag of an HTML page."""

    def __init__(self):
        super().__init__()
        self.imgs: list[str] = []
        self.urls: list[tuple[str, str, str]] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for k, v in attrs:
            if tag == "img" and k == "src":
                self.imgs.append(v or "")
            if k in ("src", "href", "srcset", "action", "poster", "data", "formaction") and v is not None:
                self.urls.append((tag, k, v))


def _audit(path: Path) -> tuple[_Audit, str]:
    text = path.read_text(encoding="utf-8")
    a = _Audit()
    a.feed(text)
    return a, text


def test_sweep_report_has_heatmaps_and_seqlen_trend(sweep):
    ds = read(sweep)
    plan = figure_plan(ds)
    assert plan == ["variants", "seqlen", "heatmap_p_sigma", "inputs_hist"]
    out = sweep.parent
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    for name in plan:
        png = (out / "figures" / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC)
        svg = (out / "figures" / f"{name}.svg").read_text()  # SVG beside every PNG, text kept as text
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "</svg>" in svg


def test_sweep_report_leads_with_headlines_and_a_pivot(sweep):
    """The first screen: headlines per swept dim, then a pivot of variants against cells; the
    long table of every cell comes after the figures, collapsed in the HTML."""
    md = (sweep.parent / "report.md").read_text()
    for dim in ("p 0 → 0.01", "σ 3 → 30", "seqlen 64 → 128"):
        assert f"**Along {dim}" in md, dim
    assert "**Best and worst**" in md
    glance = md.index("## RMSE at a glance")
    assert glance < md.index("## Figures") < md.index("## RMSE against the float64 reference, every cell")
    pivot = md[glance:md.index("## Figures")]
    header = next(line for line in pivot.splitlines() if line.startswith("| variant | seqlen="))
    assert header == "| variant | seqlen=64 | seqlen=128 |"
    # each pivot column has exactly one best value in bold
    rows = [line.split(" | ") for line in pivot.splitlines() if line.startswith("| `")]
    assert rows and all(sum("**" in r[i] for r in rows[:2]) >= 1 for i in (1, 2))
    html = (sweep.parent / "report.html").read_text()
    assert html.index("<details>") > html.index("fig-inputs_hist")  # the long table after every figure


def test_one_number_format_per_column(sweep):
    """Within a column every number is plain or every number is scientific, never both."""
    md = (sweep.parent / "report.md").read_text()
    table = md[md.index("## RMSE against the float64 reference, every cell"):md.index("## Provenance")]
    lines = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "`" in line]
    for col in (4, 5):  # rmse and its interval
        cells = " ".join(r[col] for r in lines)
        assert not ("e-0" in cells and re.search(r"(?<![e\d-])0\.0\d", cells)), cells[:300]


def test_html_is_self_contained(sweep):
    ds = read(sweep)
    audit, text = _audit(sweep.parent / "report.html")
    # every figure is an embedded PNG, one per planned figure
    assert len(audit.imgs) == len(figure_plan(ds))
    for src in audit.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1], validate=True).startswith(PNG_MAGIC)
    # nothing to fetch: only data: URLs and in-page anchors (the contents), no scripts,
    # stylesheets or frames
    assert all(v.startswith("data:") or (t == "a" and v.startswith("#")) for t, _, v in audit.urls), audit.urls
    assert not audit.tags & {"script", "link", "iframe", "object", "embed", "base"}
    assert not re.search(r"https?://|//cdn|url\(", text, flags=re.I)


def test_report_says_where_and_how(sweep):
    ds = read(sweep)
    for name in ("report.md", "report.html"):
        text = (sweep.parent / name).read_text(encoding="utf-8")
        assert ds.attrs["device_name"] in text
        assert "Where it ran" in text and "Command" in text
        assert "0.001" in text and "seqlen" in text
    md = (sweep.parent / "report.md").read_text()
    assert ds.attrs["command"] in md
    for name in figure_plan(ds):
        assert f"(figures/{name}.png)" in md


def test_report_command_remakes_the_run_report(sweep, tmp_path, cli):
    rc, out, err = cli("report", sweep, "--out", tmp_path)
    assert rc == 0, err
    src = sweep.parent
    files = ["summary.md", "report.md", "report.html"] + [f"figures/{n}.{e}" for n in figure_plan(read(sweep))
                                                          for e in ("png", "svg")]
    for rel in files:
        assert (tmp_path / rel).read_bytes() == (src / rel).read_bytes(), rel
    # the final line lists every file written, and only those
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"wrote {len(files)} file(s): ")
    assert sorted(last.split(": ", 1)[1].split(", ")) == sorted(str(tmp_path / f) for f in files)


def test_single_cell_figures_and_formats(single, tmp_path, cli):
    ds = read(single)
    assert figure_plan(ds) == ["variants", "inputs_hist"]
    rc, _, err = cli("report", single, "--out", tmp_path / "h", "--format", "html")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["report.html"]
    audit, _ = _audit(tmp_path / "h" / "report.html")
    assert len(audit.imgs) == 2
    rc, _, err = cli("report", single, "--out", tmp_path / "m", "--format", "md")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["figures", "report.md", "summary.md"]
    assert sorted(p.name for p in (tmp_path / "m" / "figures").iterdir()) == [
        "inputs_hist.png", "inputs_hist.svg", "variants.png", "variants.svg"]


def test_render_report_returns_written_files(single, tmp_path):
    paths = render_report(read(single), tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in paths} == {
        "summary.md", "report.md", "report.html", "figures/variants.png", "figures/inputs_hist.png",
        "figures/variants.svg", "figures/inputs_hist.svg"}
    assert not list(tmp_path.rglob("*.tmp"))


def test_every_run_has_a_headline_and_few_samples_are_flagged(single):
    """A run outside the paper's setting still says what it found; its 2 samples per cell are
    fewer than 8, which the report says at the top and marks on every interval."""
    md = (single.parent / "report.md").read_text()
    head = md[:md.index("## Figures")]
    assert "**Best and worst**" in head and "**Few samples.**" in head
    assert "†" in md[md.index("## RMSE against"):]


@pytest.mark.parametrize("case", ["missing", "text", "other_netcdf", "empty_format", "bad_format"])
def test_report_bad_input_is_one_line_exit_2(case, single, tmp_path, cli):
    import xarray as xr

    target = tmp_path / "x.nc"
    extra = []
    if case == "text":
        target.write_text("not a dataset\n")
    elif case == "other_netcdf":
        xr.Dataset({"a": ("x", [1.0, 2.0])}).to_netcdf(target, engine="h5netcdf")
    elif case in ("empty_format", "bad_format"):
        target = single
        extra = ["--format", "," if case == "empty_format" else "pdf"]
    rc, out, err = cli("report", target, "--out", tmp_path / "o", *extra)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not (tmp_path / "o").exists()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless check needs chromium (apt-get install chromium); "
                                             "run with -ra to see this reason in the summary")
def test_html_loads_every_figure_in_headless_chromium(sweep, tmp_path):
    """Chromium loads the page offline; a copy with a probe script reports decoded images."""
    html = (sweep.parent / "report.html").read_text(encoding="utf-8")
    probe = ("<script>window.addEventListener('load', () => { const i = [...document.images]; "
             "document.title = 'loaded ' + i.filter(x => x.complete && x.naturalWidth > 0).length + ' of ' + i.length; });"
             "</script></body>")
    page = tmp_path / "probe.html"
    page.write_text(html.replace("</body>", probe), encoding="utf-8")
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    n = len(figure_plan(read(sweep)))
    assert f"<title>loaded {n} of {n}</title>" in res.stdout, res.stdout[:300] + res.stderr[-500:]


def test_figure_plan_follows_the_dims(single):
    """Which figures a dataset gets depends only on its swept dims (no rendering here)."""
    import numpy as np

    ds = read(single)
    rmse = ds["rmse"]

    def swept(**dims):
        r = rmse
        for d, vals in reversed(list(dims.items())):
            r = r.drop_vars(d, errors="ignore").expand_dims({d: vals})
        return ds.drop_vars(list(dims), errors="ignore").drop_vars("abs_hist").assign(rmse=r)

    assert figure_plan(swept(seqlen=[64, 128])) == ["variants", "seqlen"]
    assert figure_plan(swept(p=[0.0, 0.01])) == ["variants", "vs_p"]
    assert figure_plan(swept(p=[0.0, 0.01], sigma=[3.0, 10.0])) == ["variants", "heatmap_p_sigma"]
    assert figure_plan(swept(head_dim=[64, 128], causal=[True, False])) == ["variants", "vs_head_dim", "vs_causal"]
    assert figure_plan(swept(sigma=np.array([3.0, 10.0]), seqlen=[64, 128])) == ["variants", "seqlen", "vs_sigma"]
