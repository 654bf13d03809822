"""`fa3-numerics validate`: the grid, the report, and the refusal without a Hopper GPU."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from fa3_numerics.numerics.tiles import fa3_tiles
from fa3_numerics.report.validation import markdown_validation
from fa3_numerics.studies.validate import Case, accumulator_ranking, case_recipe, grid, run_validation

def test_small_grid_covers_the_issue_axes():
    cases = grid("small")
    names = [c.name for c in cases]
    assert len(set(names)) == len(names)
    fp8 = [c for c in cases if c.dtype == "fp8"]
    assert any(c.seqlen % fa3_tiles(c.head_dim, fp8=True)[1] and c.seqlen % 128 for c in fp8)  # ragged
    assert {True, False} <= {c.causal for c in fp8}
    assert any(c.kv_heads < c.heads for c in fp8)  # GQA
    assert {64, 128, 256} <= {c.head_dim for c in fp8}
    assert len({(c.data()[1]['p'], c.data()[1]['sigma']) for c in fp8}) >= 3
    assert {"head", "tensor"} <= {c.gran for c in fp8}
    assert {"none", "hadamard"} <= {c.rot for c in fp8}
    assert any(c.dtype == "bf16" for c in cases)
    assert len(grid("full")) > len(cases)


def test_every_case_runs_on_the_fa3_kernel():
    from fa3_numerics.engine.backends import get_backend

    from fa3_numerics.numerics.granularity import parse_granularity

    fa3 = get_backend("fa3")
    for c in grid("full") + grid("small"):
        r = case_recipe(c)
        assert fa3.supports(r) is None, c.name
        # what the kernel computes for the case: its formats, descales and rotation, BF16 out
        if c.dtype == "fp8":
            assert (r.qk, r.v, r.p, r.gran, r.p_offset) == ("e4m3", "e4m3", "e4m3", parse_granularity(c.gran), 8.0)
        else:
            assert (r.qk, r.v, r.p, r.p_offset) == ("bf16", "bf16", "bf16", 0.0)
        assert (r.rot, r.out, r.algo, r.order) == (c.rot, "bf16", "flash", "reverse")
        # an accumulator model changes the emulator's recipe in that key and in no other
        r22 = case_recipe(c, "fp22")
        assert r22.acc == "fp22" and r22 != r and dataclasses.replace(r22, acc=r.acc) == r


def test_run_validation_with_stand_in_kernel(tmp_path):
    from fa3_numerics.engine.dataset import write
    from fa3_numerics.kernels.fa3 import MockFa3Backend

    cases = [Case(seqlen=96, heads=2, kv_heads=1, head_dim=64, batch=1, causal=True),
             Case(seqlen=80, heads=2, kv_heads=2, head_dim=64, batch=1, dtype="bf16")]
    msgs = []
    ds = run_validation(cases, device="cpu", kernel=MockFa3Backend(), accs=["fp32", "two-level"], progress=msgs.append)
    assert ds["fidelity"].shape == (2, 2) and np.isfinite(ds["fidelity"].values).all()
    assert ((ds["identical"].values >= 0) & (ds["identical"].values <= 1)).all()
    assert (ds["rmse_kernel"].values > 0).all()
    assert ds.attrs["kernel_hardware"] == 0 and "NOT the kernel" in ds.attrs["kernel_label"]
    assert len([m for m in msgs if m.startswith("[validate ")]) == 2  # one summary line per case
    md = markdown_validation(ds)
    assert "| fp8 | 96 | yes | 2/1 | 64 |" in md and "F two-level" in md
    rank = accumulator_ranking(ds)
    assert [r["cases"] for r in rank] == [1, 1]
    assert write(ds, tmp_path / "v.nc").is_file()


def test_deadline_leaves_the_rest_unrun():
    from fa3_numerics.kernels.fa3 import MockFa3Backend

    cases = [Case(seqlen=64, heads=1, kv_heads=1, head_dim=64, batch=1)] * 2
    ds = run_validation(cases, device="cpu", kernel=MockFa3Backend(), accs=["fp32"], deadline=0.0,
                        progress=lambda m: None)
    assert np.isnan(ds["fidelity"].values).all()


@pytest.mark.no_hopper
def test_cli_validate_exits_2_with_one_line_without_the_kernel(capsys):
    from fa3_numerics.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["validate", "--grid", "small"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "fa3" in err


def test_unknown_grid_and_accumulator_are_refused():
    from fa3_numerics.errors import UsageError
    from fa3_numerics.kernels.fa3 import MockFa3Backend

    with pytest.raises(UsageError, match="small"):
        grid("huge")
    with pytest.raises(UsageError, match="fp22"):
        run_validation([Case()], device="cpu", kernel=MockFa3Backend(), accs=["fp99"])


def test_stress_grid_covers_the_regimes_and_stays_small():
    """Issue 9's regimes, each in at least one case, at a cost ~1.5x the small grid's (which took
    ~60 s on an H200 with three accumulator models)."""
    from fa3_numerics.engine.backends import get_backend, refusal
    from fa3_numerics.engine.sampling import effective_rows

    cases = grid("stress")
    fp8 = [c for c in cases if c.dtype == "fp8"]
    bf16 = [c for c in cases if c.dtype == "bf16"]
    assert 20 <= len(cases) <= 24 and len({c.name for c in cases}) == len(cases)
    assert max(c.data()[1]['sigma'] for c in fp8) == 300 and max(c.data()[1]['p'] for c in fp8) == 0.05
    assert {c.head_dim for c in fp8} == {64, 96, 128, 192, 256}
    assert any(c.kv_heads == 1 for c in fp8) and any(c.kv_heads == 1 for c in bf16)
    ragged = [c for c in fp8 if all(c.seqlen % t for t in fa3_tiles(c.head_dim, fp8=True))]
    assert len(ragged) >= 3
    long = [c for c in fp8 if c.seqlen >= 16384]
    assert long and all(c.rows == 256 for c in long) and {c.causal for c in long} == {True, False}
    assert {c.gran for c in fp8} == {"head", "tensor"} and {c.rot for c in fp8} == {"none", "hadamard"}
    assert {c.causal for c in fp8} == {True, False}
    assert any(c.seqlen == 8192 for c in bf16)
    fa3 = get_backend("fa3")
    assert all(refusal(fa3, case_recipe(c)) is None for c in cases)

    def cost(cs):
        return sum(effective_rows(c.seqlen, c.rows) * c.seqlen * c.heads * c.batch * c.head_dim for c in cs)

    assert cost(cases) <= 1.6 * cost(grid("small"))


def test_dist_replaces_the_data_of_every_case():
    from fa3_numerics.errors import UsageError
    from fa3_numerics.studies.validate import with_dist

    cases = grid("tiny")
    o = with_dist(cases, "outliers:p=0.02")
    assert [c.data()[1]['p'] for c in o] == [0.02] * len(cases)
    assert [c.data()[1]['sigma'] for c in o] == [c.data()[1]['sigma'] for c in cases]
    t = with_dist(cases, "student-t:df=4")
    assert all(c.data() == ("student-t", {"df": 4.0}) for c in t) and "student-t[df=4]" in t[0].name
    assert [c.head_dim for c in t] == [c.head_dim for c in cases]
    with pytest.raises(UsageError, match="df"):
        with_dist(cases, "student-t:df=-1")
    with pytest.raises(UsageError, match="unknown distribution"):
        with_dist(cases, "nope")


@pytest.mark.slow
def test_captured_validation_per_layer_and_head(tmp_path, capsys):
    """The emulator against the (stand-in) kernel on a capture's recorded tensors, per layer x
    head, with the capture's GQA heads, softmax scale and causal flag."""
    pytest.importorskip("safetensors")
    import xarray as xr

    from fa3_numerics.studies.validate import captured_cases
    from fa3_numerics.testing import run_cli, write_capture

    path = tmp_path / "c.safetensors"
    tensors = write_capture(path, heads=4, kv_heads=2, tokens=200, layers=(0, 3))
    cases = captured_cases(str(path), layers="3")
    assert [c.name for c in cases] == ["fp8-n200-d64-h4-kv2-causal-layer3-head",
                                       "fp8-n200-d64-h4-kv2-causal-layer3-head-hadamard",
                                       "bf16-n200-d64-h4-kv2-causal-layer3"]
    assert all(c.scale == 64 ** -0.5 and c.causal for c in cases)
    from fa3_numerics.engine.inputs import DistInputs
    from fa3_numerics.studies.validate import tasks

    q, k, v = tasks(cases[:1], "fa3-mock", ["fp32"], "cpu")[0].inputs.draw()
    assert isinstance(tasks(cases[:1], "fa3-mock", ["fp32"], "cpu")[0].inputs, DistInputs)
    assert torch.equal(k[0], tensors["layers.3.k"].double()) and k.shape[1] == 2  # recorded, GQA kept
    code, out, err = run_cli(["validate", "--dist", f"captured:{path}", "--layers", "0,3", "--backend", "fa3-mock",
                              "--device", "cpu", "--acc", "fp32", "--out", str(tmp_path / "v")], capsys)
    assert code == 0, err
    ds = xr.load_dataset(tmp_path / "v" / "validation.nc", engine="h5netcdf")
    assert ds.sizes["case"] == 6 and ds["fidelity_sample"].shape == (6, 1, 4)
    assert np.isfinite(ds["fidelity_sample"]).all() and np.isfinite(ds["identical_sample"]).all()
    # pooled over the heads, the per-head values give the case's F
    f = ds["fidelity_sample"].isel(acc=0).values
    assert (f.min(axis=1) <= ds["fidelity"].isel(acc=0).values + 1e-12).all()
    assert (ds["fidelity"].isel(acc=0).values <= f.max(axis=1) + 1e-12).all()
    assert "Per layer x head on the capture" in out and "| layer | head |" in out


@pytest.mark.slow
def test_cli_validate_tiny_grid_on_the_stand_in(tmp_path, capsys):
    from fa3_numerics.testing import run_cli

    code, out, err = run_cli(["validate", "--grid", "tiny", "--backend", "fa3-mock", "--device", "cpu", "--acc",
                              "fp32", "--out", str(tmp_path / "v")], capsys)
    assert code == 0, err
    md = (tmp_path / "v" / "validation.md").read_text()
    assert md.count("| fp8 |") == 4
    assert "best accumulator model" in out
    # `report` on a validation dataset renders the validation report, the same text
    code, out, err = run_cli(["report", str(tmp_path / "v" / "validation.nc"), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    assert (tmp_path / "r" / "validation.md").read_text() == md
