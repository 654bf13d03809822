"""`fa3-numerics validate`: the grid, the report, and the refusal without a Hopper GPU."""

import math

import numpy as np
import pytest
import torch

from fa3_numerics.numerics.tiles import fa3_tiles
from fa3_numerics.studies.validate import (Case, accumulator_ranking, case_recipe, grid, markdown_validation,
                                   run_validation)

NO_HOPPER = not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0))


def test_small_grid_covers_the_issue_axes():
    cases = grid("small")
    names = [c.name for c in cases]
    assert len(set(names)) == len(names)
    fp8 = [c for c in cases if c.dtype == "fp8"]
    assert any(c.seqlen % fa3_tiles(c.head_dim, fp8=True)[1] and c.seqlen % 128 for c in fp8)  # ragged
    assert {True, False} <= {c.causal for c in fp8}
    assert any(c.kv_heads < c.heads for c in fp8)  # GQA
    assert {64, 128, 256} <= {c.head_dim for c in fp8}
    assert len({(c.p, c.sigma) for c in fp8}) >= 3
    assert {"head", "tensor"} <= {c.gran for c in fp8}
    assert {"none", "hadamard"} <= {c.rot for c in fp8}
    assert any(c.dtype == "bf16" for c in cases)
    assert len(grid("full")) > len(cases)


def test_every_case_runs_on_the_fa3_kernel():
    from fa3_numerics.engine.backends import get_backend

    fa3 = get_backend("fa3")
    for c in grid("full") + grid("small"):
        assert fa3.supports(case_recipe(c)) is None, c.name
        assert case_recipe(c, "fp22").acc == "fp22"


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
    assert len(msgs) == 2
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


@pytest.mark.skipif(not NO_HOPPER, reason="the refusal path is for machines without a Hopper GPU")
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
