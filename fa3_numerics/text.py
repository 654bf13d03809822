"""How the toolkit writes text from data: Markdown escaping and number formats, one place, so
that the sentences a study stores as its findings and the tables a report renders agree.

Exposed: ``fmt_pct``, ``fmt_coord``, ``md_code``, ``md_text`` (Markdown escaping); ``fmt_e``, ``fmt_f``, ``fmt_value``,
``nonfinite_text``, ``column_format``, ``ratio_format``, ``fmt_interval``, ``fmt_ratio``, ``FEW``
(numbers).

Studies write their findings as Markdown sentences (a variant's name as a code span, numbers as
plain text) and the reports render them; both use these functions, so a name that holds a
backtick or ``<img onerror=...>`` never reaches a renderer as markup, whoever wrote the sentence.

A column of a table uses one format for all its numbers (``column_format``): three significant
digits in plain notation when every value lies in [0.01, 1000), else three significant digits in
scientific notation for the whole column, so that "0.0234" never stands above "8.82e-03".
An interval uses its value's format. Pure string functions: nothing here imports the rest of
the package.
"""

from __future__ import annotations


import math
from typing import Callable, Iterable

# Marks an interval that rests on fewer than MIN_SAMPLES samples (the report says so at the top).
FEW = "†"


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def fmt_e(x: float | None) -> str:
    """One number on its own: three significant digits, scientific outside [0.01, 1000); '-' when missing."""
    if not _finite(x):
        return "-"
    return _plain(x) if 0.01 <= abs(x) < 1000 else f"{x:.2e}"


def _plain(x: float, digits: int = 3) -> str:
    # Significant digits with trailing zeros kept (0.0230, 1.20), but no bare trailing point.
    return f"{x:#.{digits}g}".rstrip(".")


def column_format(values: Iterable[float | None]) -> Callable[[float | None], str]:
    """One format for a whole column of ``values`` (see the module docstring). A column whose
    values agree in their first three digits (a cosine similarity of 0.99995 beside 0.99991) gets
    as many digits as tell them apart, up to seven."""
    vals = [abs(v) for v in values if _finite(v) and v != 0]
    plain = bool(vals) and all(0.01 <= v < 1000 for v in vals)
    digits = 3
    if plain and len(set(vals)) > 1:
        spread = (max(vals) - min(vals)) / max(vals)  # > 0: the values differ
        digits = min(7, max(3, math.ceil(-math.log10(spread)) + 2))

    def fmt(x: float | None) -> str:
        if not _finite(x):
            return "-"
        if x == 0:
            return "0"
        return _plain(x, digits) if plain else f"{x:.2e}"

    return fmt


def ratio_format(values: Iterable[float | None]) -> Callable[[float | None], str]:
    """One fixed-decimal format for a column of ratios: three decimals, more when the ratios
    differ only further down (0.9987 beside 1.0004), at most six."""
    vals = [v for v in values if _finite(v)]
    decimals = 3
    if len(set(vals)) > 1:
        spread = max(vals) - min(vals)
        decimals = min(6, max(3, math.ceil(-math.log10(spread)) + 1))
    return lambda x: "-" if not _finite(x) else f"{x:.{decimals}f}"


def fmt_interval(lo: float, hi: float, fmt: Callable[[float], str] = fmt_e, few: bool = False) -> str:
    """"[lo, hi]" in ``fmt``; '-' when undefined; ``FEW`` appended when it rests on few samples."""
    if not (_finite(lo) and _finite(hi)):
        return "-"
    return f"[{fmt(lo)}, {fmt(hi)}]" + (FEW if few else "")


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    return "-" if not _finite(x) else f"{x:.{digits}f}"


def fmt_f(x: float) -> str:
    """A fidelity F: four decimals below 10."""
    return "-" if not _finite(x) else f"{x:.4f}" if x < 10 else f"{x:.3g}"


def nonfinite_text(bad: int, n: int) -> str:
    """What a pooled value is when samples are non-finite: never an estimate over the rest."""
    return f"non-finite ({bad} of {n} samples)"


def fmt_value(value: float, bad: int = 0, n: int = 0, fmt: Callable[[float], str] = fmt_e) -> str:
    """A pooled metric, or ``nonfinite_text`` when any of its samples is non-finite."""
    return nonfinite_text(bad, n) if bad else fmt(value)





# CommonMark's backslash-escapable punctuation that can start markup inline ("|" is left to the
# table writer, which escapes it in every cell).
_MD_SPECIAL = set("\\`*_[]<>&!#~")


def fmt_pct(x) -> str:
    """A share as a percentage with two decimals ('-' when it is not finite)."""
    x = float(x)
    return "-" if not math.isfinite(x) else f"{100 * x:.2f}%"


def fmt_coord(v) -> str:
    """A coordinate's value as reports and findings name a cell: true/false, whole floats
    without a point, ``:g`` for other numbers."""
    import numpy as np

    if isinstance(v, (bool, np.bool_)):
        return str(bool(v)).lower()
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e6:
        return str(int(v))
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def md_text(text) -> str:
    """``text`` as plain Markdown text: markup characters backslash-escaped, newlines as spaces
    (a newline could start a heading, a list or a table row)."""
    flat = " ".join(str(text).splitlines())
    out = []
    for i, c in enumerate(flat):
        # "_" inside a word (x86_64, rel_l2) never starts emphasis in CommonMark: left as it is
        inner = c == "_" and flat[i - 1:i].isalnum() and flat[i + 1:i + 2].isalnum()
        out.append("\\" + c if c in _MD_SPECIAL and not inner else c)
    return "".join(out)


def md_code(text) -> str:
    """``text`` as one Markdown code span that holds it literally, whatever it holds: the fence is
    one backtick longer than the longest run of backticks inside, padded with a space where the
    text starts or ends with a backtick; newlines become spaces (a code span is one line here)."""
    flat = " ".join(str(text).splitlines())
    run = longest = 0
    for c in flat:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if flat[:1] == "`" or flat[-1:] == "`" or (flat[:1] == " " and flat[-1:] == " ") else ""
    return f"{fence}{pad}{flat}{pad}{fence}" if flat else "` `"


__all__ = ["md_code", "md_text", "fmt_e", "fmt_f", "fmt_value", "nonfinite_text", "column_format", "ratio_format",
           "fmt_interval", "fmt_ratio", "FEW"]
