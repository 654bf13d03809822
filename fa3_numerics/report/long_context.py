"""The report of `run long-context`: at what length and needle weight FP22 accumulation loses the
needle, prefill and decode, beside float32, two-level and flush-every-N (and the kernel).

Exposed: ``long_context_document``, ``render_long_context``, ``console``.

Reads only the dataset: its ``findings`` attribute (``studies.long_context.findings``: means with
95% BCa intervals over depth x seed x head samples) and its variables for the figure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..text import md_code, md_text
from .document import Bullets, Document, Fig, Para, Section, Table, Verdict, write_document


def _f(ds) -> dict:
    return json.loads(ds.attrs["findings"])


def _iv(x) -> str:
    est, lo, hi = x
    return f"{est:.3f} [{lo:.3f}, {hi:.3f}]"


def _mode_text(ds, mode: str) -> str:
    if mode == "split":
        return "split-KV decode (" + ", ".join(f"{int(s)} splits at {int(n)}" for n, s in
                                               zip(ds.length.values, ds.num_splits.values)) + ")"
    return {"prefill": f"prefill (last {ds.attrs.get('rows')} rows)", "decode": "decode, one split"}.get(mode, mode)


def verdict(ds) -> list[str]:
    """The answer first: per accumulator of the kernel (fp22 emulation, and the kernel when run),
    per mode and sink, the shortest length where the needle is lost, per weight."""
    f = _f(ds)
    lines = []
    heads = [r for r in ds.recipe.values if r in ("fa3", "fa3-mock", "fp22")]
    for r in heads:
        for mode in ds["mode"].values:
            for sink in ds.sink.values:
                rows = [x for x in f["first_loss"] if x["recipe"] == r and x["mode"] == mode and x["sink"] == sink]
                parts = [f"w={x['weight']:g}: " + (f"**lost from {x['lost_at']}**" if x["lost_at"] else
                                                   f"kept to {x['longest']}") for x in rows]
                lines.append(f"{md_code(r)}, {md_text(_mode_text(ds, str(mode)))}, sink {sink:g}: " + "; ".join(parts))
    lines.append(f"Lost = the needle's mass in the output relative to the fp32 accumulator's on the same FP8 inputs has "
                 f"a 95% upper bound below {f['lost_share']:g}, or it stays above every decoy in "
                 f"{100 * (1 - f['lost_top']):.0f}% fewer samples than with fp32.")
    return lines


def share_table(ds, mode: str, sink: float, weight: float) -> Table:
    f = _f(ds)
    cells = [c for c in f["cells"] if c["mode"] == mode and c["sink"] == sink and c["weight"] == weight]
    recipes = list(dict.fromkeys(c["recipe"] for c in cells))
    lengths = list(dict.fromkeys(c["length"] for c in cells))
    rows = []
    for r in recipes:
        row = [md_code(r)]
        for n in lengths:
            c = next(x for x in cells if x["recipe"] == r and x["length"] == n)
            mark = " **lost**" if c["lost"] else ""
            row.append(f"{_iv(c['acc_share'])} (vs exact {c['share'][0]:.3f}) top {c['top'][0]:.2f} "
                       f"rmse {c['row_rel_rmse'][0]:.3f}{mark}")
        rows.append(row)
    n_s = cells[0]["n"] if cells else 0
    return Table(["recipe"] + [f"{n} keys" for n in lengths], rows, [False] + [True] * len(lengths),
                 caption=f"needle mass relative to the fp32 accumulator [95% BCa over {n_s} samples] (its share "
                         "against float64), rate above every decoy, row relative RMSE")


def _figure(ds):
    from matplotlib import rc_context

    from .plots import finish, new_fig, theme

    modes, sinks = list(ds["mode"].values), list(ds.sink.values)
    w = float(ds.weight.values.min())
    f = _f(ds)
    with rc_context():
        theme()
        fig, axes = new_fig(4.2 * len(modes), 3.4 * len(sinks), len(sinks), len(modes), sharex=True, sharey=True)
        for i, sink in enumerate(sinks):
            for j, mode in enumerate(modes):
                ax = axes[i, j]
                for r in ds.recipe.values:
                    cs = [c for c in f["cells"] if c["recipe"] == r and c["mode"] == mode and c["sink"] == sink
                          and c["weight"] == w]
                    x = np.array([c["length"] for c in cs])
                    y = np.array([c["acc_share"] for c in cs])
                    ax.errorbar(x, y[:, 0], yerr=[y[:, 0] - y[:, 1], y[:, 2] - y[:, 0]], label=str(r), marker="o",
                                ms=3, capsize=2, lw=1.2)
                ax.axhline(1.0, color="k", lw=0.8)
                ax.axhline(f["lost_share"], color="k", lw=0.8, ls=":")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{mode}, sink {sink:g}")
                if i == len(sinks) - 1:
                    ax.set_xlabel("context length (keys)")
                if j == 0:
                    ax.set_ylabel("needle mass / fp32 accumulator's")
        axes[0, -1].legend(fontsize=8)
        return finish(fig, "needle_share", f"Needle retained vs context length (needle weight {w:g})",
                      f"The needle's mass in the output, <O, u> / sqrt(d), relative to the fp32 accumulator's on the "
                      f"same FP8 inputs, for the smallest needle weight ({w:g}), with 95% BCa intervals over depth x "
                      f"seed x head samples; dotted: the loss line ({f['lost_share']:g}).")


def long_context_document(ds) -> Document:
    doc = Document("Long context: does FP22 accumulation lose the needle?", [Verdict(verdict(ds), "Answer"), Para(
        f"Needle family: {ds.attrs.get('decoys')} decoys at half the needle's mass, distractor logit std "
        f"{ds.attrs.get('spread')}, V mean {ds.attrs.get('vmean')} x the noise, head dim {ds.attrs.get('head_dim')}, "
        f"KV tile {ds.attrs.get('kv_tile')}; reference: {md_text(ds.attrs.get('reference'))}. RMSE alone hides "
        "whether the one row that matters still carries the needle; the share does not.", "where")])
    doc.sections.append(Section("Figure", [Fig(_figure(ds))]))
    for mode in ds["mode"].values:
        for sink in ds.sink.values:
            blocks = [share_table(ds, str(mode), float(sink), float(w)) for w in ds.weight.values]
            for b, w in zip(blocks, ds.weight.values):
                b.caption = f"needle weight {float(w):g}: " + b.caption
            doc.sections.append(Section(f"{_mode_text(ds, str(mode))}, sink {float(sink):g}", blocks))
    if "kernel_match" in ds:
        km = ds["kernel_match"]
        doc.sections.append(Section("Kernel against the fp22 emulation", [Para(
            f"Outputs of the kernel that the fp22 emulation reproduces bit for bit: mean {float(km.mean()):.4f}, "
            f"lowest cell {float(km.min()):.4f} (per length: "
            + ", ".join(f"{int(n)}: {float(km.sel(length=n).mean()):.4f}" for n in ds.length.values) + ").")]))
    doc.sections.append(Section("Recipes", [Bullets([f"{md_code(r)}: {md_code(s)}" for r, s in
                                                     zip(ds.recipe.values, ds.spec.values)])]))
    prov = [f"{k}: {md_text(str(ds.attrs[k]))}" for k in ("device", "kernel_module", "kernel_version", "lost_rule")
            if k in ds.attrs]
    doc.sections.append(Section("Provenance", [Bullets(prov)]))
    return doc


def render_long_context(ds, out_dir: str | Path, formats=("html", "md")) -> list[Path]:
    """``report.md`` (figures in ``figures/``) and ``report.html``."""
    return write_document(long_context_document(ds), out_dir, stem="report", figure_dir="figures",
                          formats=tuple(formats))


def console(ds) -> tuple[str, list[str]]:
    return "\n".join(verdict(ds)), []


__all__ = ["long_context_document", "render_long_context", "console", "verdict", "share_table"]
