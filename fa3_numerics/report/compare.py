"""The comparison of two runs as text, Markdown and HTML: warnings first, then the table.

Exposed: ``text_report``, ``markdown_report``, ``html_report``, ``compare_document``, ``warnings``.

What can make a comparison misleading comes before the numbers: settings that differ between the
runs (seqlen 512 against 8192), sides with non-finite samples, intervals on fewer than 8 samples,
recipes that differ under one label. Then the table, one number format per column.
"""

from __future__ import annotations

import math

import xarray as xr

from .document import Bullets, Document, Section, Table, Verdict, md_code, md_text, render
from ..text import column_format, fmt_interval, nonfinite_text, ratio_format


def _plain(text) -> str:
    return str(text)


def _table(res: dict, code=_plain, text=_plain) -> Table:
    """The ratios table; ``code`` / ``text`` wrap the names in it (``md_code`` / ``md_text`` for Markdown)."""
    m = res["metric"]
    rows = res["rows"]
    fa = column_format([x for r in rows for x in (r["a"], r["a_lo"], r["a_hi"])])
    fb = column_format([x for r in rows for x in (r["b"], r["b_lo"], r["b_hi"])])
    # ratios near 1 need the digits that tell them apart (0.9987 beside 1.0004)
    fr = ratio_format([x for r in rows for x in (r["ratio"], r["ratio_lo"], r["ratio_hi"])])
    head = res["dims"] + ["variant", f"A {m}", "A 95% CI", f"B {m}", "B 95% CI", "B/A", "B/A 95% CI", "covers 1"]
    body = []
    for r in rows:
        cov = "-" if r["covers_1"] is None else ("yes" if r["covers_1"] else "NO")
        side = {s: (nonfinite_text(r[f"nonfinite_{s}"], r[f"n_{s}"]) if r[f"nonfinite_{s}"] else f(r[s]))
                for s, f in (("a", fa), ("b", fb))}
        ratio_ci = "-" if not math.isfinite(r["ratio_lo"]) else f"[{fr(r['ratio_lo'])}, {fr(r['ratio_hi'])}]"
        body.append([text(r[d]) for d in res["dims"]] + [
            code(r["variant"]) + ("" if r["same_spec"] else " (*)"), side["a"], fmt_interval(r["a_lo"], r["a_hi"], fa),
            side["b"], fmt_interval(r["b_lo"], r["b_hi"], fb), fr(r["ratio"]), ratio_ci, cov])
    numeric = [False] * len(res["dims"]) + [False, True, True, True, True, True, True, False]
    return Table(head, body, numeric)


def _side(label: str, path: str, ds: xr.Dataset, code=_plain, text=_plain) -> str:
    from ..engine.conventions import attr_list

    at = ds.attrs
    backend = at.get("backend") or (", ".join(dict.fromkeys(str(b) for b in ds["backend"].values))
                                    if "backend" in ds.coords else "?")
    return (f"{label}: {code(path)} — {text(at.get('device_name', '?'))} ({text(at.get('device', '?'))}), backend "
            f"{text(backend)}, seeds {attr_list(ds, 'seeds') or '?'}, commit "
            f"{text(str(at.get('git_commit', '?'))[:12])}; command: {code(at.get('command', '?'))}")


def warnings(res: dict) -> list[str]:
    """What to read before the table: differing settings, non-finite sides, few samples."""
    out = []
    if res["differs"]:
        out.append("SETTINGS DIFFER between the runs (the ratios compare different settings): "
                   + "; ".join(res["differs"]) + ".")
    bad = res["nonfinite"]
    if bad:
        out.append(f"NON-FINITE: {len(bad)} side(s) of a compared row hold NaN or Inf samples and have no value "
                   "or ratio: " + "; ".join(bad) + ".")
    out += res["sample_warnings"]
    if any(not r["same_spec"] for r in res["rows"]):
        out.append("(*) the variant's recipe spec differs between A and B.")
    return out


def _notes(res: dict, code=_plain) -> list[str]:
    rows = res["rows"]
    n_cov = sum(1 for r in rows if r["covers_1"])
    n_def = sum(1 for r in rows if r["covers_1"] is not None)
    how = ("paired: both runs hold the same (seed, batch, head) samples" if res.get("paired")
           else "the two runs' samples resampled independently")
    notes = [f"{n_cov} of {n_def} ratio intervals (95% BCa bootstrap of B/A; {how}) cover 1."]
    if res["only_a"]:
        notes.append("only in A (not compared): " + ", ".join(map(code, res["only_a"])) + ".")
    if res["only_b"]:
        notes.append("only in B (not compared): " + ", ".join(map(code, res["only_b"])) + ".")
    return notes


def text_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    t = _table(res)
    body = [[c.replace("`", "") for c in r] for r in t.rows]
    widths = [max(len(h), *(len(x[i]) for x in body)) if body else len(h) for i, h in enumerate(t.columns)]

    def line(cols):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cols, widths, t.numeric)).rstrip()

    lines = [f"warning: {w}" for w in warnings(res)]  # what makes the numbers misleading, first
    lines += [line.replace("**", "").replace("`", "") for line in res["verdict"]["lines"]]
    lines += [_side("A", path_a, a), _side("B", path_b, b), "", line(t.columns), line(["-" * w for w in widths])]
    lines += [line(x) for x in body]
    return "\n".join(lines + [""] + _notes(res))


def compare_document(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> Document:
    doc = Document(f"Comparison of {res['metric']}: B / A")
    if res["verdict"]["lines"]:
        doc.lead.append(Verdict(res["verdict"]["lines"]))
    warn = warnings(res)
    if warn:
        doc.lead.append(Bullets([md_text(w) for w in warn], "warning"))
    doc.lead.append(Bullets([_side("A", path_a, a, md_code, md_text), _side("B", path_b, b, md_code, md_text)],
                            "where"))
    doc.sections.append(Section("Ratios", [_table(res, md_code, md_text), Bullets(_notes(res, md_code), "note")]))
    return doc


def markdown_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    return render(compare_document(res, a, b, path_a, path_b), "md")


def html_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    return render(compare_document(res, a, b, path_a, path_b), "html")


__all__ = ["text_report", "markdown_report", "html_report", "compare_document", "warnings"]
