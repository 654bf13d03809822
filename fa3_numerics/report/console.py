"""Tables a command prints on its console, drawn by rich (aligned columns, numbers right-aligned,
a rule under the header) and returned as plain text, so they read the same in a terminal, a
pipe or a log file. Cell text is never read as rich markup: a variant named ``a [b]`` prints as
written."""

from __future__ import annotations

import io
from typing import Sequence


def table_text(columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool] | None = None,
               title: str = "") -> str:
    """``rows`` under ``columns`` as text; ``numeric[i]`` right-aligns column i."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    numeric = list(numeric) if numeric is not None else [False] * len(columns)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title=Text(title) if title else None,
              title_justify="left")
    for name, num in zip(columns, numeric):
        t.add_column(Text(str(name)), justify="right" if num else "left", no_wrap=True)
    for r in rows:
        t.add_row(*(Text(str(c)) for c in r))
    widest = sum(max([len(str(c))] + [len(str(r[i])) for r in rows]) + 2 for i, c in enumerate(columns))
    buf = io.StringIO()
    Console(file=buf, width=max(80, widest + 4), no_color=True, highlight=False, emoji=False,
            force_terminal=False).print(t)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines() if line.strip() or False)


__all__ = ["table_text"]
