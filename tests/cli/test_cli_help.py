"""What a new user of the CLI meets: examples in every --help, one meaning for --p, defaults that
say where they come from, `run ablation` writing into --out, a final line that lists every file
written, and `backends` saying "not usable here"."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from fa3_numerics.cli import app, main

# cli/impact.py belongs to the impact command's owner; its help is checked there.
OTHERS = ("impact",)


def _commands():
    """Every command path: ('run', 'outliers'), ('report',), ... (but OTHERS)."""
    import typer.main

    group = typer.main.get_command(app)
    out = []
    for name, cmd in group.commands.items():
        if name in OTHERS:
            continue
        if hasattr(cmd, "commands"):
            out += [(name, sub) for sub in cmd.commands]
        else:
            out.append((name,))
    return out


def _help(*path: str) -> str:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p))
def test_every_help_has_examples(path):
    text = _help(*path)
    assert "Examples" in text, path
    examples = text[text.index("Examples"):]
    assert re.search(r"fa3-numerics \w", examples), path  # real command lines, not a heading alone


def test_p_means_one_thing():
    outliers, ablation = _help("run", "outliers"), _help("run", "ablation")
    option = lambda text, flag: re.search(rf"^\W*{flag}\s+[A-Z<]", text, flags=re.M)  # noqa: E731  an option's row
    assert option(outliers, "--p") and "outliers: probability" in outliers
    assert option(ablation, "--p-handling") and not option(ablation, "--p")
    assert "--descale-rounding" in ablation  # `scale` is a distribution parameter too: renamed the same way


def test_metavars_say_what_a_value_is():
    """Typed metavars, never the Python type: comma lists that sweep say so."""
    outliers = _help("run", "outliers")
    row = lambda flag: re.search(rf"^\W*{flag}\s+(\S+)", outliers, flags=re.M).group(1)  # noqa: E731
    assert row("--seqlen") == "INT,..." and row("--p") == "FLOAT,..." and row("--variants") == "SPECS"
    assert row("--out") == "-o" or row("--out").startswith("-o")  # -o is --out on every command
    for path in _commands():
        text = _help(*path)
        options = text[text.find("Options"):]
        for python_type in ("<str>", "<int>", "<float>", "<list[str]>", "<path>"):
            assert python_type not in options, (path, python_type)


def test_defaults_say_where_they_come_from():
    outliers = " ".join(_help("run", "outliers").split())
    assert "8192, from experiments/outliers.toml" in outliers and "0.001, from experiments/outliers.toml" in outliers
    ablation = " ".join(_help("run", "ablation").split())
    assert "512,1024,2048, from experiments/ablation.toml" in ablation


def test_backends_says_not_usable_here(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["backends", "--device", "cpu"])
    out = capsys.readouterr().out
    assert (exc.value.code or 0) == 0
    status = re.findall(r"^  (\S+)\s+(usable here|not usable here|\S+)\s+\[", out, flags=re.M)
    assert status and all(s in ("usable here", "not usable here") for _, s in status), status
    assert ("emulate", "usable here") in status
    assert ("fa3", "not usable here") in status  # no Hopper GPU here: the next line says why and the fix
    assert "why, and the fix:" in out


@pytest.mark.slow
def test_run_ablation_writes_into_out_and_lists_every_file(tmp_path, capsys, ablation_toml):
    toml = ablation_toml(description="tiny ablation for the CLI", data=(("outliers", {"p": [0.01], "sigma": [10.0]}),),
                         shape={"causal": [False], "batch": 1}, run={"attribution": False},
                         designs=[{"name": "p", "gran": ["head", "block"], "p": ["offset8", "no-offset"]}])
    out = tmp_path / "abl"
    with pytest.raises(SystemExit) as exc:
        main(["run", "ablation", "--experiment", str(toml), "--workers", "0", "--p-handling", "offset8,scale448",
              "--out", str(out)])
    cap = capsys.readouterr()
    assert (exc.value.code or 0) == 0, cap.err
    files = sorted(p for p in out.rglob("*") if p.is_file() and ".cells" not in p.parts)
    names = {p.name for p in files}
    assert {"tiny.nc", "report.html", "report.md", "effects.csv"} <= names and "main_effects.svg" in names
    last = cap.out.strip().splitlines()[-1]
    assert last.startswith(f"wrote {len(files)} file(s): ")
    assert sorted(last.split(": ", 1)[1].rsplit(" (", 1)[0].split(", ")) == sorted(map(str, files))
    # --p-handling replaced the design's P levels
    import xarray as xr

    ds = xr.load_dataset(out / "tiny.nc", engine="h5netcdf")
    assert set(ds["p"].values[ds["stage"].values == "full"]) == {"offset8", "scale448"}
