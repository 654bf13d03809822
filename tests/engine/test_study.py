"""The study protocol (``engine.study``): a new study is one module plus one report page.

The module is a real file dropped into a temporary folder on ``sys.path`` and registered by
name, as another package's entry point would be: its command appears on the command line from
its declared options, it runs through the one cache and lock, its dataset carries its kind, and
``fa3-numerics report`` renders it with its own page.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import xarray as xr

from fa3_numerics.engine import study as study_mod
from fa3_numerics.engine.study import Study, StudyContext, run_study
from fa3_numerics.errors import UsageError

TINY = textwrap.dedent('''
    """A tiny real study: the RMSE of one recipe against float64 attention, per seed."""
    import math

    import numpy as np
    import torch
    import xarray as xr

    from fa3_numerics.engine.study import Study, StudyOption
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import get_recipe
    from fa3_numerics.numerics.reference import reference_attention

    RUNS = []  # seeds computed in this process: a cached seed is not computed again


    class TinyStudy(Study):
        """RMSE of one recipe on Gaussian Q, K, V, one value per seed."""

        kind = "tiny"
        stem = "tiny"
        command = "run tiny"
        options = (StudyOption("seeds", int, "seeds", 0, many=True),
                   StudyOption("variant", str, "preset", "fa3-fp8"),
                   StudyOption("scale", float, "input scale (inf makes the output non-finite)", 1.0))

        def __init__(self, seeds=None, variant=None, scale=None):
            self.seeds = list(seeds or [0])
            self.variant = variant or "fa3-fp8"
            self.scale = 1.0 if scale is None else scale

        def run(self, ctx):
            store = ctx.cells({"variant": self.variant, "scale": self.scale}, [__name__])
            out = []
            for seed in self.seeds:
                key = store.key({"seed": seed})
                got = store.get(key)
                if got is None:
                    RUNS.append(seed)
                    g = torch.Generator().manual_seed(seed)
                    q, k, v = (torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float64) * self.scale
                               for _ in range(3))
                    ref = reference_attention(q, k, v, causal=False, softmax_scale=1 / math.sqrt(64))
                    o = emulate(get_recipe(self.variant).recipe, q, k, v, causal=False,
                                softmax_scale=1 / math.sqrt(64)).double()
                    got = {"rmse": np.array(float(((o - ref) ** 2).mean().sqrt()))}
                    store.put(key, got)
                out.append(float(got["rmse"]))
            return out

        def assemble(self, results):
            return xr.Dataset({"rmse": ("seed", np.array(results))}, coords={"seed": self.seeds})

        def nonfinite(self, ds):
            bad = int((~np.isfinite(ds.rmse.values)).sum())
            return [f"{bad} non-finite RMSE value(s)"] if bad else []


    def render(ds, out_dir, formats):
        from pathlib import Path

        from fa3_numerics.engine.files import atomic_write

        return [atomic_write(Path(out_dir) / "tiny.md", f"# tiny\\n\\nmax RMSE {float(ds.rmse.max()):.3e}\\n")]
''')


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The tiny study's module on sys.path, registered under kind ``tiny`` with its report page."""
    from fa3_numerics import report

    src = tmp_path / "pkg"
    src.mkdir()
    (src / "fa3n_tiny_study.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.delitem(sys.modules, "fa3n_tiny_study", raising=False)
    monkeypatch.setitem(study_mod._REGISTRY, "tiny", "fa3n_tiny_study:TinyStudy")
    monkeypatch.setitem(report.REPORTS, "tiny", "fa3n_tiny_study:render")
    yield
    sys.modules.pop("fa3n_tiny_study", None)


def _cli(args, capsys):
    from fa3_numerics.cli import build_app, main

    try:
        main([str(a) for a in args], application=build_app())
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_new_study_is_one_module_and_one_page(tiny, tmp_path, capsys):
    code, out, err = _cli(["run", "tiny", "--help"], capsys)
    assert code == 0 and "--seeds" in out and "--variant" in out and "--allow-nonfinite" in out
    out_dir = tmp_path / "o"
    code, out, err = _cli(["run", "tiny", "--seeds", "0,1", "--out", out_dir], capsys)
    assert code == 0, err
    ds = xr.load_dataset(out_dir / "tiny.nc", engine="h5netcdf")
    assert ds.attrs["kind"] == "tiny" and list(ds.seed.values) == [0, 1]
    # an FP8 recipe's error on N(0, 1) inputs: well above float32's, well below 1
    assert np.all((ds.rmse.values > 1e-4) & (ds.rmse.values < 0.1))
    assert (out_dir / "tiny.md").read_text().startswith("# tiny")
    import fa3n_tiny_study

    assert fa3n_tiny_study.RUNS == [0, 1]
    # a rerun with one more seed computes only that one (the one cache)
    code, _, err = _cli(["run", "tiny", "--seeds", "0,1,2", "--out", out_dir], capsys)
    assert code == 0, err
    assert fa3n_tiny_study.RUNS == [0, 1, 2]
    again = xr.load_dataset(out_dir / "tiny.nc", engine="h5netcdf")
    np.testing.assert_array_equal(again.rmse.values[:2], ds.rmse.values)
    # --fresh forgets the cache
    code, _, _ = _cli(["run", "tiny", "--seeds", "0", "--out", out_dir, "--fresh"], capsys)
    assert code == 0 and fa3n_tiny_study.RUNS == [0, 1, 2, 0]
    # `report` renders any study's dataset with the page registered for its kind
    code, out, err = _cli(["report", out_dir / "tiny.nc", "--out", tmp_path / "r"], capsys)
    assert code == 0, err
    assert "max RMSE" in (tmp_path / "r" / "tiny.md").read_text()


def test_non_finite_results_exit_3_after_the_files_are_written(tiny, tmp_path, capsys):
    code, _, err = _cli(["run", "tiny", "--scale", "inf", "--out", tmp_path / "o"], capsys)
    assert code == 3 and "non-finite" in err and "Traceback" not in err
    assert (tmp_path / "o" / "tiny.nc").is_file() and (tmp_path / "o" / "tiny.md").is_file()
    code, _, err = _cli(["run", "tiny", "--scale", "inf", "--out", tmp_path / "o", "--allow-nonfinite"], capsys)
    assert code == 0, err


class _Echo(Study):
    kind = "echo"
    stem = "echo"

    def __init__(self, during=None):
        self.during = during

    def run(self, ctx: StudyContext):
        if self.during is not None:
            self.during(ctx)
        return [1.0, 2.0]

    def assemble(self, results):
        return xr.Dataset({"rmse": ("i", np.array(results))})

    def nonfinite(self, ds):
        return []


def test_one_lock_for_every_study(tmp_path):
    """A second study into a folder a study holds is refused, whatever the two studies are."""
    seen = {}

    def during(ctx):
        with pytest.raises(UsageError, match="another fa3-numerics process is writing"):
            run_study(_Echo(), tmp_path / "o", echo=lambda m: None)
        seen["refused"] = True

    outcome = run_study(_Echo(during), tmp_path / "o", echo=lambda m: None)
    assert seen["refused"] and outcome.code == 0
    assert xr.load_dataset(tmp_path / "o" / "echo.nc", engine="h5netcdf").attrs["kind"] == "echo"


def test_every_committed_dataset_kind_has_a_report_page():
    """Every study kind the package registers, and every kind of dataset it has written, renders."""
    from fa3_numerics import report
    from fa3_numerics.engine.study import studies

    pages = report.reports()
    for kind in [*studies(), "ablation", "audit", "validation"]:
        assert kind in pages, kind
        assert callable(report.renderer(kind))
    with pytest.raises(UsageError, match="no report page"):
        report.renderer("no-such-kind")
