"""Commands made from the study registry: a study that declares its options (``engine.study.Study``:
``command``, ``options``, ``dist_options``, ``examples``) is on the command line without a module here.

Each such command parses the declared options (comma lists where ``many``), makes the study with
``from_options`` (every check before the output folder is touched), and ends through the one
command tail (``cli._study``): the folder held, the cache in OUT/.cells, the dataset, the report
page registered for the study's kind, the exit code.
"""

from __future__ import annotations

import inspect
from typing import Optional

import typer

from ._registry_cache import cached
from .options import ALLOW_NONFINITE_HELP, dist_options, examples, option, parse_list

COMMON = ("out", "fresh", "allow_nonfinite", "format")
KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def describe(cls) -> dict:
    """What building a study's command needs, as plain data (kept by ``_registry_cache``)."""
    return {"kind": cls.kind, "command": getattr(cls, "command", ""), "help": cls.help or (inspect.getdoc(cls) or ""),
            "examples": list(cls.examples), "dist_options": bool(cls.dist_options),
            "options": [[o.name, o.kind.__name__, o.help, list(o.default) if isinstance(o.default, (list, tuple))
                         else o.default, o.many] for o in cls.options]}


@cached()
def _entry_point_studies() -> list[dict]:
    """Every study of the entry-point group that declares a command (importing each once)."""
    import importlib.metadata

    from ..engine.study import ENTRY_POINTS, get_study

    rows = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
        if ep.name == "run":  # ``run NAME`` runs experiment TOMLs: a command of its own
            continue
        cls = get_study(ep.name)
        if getattr(cls, "command", ""):
            rows.append(describe(cls))
    return rows


def declared() -> list[dict]:
    """The studies with a declared command: the entry points' (cached), and those registered in
    this process (``engine.study.register_study``), which are read now."""
    import importlib.metadata

    from ..engine import study

    rows = list(_entry_point_studies())
    eps = {ep.name for ep in importlib.metadata.entry_points(group=study.ENTRY_POINTS)}
    for kind in sorted(set(study._REGISTRY) - eps):
        cls = study.get_study(kind)
        if getattr(cls, "command", ""):
            rows.append(describe(cls))
    return rows


def _shown(default) -> str:
    if isinstance(default, (list, tuple)):
        return ",".join(_shown(x) for x in default)
    return str(default).lower() if isinstance(default, bool) else str(default)


def _parameters(row: dict) -> list[inspect.Parameter]:
    params = []
    for name, kind, help_text, default, many in row["options"]:
        if kind == "bool" and not many:
            flag = name.replace("_", "-")
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[bool],
                                            default=typer.Option(None, f"--{flag}/--no-{flag}", help=help_text,
                                                                 show_default=_shown(default))))
        else:
            params.append(option(name, help_text, annotation=Optional[str] if many or kind == "str"
                                 else Optional[KINDS[kind]], show_default=_shown(default)))
    taken = {p.name for p in params} | set(COMMON)
    if row["dist_options"]:
        params += [p for p in dist_options() if p.name not in taken]
    params += [
        option("out", "output folder for the dataset, its report and the cache of finished work",
               annotation=str, default=f"results/{row['kind']}"),
        inspect.Parameter("fresh", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--fresh", help="ignore work cached by an earlier run into "
                                                                      "the same --out")),
        inspect.Parameter("allow_nonfinite", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP)),
        option("format", "report formats: html, md (comma list)", annotation=str, default="html,md"),
    ]
    return params


def _values(row: dict, kw: dict) -> dict:
    declared_options = {o[0]: o for o in row["options"]}
    values = {}
    for name, v in kw.items():
        o = declared_options.get(name)
        if o is None:  # a distribution parameter: a comma list sweeps
            values[name] = parse_list(v, float, name)
        elif o[4]:
            values[name] = parse_list(v, KINDS[o[1]], name)
        else:
            values[name] = v
    return values


def make_command(row: dict):
    """The typer callback of a declared study (its options, then the common tail's); the study's
    module is imported when the command runs."""

    def command(**kw):
        from ..engine.study import get_study
        from ._study import run_study_command
        from .report import parse_formats

        formats = parse_formats(kw.pop("format"))
        out, fresh, allow = kw.pop("out"), kw.pop("fresh"), kw.pop("allow_nonfinite")
        study = get_study(row["kind"]).from_options(**_values(row, kw))
        run_study_command(study, out, formats=formats, fresh=fresh, allow_nonfinite=allow)

    command.__signature__ = inspect.Signature(_parameters(row))
    command.__doc__ = row["help"]
    command.__name__ = row["kind"]
    return command


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    taken = {c.name for c in app.registered_commands} | {c.name for c in run_app.registered_commands}
    for row in declared():
        words = row["command"].split()
        target, name = (run_app, words[1]) if words[0] == "run" and len(words) == 2 else (app, words[-1])
        if name in taken:
            continue
        target.command(name, epilog=examples(*row["examples"]) if row["examples"] else None,
                       help=row["help"])(make_command(row))
