"""`fa3-numerics validate --backward`: the emulated backward against a kernel's, on stand-in kernels whose
answer is known (the emulator itself: F = 0; a kernel off in one gradient: F there and nowhere else),
and the cuDNN path's plumbing on its emulated graph functions."""

import dataclasses

import numpy as np
import pytest
import torch

from fa3_numerics.engine.backends import EmulateBackend
from fa3_numerics.errors import KernelDeclined, UsageError
from fa3_numerics.numerics.backward import emulate_backward
from fa3_numerics.numerics.recipe import get_recipe
from fa3_numerics.report.validation_backward import validation_backward_document, verdict
from fa3_numerics.studies.validate import Case
from fa3_numerics.studies.validate_backward import backward_skips, run_backward_validation

_BASE = Case(seqlen=96, heads=2, kv_heads=1, head_dim=64, causal=True)
CASES = [_BASE, dataclasses.replace(_BASE, dtype="bf16"), dataclasses.replace(_BASE, rot="hadamard")]


class EmulatedKernel(EmulateBackend):
    """A 'kernel' that is the emulator at the preset's recipe, its LSE returned: the emulated
    backward must be it, bit for bit, in both modes."""

    name = "emulated-kernel"
    hardware = False
    recipe_name = "fa3-fp8-bwd-bf16"
    dk_noise = 0.0  # relative noise added to dK (a kernel the emulator does not model)
    decline_n = 0  # seqlen this kernel refuses

    def validation_backward_recipe(self, case):
        return dataclasses.replace(get_recipe(self.recipe_name).recipe, acc="fp32")

    def gradients(self, recipe, q, k, v, do, *, causal, rotation_seed, cache, softmax_scale=None):
        if q.shape[2] == self.decline_n:
            raise KernelDeclined(f"declines seqlen {self.decline_n}")
        gr = emulate_backward(recipe, q, k, v, do, causal=causal, softmax_scale=softmax_scale,
                              rotation_seed=rotation_seed)
        dk = gr.dk
        if self.dk_noise:
            g = torch.Generator().manual_seed(7)
            dk = dk + self.dk_noise * dk.abs().mean() * torch.randn(dk.shape, generator=g, dtype=dk.dtype)
        return {"o": gr.forward.o, "dq": gr.dq, "dk": dk, "dv": gr.dv, "lse": gr.forward.lse}


def test_the_emulator_against_itself_is_exact_in_both_modes():
    ds = run_backward_validation(CASES, device="cpu", kernel=EmulatedKernel(), progress=lambda m: None)
    run = [i for i, s in enumerate(ds["skipped"].values) if not s]
    # the rotated case is not a backward these kernels run; the BF16 case repeats the FP8 one here
    assert "rot=hadamard" in ds["skipped"].values[2] and "same recipe and inputs" in ds["skipped"].values[1]
    assert run == [0]
    f = ds["fidelity"].values[0]
    assert np.array_equal(f, np.zeros_like(f))
    assert (ds["identical"].values[0] == 1.0).all()
    assert (ds["rmse_kernel"].values[0] > 0).all()  # a real error to be faithful to
    assert np.isnan(ds["fidelity"].values[1:]).all()
    assert "every gradient within" in verdict(ds)[0]


def test_a_kernel_off_in_dk_shows_in_dk_alone():
    k = EmulatedKernel()
    k.dk_noise = 0.5
    ds = run_backward_validation(CASES[:1], device="cpu", kernel=k, progress=lambda m: None)
    f = ds["fidelity"].sel(case=CASES[0].name)
    for mode in ("kernel-fwd", "end-to-end"):
        assert float(f.sel(mode=mode, grad="dk")) > 0.01
        for g in ("o", "dq", "dv"):
            assert float(f.sel(mode=mode, grad=g)) == 0.0
    lines = verdict(ds)
    assert "above the bar" in lines[0] and "dk" in lines[0]
    doc = validation_backward_document(ds)
    assert doc.sections[0].title == "Cases"


def test_a_declined_shape_is_recorded_and_the_rest_runs():
    k = EmulatedKernel()
    k.decline_n = 96
    cases = [CASES[0], dataclasses.replace(CASES[0], seqlen=64)]
    ds = run_backward_validation(cases, device="cpu", kernel=k, progress=lambda m: None)
    assert "declines seqlen 96" in ds["skipped"].values[0]
    assert ds["skipped"].values[1] == "" and np.isfinite(ds["fidelity"].values[1]).all()


def test_skips_need_a_backward_recipe():
    with pytest.raises(UsageError, match="no backward to validate"):
        backward_skips(CASES, EmulateBackend())
    assert "--max-seqlen 64" in backward_skips(CASES[:1], EmulatedKernel(), max_seqlen=64)[0]


def test_cudnn_path_on_its_emulated_graphs(monkeypatch):
    # cuDNN's whole path but the kernel (prepare, FP8 codes and descales, decoding, Stats as the LSE) on
    # graph functions computed by the emulator at float32 accumulation: from that "kernel's" O and LSE the
    # emulated backward at the same accumulation must give its gradients back to the one-code differences of
    # x * scale against x / descale, so F stays far below the bar; a wrong LSE (e.g. reshaped across
    # heads) would not.
    from fa3_numerics.kernels import cudnn as kc

    monkeypatch.setattr(kc.CudnnFp8Backend, "graphs", kc.EmulatedGraphs)
    monkeypatch.setattr(kc.CudnnFp8Backend, "check", lambda self, device: None)
    monkeypatch.setattr(kc.CudnnFp8Backend, "validation_backward_recipe",
                        lambda self, case: kc.EmulatedGraphs.recipe("e4m3", "e4m3"))
    case = Case(seqlen=128, heads=2, kv_heads=2, head_dim=64, causal=True, gran="tensor")
    ds = run_backward_validation([case], device="cpu", backend="cudnn-fp8", progress=lambda m: None)
    f = ds["fidelity"].sel(case=case.name, mode="kernel-fwd")
    assert float(f.sel(grad="o")) == 0.0
    for g in ("dq", "dk", "dv"):
        assert float(f.sel(grad=g)) < 0.01, g


def test_cli_refuses_bad_combinations(cli, tmp_path):
    base = ("validate", "--grid", "tiny", "--backend", "fa3-mock", "--device", "cpu", "--out", tmp_path / "v")
    code, out, err = cli(*base, "--backward")
    assert code == 2 and "computes the forward only" in err and "Traceback" not in err
    code, out, err = cli(*base, "--max-seqlen", "512")
    assert code == 2 and "--max-seqlen is for --backward" in err


def test_study_writes_dataset_and_report_and_resumes(tmp_path):
    from fa3_numerics.engine.dataset import read
    from fa3_numerics.engine.study import run_study
    from fa3_numerics.report import render_report
    from fa3_numerics.studies.validate_backward import BackwardValidationStudy

    k = EmulatedKernel()
    study = BackwardValidationStudy(CASES, device="cpu", backend=k.name, kernel=k)
    out = run_study(study, tmp_path, render=render_report, formats=("md",), echo=lambda m: None,
                    stdout=lambda m: None)
    assert out.code == 0
    ds = read(tmp_path / "validation_backward.nc", kinds=None)
    assert ds.attrs["kind"] == "validation-backward" and float(ds["fidelity"].sel(case=CASES[0].name).max()) == 0.0
    md = (tmp_path / "validation_backward.md").read_text()
    assert "every gradient within" in md and "rot=hadamard" in md
    # a rerun reads the finished case from OUT/.cells instead of computing it
    k.decline_n = 96  # were it recomputed, the case would now be declined
    out = run_study(BackwardValidationStudy(CASES, device="cpu", backend=k.name, kernel=k), tmp_path,
                    render=render_report, formats=("md",), echo=lambda m: None, stdout=lambda m: None)
    assert read(tmp_path / "validation_backward.nc", kinds=None)["skipped"].values[0] == ""
