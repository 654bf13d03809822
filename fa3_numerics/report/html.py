"""Self-contained HTML report: figures embedded as base64 PNG data URIs, styles inline,
no scripts, no external links or assets; opens offline in any browser.

Exposed: ``render_html``, ``inline_md``.
"""

from __future__ import annotations

import base64
import html
import re

from .document import Block

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #1a1a1a;
       max-width: 1180px; margin: 2em auto; padding: 0 1.2em; line-height: 1.45; }
h1 { font-size: 1.55em; border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #eee; }
code { background: #f3f3f3; padding: 0 .25em; border-radius: 3px; font-size: .92em; word-break: break-all; }
figure { margin: 1.4em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #e4e4e4; }
figcaption { font-size: .92em; color: #333; margin-top: .4em; }
table { border-collapse: collapse; font-size: .86em; margin: .8em 0; }
th, td { border: 1px solid #ccc; padding: .25em .55em; text-align: left; white-space: nowrap; }
th { background: #f0f0f0; }
tbody tr:nth-child(even) { background: #fafafa; }
.scroll { overflow-x: auto; max-width: 100%; }
.where { background: #f6f8fa; border-left: 4px solid #0072b2; padding: .6em .9em; }
"""


def inline_md(text: str) -> str:
    """Escape ``text`` and turn its `code` and **bold** spans into HTML."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if len(part) >= 2 and part.startswith("`") and part.endswith("`"):
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
        else:
            esc = html.escape(part)
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", esc))
    return "".join(out)


def _table(md: str) -> str:
    lines = [ln.strip() for ln in md.strip().splitlines() if ln.strip()]
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]
    head, body = cells[0], [c for c in cells[2:]]
    th = "".join(f"<th>{inline_md(c)}</th>" for c in head)
    tr = "\n".join("<tr>" + "".join(f"<td>{inline_md(c)}</td>" for c in row) + "</tr>" for row in body)
    return f'<div class="scroll"><table>\n<thead><tr>{th}</tr></thead>\n<tbody>\n{tr}\n</tbody>\n</table></div>'


def _list(md: str) -> str:
    items = [ln[2:] if ln.startswith("- ") else ln for ln in md.strip().splitlines() if ln.strip()]
    return "<ul>\n" + "\n".join(f"<li>{inline_md(i)}</li>" for i in items) + "\n</ul>"


def render_html(blocks: list[Block]) -> str:
    title = next((b.text for b in blocks if b.kind == "h1"), "fa3-numerics report")
    body = []
    n = 0
    first_p = True
    for b in blocks:
        if b.kind == "h1":
            body.append(f"<h1>{inline_md(b.text)}</h1>")
        elif b.kind == "h2":
            body.append(f"<h2>{inline_md(b.text)}</h2>")
        elif b.kind == "p":
            cls = ' class="where"' if first_p else ""
            first_p = False
            body.append(f"<p{cls}>{inline_md(b.text)}</p>")
        elif b.kind == "table":
            body.append(_table(b.text))
        elif b.kind == "list":
            body.append(_list(b.text))
        elif b.kind == "figure":
            n += 1
            f = b.figure
            data = base64.b64encode(f.png).decode("ascii")
            body.append(f'<figure id="fig-{html.escape(f.name)}">\n<img alt="{html.escape(f.title)}" '
                        f'src="data:image/png;base64,{data}">\n<figcaption><strong>Figure {n}. '
                        f"{inline_md(f.title)}.</strong> {inline_md(f.caption)}</figcaption>\n</figure>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")
