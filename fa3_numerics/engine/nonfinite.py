"""Non-finite results, found and said out loud.

Exposed: ``Finding``, ``scan``, ``scan_counts``, ``warn``, ``enforce``, ``summary_line``.

A result is non-finite when an output (or the float64 reference) holds NaN or Inf: the metric
``nonfinite`` counts such positions per (batch, head) sample. Every command scans what it
computed (``scan``), prints one warning per (variant, cell, seed) naming the count
(``warn``), flags it in its summary and report, and ends with exit code 3 after writing its
files (``enforce``), unless the user passed ``--allow-nonfinite``. Cells a study never ran are
NaN in ``nonfinite`` and are not findings.

A finite output can still give a NaN metric: one undefined on the data (the cosine of an
all-zero output, an error relative to an all-zero reference; the metric registry's
``undefined``). Every NaN of a stored metric in a sample that ran and is finite is a finding
too, with the metric, where, how many samples and why, and ends the command with exit 3 the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import xarray as xr

from ..errors import NonFiniteError


@dataclasses.dataclass(frozen=True)
class Finding:
    variant: str
    where: dict  # the cell: dim -> value (seed included when the data has seeds)
    count: int  # non-finite positions (for an undefined metric: its NaN samples)
    samples: int  # samples holding at least one
    of: int  # samples in the cell
    metric: str = ""  # set for a metric that is NaN on finite outputs
    reason: str = ""  # why that metric is NaN there

    def line(self) -> str:
        cell = ", ".join(f"{k}={_fmt(v)}" for k, v in self.where.items() if k != "seed") or "single cell"
        seed = f", seed {_fmt(self.where['seed'])}" if "seed" in self.where else ""
        if self.metric:
            why = f" ({self.reason})" if self.reason else ""
            return (f"undefined metric: variant {self.variant!r}, {cell}{seed}: {self.metric} is NaN in "
                    f"{self.samples} of {self.of} samples with finite outputs{why}")
        return (f"non-finite results: variant {self.variant!r}, {cell}{seed}: {self.count} non-finite value(s) in "
                f"{self.samples} of {self.of} samples")


def _fmt(v) -> str:
    v = v.item() if hasattr(v, "item") else v
    return f"{v:g}" if isinstance(v, float) else str(v)


def scan_counts(counts: xr.DataArray, sample_dims, *, variant_dim: str = "variant",
                fixed: dict | None = None) -> list[Finding]:
    """Findings of a count array: one per cell (every dim but ``sample_dims``) with a count > 0."""
    sample_dims = [d for d in sample_dims if d in counts.dims]
    cells = [d for d in counts.dims if d not in sample_dims]
    arr = counts.transpose(*cells, *sample_dims).values
    flat = arr.reshape(arr.shape[:len(cells)] + (-1,)) if cells else arr.reshape(1, -1)
    out = []
    for idx in np.ndindex(*flat.shape[:-1]):
        v = flat[idx]
        ran = ~np.isnan(v)
        if not ran.any() or not (v[ran] > 0).any():
            continue
        where = {d: counts[d].values[i] for d, i in zip(cells, idx)}
        variant = str(where.pop(variant_dim, ""))
        where = {**(fixed or {}), **where}
        out.append(Finding(variant, where, int(v[ran].sum()), int((v[ran] > 0).sum()), int(ran.sum())))
    return out


def scan(ds: xr.Dataset, sample_dims=("batch", "head")) -> list[Finding]:
    """Findings of a results dataset (run, ablation, audit): its ``nonfinite`` counts (a NaN
    ``rmse`` of a sample that ran with no count counts once), then every other stored metric
    that is NaN in a sample that ran with finite outputs (``Finding.metric`` set)."""
    if "nonfinite" not in ds:
        return []
    counts = ds["nonfinite"]
    if "rmse" in ds:
        # A sample that ran (count not NaN) with a NaN RMSE counts at least once.
        hidden = ds["rmse"].isnull() & counts.notnull() & (counts == 0)
        counts = xr.where(hidden, 1.0, counts)
    fixed = {}
    if "seed" not in counts.dims and "seeds" in ds.attrs:
        from .conventions import attr_list

        seeds = attr_list(ds, "seeds")
        if len(seeds) == 1:
            fixed["seed"] = seeds[0]
    found = scan_counts(counts, sample_dims, fixed=fixed)
    finite = counts.notnull() & (counts == 0)
    for name, why in _stored_metrics(ds):
        nan = ds[name].isnull() & finite
        if not bool(nan.any()):
            continue
        # Counted like non-finite positions: 1 per NaN sample, the rest of the samples that ran 0.
        undefined = xr.where(nan, 1.0, xr.where(counts.notnull(), 0.0, np.nan))
        found += [dataclasses.replace(f, metric=name, reason=why)
                  for f in scan_counts(undefined, sample_dims, fixed=fixed)]
    return found


def _stored_metrics(ds: xr.Dataset) -> list[tuple[str, str]]:
    """(name, why it can be NaN) of every registered metric the dataset stores, but ``nonfinite``
    and ``rmse`` (scanned with the counts)."""
    from ..numerics.metrics import metrics

    return [(n, str(ds[n].attrs.get("nan_reason", m.undefined))) for n, m in metrics().items()
            if n in ds.data_vars and n not in ("nonfinite", "rmse")]


def warn(findings: list, echo: Callable[[str], None]) -> None:
    """One warning line per finding (a ``Finding`` or a line already written)."""
    for f in findings:
        echo(f"warning: {f.line() if isinstance(f, Finding) else f}")


def summary_line(findings: list) -> str:
    variants = sorted({f.variant for f in findings if isinstance(f, Finding)})
    which = f" of {len(variants)} variant(s) ({', '.join(variants)})" if variants else ""
    undefined = sum(1 for f in findings if isinstance(f, Finding) and f.metric)
    what = "non-finite values (NaN or Inf outputs or reference)" if undefined < len(findings) else ""
    if undefined:
        what += (" or " if what else "") + f"NaN metrics ({undefined} undefined on the data)"
    return f"{len(findings)} result(s){which} hold {what}"


def enforce(findings: list, allow: bool) -> None:
    """Raise ``NonFiniteError`` (exit code 3) when there are findings and they are not allowed."""
    if findings and not allow:
        raise NonFiniteError(f"{summary_line(findings)}; files are written; see the warnings above, or pass "
                             "--allow-nonfinite to exit 0")


__all__ = ["Finding", "scan", "scan_counts", "warn", "enforce", "summary_line"]
