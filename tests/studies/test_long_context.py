"""`run long-context`: runs tiny on the CPU, its numbers mean what they say, and it resumes."""

from __future__ import annotations

import json

import pytest

from fa3_numerics.engine.study import get_study, run_study
from fa3_numerics.errors import UsageError
from fa3_numerics.report import renderer
from fa3_numerics.studies.long_context import LongContextStudy

TINY = dict(weights=[0.2], depths=[0.5], seeds=[0], heads=1, head_dim=64, rows=4, flush=[1], decoys=2)


def _run(out, lines, **kw):
    study = LongContextStudy(**(TINY | kw))
    return run_study(study, out, render=renderer("long-context"), formats=("md",), echo=lines.append,
                     progress=None)


def test_runs_tiny_resumes_and_reports(tmp_path):
    lines: list[str] = []
    first = _run(tmp_path, lines, lengths=[640])
    assert first.code == 0
    ds = first.dataset
    assert set(ds.recipe.values) == {"fp22", "fp32", "two-level", "flush1"}
    assert set(ds["mode"].values) == {"prefill", "decode", "split"}
    share = ds["share"]
    # float32 accumulation keeps the needle within FP8's own noise; flush=1 is two-level exactly
    assert abs(float(share.sel(recipe="fp32").mean()) - 1) < 0.1
    assert (share.sel(recipe="flush1") == share.sel(recipe="two-level")).all()
    assert (ds["acc_share"].sel(recipe="fp32") == 1).all()  # the loss rule's yardstick
    assert (tmp_path / "report.md").read_text().startswith("# Long context")
    f = json.loads(ds.attrs["findings"])
    assert {x["recipe"] for x in f["first_loss"]} == set(ds.recipe.values)
    computed = [line for line in lines if line.startswith("[") and "cached" not in line]
    assert len(computed) == 3

    lines.clear()
    second = _run(tmp_path, lines, lengths=[640, 960])
    cells = [line for line in lines if line.startswith("[")]
    assert sum("cached" in line for line in cells) == 3 and len(cells) == 6  # only the new length computed
    assert second.dataset["share"].sel(length=640).equals(ds["share"].sel(length=640))


def test_stand_in_kernel_runs_beside_the_emulator(tmp_path):
    out = _run(tmp_path, [], lengths=[1024], modes=["decode", "split"], kernel="fa3-mock", flush=[])
    ds = out.dataset
    assert "fa3-mock" in ds.recipe.values and "kernel_match" in ds
    # the stand-in is float32 attention, not the kernel: it keeps the needle
    assert abs(float(ds["share"].sel(recipe="fa3-mock").mean()) - 1) < 0.1


@pytest.mark.parametrize("bad, words", [(dict(modes=["chunked"]), "--modes"), (dict(kernel="cudnn"), "--kernel"),
                                        (dict(weights=[0.6], sinks=[0.5]), "lower --weight"),
                                        (dict(kernel="fa3"), "--kernel fa3")])
def test_bad_options_are_refused_before_the_folder(tmp_path, bad, words):
    with pytest.raises(UsageError, match=words):
        LongContextStudy(**(TINY | dict(lengths=[640]) | bad))


def test_registered_as_a_study():
    assert get_study("long-context") is LongContextStudy


def test_flash_attn_passes_num_splits_only_when_set():
    """The split-KV decode of the study reaches the kernel's num_splits; a plain call is unchanged."""
    import torch

    from fa3_numerics.kernels.fa3 import flash_attn

    seen = []
    fn = lambda q, k, v, **kw: (seen.append(kw), q)[1]  # noqa: E731
    x = torch.zeros(1, 1, 1, 8)
    flash_attn(x, x, x, softmax_scale=1.0, causal=True, fn=fn)
    flash_attn(x, x, x, softmax_scale=1.0, causal=True, fn=fn, num_splits=57)
    assert "num_splits" not in seen[0] and seen[1]["num_splits"] == 57


def _merge_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "merge_long_context.py"
    spec = importlib.util.spec_from_file_location("merge_long_context", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lengths_measured_apart_join_into_the_dataset_of_one_run(tmp_path):
    # The 256K stage runs in a device call of its own; the joined dataset must be what one run of
    # both lengths gives, findings included.
    tool = _merge_tool()
    a = _run(tmp_path / "a", [], lengths=[640]).dataset
    b = _run(tmp_path / "b", [], lengths=[960]).dataset
    both = _run(tmp_path / "both", [], lengths=[640, 960]).dataset
    assert tool.main([str(tmp_path / "b" / "long_context.nc"), str(tmp_path / "a" / "long_context.nc"),
                      "--out", str(tmp_path / "joined.nc")]) == 0
    import xarray as xr

    joined = xr.open_dataset(tmp_path / "joined.nc").load()
    assert list(joined["length"].values) == [640, 960]
    for v in both.data_vars:
        assert joined[v].equals(both[v]), v
    assert json.loads(joined.attrs["findings"]) == json.loads(both.attrs["findings"])
    assert a.sizes["length"] == b.sizes["length"] == 1


def test_join_refuses_parts_of_other_measurements(tmp_path, capsys):
    tool = _merge_tool()
    _run(tmp_path / "a", [], lengths=[640])
    _run(tmp_path / "b", [], lengths=[960], head_dim=128)
    assert tool.main([str(tmp_path / "a" / "long_context.nc"), str(tmp_path / "b" / "long_context.nc"),
                      "--out", str(tmp_path / "joined.nc")]) == 2
    assert "head_dim" in capsys.readouterr().err and not (tmp_path / "joined.nc").exists()
    assert tool.main([str(tmp_path / "a" / "long_context.nc"), str(tmp_path / "a" / "long_context.nc"),
                      "--out", str(tmp_path / "joined.nc")]) == 2  # a length given twice
