"""Render the committed reports again from their datasets, with today's code.

    python tools/rerender_reports.py            # every report below
    python tools/rerender_reports.py ablation   # the jobs whose path contains "ablation"

Each dataset is read through its study's reader (``fa3_numerics.studies.findings.read``), which
computes the findings of a dataset written before findings were stored in datasets; the files
themselves are not rewritten. Pages written by the H200 device scripts (``reports/h200/report.md``,
``reports/h200/triton/report.md``, ``reports/h200/triton/validation/report.md``) are not
re-rendered (they hold device measurements beyond the datasets): the verdicts of their datasets
are put at the top, in place of an earlier verdict block.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(nc: Path) -> list[Path]:
    from fa3_numerics.report import render_report
    from fa3_numerics.studies.findings import read

    return render_report(read(nc), nc.parent)


def _ablation(nc: Path) -> list[Path]:
    from fa3_numerics.report.ablation import render_report
    from fa3_numerics.studies.findings import read

    return [render_report(read(nc), nc.parent, dataset_path=str(nc.relative_to(ROOT)))]


def _audit(nc: Path) -> list[Path]:
    from fa3_numerics.report.audit import settings_document
    from fa3_numerics.report.document import write_document
    from fa3_numerics.studies.findings import read

    return write_document(settings_document(read(nc)), nc.parent, stem="audit", figure_dir="")


def _validation_md(nc: Path) -> list[Path]:
    from fa3_numerics.report.validation import write_validation
    from fa3_numerics.studies.findings import read

    return [write_validation(read(nc), nc.parent, formats=("md",))]


def _backward(nc: Path) -> list[Path]:
    from fa3_numerics.engine.files import atomic_write
    from fa3_numerics.report.backward import markdown_report
    from fa3_numerics.studies.findings import read

    return [atomic_write(nc.parent / "report.md", markdown_report(read(nc)))]


def _impact(nc: Path, out: Path | None = None) -> list[Path]:
    from fa3_numerics.report.impact import render_impact
    from fa3_numerics.studies.findings import read

    return render_impact(read(nc), out or nc.parent)


def _recommend(nc: Path) -> list[Path]:
    from fa3_numerics.report.recommend import render_recommend
    from fa3_numerics.studies.findings import read

    return render_recommend(read(nc), nc.parent)


def _verdict_on_top(page: Path, datasets: list[tuple[str, Path]]) -> list[Path]:
    """``page`` (a device script's Markdown) with its datasets' verdicts as a box under its title."""
    from fa3_numerics.engine.files import atomic_write
    from fa3_numerics.report.document import Document, Verdict, render
    from fa3_numerics.report.stored import findings_of
    from fa3_numerics.studies.findings import read

    from fa3_numerics.engine.dataset import read as read_dataset
    from fa3_numerics.studies.findings import upgrade

    items = []
    for what, nc in datasets:
        ds = read_dataset(nc)
        # a device script's validation of several kernels: one verdict per kernel
        parts = [(f" [{k}]", ds.sel(kernel=k).assign_attrs(kernel_label=str(k))) for k in ds["kernel"].values] \
            if "kernel" in ds.dims else [("", read(nc))]
        for tag, sub in parts:
            f = findings_of(upgrade(sub, "validation") if tag else sub)
            lines = (f.get("verdict") or {}).get("lines") or []
            items += [f"{what}{tag} (`{nc.relative_to(page.parent)}`): {lines[0]}"] + lines[1:]
    lines = page.read_text().split("\n")
    i = 1  # past the title: blank lines and an earlier verdict box (quoted lines) are replaced
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(">")):
        i += 1
    box = render(Document("", [Verdict(items)]), "md").split("\n", 1)[1].strip("\n")
    return [atomic_write(page, "\n".join([lines[0], "", box, ""] + lines[i:]))]


R = ROOT / "reports"
JOBS = [
    *[(nc, _run) for nc in sorted([R / "outliers/default/outliers.nc", R / "outliers/sweep/outliers.nc",
                                   *(R / "recipes/runs").glob("*/outliers.nc")])],
    (R / "audit-smollm2/audit.nc", _audit), (R / "audit-smollm2/all-rows/audit.nc", _audit),
    (R / "recipes/smollm2/audit.nc", _audit),
    *[(nc, _validation_md) for nc in sorted((R / "h200/sage1").glob("*/validation.nc"))],
    *[(nc, _backward) for nc in sorted((R / "backward").glob("*/backward.nc"))],
    (R / "impact-smollm2/impact.nc", _impact),
    (R / "h200/impact/impact_emulate.nc", lambda nc: _impact(nc, nc.parent / "emulate")),
    (R / "h200/impact/impact_fa3.nc", lambda nc: _impact(nc, nc.parent / "fa3")),
    (R / "recommend-smollm2/recommend.nc", _recommend), (R / "recommend-smollm2-vllm/recommend.nc", _recommend),
    (R / "h200/report.md", lambda p: _verdict_on_top(p, [("Table 3 on the H200", p.parent / "table3_hardware.nc"),
                                                         ("Validation", p.parent / "validation.nc")])),
    (R / "h200/triton/report.md", lambda p: _verdict_on_top(p, [("Table 3 on the Triton kernels",
                                                                 p.parent / "table3_hardware.nc")])),
    (R / "h200/triton/validation/report.md", lambda p: _verdict_on_top(p, [("Validation", p.parent /
                                                                            "validation.nc")])),
    (R / "ablation/ablation.nc", _ablation),
]


def main(argv: list[str]) -> int:
    for path, job in JOBS:
        if argv and not any(a in str(path) for a in argv):
            continue
        t0 = time.perf_counter()
        written = job(path)
        print(f"{path.relative_to(ROOT)}: {len(written)} file(s) in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
