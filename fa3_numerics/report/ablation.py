"""The ablation report: the verdict, the generated findings, figures, tables, as HTML and Markdown.

Exposed: ``ablation_document``, ``render_report``.

Everything here reads an ablation dataset and the findings its study stored in it
(``fa3_numerics.studies.ablation_findings``: the statistics of ``studies.effects`` and
``studies.attribution`` as tables, the findings in words, the verdict); nothing is computed here.
The document (``fa3_numerics.report.document``) opens with the verdict box, then the findings,
the design in a paragraph, the figures (``ablation_figures``), and the long tables last
(collapsed in the HTML; every table is also a CSV). Files are written whole or not at all.
"""

from __future__ import annotations

import json

import numpy as np
import xarray as xr

from ..engine.conventions import attr_list
from .document import Bullets, Document, Fig, Para, Section, Table, md_code, md_text
from .stored import findings_of, verdict_block

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


_F3 = lambda v: f"{v:.3f}"  # noqa: E731  ratios near 1: three decimals show a 0.1% effect
_FMT = {"ratio": _F3, "lo": _F3, "hi": _F3, "size": lambda v: f"x{v:.2f}", "size_lo": lambda v: f"{v:.2f}",
        "size_hi": lambda v: f"{v:.2f}", "fold": lambda v: f"x{v:.3f}", "fold_lo": _F3, "fold_hi": _F3,
        "rms_log10": lambda v: f"{v:.4f}", "share": lambda v: f"{v:.1%}", "share_lo": lambda v: f"{v:.1%}",
        "share_hi": lambda v: f"{v:.1%}", "additivity": lambda v: f"{v:.2f}", "full_rmse": lambda v: f"{v:.2e}"}


def _frame(t: dict):
    import pandas as pd

    if not t["columns"]:
        return pd.DataFrame()
    df = pd.DataFrame(t["data"], columns=t["columns"])
    for c in df.columns:  # JSON keeps NaN as null: numeric columns with a gap come back as objects
        vals = [v for v in df[c] if v is not None]
        # (a column of nulls only is a number missing everywhere, e.g. intervals of one sample)
        if df[c].dtype == object and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            df[c] = df[c].astype(float)
    return df


def ablation_document(ds: xr.Dataset, *, dataset_path=None, n_boot: int | None = None) -> tuple[Document, list]:
    """The report of an ablation dataset, and its tables as CSV files [(name, bytes)]. ``n_boot``:
    the resamples of the stored findings' intervals (findings computed with another count are
    computed again by the study, for datasets from before they were stored)."""
    from ..numerics.keys import factors as registered
    from ..numerics.metrics.bootstrap import few_samples
    from .ablation_figures import (fig_attribution, fig_block, fig_interactions, fig_main_effects, fig_per_data,
                                   fig_seqlen)
    from .summary import provenance_items

    settings = None
    if n_boot is not None:
        settings = {"n_boot": int(n_boot)}
        ds = ds.copy()
        ds.attrs["findings_n_boot"] = int(n_boot)
    f = findings_of(ds, settings, kind="ablation")
    tabs = {k: _frame(t) for k, t in f["tables"].items()}
    me, it, per_data, blk, seq = (tabs[k] for k in ("effects", "interactions", "effects_per_data", "block_quant",
                                                    "seqlen"))
    att_all = tabs["attribution"] if len(tabs["attribution"]) else None
    base = f["base_shape"]
    att = att_all
    if att is not None:
        att = att[(att["head_dim"] == base["head_dim"]) & (att["causal"] == base["causal"])]
    named = f["named"]
    extra = [(f"{name}.csv", df.to_csv(index=False, float_format="%.6g").encode())
             for name, df in (("effects", me), ("interactions", it), ("effects_per_data", per_data),
                              ("block_quant", blk), ("seqlen", seq), ("attribution", att_all))
             if df is not None and len(df)]
    figs = []
    if len(me):
        figs.append(fig_main_effects(me))
    if f["interaction_means"]:
        figs.append(fig_interactions(f["interaction_means"]))
    if len(per_data):
        figs.append(fig_per_data(per_data, f["factors"]))
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
                                        f"{base['head_dim']}, causal {base['causal']}",
                                        f"attribution_{_slug(str(d))}", labels=f["labels"], stages=f["stages"],
                                        keep=list(named.values()), short=f"Attribution: {d}"))
    figs = [f for f in figs if f is not None]

    doc = Document(f"Ablation: {md_text(ds.attrs.get('description', ''))}", verdict_block(f))
    at = ds.attrs
    doc.lead.append(Para(f"**Where it ran:** {md_text(at.get('device_name', '?'))} (device {md_code(at.get('device', '?'))}, backend "
                         f"{md_code(at.get('backend', '?'))}, {md_text(at.get('cpu_cores', '?'))} cores, dask workers "
                         f"{md_text(at.get('workers', '?'))}); the sweep took {md_text(at.get('wall_seconds', '?'))} s. **Command:** "
                         f"{md_code(at.get('command', '?'))}", "where"))
    nf = f["nonfinite"]
    if nf:
        doc.lead += [Para(nf[0], "warning"), Bullets(nf[1:], "warning")]
    if few_samples(f["samples"]):
        doc.lead.append(Para(f"**Few samples.** Each cell has {f['samples']} (seed, batch, head) samples, fewer than 8: "
                             "the intervals are rough.", "warning"))
    doc.sections.append(Section("Findings (generated from the data)", [Bullets(f["lines"], "headline")]))
    designs = json.loads(ds.attrs.get("designs", "{}"))
    reg = registered()
    factors = f["factors"]
    default = {x: reg[x].default if x in reg else "?" for x in factors}
    n_full = int((ds["stage"] == "full").sum())
    doc.sections.append(Section("Design", [
        Para(f"{n_full} recipes over data {', '.join(f'{md_code(d)}' for d in ds['data'].values)}, seqlen "
             f"{[int(s) for s in ds['seqlen'].values]}, head dim {[int(h) for h in ds['head_dim'].values]}, causal "
             f"{[bool(c) for c in ds['causal'].values]}; {int(ds.coords['heads'])} heads x batch "
             f"{int(ds.coords['batch_size'])} x seeds {attr_list(ds, 'seeds')} samples, "
             f"{int(ds.coords['rows'])} query rows each. Recipes are {md_code('|'.join(factors))} over the base "
             f"{md_code(ds.attrs.get('base_recipe'))}; designs (full factorials, unlisted factors at "
             f"{'|'.join(default[x] for x in factors)}):"),
        Bullets([f"{md_code(k)}: " + ", ".join(f"{x} {{{', '.join(v)}}}" for x, v in d["levels"].items() if len(v) > 1)
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


def render_report(ds: xr.Dataset, out, *, dataset_path=None, n_boot: int | None = None,
                  formats=("html", "md")):
    """Write report.md, report.html, figures (PNG, SVG) and tables (CSV) for an ablation dataset
    into ``out``; return the path of report.md."""
    from pathlib import Path

    from .document import write_document

    doc, extra = ablation_document(ds, dataset_path=dataset_path, n_boot=n_boot)
    write_document(doc, out, stem="report", formats=formats, figure_dir="", extra=extra)
    return Path(out) / "report.md"
