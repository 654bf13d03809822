"""Markdown of a flat block list (the older document model, still used by
``fa3_numerics.report.impact``), from the jinja2 template ``templates/report.md.j2``.

Exposed: ``render_markdown``.
"""

from __future__ import annotations

from .document import Block, from_blocks, render


def render_markdown(blocks: list[Block], figure_dir: str = "figures") -> str:
    return render(from_blocks(blocks), "md", figure_dir)


__all__ = ["render_markdown"]
