"""The report of `run backward`: gradient errors per variant, and their attribution per product.

Exposed: ``gradient_table``, ``attribution_rows``, ``markdown_report``.

Every figure pools the (seed, batch, head) samples of one cell (RMSE as the root of the mean square,
the rest as means) with its 95% BCa interval (``metrics.bootstrap_ci``); a sample holding NaN or
Inf makes its figure "non-finite (k of n samples)", never an estimate over the rest.
"""

from __future__ import annotations

import numpy as np

from ..numerics.metrics import bootstrap_ci, nonfinite_samples, pooled
from ..numerics.metrics.bootstrap import few_samples
from ..studies.backward import GRAD_NAMES, GRADS, SHARE_STAGES, STAGES, stage_shares
from .document import Table, md_table
from ..text import FEW, fmt_e, fmt_interval, nonfinite_text
from .summary import fmt_param, provenance_block

_SAMPLE = ("seed", "batch", "head", "kv_head")


def _cells(ds):
    sweep = [d for d in ds["o_rmse"].dims if d not in _SAMPLE + ("variant", "stage")]
    for idx in np.ndindex(*(ds.sizes[d] for d in sweep)):
        yield {d: ds[d].values[i].item() for d, i in zip(sweep, idx)}


def _figure(values: np.ndarray, metric: str) -> str:
    bad, n = nonfinite_samples(values)
    if bad:
        return nonfinite_text(bad, n)
    est = pooled(metric, values)
    lo, hi = bootstrap_ci(metric, values) if n > 1 else (np.nan, np.nan)
    return f"{fmt_e(est)} {fmt_interval(lo, hi, few=few_samples(n))}"


def gradient_table(ds, where: dict, metric: str = "rel_l2") -> Table:
    """Per variant: ``metric`` of O, dQ, dK, dV (stage ``full``) with intervals."""
    rows = []
    for v in ds["variant"].values:
        cells = [str(v)]
        for g in GRADS:
            x = ds[f"{g}_{metric}"].sel(variant=v, stage="full", **where).values.ravel()
            cells.append(_figure(x, metric))
        rows.append(cells)
    return Table(["variant"] + [f"{GRAD_NAMES[g]} {metric}" for g in GRADS], rows, [False] + [True] * len(GRADS))


def attribution_rows(ds, where: dict) -> list[list[str]]:
    """Per (variant, gradient): the share of each stage's MSE, the additivity ratio, and ``fwd+s``'s
    MSE relative to the full recipe's."""
    sub = ds.sel(**where) if where else ds
    rows = []
    for v in ds["variant"].values:
        for g in ("dq", "dk", "dv"):
            sh = stage_shares(sub, g, str(v))
            full = float(np.nanmean(sub[f"{g}_rmse"].sel(variant=v, stage="full").values ** 2))
            both = float(np.nanmean(sub[f"{g}_rmse"].sel(variant=v, stage="fwd+s").values ** 2))
            top = max(SHARE_STAGES, key=lambda s: sh[s] if np.isfinite(sh[s]) else -1)
            rows.append([str(v), GRAD_NAMES[g]] + [f"{100 * sh[s]:.1f}%" for s in SHARE_STAGES]
                        + [f"{sh['additivity']:.2f}", f"{both / full:.2f}" if full > 0 else "-", top])
    return rows


def markdown_report(ds) -> str:
    lines = ["# Backward pass: gradient error of low-precision attention", "",
             f"Distribution `{ds.attrs.get('dist')}`; every query row; dO ~ N(0, 1) ({ds.attrs.get('do_seed')}); "
             f"reference: {ds.attrs.get('reference')}. Figures: pooled over (seed, batch, head) samples with 95% BCa "
             f"intervals ({FEW} marks fewer than 8 samples).", ""]
    attribution = "stage" in ds.coords and "fwd" in [str(s) for s in ds["stage"].values]
    for where in _cells(ds):
        head = ", ".join(f"{k}={fmt_param(v)}" for k, v in where.items()) or "single cell"
        lines += [f"## {head}", "", "### Relative L2 error (||x - x_ref|| / ||x_ref||)", "",
                  md_table(gradient_table(ds, where, "rel_l2")), "", "### Cosine similarity", "",
                  md_table(gradient_table(ds, where, "cosine")), ""]
        if attribution:
            cols = ["variant", "grad"] + SHARE_STAGES_LABELS + ["full / sum", "fwd+s / full", "largest"]
            lines += ["### Attribution: share of the summed stage MSE (each stage alone in low precision)", "",
                      md_table(Table(cols, attribution_rows(ds, where), [False, False] + [True] * (len(cols) - 3)
                                     + [False])), "",
                      "Stages: " + "; ".join(f"`{s}`: {STAGES[s]}" for s in STAGES) + ". `full / sum` below 1: "
                      "the stages' errors cancel in the full recipe (a forward and a backward that quantize Q and K "
                      "alike give a consistent P); `fwd+s / full`: the forward and the S recompute together, "
                      "relative to the full recipe's MSE.", ""]
    lines += ["## Variants", ""] + [f"- `{v}`: `{s}`" for v, s in zip(ds["variant"].values, ds["spec"].values)]
    lines += ["", "## Provenance", "", provenance_block(ds), ""]
    return "\n".join(lines)


SHARE_STAGES_LABELS = list(SHARE_STAGES)

__all__ = ["gradient_table", "attribution_rows", "markdown_report"]
