"""Markdown report: ``report.md`` with its figures as PNG files in ``figures/`` beside it.

Exposed: ``render_markdown``.
"""

from __future__ import annotations

from .document import Block


def render_markdown(blocks: list[Block], figure_dir: str = "figures") -> str:
    out = []
    n = 0
    for b in blocks:
        if b.kind == "h1":
            out.append(f"# {b.text}")
        elif b.kind == "h2":
            out.append(f"## {b.text}")
        elif b.kind in ("p", "table", "list"):
            out.append(b.text)
        elif b.kind == "figure":
            n += 1
            f = b.figure
            out.append(f"### Figure {n}. {f.title}\n\n![{f.title}]({figure_dir}/{f.name}.png)\n\n*{f.caption}*")
    return "\n\n".join(out) + "\n"
