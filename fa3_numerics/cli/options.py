"""Options shared by the commands, and options generated from the registries.

Exposed: ``parse_list``, ``with_options``, ``option``, ``dist_options``, ``factor_options``,
``factor_flag``, ``examples``, ``toml_default``, ``experiment_toml``, ``wrote``, ``ALLOW_NONFINITE_HELP``,
``finish``, ``JSON_HELP``, ``json_text``.

``dist_options`` makes one ``--NAME`` option per parameter of every registered distribution
(its help from the registry, a comma list sweeps), and ``factor_options`` one per registered
ablation factor: a family or factor added to its registry appears in ``--help`` and works on the
command line without an edit here. A parameter whose name a command already uses for something
else stays settable through ``--dist NAME:k=v``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import typer

from ..errors import UsageError
from ._registry_cache import cached

ALLOW_NONFINITE_HELP = ("exit 0 even when results hold NaN or Inf (they are still reported in the warnings, "
                        "summary and report); without it such a run ends with exit code 3")


def parse_list(text: Optional[str], kind: type, name: str) -> Optional[list]:
    """``"1,2,3"`` -> [1, 2, 3] of ``kind``; one-line errors naming ``--name``."""
    if text is None:
        return None
    parts = [t.strip() for t in str(text).split(",")]
    if not any(parts):
        raise UsageError(f"--{name.replace('_', '-')} got an empty list; give at least one value")
    if not all(parts):
        raise UsageError(f"--{name.replace('_', '-')} {text!r} has an empty item; remove the extra comma")
    try:
        if kind is bool:
            vals = []
            for t in parts:
                if t.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                vals.append(t.lower() in ("true", "1", "yes"))
            return vals
        if kind is int:
            return [_int(t) for t in parts]
        return [kind(t) for t in parts]
    except (ValueError, OverflowError):
        raise UsageError(f"--{name.replace('_', '-')} expects {kind.__name__} values, got {text!r}") from None


def _int(text: str) -> int:
    # "1e3" and "1024.0" are integers; Python ints are unbounded, so range checks come later.
    try:
        return int(text)
    except ValueError:
        f = float(text)
        if not f.is_integer():
            raise
        return int(f)


def option(name: str, help: str, annotation=Optional[str], default=None, flag: str = "",
           show_default: str | bool = True) -> inspect.Parameter:
    """A keyword-only typer option ``--name`` (underscores become dashes; ``flag`` overrides it)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, flag or f"--{name.replace('_', '-')}", help=help,
                                                  show_default=show_default))


def examples(*lines: str) -> str:
    """A command's help epilog: its examples, one per paragraph (rich markup escaped)."""
    from rich.markup import escape

    return "[bold]Examples[/bold]\n\n" + "\n\n".join(f"  {escape(line)}" for line in lines)


def toml_default(values: dict, key: str, source: str) -> str | bool:
    """``show_default`` text for an option whose default comes from an experiment TOML."""
    if key not in values:
        return True
    v = values[key]
    text = ",".join(_plain(x) for x in v) if isinstance(v, (list, tuple)) else _plain(v)
    return f"{text}, from {source}"


def _plain(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def experiment_toml(name: str) -> dict:
    """experiments/NAME.toml as a dict ({} if unreadable: the command then reports it when run),
    read without importing the studies, so that building the CLI stays light."""
    import importlib.resources
    import tomllib

    try:
        text = importlib.resources.files("fa3_numerics.experiments").joinpath(f"{name}.toml").read_text()
        return tomllib.loads(text)
    except (OSError, ValueError, ModuleNotFoundError):
        return {}


def wrote(paths, tail: str = "") -> str:
    """The final line of a command: every file it wrote."""
    paths = [str(p) for p in paths]
    return f"wrote {len(paths)} file(s): {', '.join(paths)}" + (f" {tail}" if tail else "")


def with_options(extra: Callable[[], list[inspect.Parameter]]):
    """Decorator: append generated options (``extra()``, read when the command is registered) to
    a command whose last parameter is ``**generated``; their values arrive in that dict."""

    def deco(fn):
        sig = inspect.signature(fn)
        fixed = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in fixed}
        params = fixed + [p for p in extra() if p.name not in taken]
        names = {p.name for p in params} - taken

        @functools.wraps(fn)
        def wrapper(**kw):
            generated = {k: kw.pop(k) for k in list(kw) if k in names}
            return fn(**kw, **generated)

        wrapper.__signature__ = sig.replace(parameters=params)
        return wrapper

    return deco


DISTRIBUTIONS = "fa3_numerics.data.distributions"
KEYS = "fa3_numerics.numerics.keys.core"  # loaded with the key registry's modules


@cached(DISTRIBUTIONS)
def dist_params() -> dict[str, list[str]]:
    """Distribution parameter name -> one help line per family that has it (the registry's)."""
    from ..data import distributions

    helps: dict[str, list[str]] = {}
    for name, entry in distributions.available().items():
        for p, (default, text) in entry.params.items():
            helps.setdefault(p, []).append(f"{name.rstrip(':')}: {text} (default {default:g})")
    return helps


@cached(DISTRIBUTIONS)
def dist_help() -> str:
    """``--dist``'s help: the syntax and every registered family."""
    from ..data import distributions
    from ..data.dist_spec import SYNTAX

    return f"input distribution: {SYNTAX}; registered: {', '.join(n.rstrip(':') for n in distributions.available())}"


def dist_options(toml: dict | None = None, source: str = "") -> list[inspect.Parameter]:
    """One option per distribution parameter name; help lists every family that has it.
    ``toml``: the experiment's [params] table, whose values are the defaults shown."""
    helps = dist_params()
    toml = toml or {}
    return [option(p, "; ".join(h) + ". A comma list sweeps.",
                   show_default=toml_default(toml, p, source) if p in toml else False) for p, h in helps.items()]


def factor_flag(name: str, help_text: str) -> str:
    """The option of an ablation factor: ``--NAME``, unless a distribution parameter already
    means something else by that name (``--p`` is the outlier probability everywhere), then the
    words its help starts with (``p``, "P handling: ..." -> ``--p-handling``)."""
    taken = set(dist_params())
    if name not in taken:
        return f"--{name.replace('_', '-')}"
    words = help_text.split(":")[0].strip().lower()
    return "--" + "-".join("".join(c if c.isalnum() else " " for c in words).split())


@cached(KEYS)
def factor_list() -> list[tuple[str, str, list[str]]]:
    """(name, help, level names) of every registered ablation factor."""
    from ..numerics.keys import factors

    return [(name, f.help, list(f.level_names() or ())) for name, f in factors().items()]


def factor_options() -> list[inspect.Parameter]:
    """One option per registered ablation factor: its levels for designs that vary it."""
    out = []
    for name, help_text, levels in factor_list():
        out.append(option(name, f"{help_text}; levels for the designs that vary it"
                                + (f" ({', '.join(levels)})" if levels else "") + ", comma separated",
                          flag=factor_flag(name, help_text), show_default="each design's, from the experiment TOML"))
    return out


JSON_HELP = "print one JSON document on stdout instead of the text (NaN as null, infinities as \"inf\"/\"-inf\")"


def json_text(obj) -> str:
    """``obj`` as strict JSON (RFC 8259 has no NaN or Infinity): NaN becomes null and +-inf the
    strings "inf" / "-inf", NumPy scalars and arrays plain numbers and lists, tuples lists, and
    anything else (paths, recipe objects) its ``str``."""
    import json
    import math

    def plain(x):
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if hasattr(x, "tolist"):  # NumPy scalars and arrays
            return plain(x.tolist())
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return str(x)

    return json.dumps(plain(obj), indent=1, ensure_ascii=False, allow_nan=False)


def finish(findings, allow: bool, echo: Callable[[str], None]) -> None:
    """End a command after its files are written: warn about non-finite results, exit 3 unless allowed."""
    from ..engine.nonfinite import enforce, warn

    warn(findings, echo)
    enforce(findings, allow)


__all__ = ["parse_list", "with_options", "option", "dist_options", "factor_options", "factor_flag", "examples",
           "toml_default", "experiment_toml", "wrote", "ALLOW_NONFINITE_HELP", "finish", "JSON_HELP", "json_text"]
