"""The validation report: the emulator against the kernel, case by case, as ``validation.html`` and
``validation.md``.

Exposed: ``validation_document``, ``markdown_validation``, ``write_validation``, ``fig_fidelity``.

The page leads with the verdict the study stored (``studies.validate_findings``: pass or fail
against the fidelity band, the accumulator model that matches, those to avoid), the ranking per
accumulator model, then the figure of F per case, then the
tables (every case; per layer x head on a capture). ``markdown_validation(ds)`` is the body without
the title, for commands and scripts that print or embed it (``validate``'s stdout,
``kernels/device/h200.py``). Datasets written before the non-finite counts existed still render.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text, render
from ..text import fmt_f
from .plots import Figure, finish, new_fig, plain_ticks, theme
from .stored import findings_of, verdict_block


def _nonfinite_cell(ds, i: int, accs: list[str]) -> str:
    if "nonfinite_kernel" not in ds:
        return "-"
    k = ds["nonfinite_kernel"].values[i]
    only = [ds["nonfinite_emulator_only"].sel(acc=a).values[i] for a in accs]
    if not np.isfinite(k):
        return "-"
    if k == 0 and not np.nansum(only):
        return "0"
    return f"**kernel {int(k)}; emulator-only " + "/".join(str(int(x)) if np.isfinite(x) else "-" for x in only) + "**"


def _case_tables(ds, accs: list[str], F_LIMIT: float) -> list[Table]:
    """Every case as two tables that each fit the page: what the case is, then what it measured."""
    what_head = ["case", "format", "n", "causal", "h/kv", "d", "data", "descale", "rot"]
    got_head = ["case", "RMSE(kernel)"] + [f"F {a}" for a in accs] + [f"identical {a}" for a in accs] + ["non-finite"]
    what, got = [], []
    for i in range(ds.sizes["case"]):
        c = ds.isel(case=i)
        fp8 = str(c["dtype"].values) == "fp8"
        ran = np.isfinite(float(c["seconds"]))
        fs = []
        for a in accs:
            f = float(c["fidelity"].sel(acc=a))
            if not ran:
                fs.append("not run")
            elif not np.isfinite(f):
                fs.append("**non-finite**")
            else:
                fs.append(f"**{fmt_f(f)}**" if fp8 and f > F_LIMIT else fmt_f(f))
        idn = [("-" if not np.isfinite(float(c["identical"].sel(acc=a))) else f"{float(c['identical'].sel(acc=a)):.1%}")
               for a in accs]
        rk = float(c["rmse_kernel"])
        dist = str(c["dist"].values) if "dist" in c else "outliers"
        data = (f"p {float(c['p']):g}, σ {float(c['sigma']):g}" if dist == "outliers" else
                f"layer {c['params'].values}".replace("layer=", "") if dist.startswith("capture-file:") else
                f"{dist} {c['params'].values}")
        name = md_code(c['case'].values)
        what.append([name, str(c["dtype"].values), str(int(c["seqlen"])), "yes" if int(c["causal"]) else "no",
                     f"{int(c['heads'])}/{int(c['kv_heads'])}", str(int(c["head_dim"])), data,
                     str(c["gran"].values) if fp8 else "-", str(c["rot"].values)])
        got.append([name, "-" if not np.isfinite(rk) else f"{rk:.3e}"] + fs + idn + [_nonfinite_cell(ds, i, accs)])
    long = len(got) > 30
    return [Table(got_head, got, [False, True] + [True] * (2 * len(accs)) + [False], long=long,
                  summary="What every case measured"),
            Table(what_head, what, [False, False, True, False, True, True, False, False, False], long=long,
                  summary="What every case is")]


def _per_head(ds, accs: list[str]) -> list:
    """For cases on a capture: F and the identical share per layer x head (the worst heads)."""
    if "fidelity_sample" not in ds or "dist" not in ds:
        return []
    cap = [i for i, d in enumerate(ds["dist"].values) if str(d).startswith("capture-file:")]
    if not cap:
        return []
    rows = []
    for i in cap:
        layer = str(ds["params"].values[i]).replace("layer=", "")
        heads = int(ds["heads"].values[i])
        for j, a in enumerate(accs):
            for h in range(heads):
                rows.append((float(ds["fidelity_sample"].values[i, j, h]), str(ds["case"].values[i]), layer, h, a,
                             float(ds["identical_sample"].values[i, j, h])))
    # cases not run (and heads with no finite output) have no F: they are listed above, not ranked here
    absent = sum(1 for r in rows if not np.isfinite(r[0]))
    rows = sorted((r for r in rows if np.isfinite(r[0])), key=lambda r: -r[0])
    if not rows:
        return []
    gap = f"; {absent} without an F (cases not run, listed above)" if absent else ""
    return [Para(f"Per layer x head on the capture ({len(rows)} layer x head x accumulator values{gap}; the 15 with "
                 "the largest F, all in `fidelity_sample` and `identical_sample` of the dataset):"),
            Table(["case", "layer", "head", "acc", "F", "identical"],
                  [[case, layer, str(h), md_code(a), fmt_f(f), f"{idn:.1%}"] for f, case, layer, h, a, idn in rows[:15]],
                  [False, True, True, False, True, True])]


def _ranking(f: dict) -> list:
    rank, F_LIMIT = f["ranking"], f["f_limit"]
    if not rank:
        return []
    return [Table(["acc", "max F", "median F", "mean bit-identical", "cases",
                   "non-finite where the kernel's are finite", f"F <= {F_LIMIT} everywhere, all finite"],
                  [[md_code(r['acc']), fmt_f(r["max_F"]), fmt_f(r["median_F"]), f"{r['mean_identical']:.1%}",
                    str(r["cases"]), str(r["nonfinite_only"]), "yes" if r["pass"] else "no"] for r in rank],
                  [False, True, True, True, True, True, False],
                  caption="Accumulator models over the FP8 cases (best first):")]


def fig_fidelity(ds) -> Figure | None:
    """F per case and accumulator model, log axis, the F limit marked."""
    import matplotlib as mpl

    f_ = findings_of(ds, kind="validation")
    F_AIM, F_LIMIT = f_["f_aim"], f_["f_limit"]

    f = ds["fidelity"].values
    if not np.isfinite(f).any():
        return None
    accs = [str(a) for a in ds["acc"].values]
    cases = [str(c) for c in ds["case"].values]
    with mpl.rc_context():
        theme(font_scale=0.95)
        import seaborn as sns

        fig, axes = new_fig(12, 0.32 * len(cases) + 1.8)
        ax = axes[0, 0]
        pal = sns.color_palette("colorblind", len(accs))
        y = np.arange(len(cases))[::-1]
        pos = f[np.isfinite(f) & (f > 0)]
        floor = pos.min() / 2 if pos.size else 1e-6
        for j, a in enumerate(accs):
            x = np.where(f[:, j] > 0, f[:, j], floor)  # F = 0 (bit-identical everywhere) sits at the left edge
            ax.scatter(x, y + (j - (len(accs) - 1) / 2) * 0.22, color=pal[j], marker="osD^v"[j % 5], s=26,
                       label=a, zorder=3)
        ax.axvline(F_LIMIT, color="#d55e00", lw=1.2, ls="--", label=f"limit {F_LIMIT:g} (FP8 cases)")
        ax.axvline(F_AIM, color="0.5", lw=1, ls=":", label=f"aim {F_AIM:g}")
        ax.set_xscale("log")
        plain_ticks(ax, "x")
        ax.set_yticks(y, cases, fontsize=8)
        ax.set_xlabel("F = RMSE(emulator − kernel) / RMSE(kernel − float64), log scale")
        handles, names = ax.get_legend_handles_labels()  # outside the axes: it must not cover a case
        fig.legend(handles, names, title="emulator accumulator", fontsize=8.5, loc="outside right upper")
        ax.set_title("Emulator against the kernel, per case", fontsize=11)
        return finish(fig, "fidelity", "F per case and accumulator model",
                      "Each dot is one case's F for one emulator accumulator model; smaller is closer to the kernel. "
                      f"The dashed line is the bar every FP8 case must stay under ({F_LIMIT:g}); F = 0 (every output "
                      "bit-identical) is drawn at the left edge.")


def _intro(ds, F_LIMIT: float) -> str:
    label = ds.attrs.get("kernel_label", ds.attrs.get("backend", "?"))
    return (f"Kernel: {md_code(label)} ({ds.attrs.get('kernel_version', ds.attrs.get('kernel_module', ''))}) on "
            f"{ds.attrs.get('device_name', ds.attrs.get('device', '?'))}; emulator default acc "
            f"{md_code(ds.attrs.get('recipe_default_acc'))}. F = RMSE(emulator, kernel) / RMSE(kernel, float64) over the "
            f"outputs finite in both; **bold** F > {F_LIMIT} (FP8 cases must stay below it). Every query row unless "
            "the case name ends in rowsN (N sampled rows). Non-finite: the kernel's outputs, and the emulator's "
            "where the kernel's are finite, per accumulator (the target is 0).")


def _blocks(ds, with_figure: bool) -> tuple[list, list[Section]]:
    accs = [str(a) for a in ds["acc"].values]
    f = findings_of(ds, kind="validation")
    lead: list = verdict_block(f) + [Para(_intro(ds, f["f_limit"]), "where")]
    bad = f["nonfinite"]
    if bad:
        lead += [Para("**Non-finite outputs** (F and the identical share are over the outputs finite in both):",
                      "warning"), Bullets(bad, "warning")]
    sections = []
    ranking = _ranking(f)
    if ranking:
        sections.append(Section("Which accumulator model the kernel matches", ranking))
    fig = fig_fidelity(ds) if with_figure else None
    if fig is not None:
        sections.append(Section("Figure", [Fig(fig)]))
    sections.append(Section("Every case", _case_tables(ds, accs, f["f_limit"]) + _per_head(ds, accs)))
    return lead, sections


def validation_document(ds) -> Document:
    lead, sections = _blocks(ds, with_figure=True)
    a = ds.attrs
    sections.append(Section("Provenance", [Bullets([
        f"command: {md_code(a.get('command', '?'))}", f"git commit {md_code(a.get('git_commit', '?'))}; created "
        f"{md_text(a.get('created_utc', '?'))}", f"torch {md_text(a.get('version_torch'))}, python {md_text(a.get('python'))}"])]))
    return Document(f"Validation: the emulator against {md_code(a.get('kernel_label', a.get('backend', '?')))}", lead, sections)


def markdown_validation(ds) -> str:
    """The body of the report (verdict, every case) as Markdown, without title or figure."""
    lead, sections = _blocks(ds, with_figure=False)
    text = render(Document("", lead, sections), "md")
    return text.split("\n", 1)[1].lstrip("\n") if text.startswith("# ") else text


def write_validation(ds, out: Path, formats=("html", "md")) -> Path:
    """``out/validation.md``, ``validation.html`` and the figure, each whole or not at all."""
    from .document import write_document

    write_document(validation_document(ds), out, stem="validation", formats=formats, figure_dir="")
    return Path(out) / "validation.md"


__all__ = ["validation_document", "markdown_validation", "write_validation", "fig_fidelity"]
