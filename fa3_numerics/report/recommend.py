"""The report of a ``recommend`` study: the verdict first, then the evidence. Reads the dataset only
(its ``findings`` attribute, written by ``studies.recommend_dataset``, and its variables);
computes nothing the study did not.

Exposed: ``recommend_document``, ``render_recommend``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .document import Bullets, Document, Para, Section, Table, Verdict, write_document
from .stored import findings_of
from ..text import fmt_e


LONG_LABEL = 48  # characters of a recipe label past which a table names it by a short name


def _m(v: dict) -> str:
    return (f"KL mean {fmt_e(v['kl_mean'])} ({v['bf16_multiple']:.1f}x BF16 SDPA), top-1 "
            f"{100 * v['top1_agree']:.2f}%, dppl {v['ppl_delta']:+.4f}")


def _verdict(f: dict) -> list:
    b = f["budget"]
    budget = f"KL mean <= {fmt_e(b['kl_mean'])} ({b['source']})" + (
        f", |dppl| <= {b['ppl_delta']:g}" if b["ppl_delta"] is not None else "") + (
        f", top-1 >= {b['top1']:g}" if b["top1"] is not None else "")
    lines = []
    c = f["choice"]
    if c:
        lines.append(f"**Use `{c['label']}`** on {f['target']}: {_m(c)}, measured end to end on held-out text.")
        if c["exceptions"]:
            lines.append("Per-layer exceptions: " + ", ".join(f"layer {e['layer']}: `{e['recipe']}`" for e in
                                                            c["exceptions"]) + f" (the rest `{c['majority']}`).")
    else:
        cl = f["closest"]
        lines.append(f"**No verified candidate meets the budget.** Closest: `{cl['label']}`, {_m(cl)}.")
    for a in f["avoid"][:3]:
        indicated = a.get("worst_layer_indicated")  # absent in datasets of the first version
        why = f"{a['worst_layer_share'] * 100:.0f}% of its predicted KL in layer {a['worst_layer']} " + (
            f"(diagnosis there: {a['worst_layer_diagnosis']})" if indicated is None else
            f"({a['worst_layer_diagnosis']} indicated there)" if indicated else
            f"(no statistic over its threshold there; nearest: {a['worst_layer_diagnosis']})")
        if a["saturation"]:
            s = a["saturation"][0]
            why += f"; its fixed {s['tensor'].upper()} scale saturates {s['count']} held-out entries (worst: layer " \
                   f"{s['worst_layer']}, head {s['worst_head']})"
        lines.append(f"Avoid `{a['candidate']}`: KL mean {fmt_e(a['kl_mean'])} ({a['bf16_multiple']:.0f}x BF16"
                     f"{'' if a['measured'] else ', predicted'}); {why}.")
    ds_ = f.get("diagnosis_summary")
    if ds_ and ds_["failing_layers"]:
        stat = ", ".join(f"{k} in {v}" for k, v in sorted(ds_["by_statistic"].items(), key=lambda x: -x[1]))
        meas = ", ".join(f"{k} in {v}" for k, v in sorted(ds_["by_measurement"].items(), key=lambda x: -x[1]))
        first = f["diagnosis"][0]["first_candidate"]
        n = ds_["failing_layers"]
        lines.append(f"Diagnosis of the {n} layer{'s' if n != 1 else ''} where `{first}` alone spends more than its "
                     "share of the budget: " + (f"the statistics point to {stat}" if stat else
                                                "no statistic over its threshold")
                     + (f"; measured, the largest rel_l2 reduction comes from {meas}" if meas else "") + ".")
    lines.append(f"Budget: {budget}.")
    return [Verdict(lines)]


def recommend_document(ds) -> Document:
    f = findings_of(ds)
    doc = Document(f"recommend: {f['model']} on {f['target']}")
    doc.lead = _verdict(f) + [Para(f"Calibration: {f['texts']['calibration']}; held-out: {f['texts']['held_out']}; "
                                   f"reference ppl {f['reference_ppl']:.4g}; accumulator {f['accumulator']}; "
                                   f"{f['seconds']:.0f} s.", role="where")]
    # a per-layer map is listed under the table by a short name: in a cell it stretched the table
    # past the page
    maps = [v["label"] for v in f["verified"] if len(v["label"]) > LONG_LABEL]
    short = {lab: f"map {i + 1} (below)" for i, lab in enumerate(maps)}
    rows = [[short.get(v["label"], v["label"]), v["kind"], fmt_e(v["predicted"]), fmt_e(v["kl_mean"]),
             f"{v['bf16_multiple']:.1f}", f"{100 * v['top1_agree']:.2f}%", f"{v['ppl_delta']:+.4f}", str(v["cost"]),
             "yes" if v["meets"] else "no"]
            for v in f["verified"]]
    bf = f["bf16_sdpa"]
    rows.append(["model's own BF16 SDPA", "noise", "", fmt_e(bf["kl_mean"]), "1.0", f"{100 * bf['top1_agree']:.2f}%",
                 f"{bf['ppl_delta']:+.4f}", "", ""])
    verified = Section("Verified end to end", [Table(["recipe", "kind", "predicted KL", "KL mean", "x BF16", "top-1",
                                                      "dppl", "cost", "meets"], rows,
                                                     numeric=[False, False] + [True] * 6 + [False])]
                       + ([Bullets([f"{short[m].split(' (')[0]}: `{m}`" for m in maps])] if maps else []))
    cand = [str(c) for c in ds["candidate"].values]
    screen_rows = []
    for c in cand:
        s = ds.sel(candidate=c)
        sat = int(s.saturated.sum())
        screen_rows.append([c, fmt_e(float(s.predicted_kl)), str(int(s.cost)),
                            fmt_e(float(s.rel_l2_pooled.max())), str(int(np.nanargmax(s.rel_l2_pooled.values))),
                            str(sat)])
    screen = Section("Screen: every candidate, every layer", [
        Para("rel_l2 on the held-out Q, K, V of each layer; predicted KL = sum over layers of gain x rel_l2^2, the "
             "gain measured one layer at a time with the first candidate."),
        Table(["candidate", "predicted KL", "cost", "worst layer rel_l2", "worst layer", "saturated entries"],
              screen_rows, numeric=[False, True, True, True, True, True])])
    def _said(x):
        head = f"{x['statistic']} = {x['value']:.3g} (threshold {x['threshold']:g})"
        if x["indicated"]:
            return f"{head}: {x['why']} -> {x['what']}"
        return f"no statistic reaches its threshold; the nearest is {head}, which points to {x['what']}"

    diag = [f"Layer {d['layer']}: `{d['first_candidate']}` alone costs KL {fmt_e(d['layer_kl'])} "
            f"({100 * d['share']:.0f}% of the budget). {_said(d['diagnosis'])}"
            + (f"; of the remedies indicated, {d['measured_best']['remedy']} lowers this layer's rel_l2 most "
               f"({d['measured_best']['gain']:.2f}x)" if d.get("measured_best") and
               d["measured_best"]["remedy"] != d["diagnosis"]["remedy"] else "")
            + ("; measured: " + ", ".join(f"`{x['candidate']}` rel_l2 {x['rel_l2']:.3g} (" + (
                f"{x['gain']:.2f}x lower)" if x["gain"] >= 1 else f"{1 / x['gain']:.2f}x higher)")
                for x in d["remedy_measured"]) if d["remedy_measured"] else "")
            for d in f["diagnosis"]]
    order = sorted(range(len(f["diagnosis"])), key=lambda i: -f["diagnosis"][i]["share"])
    table = Table(["layer", "KL share of budget", "statistic (value / threshold)", "indicated", "measured best"],
                  [[str(d["layer"]), f"{100 * d['share']:.0f}%", f"{d['diagnosis']['statistic']} "
                    f"({d['diagnosis']['value']:.3g} / {d['diagnosis']['threshold']:g})",
                    ", ".join(r["remedy"] for r in d["ranked"] if r["indicated"]) or "none",
                    (f"{d['measured_best']['remedy']} ({d['measured_best']['gain']:.2f}x)"
                     if d.get("measured_best") else "")] for d in f["diagnosis"]],
                  numeric=[True, True, False, False, False], long=len(f["diagnosis"]) > 12,
                  summary="every failing layer")
    diagnosis = Section("Diagnosis per failing layer", [
        Para("The layers that cost most, worst first:"), Bullets([diag[i] for i in order[:8]]), table]
        if diag else [Para("No layer spends more than its share of the budget under the first candidate.")])
    sat_rows = [[s["candidate"], s["tensor"].upper(), str(s["count"]), ",".join(map(str, s["layers"][:12])),
                 f"layer {s['worst_layer']}, head {s['worst_head']} ({s['worst_count']})"] for s in f["saturation"]]
    saturation = Section("Calibrated scales on held-out text", [
        Table(["candidate", "tensor", "saturated", "layers", "worst"], sat_rows) if sat_rows else
        Para("No calibrated scale saturates on the held-out text.")])
    dep = f["deploy"] or {}
    dep_blocks = [Para(dep["how"])] if dep.get("how") else []
    if dep.get("layout"):
        dep_blocks = [Bullets([f"scales: {dep['layout']['scales']}", f"layers kept in BF16: "
                               f"{dep.get('keep_bf16_layers') or 'none'}; switch: {dep['layout']['skip_layers']}"])]
    if dep.get("layers"):
        def _scales(row):
            got = [f"{t} {fmt_e(row[t + '_scale'][0])}" + ("..." if len(row[t + "_scale"]) > 1 else "")
                   for t in ("q", "k", "v") if t + "_scale" in row]
            if row.get("fp8") is False:
                return "none (16-bit kernel)"
            return ", ".join(got) or "from each call's amax"

        dep_blocks.append(Table(["layer", "recipe", "rotation", "K smoothing", "descales"],
                                [[str(r["layer"]), r["recipe"], r.get("rotation", "none"),
                                  "static mean" if "k_mean" in r else r.get("smoothing", "none"), _scales(r)]
                                 for r in dep["layers"]], long=len(dep["layers"]) > 12,
                                summary="per-layer deployment"))
    dep_blocks.append(Para("The per-layer values (rotation, K mean, q/k/v scales) are in recommend.json. " + f["decode"]
                           + "."))
    deploy = Section("What the target takes", dep_blocks)
    return Document(doc.title, doc.lead, [verified, diagnosis, saturation, deploy, screen])


def render_recommend(ds, out_dir: str | Path, formats=("html", "md")) -> list[Path]:
    return write_document(recommend_document(ds), out_dir, stem="report", figure_dir="", formats=tuple(formats))


def console(ds) -> tuple[str, list[str]]:
    """What ``recommend`` prints when done: the choice and what it costs against BF16 SDPA."""
    import json

    art = json.loads(ds.attrs.get("artifact", "{}") or "{}")
    c = art.get("choice")
    if not c:
        return "", []
    return (f"use {c['label']}: KL mean {c['kl_mean']:.3g} ({c['bf16_multiple']:.1f}x BF16 SDPA), top-1 "
            f"{100 * c['top1_agree']:.2f}%, dppl {c['ppl_delta']:+.4f}"), []


__all__ = ["recommend_document", "render_recommend"]
