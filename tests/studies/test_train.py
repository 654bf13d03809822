"""Tests of ``fa3-numerics train`` on a tiny random Llama (2 layers, 2 query heads, 1 KV head, head
dim 64, a word-level tokenizer over the default text), a few steps on the CPU:

- ``exact`` against ``exact`` from the same seed: a gap of exactly 0 at every step, gradient
  cosines of 1 (two runs of the same code on the same batches are bit-identical);
- a coarse FP8 recipe (cuDNN's per-tensor FP8 forward and backward) moves the loss and the
  gradient, and its per-call error is far above the float32 floor of ``exact``;
- a run killed after 2 of 4 steps resumes from its checkpoint and gives the uninterrupted run's
  metrics bit for bit;
- bad input exits 2 with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

pytest.importorskip("transformers", reason="train needs transformers: pip install 'fa3-numerics[capture]'")

from fa3_numerics.engine.study import run_study  # noqa: E402
from fa3_numerics.studies.train import TrainStudy  # noqa: E402

QUIET = lambda _msg: None  # noqa: E731
SMALL = dict(tokens=32, batch=2, lr=1e-3, checkpoint_every=2, probe_every=2, progress=QUIET)


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> Path:
    """A random 2-layer Llama with a word-level tokenizer over the default text, as an HF folder."""
    return tiny_llama("train", layers=2, hidden=64, positions=128, words=500, by_frequency=True)


def _run(tiny, out, **kw):
    study = TrainStudy(model=str(tiny), **{**SMALL, **kw})
    return run_study(study, out, echo=QUIET)


@pytest.fixture(scope="module")
def fp8(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-fp8")
    outcome = _run(tiny, out, steps=4, variants="cudnn-fp8")
    assert outcome.code == 0
    return outcome.dataset, out


def test_exact_against_exact_is_a_zero_gap_bit_for_bit(tiny, tmp_path):
    ds = _run(tiny, tmp_path / "o", steps=3, variants="exact").dataset
    assert list(ds.variant.values) == ["exact", "exact#2"]
    assert np.all(ds.loss_gap.values == 0.0)
    np.testing.assert_array_equal(ds.grad_norm.values[:, 0], ds.grad_norm.values[:, 1])
    np.testing.assert_allclose(ds.grad_cos.values, 1.0, rtol=0, atol=1e-12)
    # the loss moves: the runs did train (lr 1e-3 on the same few windows)
    assert np.all(np.isfinite(ds.loss.values)) and ds.loss.values[0, 0] != ds.loss.values[-1, 0]


def test_fp8_recipe_moves_the_loss_and_the_gradient(fp8):
    ds, out = fp8
    gap = ds.loss_gap.sel(candidate="cudnn-fp8").values
    assert np.all(np.abs(gap) > 1e-6)
    cos = ds.grad_cos.sel(candidate="cudnn-fp8").values
    assert np.all(cos < 1 - 1e-7) and np.all(cos > 0.5)
    err = ds.attn_rel_l2.sel(grad=["dq", "dk", "dv"])
    assert float(err.sel(variant="cudnn-fp8").min()) > 100 * float(err.sel(variant="exact").max())
    assert float(err.sel(variant="exact").max()) < 1e-4
    f = json.loads(ds.attrs["findings"])["candidates"]["cudnn-fp8"]
    assert f["final_gap"]["mean"] == pytest.approx(float(np.mean(gap[-1:])))
    assert ds.attrs["kind"] == "train" and (out / "train.nc").is_file()


def test_killed_run_resumes_bit_identical(tiny, fp8, tmp_path):
    ds, _ = fp8
    out = tmp_path / "o"
    with pytest.raises(RuntimeError, match="killed after step 2"):
        _run(tiny, out, steps=4, variants="cudnn-fp8", fail_after=2)
    assert len(list((out / ".cells").glob("*.npz"))) == 2  # the checkpoint and its index
    again = _run(tiny, out, steps=4, variants="cudnn-fp8").dataset
    assert again.attrs["resumed_from_step"] == 2
    for name in ("loss", "loss_gap", "grad_norm", "grad_norm_total", "grad_cos", "attn_rel_l2"):
        np.testing.assert_array_equal(again[name].values, ds[name].values, err_msg=name)
    # fewer steps read the metrics from the checkpoint without training
    short = _run(tiny, out, steps=3, variants="cudnn-fp8").dataset
    np.testing.assert_array_equal(short.loss.values, ds.loss.values[:3])


def test_report_page(fp8, tmp_path):
    from fa3_numerics.report import renderer

    _, out = fp8
    ds = xr.load_dataset(out / "train.nc", engine="h5netcdf")  # the page reads the file as written
    written = renderer("train")(ds, tmp_path, ("md", "html"))
    md = (tmp_path / "report.md").read_text()
    assert md.index("cudnn-fp8") < md.index("Loss curves")
    assert "nats" in md and any(p.name == "report.html" for p in written)


@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--variants", "no-such-recipe"], "unknown variant"),
    (["--lr", "-1"], "--lr must be a positive number"),
])
def test_bad_input_exits_2_with_one_line(tiny, tmp_path, cli, args, words):
    code, out, err = cli("train", "--model", tiny, "--tokens", "16", "--out", tmp_path / "o", *args)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err
    assert not (tmp_path / "o").exists()
