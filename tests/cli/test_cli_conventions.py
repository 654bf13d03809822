"""Conventions every command line follows: `--version`, and `--json` documents for the listing
commands (`variants`, `backends`; `compare --json` is tested with compare) that parse as strict
JSON and say what the text says."""

from __future__ import annotations

import importlib.metadata
import json

import fa3_numerics


def _strict(text: str):
    """Parse as RFC 8259 JSON: NaN and Infinity are refused."""
    def no_constant(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=no_constant)


def test_version_prints_the_installed_version(cli):
    rc, out, err = cli("--version")
    assert rc == 0, err
    assert out == f"fa3-numerics {fa3_numerics.__version__}\n"
    assert fa3_numerics.__version__ == importlib.metadata.version("fa3-numerics")  # one version, not two
    rc, out, _ = cli("--help")
    assert rc == 0 and "--version" in out


def test_variants_json_lists_every_preset_and_key(cli):
    from fa3_numerics.numerics.keys import keys
    from fa3_numerics.numerics.recipe import PRESETS, Recipe

    rc, out, err = cli("variants", "--json")
    assert rc == 0, err
    doc = _strict(out)
    assert [p["name"] for p in doc["presets"]] == list(PRESETS)
    for p in doc["presets"]:
        # a preset's spec parses back to its recipe: the document is usable, not only readable
        assert Recipe.from_str(p["spec"]) == PRESETS[p["name"]].recipe
        assert p["paper_rmse"] == PRESETS[p["name"]].paper_rmse
    assert [k["key"] for k in doc["keys"]] == [k.key for k in keys()]
    acc = next(k for k in doc["keys"] if k["key"] == "acc")
    assert acc["default"] == "fp32" and "fp22" in acc["choices"]
    rc, text, _ = cli("variants")
    assert rc == 0 and all(p["name"] in text for p in doc["presets"]) and not text.lstrip().startswith("{")


def test_backends_json_matches_the_registry(cli):
    from fa3_numerics.engine.backends import available_backends, names

    rc, out, err = cli("backends", "--device", "cpu", "--json")
    assert rc == 0, err
    doc = _strict(out)
    assert [d["device"] for d in doc["devices"]] == ["cpu"]
    rows = doc["devices"][0]["backends"]
    assert [r["name"] for r in rows] == names()
    status = available_backends("cpu")
    for r in rows:
        assert r["usable"] == (status[r["name"]] is None)
        assert bool(r["why"]) != r["usable"]  # a reason exactly where it cannot run
    assert next(r for r in rows if r["name"] == "emulate")["usable"] is True
    assert next(r for r in rows if r["name"] == "fa3")["hardware"] is True


def test_json_text_is_strict_json_for_non_finite_numbers():
    import math

    import numpy as np

    from fa3_numerics.cli.options import json_text

    doc = _strict(json_text({"nan": math.nan, "inf": np.float64(math.inf), "neg": -math.inf, "arr": np.arange(2),
                             "t": (1, "a"), "path": __import__("pathlib").Path("x")}))
    assert doc == {"nan": None, "inf": "inf", "neg": "-inf", "arr": [0, 1], "t": [1, "a"], "path": "x"}


def _options(cmd, path=()):
    """(command path, click option) for every option of every command under ``cmd``."""
    if hasattr(cmd, "commands"):  # a group (typer's own click or the installed one)
        for name, sub in cmd.commands.items():
            yield from _options(sub, path + (name,))
    else:
        for p in cmd.params:
            if type(p).__name__.endswith("Option"):
                yield " ".join(path), p


def test_every_option_is_spelled_in_lower_case():
    # typer 0.27-0.28 (pyproject admits >= 0.27; the H200 image has 0.27.2) named an option without
    # declarations after its metavar when that was its name upper-cased: `validate --backend`
    # became `--BACKEND` and the documented spelling was refused there
    import typer

    from fa3_numerics.cli import build_app

    bad = [(path, p.name, p.opts) for path, p in _options(typer.main.get_command(build_app()))
           if any(o.startswith("--") and o != o.lower() for o in p.opts + p.secondary_opts)]
    assert not bad, bad


def test_an_option_given_a_metavar_has_its_name_declared():
    # the same property independent of the installed typer: a metavar'd, non-flag option carries
    # its own `--name`, so no typer release can derive a name from the metavar
    import inspect

    from typer.models import OptionInfo

    from fa3_numerics.cli import build_app

    app = build_app()
    missing = []
    for a in [app] + [g.typer_instance for g in app.registered_groups]:
        for cmd in a.registered_commands:
            for name, param in inspect.signature(cmd.callback).parameters.items():
                info = param.default
                if isinstance(info, OptionInfo) and info.metavar and info.metavar == name.upper() \
                        and not info.param_decls:
                    missing.append((cmd.name, name))
    assert not missing, missing
