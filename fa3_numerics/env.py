"""The environment variables the toolkit reads, read one way.

Exposed: ``env_number``, ``env_choice``.

A malformed value (``FA3N_P_KEEP_MB=lots``) is bad input like a malformed option: a one-line
``UsageError`` naming the variable and what it takes, never a traceback from deep inside a run
and never a silent fall-back to the default that the user did not ask for.
"""

from __future__ import annotations

import math
import os

from .errors import UsageError


def env_number(name: str, default: float, *, least: float = 0.0, integer: bool = False) -> float:
    """``$name`` as a finite number >= ``least`` (an integer if ``integer``); ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < least or (integer and not value.is_integer()):
        kind = "an integer" if integer else "a number"
        raise UsageError(f"environment variable {name}={raw[:40]!r} is not {kind} >= {least:g}; set it to one "
                         f"(default {default:g}) or unset it")
    return int(value) if integer else value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """``$name`` (lower case) as one of ``choices``; ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        raise UsageError(f"environment variable {name}={raw[:40]!r} is not one of {', '.join(choices)}; set it to "
                         f"one or unset it")
    return raw


__all__ = ["env_number", "env_choice"]
