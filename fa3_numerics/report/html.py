"""Self-contained HTML of a flat block list (the older document model, still used by
``fa3_numerics.report.impact``): the blocks become a ``Document`` rendered from the jinja2
template ``templates/report.html.j2``, like every other report.

Exposed: ``render_html``, ``inline_md``.
"""

from __future__ import annotations

from .document import Block, from_blocks, md_inline, render


def inline_md(text: str) -> str:
    """``text``'s inline Markdown (code, bold) as HTML, everything else escaped."""
    return md_inline(text)


def render_html(blocks: list[Block]) -> str:
    return render(from_blocks(blocks), "html")


__all__ = ["render_html", "inline_md"]
