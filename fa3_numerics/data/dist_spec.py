"""``--dist`` strings: a registered distribution with parameters, written once for every command.

Exposed: ``DistSpec``, ``parse_dist``, ``SYNTAX``.

Syntax (``SYNTAX``):

- ``NAME`` or ``NAME:k=v,k=v`` for a family of the registry (``outliers:p=0.01,sigma=30``);
- ``NAME:ARG`` or ``NAME:ARG@k=v,...`` for a family that takes an argument, registered with a
  trailing colon (``captured:model.safetensors@layer=3,rope=0``); a bare ``@V`` sets the
  family's first parameter (``captured:FILE@12`` = layer 12).

Parameters are folded into the parameters a study records, so the dataset says what ran
(``captured:FILE@rope=0`` records rope = 0). Values are numbers, as the registry declares them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ..errors import UsageError, require
from . import distributions

SYNTAX = "NAME, NAME:k=v,k=v (e.g. outliers:p=0.01,sigma=30) or captured:FILE[@layer=N,...]"


@dataclasses.dataclass(frozen=True)
class DistSpec:
    name: str  # what ``distributions.generate`` takes: "outliers" or "captured:FILE"
    family: str  # registry name: "outliers" or "captured:"
    params: dict  # parameters given in the string (the registry's defaults are not filled in)

    @property
    def entry(self):
        return distributions.get(self.name)


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--dist {what}: {text!r} is not a number") from None
    require(math.isfinite(value), f"--dist {what}: {text!r} is not a finite number")
    return value


def _pairs(text: str, entry, family: str) -> dict:
    out: dict = {}
    names = list(entry.params)
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, val = part.partition("=")
        if not eq:
            require(bool(names), f"--dist {family}: takes no parameters, got {part!r}")
            key, val = names[0], part
        key = key.strip()
        require(key in entry.params, f"--dist {family}: unknown parameter {key!r}; it takes "
                f"{', '.join(names) or 'none'}")
        require(key not in out, f"--dist {family}: parameter {key} is given twice")
        out[key] = _number(val.strip(), f"{family} {key}")
    return out


def parse_dist(text: str) -> DistSpec:
    """``NAME[:...]`` -> (generate name, registry family, parameters given); see the module docstring."""
    text = (text or "").strip()
    require(bool(text), f"--dist is empty; write {SYNTAX}")
    head, colon, rest = text.partition(":")
    takes_arg = colon and f"{head}:" in distributions.available()
    if takes_arg:
        entry = distributions.get(f"{head}:")
        arg, params = rest, {}
        path, at, suffix = rest.rpartition("@")
        if at and not Path(rest).exists():
            arg, params = path, _pairs(suffix, entry, head)
        require(bool(arg.strip()), f"--dist {head}: needs an argument, e.g. {head}:FILE")
        return DistSpec(f"{head}:{arg}", f"{head}:", params)
    entry = distributions.get(head)
    return DistSpec(entry.name, entry.name, _pairs(rest, entry, entry.name) if colon else {})


__all__ = ["DistSpec", "parse_dist", "SYNTAX"]
