"""The report of `validate --backward`: the emulated backward against a kernel's, case by case.

Exposed: ``validation_backward_document``, ``render_validation_backward``, ``verdict``, ``markdown_body``.

Reads only the dataset (``studies.validate_backward``): its ``findings`` attribute (max and median F
per mode and gradient, the cases above the bar) and its variables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..text import md_code, md_text
from .document import Bullets, Document, Para, Section, Table, Verdict, write_document


def _summary(ds) -> dict:
    return json.loads(ds.attrs.get("findings", "{}"))


def verdict(ds) -> list[str]:
    """Per mode: does every gradient meet the bar, and the worst case of each that does not."""
    lim = float(ds.attrs.get("f_limit", 0.01))
    modes = json.loads(ds.attrs.get("modes", "{}"))
    lines = []
    for mode, row in _summary(ds).items():
        bad = {g: r for g, r in row.items() if r["above"]}
        cases = max(r["cases"] for r in row.values())
        head = f"{md_code(mode)} ({md_text(modes.get(mode, mode))}), {cases} case(s): "
        if not bad:
            lines.append(head + f"**every gradient within F <= {lim:g}** ("
                         + ", ".join(f"{g} max {r['max']:.4f}" for g, r in row.items()) + ")")
        else:
            lines.append(head + "**above the bar** on " + "; ".join(
                f"{g}: {len(r['above'])} case(s), max {r['max']:.4f} ({md_code(r['worst'])})" for g, r in bad.items())
                + "; within it: " + (", ".join(f"{g} max {r['max']:.4f}" for g, r in row.items() if g not in bad)
                                     or "none"))
    skipped = [s for s in ds["skipped"].values if s]
    if skipped:
        lines.append(f"{len(skipped)} case(s) not run (reasons below).")
    return lines


def _fmt(x: float) -> str:
    return "" if not np.isfinite(x) else f"{x:.4f}"


def case_table(ds) -> Table:
    modes, grads = list(ds["mode"].values), list(ds["grad"].values)
    cols = ["case"] + [f"{m} F {g}" for m in modes for g in grads] + ["identical (end-to-end, dK)", "dO"]
    rows = []
    for i, c in enumerate(ds["case"].values):
        if ds["skipped"].values[i]:
            continue
        f = ds["fidelity"].values[i]
        idn = ds["identical"].sel(mode="end-to-end", grad="dk").values[i]
        rows.append([md_code(str(c))] + [_fmt(f[mi, gi]) for mi in range(len(modes)) for gi in range(len(grads))]
                    + [_fmt(idn), md_text(str(ds["do_source"].values[i]))])
    return Table(cols, rows, numeric=[False] + [True] * (len(cols) - 3) + [True, False],
                 caption="F = RMSE(emulator, kernel) / RMSE(kernel, float64) per gradient; O is the forward's output "
                         "(in kernel-fwd mode the kernel's own, so 0)")


def spread_table(ds) -> Table:
    """Per case, the spread of F over heads (end to end): the sampling uncertainty beside each figure."""
    rows = []
    for i, c in enumerate(ds["case"].values):
        if ds["skipped"].values[i]:
            continue
        cells = []
        for g in ds["grad"].values:
            s = ds["fidelity_sample"].sel(mode="end-to-end", grad=g).values[i]
            s = s[np.isfinite(s)]
            cells.append(f"{np.median(s):.4f} [{s.min():.4f}, {s.max():.4f}]" if s.size else "")
        rows.append([md_code(str(c))] + cells)
    return Table(["case"] + [f"F {g}: median [min, max] over heads" for g in ds["grad"].values], rows,
                 caption="end to end, per (batch, head) sample; dK and dV per KV head", long=True,
                 summary="F per head")


def validation_backward_document(ds) -> Document:
    kernel = ds.attrs.get("kernel_label", ds.attrs.get("backend", "?"))
    doc = Document(f"The emulated backward against {kernel}'s, case by case",
                   [Verdict(verdict(ds), "Answer"),
                    Para(f"Bar F <= {float(ds.attrs.get('f_limit', 0.01)):g} per gradient. Inputs float64 from each "
                         f"case's seed; dO {md_text(ds.attrs.get('do_seed', ''))}; "
                         f"{md_text(ds.attrs.get('rows', ''))}; reference float64 autograd of exact attention.",
                         "where")])
    doc.sections.append(Section("Cases", [case_table(ds), spread_table(ds)]))
    skipped = [(c, s) for c, s in zip(ds["case"].values, ds["skipped"].values) if s]
    if skipped:
        doc.sections.append(Section("Not run", [Bullets([f"{md_code(str(c))}: {md_text(str(s))}"
                                                         for c, s in skipped])]))
    specs = sorted({str(s) for s in ds["spec"].values if s})
    doc.sections.append(Section("Recipe", [Bullets([md_code(s) for s in specs])]))
    prov = [f"{k}: {md_text(str(ds.attrs[k]))}" for k in ("backend", "device", "kernel_module", "kernel_version",
                                                         "torch", "wall_seconds") if k in ds.attrs]
    doc.sections.append(Section("Provenance", [Bullets(prov)]))
    return doc


def markdown_body(ds) -> str:
    return "\n".join(verdict(ds))


def render_validation_backward(ds, out_dir: str | Path, formats=("html", "md")) -> list[Path]:
    """``validation_backward.md`` and ``validation_backward.html``."""
    return write_document(validation_backward_document(ds), out_dir, stem="validation_backward", figure_dir="",
                          formats=tuple(formats))


__all__ = ["validation_backward_document", "render_validation_backward", "verdict", "markdown_body",
           "case_table"]
