"""Plain-text and Markdown summaries of a run's dataset (tables only; figures live in report/).

Exposed: ``text_table``, ``markdown_table``, ``markdown_summary``, ``provenance_block``.
"""

from __future__ import annotations

import math

import xarray as xr

from ..engine.dataset import summary_table


def _e(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}" if abs(x) >= 0.01 and abs(x) < 1000 else f"{x:.2e}"


def _rows(ds: xr.Dataset, metric: str):
    rows = summary_table(ds, metric)
    keys = [k for k in rows[0] if k not in ("variant", "value", "lo", "hi", "n", "paper", "ratio")] if rows else []
    return rows, keys


def text_table(ds: xr.Dataset, metric: str = "rmse") -> str:
    rows, keys = _rows(ds, metric)
    head = keys + ["variant", metric, "95% CI", "samples", "paper", "ours/paper"]
    body = [[str(r[k]) for k in keys] + [r["variant"], _e(r["value"]), f"[{_e(r['lo'])}, {_e(r['hi'])}]", str(r["n"]),
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
        cols = [str(r[k]) for k in keys] + [f"`{r['variant']}`", _e(r["value"]), f"[{_e(r['lo'])}, {_e(r['hi'])}]",
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


def markdown_summary(ds: xr.Dataset) -> str:
    title = ds.attrs.get("description") or ds.attrs.get("experiment", "run")
    spec_lines = "\n".join(f"- `{v}`: `{s}`" for v, s in zip(ds["variant"].values, ds["spec"].values))
    return (f"# {ds.attrs.get('experiment', 'run')}: {title}\n\n## RMSE against the float64 reference\n\n"
            f"{markdown_table(ds)}\n\n## Provenance\n\n{provenance_block(ds)}\n\n## Variants (full recipe specs)\n\n"
            f"{spec_lines}\n")

