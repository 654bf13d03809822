"""One set of option conventions for every command, applied where the app is built.

- Metavars say what a value is (``INT,...`` for a comma list that sweeps, ``SPECS`` for
  recipes, ``DIR`` for a folder) instead of the Python type typer prints (``<str>``); an option
  a command names itself keeps its own.
- ``-o`` is ``--out`` everywhere; ``--seed`` is also accepted where a command takes ``--seeds``
  (and only there: a command with one seed says ``--seed``).
- Flags show no metavar.

A command added to the package follows them without an edit here.
"""

from __future__ import annotations

import inspect

import typer
from typer.models import ArgumentInfo, OptionInfo

# option name -> metavar; names that sweep take comma lists
BY_NAME = {
    "seqlen": "INT,...", "head_dim": "INT,...", "seeds": "INT,...", "causal": "BOOL,...",
    "variants": "SPECS", "dist": "NAME[:k=v,...]", "device": "DEVICE", "backend": "BACKEND",
    "out": "DIR", "report": "DIR", "text": "FILE", "calib_text": "FILE", "model": "MODEL",
    "layers": "LAYERS", "format": "FORMATS", "designs": "NAMES", "data": "LABELS", "experiment": "NAME|TOML",
    "capture": "FILE", "file": "FILE", "dataset": "DATASET", "scheduler": "ADDRESS", "grid": "NAME", "acc": "MODELS", "target": "TARGET",
    "add": "SPEC", "drop": "NAME", "recipe_map": "MAP", "decode": "SCALINGS", "metric": "METRIC",
    "budget_metric": "METRIC", "rank_metric": "METRIC", "rank_by": "VARIANT", "budget_stat": "STAT",
    "sweep_acc": "MODE",
}
BY_TYPE = {int: "INT", float: "FLOAT", str: "TEXT"}


def _base(annotation):
    """``Optional[int]`` -> int; anything else as it is."""
    args = getattr(annotation, "__args__", None)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def _metavar(name: str, annotation, info: OptionInfo, list_option: bool) -> str | None:
    if name in BY_NAME:
        return BY_NAME[name]
    base = _base(annotation)
    if list_option:
        return "FLOAT,..." if base in (str, None) else f"{BY_TYPE.get(base, 'VALUE')},..."
    if base is bool:
        return ""
    if base is not None and getattr(base, "__name__", "") == "Path":
        return "PATH"
    return BY_TYPE.get(base)


def apply(app: typer.Typer, list_options: set[str] = frozenset(), level_flags: set[str] = frozenset()) -> None:
    """Give every option of ``app``'s commands (and its sub-apps') the conventions above.
    ``list_options``: generated options (distribution parameters, factor levels) that take
    comma lists of numbers; ``level_flags``: the flags of those that take level names (ablation
    factors: ``--p-handling``, never a distribution's ``--p``)."""
    apps = [app] + [g.typer_instance for g in app.registered_groups]
    for a in apps:
        for cmd in a.registered_commands:
            fn = cmd.callback
            for name, param in inspect.signature(fn).parameters.items():
                info = param.default
                annotation = param.annotation
                if isinstance(annotation, str):  # ``from __future__ import annotations``
                    try:
                        annotation = eval(annotation, getattr(inspect.unwrap(fn), "__globals__", {}))  # noqa: S307
                    except Exception:  # noqa: BLE001 - an unknown name: no type-based metavar
                        annotation = None
                if isinstance(info, ArgumentInfo):
                    if info.metavar is None:
                        info.metavar = BY_NAME.get(name, name.upper())
                    continue
                if not isinstance(info, OptionInfo):
                    continue
                decls = list(info.param_decls or ())
                if name == "out" and "-o" not in decls:
                    info.param_decls = tuple(decls or ["--out"]) + ("-o",)
                if name == "seeds" and not any(d.startswith("--seed") and d != "--seeds" for d in decls):
                    info.param_decls = tuple(decls or ["--seeds"]) + ("--seed",)
                if info.metavar is None:
                    mv = "LEVEL,..." if level_flags & set(decls) else _metavar(name, annotation, info,
                                                                               name in list_options)
                    if mv is not None:
                        info.metavar = mv
                        # typer 0.27-0.28 name an option without declarations after its metavar
                        # when the metavar is the parameter's name upper-cased (--backend became
                        # --BACKEND): declare the name, so every typer the range admits parses it.
                        if not info.param_decls and _base(annotation) is not bool:
                            info.param_decls = (f"--{name.replace('_', '-')}",)


__all__ = ["apply", "BY_NAME"]
