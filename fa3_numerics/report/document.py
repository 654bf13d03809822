"""The content of every report as a document model, rendered to HTML and Markdown from jinja2
templates.

Exposed: ``Document``, ``Section``, ``Para``, ``Bullets``, ``Table``, ``Fig``, ``Markdown``, ``Verdict``,
``Block`` (the older flat model, still accepted), ``from_blocks``, ``render``, ``write_document``,
``md_inline``, ``md_code``, ``md_text``.

Every string a report interpolates that the user controls (variant names and specs, capture
metadata, an ablation's description and design names, file names, the command line) goes
through ``md_code`` (a code span nothing can break out of) or ``md_text`` (plain text with
Markdown's punctuation escaped): Markdown renderers pass raw HTML through, so a backtick or a
``<img onerror=...>`` in a name must never reach the Markdown as markup. The HTML twin is safe
either way (markdown-it escapes raw HTML).

A ``Document`` has a title, a lead (where it ran, warnings, headlines: what the first screen
shows) and sections of blocks:

- ``Para``: a paragraph of Markdown-flavoured inline text (backticks for code, ``**`` for bold);
  ``role`` "where", "headline" or "warning" styles it in HTML;
- ``Bullets``: a list of such lines;
- ``Table``: columns and rows of inline text, numeric columns right-aligned; ``long`` tables
  are collapsed in the HTML (``<details>``) so that they never bury what follows;
- ``Fig``: a ``fa3_numerics.report.plots.Figure``;
- ``Markdown``: a Markdown fragment (tables, lists) from older report code;
- ``Verdict``: the boxed answer at the top of every report (what to use, what it costs, what to
  avoid), its lines taken from the dataset's findings.

``render(doc, "html")`` fills ``templates/report.html.j2``: one self-contained page (styles
inline, figures as PNG data URIs, no scripts, no external links); ``render(doc, "md")`` fills
``templates/report.md.j2`` with figures as files. Inline text and Markdown fragments become HTML
through markdown-it-py (CommonMark, tables enabled, raw HTML escaped): the same words in both
formats, and no hand-written Markdown parser. Nothing depends on the time of rendering.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import re
from pathlib import Path
from typing import Iterable, Union

from ..text import md_code, md_text  # noqa: F401  re-exported: every report module escapes with them
from .plots import Figure

FORMATS = ("html", "md")


@dataclasses.dataclass
class Para:
    text: str
    role: str = ""  # "", "where", "headline", "warning", "note"


@dataclasses.dataclass
class Bullets:
    items: list[str]
    role: str = ""


@dataclasses.dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    numeric: list[bool] | None = None  # per column: right-aligned
    caption: str = ""
    long: bool = False  # collapsed in the HTML, with ``summary`` as its handle
    summary: str = ""

    def __post_init__(self):
        if self.numeric is None:
            self.numeric = [False] * len(self.columns)


@dataclasses.dataclass
class Fig:
    figure: Figure


@dataclasses.dataclass
class Markdown:
    text: str


@dataclasses.dataclass
class Verdict:
    """The answer a report opens with, boxed: which recipe to use on this data and what it costs
    against FP16/BF16, which to avoid (lines of inline Markdown, written by the study into the
    dataset's findings)."""
    items: list[str]
    title: str = "Verdict"


BlockT = Union[Para, Bullets, Table, Fig, Markdown, Verdict]


@dataclasses.dataclass
class Section:
    title: str
    blocks: list[BlockT] = dataclasses.field(default_factory=list)
    level: int = 2
    id: str = ""


@dataclasses.dataclass
class Document:
    title: str
    lead: list[BlockT] = dataclasses.field(default_factory=list)
    sections: list[Section] = dataclasses.field(default_factory=list)

    def figures(self) -> list[Figure]:
        return [b.figure for s in self.sections for b in s.blocks if isinstance(b, Fig)] + \
            [b.figure for b in self.lead if isinstance(b, Fig)]


# -- the older flat model (report/impact.py builds it) -------------------------------------------

@dataclasses.dataclass(frozen=True)
class Block:
    kind: str  # h1, h2, p, figure, table (Markdown table text), list (Markdown bullets)
    text: str = ""
    figure: Figure | None = None


def from_blocks(blocks: Iterable[Block]) -> Document:
    """A ``Document`` of flat blocks: h1 the title, paragraphs before the first h2 the lead."""
    doc = Document("fa3-numerics report")
    current: list = doc.lead
    for b in blocks:
        if b.kind == "h1":
            doc.title = b.text
        elif b.kind == "h2":
            doc.sections.append(Section(b.text))
            current = doc.sections[-1].blocks
        elif b.kind == "p":
            current.append(Para(b.text, "where" if current is doc.lead and not current else ""))
        elif b.kind in ("table", "list"):
            current.append(Markdown(b.text))
        elif b.kind == "figure" and b.figure is not None:
            if current is doc.lead:  # a figure belongs to a section
                doc.sections.append(Section("Figures"))
                current = doc.sections[-1].blocks
            current.append(Fig(b.figure))
    return doc


# -- rendering ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _markdown_it():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table")


_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)


def _escape_lt(text: str) -> str:
    """Each "<" that could open a tag and is not already escaped (after an even number of
    backslashes) escaped; md_text's "\\<" is left."""
    out, slashes = [], 0
    for i, c in enumerate(text):
        nxt = text[i + 1:i + 2]
        # only "<" before a letter, "/", "!" or "?" can open raw HTML (an autolink needs a letter
        # too): "<=" and "< 5" stay as written
        if c == "<" and slashes % 2 == 0 and (nxt.isalpha() or nxt in ("/", "!", "?")):
            out.append("\\")
        out.append(c)
        slashes = slashes + 1 if c == "\\" else 0
    return "".join(out)


def md_no_html(text) -> str:
    """Authored Markdown with every ``<`` outside code spans backslash-escaped, so that no raw HTML
    tag reaches a renderer that passes HTML through (GitHub's, before its sanitiser), whatever a
    report module forgot to escape: the last line of defence behind ``md_text``/``md_code``. Code
    spans stay as written (a renderer shows their content literally)."""
    text, out, at = str(text), [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_escape_lt(text[at:m.start()]))
        out.append(m.group(0))
        at = m.end()
    out.append(_escape_lt(text[at:]))
    return "".join(out)


def md_inline(text: str) -> str:
    """Inline Markdown (code, bold, emphasis) as HTML; any HTML in ``text`` is escaped."""
    return _markdown_it().renderInline(str(text))


def md_block(text: str) -> str:
    """A Markdown fragment (paragraphs, lists, tables) as HTML."""
    return _markdown_it().render(str(text))


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(t: Table) -> str:
    """A ``Table`` as a Markdown (GFM) table, numeric columns right-aligned."""
    head = "| " + " | ".join(_md_cell(c) for c in t.columns) + " |"
    rule = "|" + "".join("---:|" if n else "---|" for n in t.numeric)
    return "\n".join([head, rule] + ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in t.rows])


def md_bullets(items: list[str]) -> str:
    return "\n".join(f"- {i}" for i in items)


@functools.lru_cache(maxsize=1)
def _env():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("fa3_numerics.report", "templates"),
                             autoescape=lambda name: bool(name) and name.endswith(".html.j2"),
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    env.filters.update(md_inline=lambda t: _markup(md_inline(t)), md_block=lambda t: _markup(md_block(t)),
                       md_table=md_table, md_bullets=md_bullets, md_text=md_text, no_html=md_no_html, b64=lambda b: base64.b64encode(b).decode("ascii"))
    env.globals.update(kind=lambda b: type(b).__name__)
    return env


def _markup(html: str):
    from markupsafe import Markup

    return Markup(html)


def render(doc: Document, fmt: str, figure_dir: str = "figures") -> str:
    """``doc`` as one HTML page or one Markdown file (figures referenced in ``figure_dir``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    numbers: dict[str, int] = {}
    for f in doc.figures():
        numbers.setdefault(f.name, len(numbers) + 1)
    template = _env().get_template(f"report.{fmt}.j2")
    prefix = f"{figure_dir}/" if figure_dir else ""
    return template.render(doc=doc, numbers=numbers, prefix=prefix)


def write_document(doc: Document, out_dir: str | Path, *, stem: str = "report", formats=FORMATS,
                   figure_dir: str = "figures", extra: Iterable[tuple[str, bytes]] = ()) -> list[Path]:
    """Write ``doc`` into ``out_dir``: ``<stem>.md`` with every figure as PNG and SVG in
    ``figure_dir`` (stale figures of an earlier render removed), ``<stem>.html`` self-contained,
    and ``extra`` (name, bytes) files; each whole or not at all. Returns the files written."""
    from ..files import atomic_write, make_folder

    out = Path(out_dir)
    make_folder(out)  # a folder that cannot be made is one line, not a traceback
    written: list[Path] = []
    if "md" in formats:
        fig_dir = out / figure_dir if figure_dir else out
        make_folder(fig_dir)
        figs = doc.figures()
        if figure_dir:  # a folder of our own: figures of an earlier render with other dims go
            keep = {f"{f.name}.{ext}" for f in figs for ext in ("png", "svg")}
            for stale in [*fig_dir.glob("*.png"), *fig_dir.glob("*.svg")]:
                if stale.name not in keep:
                    stale.unlink()
        for f in figs:
            written.append(atomic_write(fig_dir / f"{f.name}.png", f.png))
            if f.svg:
                written.append(atomic_write(fig_dir / f"{f.name}.svg", f.svg))
        written.append(atomic_write(out / f"{stem}.md", render(doc, "md", figure_dir)))
    if "html" in formats:
        written.append(atomic_write(out / f"{stem}.html", render(doc, "html", figure_dir)))
    for name, data in extra:
        written.append(atomic_write(out / name, data))
    return written


__all__ = ["Document", "Section", "Para", "Bullets", "Table", "Fig", "Markdown", "Verdict", "Block", "from_blocks", "render",
           "write_document", "md_inline", "md_block", "md_code", "md_text", "FORMATS"]
