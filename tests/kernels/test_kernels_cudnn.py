"""The ``cudnn-fp8`` backend (cuDNN's FP8 SDPA forward) and its recipe, ``cudnn-fp8-fwd``.

CPU side: the refusal and its fix, the listing, the recipe per validation case and the skips, the
descales the backend hands cuDNN (the emulator's, checked against an independent amax / 448), the
FP8 O scaling (oscale=amax). GPU side (skipped without cuDNN on a Hopper GPU): the emulator
against the kernel through ``validate``'s machinery, F <= 0.05 and no non-finite output.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np
import pytest
import torch

from fa3_numerics.engine.backends import backend_table, get_backend, refusal
from fa3_numerics.errors import UsageError
from fa3_numerics.kernels.cudnn import kernel_inputs, kernel_problem, out_descale, p_scales
from fa3_numerics.numerics.emulator import emulate, prepare
from fa3_numerics.numerics.formats import quantize_dequantize
from fa3_numerics.numerics.recipe import Recipe, get_recipe
from fa3_numerics.studies.validate import Case, case_recipe, grid, skips

CUDNN = get_recipe("cudnn-fp8-fwd").recipe


def _kernel_ok() -> bool:
    return kernel_problem("cuda") is None


def _inputs(b=1, h=4, hkv=2, n=96, d=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, hh, n, d, generator=g, dtype=torch.float64) * s
                 for hh, s in ((h, 2.0), (hkv, 3.0), (hkv, 1.5)))


# -- refusals, listing, recipes -------------------------------------------------------------

@pytest.mark.skipif(_kernel_ok(), reason="cuDNN's FP8 attention can run here")
def test_refusal_names_what_is_missing_and_the_fix():
    why = get_backend("cudnn-fp8").check("cuda")
    assert why is not None and "\n" not in why
    assert why.endswith("meanwhile use --backend emulate")
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in why
    if importlib.util.find_spec("cudnn") is None:
        assert "pip install nvidia-cudnn-frontend==1.32.0" in why


def test_backends_lists_cudnn_with_its_reason():
    rows = {r["name"]: r for r in backend_table("cpu")}
    assert rows["cudnn-fp8"]["hardware"]
    assert rows["cudnn-fp8"]["usable"] or rows["cudnn-fp8"]["why"]


def test_preset_forward_is_the_backward_presets_forward_with_fp8_o():
    # the backward study's cudnn-fp8 keeps its spec; the forward preset differs only where the
    # Hopper kernel does: O in E4M3 scaled by its amax, and the FP8 wgmma accumulator
    bwd = get_recipe("cudnn-fp8").recipe
    assert CUDNN.gran.short_str() == "tensor" and CUDNN.p_offset == bwd.p_offset
    assert (CUDNN.out, CUDNN.oscale, CUDNN.acc) == ("e4m3", "amax", "fp22")
    assert bwd.out == "bf16" and bwd.oscale == "none"
    b = get_backend("cudnn-fp8")
    assert refusal(b, CUDNN) is None
    assert "one descale per tensor" in refusal(b, get_recipe("fa3-fp8-kernel").recipe)
    assert "bwd.s" in refusal(b, bwd)  # the backward's keys are not this forward's
    with pytest.raises(UsageError, match="oscale=amax scales O into an FP8 output"):
        Recipe.from_str("cudnn-fp8-fwd,out=bf16")


def test_recipe_per_case_and_skips():
    b = get_backend("cudnn-fp8")
    small = grid("small")
    why = skips(small, b)
    for c, w in zip(small, why):
        r = case_recipe(c, backend=b)
        assert r.rot == c.rot and r.gran.short_str() == "tensor"
        if not w:
            assert refusal(b, r) is None
    # per-head and per-tensor descales are one recipe on cuDNN, and BF16 cases its FP8 recipe
    assert why[2].startswith("same recipe and inputs as case " + small[0].name)
    assert why[small.index(Case(dtype="bf16"))].startswith("same recipe and inputs as case " + small[0].name)


def test_descales_are_amax_over_448_per_tensor():
    q, k, v = _inputs()
    pre = prepare(CUDNN, q, k, v, q_index=torch.arange(q.shape[2]))
    ins = kernel_inputs(pre, CUDNN, kv_heads=2)
    for name, x in (("q", q), ("k", k), ("v", v)):
        want = torch.tensor(float(x.abs().max()) / 448.0, dtype=torch.float32)
        got = ins["descale_" + name]
        assert got.shape == (1, 1, 1, 1) and got.dtype == torch.float32
        assert float(got) == float(want)
        t = ins[name]
        assert t.dtype == torch.float8_e4m3fn and t.is_contiguous() and t.shape == x.shape
        # the bytes are the saturating cast of x / descale: the largest entry lands on 448
        assert float(t.to(torch.float64).abs().max()) == 448.0
        np.testing.assert_array_equal(t.to(torch.float64).numpy(),
                                      quantize_dequantize(x / float(want), "e4m3", torch.float64).numpy())
    s, ds = p_scales(CUDNN)
    # scale_s = 2^poff, the emulator's P~ peak (poff=8.80735 is log2(448) to 6 digits: 447.9985)
    assert s == float(torch.tensor(2.0 ** CUDNN.p_offset, dtype=torch.float32)) and abs(s - 448.0) < 0.01 and ds == float(torch.tensor(1.0 / s, dtype=torch.float32))
    with pytest.raises(UsageError, match="one descale per tensor"):
        r = get_recipe("fa3-fp8-kernel").recipe
        kernel_inputs(prepare(r, q, k, v, q_index=torch.arange(q.shape[2])), r, kv_heads=2)


def test_fp8_o_is_scaled_by_its_amax():
    q, k, v = _inputs(n=80)
    o = emulate(CUDNN, q, k, v)
    bf = emulate(dataclasses.replace(CUDNN, out="bf16", oscale="none"), q, k, v)
    # the largest output is 448 descales; the descale is a float32 amax / 448 of O (here within
    # BF16's rounding of the same O), and every output is an E4M3 value times that one descale
    descale = float(o.abs().max()) / 448.0
    assert descale == float(torch.tensor(descale, dtype=torch.float32))
    assert abs(descale / out_descale(float(bf.abs().max()), CUDNN) - 1) < 2 ** -7
    codes = o / descale
    np.testing.assert_array_equal(codes.numpy(), quantize_dequantize(codes, "e4m3", torch.float64).numpy())
    err = float(((o - bf) ** 2).mean().sqrt() / bf.pow(2).mean().sqrt())
    assert 1e-3 < err < 0.05  # E4M3's rounding, far above BF16's
    unscaled = emulate(dataclasses.replace(CUDNN, oscale="none"), q, k, v)
    assert not torch.equal(unscaled, o)  # negative control: the scale changes which values are kept
    # a sample of rows keeps the scale of every row (the kernel's Amax_O covers them all)
    some = torch.tensor([1, 40, 79])
    assert torch.equal(emulate(CUDNN, q, k, v, q_index=some), o.index_select(2, some))


def test_attention_refuses_on_the_cpu():
    b = get_backend("cudnn-fp8")
    q, k, v = _inputs()
    with pytest.raises(UsageError, match="CUDA device"):
        b.attention(CUDNN, q, k, v, causal=False, q_index=torch.arange(q.shape[2]), rotation_seed=0, cache={})


# -- on a GPU with cuDNN ----------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(not _kernel_ok(), reason=f"cuDNN's sdpa_fp8 cannot run here: {kernel_problem('cuda')}")

GPU_CASES = [Case(seqlen=1000, heads=4, kv_heads=4, head_dim=128),
             Case(seqlen=777, heads=4, kv_heads=2, head_dim=64, causal=True),
             Case(seqlen=512, heads=4, kv_heads=1, head_dim=128, rot="hadamard").with_data(p=0.01, sigma=30.0)]


# Fitted on the H200 (reports/h200/field/README.md): every O code equal on most cases; rows that one
# key dominates sit on E4M3 ties and flip whole (49-51 codes of 256,000, F 0.08 where they occur),
# which the bar leaves room for; the preset before the fit gave F 0.08-0.78.
@needs_kernel
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_emulator_matches_the_kernel(case):
    from fa3_numerics.studies.validate import run_validation

    b = get_backend("cudnn-fp8")
    skip = b.validation_skip(case)
    if skip:
        pytest.skip(skip)
    ds = run_validation([case], device="cuda", backend="cudnn-fp8", progress=lambda s: None)
    f = ds["fidelity"].values[0]
    print(case.name, dict(zip(ds["acc"].values, f)), "identical", ds["identical"].values[0], "amax", b.last_amax,
          "engine", b.last_engine)
    assert float(ds["nonfinite_kernel"].values[0]) == 0
    assert np.nansum(ds["nonfinite_emulator"].values[0]) == 0
    assert np.isfinite(f).all()
    assert float(np.min(f)) <= 0.1  # the best accumulator model; the validation grid says which
    if b.last_amax:  # the kernel ran in this process (the engine's default)
        assert math.isfinite(b.last_amax["amax_o"]) and b.last_amax["amax_o"] > 0


@needs_kernel
def test_kernel_amax_o_is_the_emulators():
    # the scale of O comes from the kernel's Amax_O; it must be the emulator's amax of O
    q, k, v = (x.cuda() for x in _inputs(n=256, d=128))
    b = get_backend("cudnn-fp8")
    b.attention(CUDNN, q, k, v, causal=False, q_index=torch.arange(256, device="cuda"), rotation_seed=0, cache={})
    bf = emulate(dataclasses.replace(CUDNN, out="bf16", oscale="none", acc="fp32"), q, k, v)
    assert abs(b.last_amax["amax_o_first"] / float(bf.abs().max()) - 1) < 0.01


def _sdpa_fp8_cpu(ins, scale_o, out, causal, softmax_scale):
    """cuDNN's sdpa_fp8 graph in float64 on the CPU, P unquantized: a stand-in with run_graph's
    contract (FP8 O = O * scale_o saturating, Amax_O before scale_o), for the backend's own steps."""
    from fa3_numerics.numerics.reference import reference_attention

    deq = lambda name: ins[name].to(torch.float64) * float(ins["descale_" + name])  # noqa: E731
    o = reference_attention(deq("q"), deq("k"), deq("v"), causal=causal, softmax_scale=softmax_scale)
    o8 = (o * scale_o).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"o": o8, "amax_s": 1.0, "amax_o": float(o.abs().max())}


def test_backend_scales_o_by_the_kernels_amax():
    from fa3_numerics.numerics.reference import reference_attention

    q, k, v = _inputs(b=2, h=6, hkv=2, n=64, d=64)
    b = get_backend("cudnn-fp8")
    b.kernel_fn = staticmethod(_sdpa_fp8_cpu)
    rows = torch.arange(q.shape[2])
    o = b.attention(CUDNN, q, k, v, causal=True, q_index=rows, rotation_seed=0, cache={})
    ref = reference_attention(q, k, v, causal=True)
    descale = out_descale(b.last_amax["amax_o_first"], CUDNN)
    codes = o / descale
    np.testing.assert_array_equal(codes.numpy(), quantize_dequantize(codes, "e4m3", torch.float64).numpy())
    assert float(codes.abs().max()) == 448.0
    # the heads are where they belong (GQA: query head 4 reads kv head 1): E4M3 error only (~8%,
    # Q, K, V and O each rounded to 4 significant bits), where a wrong head is ~100%
    per_head = ((o - ref) ** 2).mean(dim=(0, 2, 3)).sqrt() / (ref ** 2).mean(dim=(0, 2, 3)).sqrt()
    assert float(per_head.max()) < 0.15
    wrong = ((o - ref.roll(1, dims=1)) ** 2).mean().sqrt() / (ref ** 2).mean().sqrt()
    assert float(wrong) > 0.5  # negative control
    # sampled rows: the same scale (the amax of every row), the same values
    some = torch.tensor([0, 9, 33, 63])
    assert torch.equal(b.attention(CUDNN, q, k, v, causal=True, q_index=some, rotation_seed=0, cache={}),
                       o.index_select(2, some))
    with pytest.raises(UsageError, match="causal with seqlen_q"):
        b.attention(CUDNN, q[:, :, :32], k, v, causal=True, q_index=rows[:32], rotation_seed=0, cache={})


# -- the backward: sdpa_fp8 training + sdpa_fp8_backward ----------------------------------------

from fa3_numerics.engine.backends import backward_refusal  # noqa: E402
from fa3_numerics.kernels import cudnn as kc  # noqa: E402
from fa3_numerics.numerics.backward import emulate_backward  # noqa: E402
from fa3_numerics.numerics.metrics import fidelity  # noqa: E402


def _bwd_recipe(do_fmt="e4m3", grad="e4m3", **kw):
    # the kernel preset at float32 accumulation (CPU speed), in the given dO and gradient formats
    return dataclasses.replace(get_recipe("cudnn-fp8-kernel").recipe, acc="fp32", **kc.bwd_formats(do_fmt, grad),
                               bwd_acc="fp32", **kw)


def test_backends_lists_which_compute_gradients():
    rows = {r["name"]: r for r in backend_table("cpu")}
    assert rows["cudnn-fp8"]["backward"] and rows["emulate"]["backward"] and rows["sdpa-flash"]["backward"]
    assert not rows["fa3"]["backward"] and not rows["sdpa-math"]["backward"]
    # sdpa-flash's backward runs every bwd.* product in its input format, nothing else
    flash = get_backend("sdpa-flash")
    assert flash.backward_supports(get_recipe("sdpa-flash-bf16").recipe) is None
    fp8_bwd = dataclasses.replace(get_recipe("sdpa-flash-bf16").recipe, bwd_ds="e5m2", bwd_dq="e5m2")
    assert "bwd.* formats" in flash.backward_supports(fp8_bwd)
    assert "forward only" in backward_refusal(get_backend("fa3"), get_recipe("fa3-fp8-bwd-bf16").recipe)


def test_backward_refuses_what_cudnn_does_not_compute_with_the_fix():
    b = get_backend("cudnn-fp8")
    assert backward_refusal(b, _bwd_recipe()) is None
    assert backward_refusal(b, _bwd_recipe("e5m2", "bf16")) is None
    assert backward_refusal(b, get_recipe("cudnn-fp8-kernel").recipe) is None
    # the study preset (BF16 O, P at its amax) is not what the kernel computes; the kernel preset is
    assert "out=e4m3,oscale=amax" in backward_refusal(b, get_recipe("cudnn-fp8").recipe)
    assert "bwd.pscale=offset" in backward_refusal(b, dataclasses.replace(_bwd_recipe(), bwd_pscale="amax"))
    assert "bwd.dqcast=fp16" in backward_refusal(b, dataclasses.replace(_bwd_recipe(), bwd_dqcast="direct"))
    # Hopper's training forward writes FP8 O, which the backward reads
    assert "out=e4m3,oscale=amax" in backward_refusal(b, dataclasses.replace(_bwd_recipe(), out="bf16",
                                                                              oscale="none"))
    assert "one scale per tensor" in backward_refusal(b, dataclasses.replace(_bwd_recipe(),
                                                                              bwd_gran=get_recipe("fp8-bwd-block").recipe.bwd_gran))
    # dS in another format than dO: not what this path runs
    why = backward_refusal(b, dataclasses.replace(_bwd_recipe("e5m2"), bwd_dq="e4m3"))
    assert why and "bwd.dq=e5m2:e4m3" in why
    assert "dO in bf16" in backward_refusal(b, dataclasses.replace(_bwd_recipe(), bwd_dv="e4m3:bf16",
                                                                    bwd_dp="bf16:e4m3", bwd_ds="bf16:e4m3"))
    # the arithmetic fitted on the kernel's bytes: another form is refused, naming the key and the fix
    assert backward_refusal(b, _bwd_recipe()) is None
    for key, value in (("bwd_pexp", "fa3"), ("bwd_outscale", "descale"), ("bwd_dsform", "cudnn"),
                       ("bwd_dqscale", "tile")):
        why = backward_refusal(b, dataclasses.replace(_bwd_recipe(), **{key: value}))
        assert why and f"{key.replace('_', '.', 1)}={value}" in why and "cudnn-fp8-kernel" in why, key


def test_gradients_refuse_on_the_cpu():
    q, k, v = _inputs()
    with pytest.raises(UsageError, match="CUDA device"):
        get_backend("cudnn-fp8").gradients(_bwd_recipe(), q, k, v, torch.ones_like(q), causal=False,
                                           rotation_seed=0, cache={})


@pytest.mark.parametrize("do_fmt,grad,causal", [("e4m3", "e4m3", False), ("e5m2", "bf16", True)])
def test_gradients_path_on_emulated_graphs_is_the_emulator(monkeypatch, do_fmt, grad, causal):
    # The whole path but cuDNN (prepare -> FP8 codes and descales -> the scale passes -> decoding)
    # on graph functions computed by the emulator: it must give the emulator's own gradients back, to
    # the one-code differences of x * scale against x / descale in the FP8 outputs.
    monkeypatch.setattr(kc.CudnnFp8Backend, "graphs", kc.EmulatedGraphs)
    b = get_backend("cudnn-fp8")
    q, k, v = _inputs(n=128, d=64)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    r = _bwd_recipe(do_fmt, grad)
    got = b.gradients(r, q, k, v, do, causal=causal, rotation_seed=0, cache={})
    want = emulate_backward(r, q, k, v, do, causal=causal)
    ref = emulate_backward(dataclasses.replace(r, **{f: "fp32" for f in ("bwd_s", "bwd_dv", "bwd_dp", "bwd_ds",
                                                                         "bwd_dq", "bwd_dk", "bwd_out")},
                                               qk="fp32", v="fp32", p="fp32", out="fp32", oscale="none"),
                           q, k, v, do, causal=causal)
    for name, w, rr in (("dq", want.dq, ref.dq), ("dk", want.dk, ref.dk), ("dv", want.dv, ref.dv)):
        assert got[name].shape == w.shape
        assert fidelity(w, got[name], rr)["F"] < 0.01, name
    assert fidelity(want.forward.o, got["o"], ref.forward.o)["F"] < 0.01
    sc = kc.CudnnFp8Backend.last_backward["scalars"]
    fmax = kc.FMT_MAX[do_fmt]
    assert sc["scale_dP"] == pytest.approx(fmax) and sc["descale_dP"] == pytest.approx(1 / fmax)  # stand-in amax 1
    # negative control: dO quantized in the other format moves the gradients
    other = "e5m2" if do_fmt == "e4m3" else "e4m3"
    moved = emulate_backward(_bwd_recipe(other, grad), q, k, v, do, causal=causal)
    assert fidelity(moved.dq, got["dq"], ref.dq)["F"] > 0.05


class _FakeTensor:
    def __init__(self, name, **kw):
        self.name, self.attrs = name, dict(kw)

    def __getattr__(self, attr):
        if attr.startswith("set_"):
            def setter(value):
                self.attrs[attr[4:]] = value
                return self
            return setter
        raise AttributeError(attr)


class _FakeGraph:
    def __init__(self, **kw):
        self.kw, self.calls, self.executed = kw, {}, []

    def tensor(self, name, dim, stride, data_type):
        return _FakeTensor(name, dim=dim, stride=stride, data_type=data_type)

    def sdpa_fp8(self, **kw):
        self.calls["sdpa_fp8"] = kw
        return tuple(_FakeTensor(n) for n in ("o", "stats", "amax_s", "amax_o"))

    def sdpa_fp8_backward(self, **kw):
        self.calls["sdpa_fp8_backward"] = kw
        return tuple(_FakeTensor(n) for n in ("dq", "dk", "dv", "amax_dq", "amax_dk", "amax_dv", "amax_dp"))

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self):
        return 0

    def execute(self, pack, ws, handle=None):
        self.executed.append(pack)


class _FakeCudnn:
    class data_type:  # noqa: N801 - cudnn's spelling
        FP8_E4M3, FP8_E5M2, BFLOAT16, FLOAT = "e4m3", "e5m2", "bf16", "f32"

    class heur_mode:  # noqa: N801
        A, FALLBACK = "A", "FALLBACK"

    graphs: list = []

    @classmethod
    def pygraph(cls, **kw):
        cls.graphs.append(_FakeGraph(**kw))
        return cls.graphs[-1]


def test_backward_graph_takes_cudnns_documented_operands(monkeypatch):
    # The operand names of sdpa_fp8_backward as the wheel's binding documents them (cudnn-frontend
    # 1.32 docstring: q, k, v, o, dO, stats, descale_q/k/v/o/dO/s/dP, scale_s/dQ/dK/dV/dP), dO in the
    # asked format, the gradients written in theirs, and every graph tensor bound at execution.
    monkeypatch.setattr(kc, "_KERNEL", {"mod": _FakeCudnn, "version": "fake"})
    monkeypatch.setattr(kc, "_handle", lambda dev: None)
    monkeypatch.setattr(kc, "_BWD", {})
    entry = kc.build_backward(torch.device("cpu"), 1, 4, 2, 64, 64, True, 0.125, "e5m2", "bf16")
    g = _FakeCudnn.graphs[-1]
    kw = g.calls["sdpa_fp8_backward"]
    documented = {"q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v", "descale_o",
                  "descale_dO", "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV",
                  "scale_dP", "attn_scale", "use_causal_mask", "name"}
    assert set(kw) == documented
    assert kw["use_causal_mask"] is True and kw["attn_scale"] == 0.125
    assert kw["dO"].attrs["data_type"] == "e5m2" and kw["q"].attrs["data_type"] == "e4m3"
    assert kw["k"].attrs["dim"] == [1, 2, 64, 64]
    assert {entry["t"][n].attrs["data_type"] for n in ("dq", "dk", "dv")} == {"bf16"}
    assert entry["t"]["dk"].attrs["dim"] == [1, 2, 64, 64]
    e4 = torch.float8_e4m3fn
    ins = {"q": torch.zeros(1, 4, 64, 64, dtype=e4), "k": torch.zeros(1, 2, 64, 64, dtype=e4),
           "v": torch.zeros(1, 2, 64, 64, dtype=e4), "o": torch.zeros(1, 4, 64, 64, dtype=e4),
           "dO": torch.zeros(1, 4, 64, 64, dtype=torch.float8_e5m2), "stats": torch.zeros(1, 4, 64, 1)}
    out = kc.run_backward(entry, ins, {n: 1.0 for n in kc.BWD_SCALARS})
    pack = g.executed[-1]
    assert set(map(id, pack)) == set(map(id, entry["t"].values()))
    assert out["dq"].dtype == torch.bfloat16 and out["dk"].shape == (1, 2, 64, 64)


@pytest.mark.parametrize("train", [False, True])
def test_forward_graphs_take_cudnns_documented_operands(monkeypatch, train):
    # The inference and the training forward are one graph builder: the same operands, the
    # training one also writing Stats (the log-sum-exp the backward reads), O in E4M3 on Hopper.
    monkeypatch.setattr(kc, "_KERNEL", {"mod": _FakeCudnn, "version": "fake"})
    monkeypatch.setattr(kc, "_handle", lambda dev: None)
    monkeypatch.setattr(kc, "_GRAPHS", {})
    monkeypatch.setattr(kc, "_FWD_TRAIN", {})
    dev = torch.device("cpu")
    if train:
        entry = kc.build_train_forward(dev, 1, 4, 2, 64, 128, False, 0.125)
    else:
        entry = kc.build_graph(dev, 1, 4, 2, 64, 96, 128, 128, False, 0.125, "e4m3")
    kw = _FakeCudnn.graphs[-1].calls["sdpa_fp8"]
    assert set(kw) == {"q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o",
                       "is_inference", "attn_scale", "use_causal_mask", "name"}
    assert kw["is_inference"] is (not train) and kw["attn_scale"] == 0.125 and kw["use_causal_mask"] is False
    assert kw["k"].attrs["dim"] == [1, 2, 64 if train else 96, 128]
    t = entry["t"]
    assert ("stats" in t) is train
    assert t["o"].attrs["data_type"] == "e4m3" and t["o"].attrs["dim"] == [1, 4, 64, 128]
    if train:
        assert t["stats"].attrs["dim"] == [1, 4, 64, 1] and t["stats"].attrs["data_type"] == "f32"


def test_validation_backward_skips_the_lengths_of_the_ragged_dq_defect():
    # the H200 dump: dQ's last rows half zero at n 333 / 1000 / 4097, clean at multiples of 128
    from fa3_numerics.kernels.cudnn import RAGGED_DQ_MULTIPLE

    be = get_backend("cudnn-fp8")
    by = {c.name: c for c in grid("small")}
    ragged = by["fp8-n1000-d128-h8-causal-p0.001s10-head"]
    why = be.validation_backward_skip(ragged)
    assert why is not None and "seqlen 1000" in why and f"multiple of {RAGGED_DQ_MULTIPLE}" in why
    assert be.validation_backward_skip(by["fp8-n2048-d128-h8-causal-p0.001s10-head"]) is None
    assert be.validation_backward_skip(dataclasses.replace(ragged, seqlen=1024)) is None
