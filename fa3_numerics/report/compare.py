"""The comparison of two runs as text and Markdown.

Exposed: ``text_report``, ``markdown_report``.
"""

from __future__ import annotations

import math

import xarray as xr

from ..studies.compare import findings
from .format import fmt_e as _e
from .format import nonfinite_text


def _table(res: dict) -> tuple[list[str], list[list[str]]]:
    m = res["metric"]
    head = res["dims"] + ["variant", f"A {m}", "A 95% CI", f"B {m}", "B 95% CI", "B/A", "B/A 95% CI", "covers 1"]
    body = []
    for r in res["rows"]:
        cov = "-" if r["covers_1"] is None else ("yes" if r["covers_1"] else "NO")
        side = {s: (nonfinite_text(r[f"nonfinite_{s}"], r[f"n_{s}"]) if r[f"nonfinite_{s}"] else _e(r[s]))
                for s in ("a", "b")}
        body.append([str(r[d]) for d in res["dims"]] + [
            r["variant"] + ("" if r["same_spec"] else " (*)"), side["a"], f"[{_e(r['a_lo'])}, {_e(r['a_hi'])}]",
            side["b"], f"[{_e(r['b_lo'])}, {_e(r['b_hi'])}]",
            "-" if not math.isfinite(r["ratio"]) else f"{r['ratio']:.3f}",
            f"[{'-' if not math.isfinite(r['ratio_lo']) else format(r['ratio_lo'], '.3f')}, "
            f"{'-' if not math.isfinite(r['ratio_hi']) else format(r['ratio_hi'], '.3f')}]", cov])
    return head, body


def _side(label: str, path: str, ds: xr.Dataset, code: str = "") -> str:
    at = ds.attrs
    return (f"{label}: {code}{path}{code} — {at.get('device_name', '?')} ({at.get('device', '?')}), backend "
            f"{at.get('backend', '?')}, seeds {at.get('seeds', '?')}, commit {str(at.get('git_commit', '?'))[:12]}; "
            f"command: {code}{at.get('command', '?')}{code}")


def _notes(res: dict) -> list[str]:
    rows = res["rows"]
    bad = findings(res)
    n_cov = sum(1 for r in rows if r["covers_1"])
    n_def = sum(1 for r in rows if r["covers_1"] is not None)
    notes = [f"{n_cov} of {n_def} ratio intervals (95%, bootstrap of B/A over each side's samples) cover 1."]
    if bad:
        notes.insert(0, f"NON-FINITE: {len(bad)} side(s) of a compared row hold NaN or Inf samples and have no value "
                        "or ratio: " + "; ".join(bad) + ".")
    if any(not r["same_spec"] for r in rows):
        notes.append("(*) the variant's recipe spec differs between A and B.")
    if res["differs"]:
        notes.append("fixed parameters that differ: " + "; ".join(res["differs"]) + ".")
    if res["only_a"]:
        notes.append("only in A (not compared): " + ", ".join(res["only_a"]) + ".")
    if res["only_b"]:
        notes.append("only in B (not compared): " + ", ".join(res["only_b"]) + ".")
    return notes


def text_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    head, body = _table(res)
    widths = [max(len(h), *(len(x[i]) for x in body)) for i, h in enumerate(head)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    lines = [_side("A", path_a, a), _side("B", path_b, b), "", fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(x) for x in body]
    return "\n".join(lines + [""] + _notes(res))


def markdown_report(res: dict, a: xr.Dataset, b: xr.Dataset, path_a: str, path_b: str) -> str:
    head, body = _table(res)
    lines = [f"# Comparison of {res['metric']}: B / A", "", f"- {_side('A', path_a, a, '`')}",
             f"- {_side('B', path_b, b, '`')}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(x) + " |" for x in body]
    return "\n".join(lines + [""] + [f"- {n}" for n in _notes(res)]) + "\n"
