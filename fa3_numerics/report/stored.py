"""The findings a dataset holds, as a report reads them.

Exposed: ``findings_of``, ``verdict_block``.

Every study stores what it found in its dataset's ``findings`` attribute (JSON; written by
``fa3_numerics.studies.findings``); a report renders that and computes no finding of its own.
``verdict_block`` is the boxed answer every report opens with.

A dataset written before findings were stored, or whose findings were computed for other report
settings (an audit's budget set after the audit ran), is read through its study's upgrade here:
the one place a report reaches into ``studies`` (lazily, for such datasets only), until the
command tails read every dataset through its study's reader before rendering it.
"""

from __future__ import annotations

import json

from .document import Verdict


def findings_of(ds, settings: dict | None = None, kind: str | None = None) -> dict:
    """The findings ``ds`` holds (upgraded through its study, of ``kind`` when given, where
    missing or computed for other ``settings``)."""
    raw = ds.attrs.get("findings")
    got = json.loads(raw) if raw else None
    if got is not None and (settings is None or got.get("settings") == settings):
        return got
    from ..studies.findings import upgrade  # datasets from before stored findings only

    return json.loads(upgrade(ds, kind).attrs["findings"])


def verdict_block(f: dict, title: str = "Verdict") -> list:
    """The verdict box of findings ``f`` ([] when the study found nothing to say)."""
    lines = (f.get("verdict") or {}).get("lines") or []
    return [Verdict(list(lines), title)] if lines else []


__all__ = ["findings_of", "verdict_block"]
