"""Plain-text and Markdown summaries of a run's dataset (tables only; figures live in report/).

Exposed: ``text_table``, ``markdown_table``, ``markdown_summary``, ``provenance_block``,
``nonfinite_block``.

A variant whose samples hold NaN or Inf shows "non-finite (k of n samples)" in place of its
value, and the summary opens with the list of such results: never an estimate over the finite
rest that would read as complete.
"""

from __future__ import annotations

import math

import xarray as xr

from ..engine.dataset import summary_table
from .format import fmt_e as _e
from .format import fmt_value


def _rows(ds: xr.Dataset, metric: str):
    rows = summary_table(ds, metric)
    keys = [k for k in rows[0] if k not in ("variant", "value", "lo", "hi", "n", "nonfinite", "paper", "ratio")] \
        if rows else []
    return rows, keys


def text_table(ds: xr.Dataset, metric: str = "rmse") -> str:
    rows, keys = _rows(ds, metric)
    head = keys + ["variant", metric, "95% CI", "samples", "paper", "ours/paper"]
    body = [[str(r[k]) for k in keys] + [r["variant"], fmt_value(r["value"], r["nonfinite"], r["n"]),
                                           f"[{_e(r['lo'])}, {_e(r['hi'])}]", str(r["n"]),
                                           _e(r["paper"]), "-" if not math.isfinite(r["ratio"]) else f"{r['ratio']:.2f}"]
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def markdown_table(ds: xr.Dataset, metric: str = "rmse") -> str:
    rows, keys = _rows(ds, metric)
    head = keys + ["variant", metric, "95% CI", "samples", "paper (Table 3)", "ours / paper"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        value = fmt_value(r["value"], r["nonfinite"], r["n"])
        cols = [str(r[k]) for k in keys] + [f"`{r['variant']}`", f"**{value}**" if r["nonfinite"] else value,
                                            f"[{_e(r['lo'])}, {_e(r['hi'])}]",
                                            str(r["n"]), _e(r["paper"]),
                                            "-" if not math.isfinite(r["ratio"]) else f"{r['ratio']:.2f}"]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def provenance_block(ds: xr.Dataset) -> str:
    a = ds.attrs
    fixed = {k: ds.coords[k].values.item() for k in ds.coords if ds.coords[k].ndim == 0}
    lines = [
        f"- command: `{a.get('command', '?')}`",
        f"- device: {a.get('device', '?')} ({a.get('device_name', '?')}), backend `{a.get('backend', '?')}`",
        f"- git commit: `{a.get('git_commit', '?')}`; created {a.get('created_utc', '?')}; wall time {a.get('wall_seconds', '?')} s",
        f"- versions: fa3-numerics {a.get('version_fa3_numerics')}, torch {a.get('version_torch')}, "
        f"numpy {a.get('version_numpy')}, xarray {a.get('version_xarray')}, python {a.get('python')}",
        f"- distribution `{a.get('dist')}`; fixed parameters: " + ", ".join(f"{k}={v}" for k, v in fixed.items()),
        f"- seeds {a.get('seeds')}; query rows: {a.get('rows_sampling')}; interval: 95% percentile bootstrap "
        f"over (seed, batch, head) samples",
    ]
    return "\n".join(lines)


def nonfinite_block(ds: xr.Dataset) -> str:
    """Markdown list of the results holding NaN or Inf ('' when there are none)."""
    from ..engine.nonfinite import scan

    found = scan(ds)
    if not found:
        return ""
    return ("**Non-finite results.** These variants produced NaN or Inf outputs (or the float64 reference did); "
            "their pooled values read \"non-finite (k of n samples)\":\n\n" + "\n".join(f"- {f.line()}" for f in found))


def markdown_summary(ds: xr.Dataset) -> str:
    title = ds.attrs.get("description") or ds.attrs.get("experiment", "run")
    spec_lines = "\n".join(f"- `{v}`: `{s}`" for v, s in zip(ds["variant"].values, ds["spec"].values))
    flag = nonfinite_block(ds)
    return (f"# {ds.attrs.get('experiment', 'run')}: {title}\n\n" + (f"{flag}\n\n" if flag else "") +
            "## RMSE against the float64 reference\n\n"
            f"{markdown_table(ds)}\n\n## Provenance\n\n{provenance_block(ds)}\n\n## Variants (full recipe specs)\n\n"
            f"{spec_lines}\n")

