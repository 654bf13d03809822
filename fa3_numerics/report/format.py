"""How numbers read in every report: one place, so tables of different studies agree.

Exposed: ``fmt_e``, ``fmt_f``, ``fmt_value``, ``nonfinite_text``.
"""

from __future__ import annotations

import math


def fmt_e(x: float | None) -> str:
    """Three significant digits, scientific outside [0.01, 1000); '-' for a missing value."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.3g}" if 0.01 <= abs(x) < 1000 else f"{x:.2e}"


def fmt_f(x: float) -> str:
    """A fidelity F: four decimals below 10."""
    return "-" if not math.isfinite(x) else f"{x:.4f}" if x < 10 else f"{x:.3g}"


def nonfinite_text(bad: int, n: int) -> str:
    """What a pooled value is when samples are non-finite: never an estimate over the rest."""
    return f"non-finite ({bad} of {n} samples)"


def fmt_value(value: float, bad: int = 0, n: int = 0) -> str:
    """A pooled metric, or ``nonfinite_text`` when any of its samples is non-finite."""
    return nonfinite_text(bad, n) if bad else fmt_e(value)


__all__ = ["fmt_e", "fmt_f", "fmt_value", "nonfinite_text"]
