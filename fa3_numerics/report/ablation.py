"""The ablation report: generated findings (prose), figures, tables, as HTML and Markdown.

Exposed: ``summary_lines``, ``ablation_document``, ``render_report``, ``nonfinite_lines``.

Everything here reads an ablation dataset and the statistics of
``fa3_numerics.studies.effects`` / ``fa3_numerics.studies.attribution``; nothing is computed
that the study does not own. The document (``fa3_numerics.report.document``) puts the findings
first, then the design in a paragraph, the figures (``ablation_figures``), and the long tables
last (collapsed in the HTML; every table is also a CSV). Files are written whole or not at all.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import xarray as xr

from ..engine.conventions import attr_list
from ..studies.effects import (Frame, base_shape, block_quant_effect, cell_frame, growth, interaction_means,
                               interactions, main_effects, named_variants, paper_finding, per_data_effects,
                               seqlen_table)
from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text

# -- summary --------------------------------------------------------------------------------

def _x(r) -> str:
    return f"x{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]"


def _pct(r) -> str:
    return f"{(r[0] - 1) * 100:+.0f}% [{(r[1] - 1) * 100:+.0f}%, {(r[2] - 1) * 100:+.0f}%]"


def summary_lines(ds: xr.Dataset, fr: Frame, me, per_data, blk, att) -> list[str]:
    """The generated findings, each with its numbers (Markdown bullet lines)."""
    lines = []
    base = base_shape(ds)
    paper = [str(d) for d, p in zip(ds["data"].values, ds["paper_data"].values) if p]
    scales = [sc for sc in ("pow2", "amax") if sc in fr.order.get("scale", ["amax"])]
    for d, sc in itertools.product(paper, scales):
        pf = paper_finding(fr, d, base, sc)
        if "all" not in pf:
            continue
        first = not any(line.startswith("- **Paper finding") for line in lines)
        rot, b = pf["all"]["rotation_gain"], pf["all"]["block_gain"]
        lr, lb = math.log(rot[0]), math.log(max(b[0], 1e-12))
        share = lr / (lr + lb) if lb > 0 and lr > 0 else (1.0 if lr > 0 else 0.0)
        ok = rot[0] > b[0] and rot[1] > 1
        per_s = "; ".join(f"seqlen {s}: rotation {_x(v['rotation_gain'])}, block {_x(v['block_gain'])}"
                          for s, v in pf.items() if s != "all")
        gains = [v["rotation_gain"][0] for s, v in pf.items() if s != "all"]
        if len(gains) > 1 and gains[-1] > gains[0]:
            per_s += (f". Rotation's gain grows with seqlen (x{gains[0]:.2f} to x{gains[-1]:.2f}), towards the "
                      f"paper's x2.64 at its (inferred) seqlen 8192")
        what = (f"- **Paper finding {'reproduced' if ok else 'not reproduced'}** on {md_code(d)} (FA3 paper data, "
                f"{sc} scales{' as in the paper' if sc == 'pow2' else ''})" if first else
                f"- The same contrasts with {sc} scales (paper finding {'holds' if ok else 'does not hold'})")
        lines.append(
            what + f": with block quantization, incoherent processing (random Hadamard) lowers RMSE by {_x(rot)}, while block "
            f"quantization (vs one scale per tensor, with Hadamard) changes it by {_x(b)}"
            + (f"; rotation carries {share:.0%} of the combined log-gain" if lr > 0 and lb > 0 else "")
            + f" (paper, Table 3: x{2.4e-2 / 9.1e-3:.2f} and x{9.3e-3 / 9.1e-3:.2f}). Per seqlen: {per_s}.")
    if len(blk):
        b = blk[blk["vs"] == "tensor"]
        beyond = lambda t: (t["hi"] < 0.9) | (t["lo"] > 1.1)  # noqa: E731  whole interval past +-10%
        point = lambda t: (t["ratio"] - 1).abs() > 0.10  # noqa: E731
        clear, maybe, calm = [], [], []
        for d, sub in b.groupby("data", sort=False):
            w = sub.iloc[(sub["ratio"] - 1).abs().argmax()]
            where = (f"largest {_pct((w['ratio'], w['lo'], w['hi']))} at seqlen {w['seqlen']}, rot={w['rot']}, "
                     f"p={w['p']}, scale={w.get('scale', 'amax')}")
            if beyond(sub).any():
                clear.append(f"{md_code(d)} ({int(beyond(sub).sum())} of {len(sub)} settings; {where})")
            elif point(sub).any():
                maybe.append(f"{md_code(d)} ({int(point(sub).sum())} of {len(sub)}; {where})")
            else:
                calm.append(f"{md_code(d)} (ratios within [{sub['ratio'].min():.2f}, {sub['ratio'].max():.2f}])")
        head = ("- **Block quantization** (kernel tiles vs one scale per tensor; every data x seqlen x rotation x "
                "P handling x scale rounding in the grid) changes the RMSE by more than 10%, with the whole 95% interval "
                "beyond +-10%, ")
        head += ("under: " + "; ".join(clear) + ", and nowhere else" if clear else "**nowhere in the grid**")
        head += f" ({len(b)} comparisons, 95% intervals without multiple-comparison correction)."
        if maybe:
            head += (" Point estimates beyond 10% whose intervals still reach inside +-10% (not established at this "
                     "sample size): " + "; ".join(maybe) + ".")
        if calm:
            head += " Every point estimate within 10%: " + "; ".join(calm) + "."
        lines.append(head)
        h = blk[blk["vs"] == "head"]
        if len(h):
            w = h.iloc[(h["ratio"] - 1).abs().argmax()]
            lines.append(f"- Against per-head scales (what the public kernel takes), block scales change the RMSE by "
                         f"at most {_pct((w['ratio'], w['lo'], w['hi']))} ({md_code(w['data'])}, seqlen {w['seqlen']}, "
                         f"rot={w['rot']}, p={w['p']}, scale={w.get('scale', 'amax')}).")
        if "scale" in b and b["scale"].nunique() > 1:
            keys = ["data", "seqlen", "rot", "p"]
            both = b.groupby(keys)["scale"].transform("nunique") == b["scale"].nunique()  # same settings
            by = b[both].assign(dev=(b["ratio"] - 1).abs()).groupby("scale")["dev"].median()
            lines.append("- Block quantization's effect depends on how scales are rounded: median |RMSE(block) / "
                         "RMSE(tensor) - 1| is " + ", ".join(f"{v:.1%} with {k} scales" for k, v in by.items())
                         + " (with amax scales each block's largest value is exact; with power-of-two scales "
                           "block quantization changes only subnormals and saturation).")
    if len(per_data):
        parts = []
        for d, sub in per_data.drop_duplicates(["data", "factor"]).groupby("data", sort=False):
            sub = sub[sub["factor"].isin(fr.factors)].sort_values("size", ascending=False)
            if not len(sub):
                continue
            top = sub.iloc[0]
            rest = ", ".join(f"{r.factor} x{r.size:.2f}" for r in sub.iloc[1:].itertuples())
            parts.append(f"{md_code(d)}: **{top['factor']}** x{top['size']:.2f} [{top['size_lo']:.2f}, {top['size_hi']:.2f}]"
                         f" (then {rest})")
        lines.append("- **Which factor matters where** (max/min level RMSE ratio within each data): " + "; ".join(parts)
                     + ".")
    if len(me):
        for f in ("acc", "fmt", "p", "head_dim", "causal"):
            sub = me[me["factor"] == f]
            if len(sub):
                lv = ", ".join(f"{r.level} {(r.ratio - 1) * 100:+.2f}% [{(r.lo - 1) * 100:+.2f}%, {(r.hi - 1) * 100:+.2f}%]"
                               for r in sub.itertuples())
                lines.append(f"- Main effect of {md_code(f)} (RMSE relative to the mean of its levels, over "
                             f"{int(sub['sets'].iloc[0])} matched sets): {lv}.")
    seq = sorted(int(s) for s in ds["seqlen"].values)
    if len(seq) > 1:
        named = named_variants(ds)
        parts = []
        for name in ("kernel (per-head, no rotation)", "FA3 (block + Hadamard, pow2 scales)"):
            if name not in named:
                continue
            grew = []
            for d in fr.order["data"]:
                g = growth(fr, named[name], d, seq[0], seq[-1], {k: str(v) for k, v in base.items()})
                if g:
                    grew.append(f"{d} x{g[0]:.2f} [{g[1]:.2f}, {g[2]:.2f}]")
            parts.append(f"{name}: " + ", ".join(grew))
        lines.append(f"- **Seqlen trend** (RMSE at {seq[-1]} / at {seq[0]}): " + "; ".join(parts) + ".")
    if att is not None and len(att):
        named = named_variants(ds)
        smax = att["seqlen"].max()
        parts = []
        for name in ("kernel (per-head, no rotation)", "FA3 (block + Hadamard, pow2 scales)"):
            if name not in named:
                continue
            sub = att[(att["variant"] == named[name]) & (att["seqlen"] == smax)]
            desc = []
            for d, g in sub.groupby("data", sort=False):
                top = g.sort_values("share", ascending=False).head(2)
                desc.append(f"{d}: " + ", ".join(f"{r.stage} {r.share:.0%}" for r in top.itertuples()))
            parts.append(f"{name}: " + "; ".join(desc))
        add = att[att["stage"] == "qk"]["additivity"]
        lines.append(f"- **Attribution** (share of the summed single-stage MSE, seqlen {smax}): " + " | ".join(parts)
                     + f". Full-recipe MSE / sum of stage MSEs ranges over [{add.min():.2f}, {add.max():.2f}] "
                       f"(median {add.median():.2f}): the stages' errors are close to additive.")
    return lines

# -- the document -----------------------------------------------------------------------------

def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def _table(df, cols, fmt=None, long=False, summary="", caption="") -> Table:
    """A DataFrame's columns as a ``Table``; numbers in one format per column (``fmt``)."""
    import pandas as pd

    fmt = fmt or {}
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in cols]
    rows = [[fmt.get(c, str)(v) for c, v in zip(cols, r)] for r in df[cols].itertuples(index=False)]
    return Table(list(cols), rows, numeric, caption=caption, long=long, summary=summary)


def nonfinite_lines(ds: xr.Dataset, fr: Frame) -> list[str]:
    """The non-finite results of the ablation, as Markdown (empty when there are none)."""
    from ..engine.nonfinite import scan

    found = scan(ds)
    if not found:
        return []
    lines = [f"**Non-finite results.** {len(found)} (data, shape, variant, seed) result(s) hold NaN or Inf; "
             f"{len(fr.nonfinite)} cell(s) are left out of the effects and figures below, which are over the "
             "finite cells only:"]
    lines += [f.line() for f in found[:40]]
    if len(found) > 40:
        lines.append(f"... and {len(found) - 40} more (every one in the dataset's `nonfinite` variable)")
    return lines


_F3 = lambda v: f"{v:.3f}"  # noqa: E731  ratios near 1: three decimals show a 0.1% effect
_FMT = {"ratio": _F3, "lo": _F3, "hi": _F3, "size": lambda v: f"x{v:.2f}", "size_lo": lambda v: f"{v:.2f}",
        "size_hi": lambda v: f"{v:.2f}", "fold": lambda v: f"x{v:.3f}", "fold_lo": _F3, "fold_hi": _F3,
        "rms_log10": lambda v: f"{v:.4f}", "share": lambda v: f"{v:.1%}", "share_lo": lambda v: f"{v:.1%}",
        "share_hi": lambda v: f"{v:.1%}", "additivity": lambda v: f"{v:.2f}", "full_rmse": lambda v: f"{v:.2e}"}


def ablation_document(ds: xr.Dataset, *, dataset_path=None, n_boot: int = 1000) -> tuple[Document, list]:
    """The report of an ablation dataset, and its tables as CSV files [(name, bytes)]."""
    from ..numerics.keys import factors as registered
    from ..numerics.metrics.bootstrap import few_samples
    from ..studies.attribution import attribution_table
    from .ablation_figures import (fig_attribution, fig_block, fig_interactions, fig_main_effects, fig_per_data,
                                   fig_seqlen)
    from .summary import provenance_items

    fr = cell_frame(ds, n_boot=n_boot)
    me = main_effects(fr)
    it = interactions(fr)
    per_data = per_data_effects(fr)
    base = base_shape(ds)
    blk = block_quant_effect(fr, base)
    att = att_all = attribution_table(ds, n_boot=n_boot) if "stage_of_qk" in ds.coords else None
    if att is not None and len(att):
        att = att[(att["head_dim"] == base["head_dim"]) & (att["causal"] == base["causal"])]
    named = named_variants(ds)
    seq = seqlen_table(ds, list(named.values()))
    if len(seq):
        inv = {v: k for k, v in named.items()}
        seq["name"] = seq["variant"].map(inv)
    extra = [(f"{name}.csv", df.to_csv(index=False, float_format="%.6g").encode())
             for name, df in (("effects", me), ("interactions", it), ("effects_per_data", per_data),
                              ("block_quant", blk), ("seqlen", seq), ("attribution", att_all))
             if df is not None and len(df)]
    figs = []
    if len(me):
        figs.append(fig_main_effects(me))
    if len(it):
        figs.append(fig_interactions(fr, [(r.f, r.g) for r in it.head(9).itertuples()], interaction_means))
    if len(per_data):
        figs.append(fig_per_data(per_data, fr.factors))
    if len(blk):
        figs.append(fig_block(blk))
    if len(seq):
        figs.append(fig_seqlen(seq))
    if att is not None and len(att):
        smax = att["seqlen"].max()
        a = att[att["seqlen"] == smax]
        full = [str(v) for v, s in zip(ds["variant"].values, ds["stage"].values) if s == "full"]
        for d in ds["data"].values:
            figs.append(fig_attribution(a[a["data"] == str(d)], full, f"Attribution, {d}, seqlen {smax}, head dim "
                                        f"{base['head_dim']}, causal {base['causal']} (every recipe)",
                                        f"attribution_{_slug(str(d))}", short=f"Attribution: {d}"))
    figs = [f for f in figs if f is not None]

    doc = Document(f"Ablation: {md_text(ds.attrs.get('description', ''))}")
    at = ds.attrs
    doc.lead.append(Para(f"**Where it ran:** {md_text(at.get('device_name', '?'))} (device {md_code(at.get('device', '?'))}, backend "
                         f"{md_code(at.get('backend', '?'))}, {md_text(at.get('cpu_cores', '?'))} cores, dask workers "
                         f"{md_text(at.get('workers', '?'))}); the sweep took {md_text(at.get('wall_seconds', '?'))} s. **Command:** "
                         f"{md_code(at.get('command', '?'))}", "where"))
    nf = nonfinite_lines(ds, fr)
    if nf:
        doc.lead += [Para(nf[0], "warning"), Bullets(nf[1:], "warning")]
    if few_samples(fr.samples):
        doc.lead.append(Para(f"**Few samples.** Each cell has {fr.samples} (seed, batch, head) samples, fewer than 8: "
                             "the intervals are rough.", "warning"))
    doc.sections.append(Section("Findings (generated from the data)", [
        Bullets([line[2:] if line.startswith("- ") else line for line in summary_lines(ds, fr, me, per_data, blk, att)],
                "headline")]))
    designs = json.loads(ds.attrs.get("designs", "{}"))
    reg = registered()
    default = {f: reg[f].default if f in reg else "?" for f in fr.factors}
    n_full = int((ds["stage"] == "full").sum())
    doc.sections.append(Section("Design", [
        Para(f"{n_full} recipes over data {', '.join(f'{md_code(d)}' for d in ds['data'].values)}, seqlen "
             f"{[int(s) for s in ds['seqlen'].values]}, head dim {[int(h) for h in ds['head_dim'].values]}, causal "
             f"{[bool(c) for c in ds['causal'].values]}; {int(ds.coords['heads'])} heads x batch "
             f"{int(ds.coords['batch_size'])} x seeds {attr_list(ds, 'seeds')} samples, "
             f"{int(ds.coords['rows'])} query rows each. Recipes are {md_code('|'.join(fr.factors))} over the base "
             f"{md_code(ds.attrs.get('base_recipe'))}; designs (full factorials, unlisted factors at "
             f"{'|'.join(default[f] for f in fr.factors)}):"),
        Bullets([f"{md_code(k)}: " + ", ".join(f"{f} {{{', '.join(v)}}}" for f, v in d["levels"].items() if len(v) > 1)
                 + (f"; data {d['data']}" if d.get("data") else "")
                 + "".join(f"; {k2} {d[k2]}" for k2 in ("seqlen", "head_dim", "causal") if d.get(k2))
                 for k, d in designs.items()]),
        Para("Response: log10 of the RMSE pooled over (seed, batch, head). Effects use matched sets (cells equal in "
             "every other factor); intervals are 95% BCa bootstraps (scipy.stats.bootstrap) over (seed, batch, "
             "head) samples, resampled jointly across cells. Attribution: each stage alone in low precision, the "
             "rest float32; a share is the stage's MSE over the sum of the stage MSEs.", "note")]))
    doc.sections.append(Section("Figures", [Fig(f) for f in figs]))
    doc.sections.append(Section("Main effects", [
        _table(me, ["factor", "level", "ratio", "lo", "hi", "sets", "size"], _FMT, long=len(me) > 30,
               summary="Main effect of every level",
               caption="`ratio`: RMSE at the level / geometric mean over the factor's levels in the same matched "
                       "set; `size`: max/min level ratio.") if len(me) else Para("(none)")]))
    doc.sections.append(Section("Two-way interactions", [
        _table(it, ["f", "g", "levels", "sets", "rms_log10", "fold", "fold_lo", "fold_hi"], _FMT,
               long=len(it) > 30, summary="Every factor pair",
               caption="`fold`: 10^(RMS of the interaction residual in log10 RMSE); 1 = purely additive on log RMSE.")
        if len(it) else Para("(none)")]))
    if len(per_data):
        pd_ = per_data.drop_duplicates(["data", "factor"])
        doc.sections.append(Section("Factor effects within each data", [
            _table(pd_, ["data", "factor", "size", "size_lo", "size_hi", "sets"], _FMT, long=len(pd_) > 30,
                   summary="Every (data, factor)")]))
    if att is not None and len(att):
        smax = att["seqlen"].max()
        sel = att[(att["seqlen"] == smax) & att["variant"].isin(named.values())].copy()
        sel["recipe"] = sel["variant"].map({v: k for k, v in named.items()})
        sel["full_rmse"] = np.sqrt(sel["full_mse"])
        doc.sections.append(Section(f"Attribution of named recipes (seqlen {smax})", [
            _table(sel, ["data", "recipe", "stage", "share", "share_lo", "share_hi", "full_rmse", "additivity"], _FMT,
                   long=True, summary="Shares per stage of the named recipes",
                   caption="Every recipe is in attribution.csv and the figures.")]))
    prov = provenance_items(ds)
    prov = [p.replace("distribution `several (see coords dist, data_params)`", "distributions: see Design")
            for p in prov]
    prov.append(f"machine: {md_text(ds.attrs.get('cpu_cores', '?'))} CPU cores, 1-minute load average "
                f"{md_text(ds.attrs.get('loadavg_start', '?'))} at the start of the sweep and {md_text(ds.attrs.get('loadavg_end', '?'))} "
                f"at its end (other processes share the cores); dask workers: {md_text(ds.attrs.get('workers'))}; "
                f"variant results reused from cache: {md_text(ds.attrs.get('cells_reused'))}")
    if dataset_path:
        prov.append(f"dataset: {md_code(dataset_path)}")
    prov.append("tables: " + ", ".join(md_code(name) for name, _ in extra))
    doc.sections.append(Section("Provenance", [Bullets(prov)]))
    return doc, extra


def render_report(ds: xr.Dataset, out, *, dataset_path=None, n_boot: int = 1000, formats=("html", "md")) -> "Path":  # noqa: F821
    """Write report.md, report.html, figures (PNG, SVG) and tables (CSV) for an ablation dataset
    into ``out``; return the path of report.md."""
    from pathlib import Path

    from .document import write_document

    doc, extra = ablation_document(ds, dataset_path=dataset_path, n_boot=n_boot)
    write_document(doc, out, stem="report", formats=formats, figure_dir="", extra=extra)
    return Path(out) / "report.md"
