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

from .options import ALLOW_NONFINITE_HELP, dist_options, examples, option, parse_list

COMMON = ("out", "fresh", "allow_nonfinite", "format")


def _parameters(cls) -> list[inspect.Parameter]:
    params = []
    for o in cls.options:
        shown = ",".join(str(x).lower() if isinstance(x, bool) else str(x) for x in o.default) \
            if isinstance(o.default, (list, tuple)) else (str(o.default).lower() if isinstance(o.default, bool)
                                                          else str(o.default))
        if o.kind is bool and not o.many:
            flag = o.name.replace("_", "-")
            params.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[bool],
                                            default=typer.Option(None, f"--{flag}/--no-{flag}", help=o.help,
                                                                 show_default=shown)))
        else:
            params.append(option(o.name, o.help, annotation=Optional[str] if o.many or o.kind is str
                                 else Optional[o.kind], show_default=shown))
    taken = {p.name for p in params} | set(COMMON)
    if cls.dist_options:
        params += [p for p in dist_options() if p.name not in taken]
    params += [
        option("out", "output folder for the dataset, its report and the cache of finished work",
               annotation=str, default=f"results/{cls.kind}"),
        inspect.Parameter("fresh", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--fresh", help="ignore work cached by an earlier run into "
                                                                      "the same --out")),
        inspect.Parameter("allow_nonfinite", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--allow-nonfinite", help=ALLOW_NONFINITE_HELP)),
        option("format", "report formats: html, md (comma list)", annotation=str, default="html,md"),
    ]
    return params


def _values(cls, kw: dict) -> dict:
    declared = {o.name: o for o in cls.options}
    values = {}
    for name, v in kw.items():
        o = declared.get(name)
        if o is None:  # a distribution parameter: a comma list sweeps
            values[name] = parse_list(v, float, name)
        elif o.many:
            values[name] = parse_list(v, o.kind, name)
        else:
            values[name] = v
    return values


def make_command(cls):
    """The typer callback of study class ``cls`` (its options, then the common tail's)."""

    def command(**kw):
        from ._study import run_study_command
        from .report import parse_formats

        formats = parse_formats(kw.pop("format"))
        out, fresh, allow = kw.pop("out"), kw.pop("fresh"), kw.pop("allow_nonfinite")
        study = cls.from_options(**_values(cls, kw))
        run_study_command(study, out, formats=formats, fresh=fresh, allow_nonfinite=allow)

    command.__signature__ = inspect.Signature(_parameters(cls))
    command.__doc__ = inspect.getdoc(cls)
    command.__name__ = cls.kind
    return command


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    from ..engine.study import get_study, studies

    taken = {c.name for c in app.registered_commands} | {c.name for c in run_app.registered_commands}
    for kind in sorted(studies()):
        if kind in taken or kind == "run":  # a command of its own (``run`` runs experiment TOMLs)
            continue
        cls = get_study(kind)
        if not getattr(cls, "command", ""):
            continue
        words = cls.command.split()
        target, name = (run_app, words[1]) if words[0] == "run" and len(words) == 2 else (app, words[-1])
        if name in taken:
            continue
        target.command(name, epilog=examples(*cls.examples) if cls.examples else None,
                       help=cls.help or (inspect.getdoc(cls) or "").split("\n\n")[0])(make_command(cls))
