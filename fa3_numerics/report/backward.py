"""The report of `run backward`: gradient errors per variant, and their attribution per product.

Exposed: ``backward_document``, ``gradient_table``, ``attribution_rows``, ``markdown_report``.

Everything here is what the study stored in the dataset (``studies.backward_findings``): per
cell, every figure pools the (seed, batch, head) samples (RMSE as the root of the mean square,
the rest as means) with its 95% BCa interval; a sample holding NaN or Inf makes its figure
"non-finite (k of n samples)", never an estimate over the rest. The verdict comes first.
"""

from __future__ import annotations

from ..numerics.metrics.bootstrap import few_samples
from ..text import FEW, fmt_e, fmt_interval, md_code, md_text, nonfinite_text
from .document import Bullets, Document, Para, Section, Table, md_table, render
from .stored import findings_of, verdict_block
from .summary import fmt_param, provenance_items


def _n(x) -> float:
    return float("nan") if x is None else float(x)


def _cell(ds, where: dict) -> dict:
    f = findings_of(ds, kind="backward")
    for c in f["cells"]:
        if all(c["where"].get(k) == v for k, v in where.items()) and len(c["where"]) == len(where):
            return c
    raise KeyError(f"no stored cell {where}")


def _figure(x: dict) -> str:
    if x["nonfinite"]:
        return nonfinite_text(x["nonfinite"], x["n"])
    return f"{fmt_e(_n(x['value']))} {fmt_interval(_n(x['lo']), _n(x['hi']), few=few_samples(x['n']))}"


def gradient_table(ds, where: dict, metric: str = "rel_l2") -> Table:
    """Per variant: ``metric`` of O, dQ, dK, dV (stage ``full``) with intervals."""
    f = findings_of(ds, kind="backward")
    grads = f["grads"]
    per = _cell(ds, where)["gradients"][metric]
    rows = [[md_code(v)] + [_figure(per[v][g]) for g in grads] for v in per]
    return Table(["variant"] + [f"{name} {metric}" for name in grads.values()], rows, [False] + [True] * len(grads))


def attribution_rows(ds, where: dict) -> list[list[str]]:
    """Per (variant, gradient): the share of each stage's MSE, the additivity ratio, and ``fwd+s``'s
    MSE relative to the full recipe's."""
    stages = findings_of(ds, kind="backward")["share_stages"]
    out = []
    for r in _cell(ds, where)["attribution"]:
        ratio = r["fwd_s_over_full"]
        out.append([md_code(r["variant"]), r["grad"]] + [f"{100 * _n(r['shares'][s]):.1f}%" for s in stages]
                   + [f"{_n(r['additivity']):.2f}", f"{ratio:.2f}" if ratio is not None else "-", r["largest"]])
    return out


def backward_document(ds) -> Document:
    """The report of a backward dataset (what ``report`` renders for kind ``backward``)."""
    f = findings_of(ds, kind="backward")
    doc = Document("Backward pass: gradient error of low-precision attention", verdict_block(f) + [Para(
        f"Distribution {md_code(ds.attrs.get('dist'))}; every query row; dO: "
        f"{md_text(ds.attrs.get('do_source') or 'N(0, 1), ' + str(ds.attrs.get('do_seed')))}; "
        f"reference: {md_text(ds.attrs.get('reference'))}. Figures: pooled over (seed, batch, head) samples with 95% BCa "
        f"intervals ({FEW} marks fewer than 8 samples).", "where")])
    for c in f["cells"]:
        where = c["where"]
        head = ", ".join(f"{k}={fmt_param(v)}" for k, v in where.items()) or "single cell"
        doc.sections.append(Section(head, []))
        doc.sections.append(Section("Relative L2 error (||x - x_ref|| / ||x_ref||)", [gradient_table(ds, where, "rel_l2")],
                                    level=3))
        doc.sections.append(Section("Cosine similarity", [gradient_table(ds, where, "cosine")], level=3))
        if c["attribution"]:
            cols = ["variant", "grad"] + f["share_stages"] + ["full / sum", "fwd+s / full", "largest"]
            doc.sections.append(Section(
                "Attribution: share of the summed stage MSE (each stage alone in low precision)",
                [Table(cols, attribution_rows(ds, where), [False, False] + [True] * (len(cols) - 3) + [False]),
                 Para("Stages: " + "; ".join(f"{md_code(s)}: {md_text(d)}" for s, d in f["stages"].items())
                      + ". `full / sum` below 1: the stages' errors cancel in the full recipe (a forward and a "
                      "backward that quantize Q and K alike give a consistent P); `fwd+s / full`: the forward and "
                      "the S recompute together, relative to the full recipe's MSE.", "note")], level=3))
    doc.sections.append(Section("Variants", [Bullets([f"{md_code(v)}: {md_code(s)}"
                                                      for v, s in zip(ds["variant"].values, ds["spec"].values)])]))
    doc.sections.append(Section("Provenance", [Bullets(provenance_items(ds))]))
    return doc


def markdown_report(ds) -> str:
    return render(backward_document(ds), "md")


def render_backward(ds, out_dir, formats=("html", "md")) -> list:
    """The report page of a backward dataset: ``report.md`` and ``report.html``."""
    from .document import write_document

    return write_document(backward_document(ds), out_dir, stem="report", figure_dir="", formats=tuple(formats))


def console(ds) -> tuple[str, list[str]]:
    """What ``run backward`` prints when done: the first cell's relative-L2 table."""
    first = {d: ds[d].values[0].item() for d in ds["o_rmse"].dims if d not in
             ("variant", "stage", "seed", "batch", "head", "kv_head")}
    return md_table(gradient_table(ds, first, "rel_l2")), []


__all__ = ["backward_document", "gradient_table", "attribution_rows", "markdown_report", "render_backward", "console"]
