"""Recipes of the field in the emulator: INT8/INT4, MXFP8/NVFP4, smoothing, FA1, FP16
accumulation, and the presets sage1/2/3, fa1-fp16, fa3-mxfp8.

References are independent of the emulator: float64 attention on operands quantized here with
numpy and ml_dtypes (integer codes by their definition, microscaling scales by frexp), exact
identities (smoothing changes nothing when nothing is quantized), invariances (GQA equals MHA
with repeated K/V, a sample of query rows equals the same rows of a full run), and known
failures that a recipe exists to fix (a k-bias defeats per-block INT8 until K is smoothed;
a strong sink collapses P in forward order unless each tile has its own max)."""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fa3_numerics.data.distributions import AttnShape, generate
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.emulator import emulate, prepare
from fa3_numerics.numerics.families import bits_per_element, family
from fa3_numerics.numerics.granularity import amax, thread_granularities
from fa3_numerics.numerics.operands import cast_p
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.numerics.reference import reference_attention
from fa3_numerics.studies.attribution import STAGES, exact_recipe, stage_recipe
from fa3_numerics.studies.audit import DEFAULT_VARIANTS, recipe_cost
from fa3_numerics.testing import run_cli

FIELD = ("fa1-fp16", "sage1", "sage2-int8", "sage2-int4", "sage3-nvfp4", "fa3-mxfp8")
E4M3, E2M1 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn
# everything but the operand under test in float32: the error left is float32 arithmetic
F32 = "v=fp32,p=fp32,out=fp32,poff=0"


def rmse(a, b) -> float:
    return float(((a - b) ** 2).mean().sqrt())


@pytest.fixture(scope="module")
def outl():
    return generate("outliers", AttnShape(1, 4, 256, 64, kv_heads=2), 5, p=0.01, sigma=10.0)


# -- recipes: parsing, refusals, costs -------------------------------------------------------

@pytest.mark.parametrize("name", FIELD)
def test_field_presets_round_trip_and_every_stage_recipe_is_valid(name):
    r = PRESETS[name].recipe
    assert Recipe.from_str(r.spec()) == r and Recipe.from_str(r.short_str()) == r
    assert "Requires:" in PRESETS[name].description
    exact_recipe(r)
    for s in STAGES:  # attribution builds these; a check must not refuse them
        stage_recipe(r, s)


@pytest.mark.parametrize("spec,words", [
    ("v=int8", "v and p cannot be int8"),
    ("p=int4", "cannot be int4"),
    ("qk=int2", "unknown number format"),
    ("gran=channel", "use vgran=channel"),
    ("gran=thread", "vgran=channel"),
    ("sage1,p=e4m3", "acc=fp16 is an FP16 MMA"),
    ("fa3-mxfp8,acc=fp22", "Blackwell"),
    ("sage2-int8,v=nvfp4", "acc=two-level models Hopper"),
    ("fa1-fp16,algo=standard", "norm=tile"),
    ("smooth=kq", "not one of none, k, qk"),
])
def test_refused_combinations_name_the_fix(spec, words):
    with pytest.raises(UsageError, match=words):
        Recipe.from_str(spec)


def test_bad_combination_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = run_cli(["run", "outliers", "--variants", "sage1,p=e4m3", "--seqlen", "128", "--heads", "1",
                              "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "acc=fp16" in err and len(err.strip().splitlines()) == 1


def test_costs_of_the_new_keys_and_the_audit_defaults():
    base = recipe_cost(Recipe.from_str("fa3-fp8-kernel,acc=fp32"))
    delta = lambda spec: recipe_cost(Recipe.from_str("fa3-fp8-kernel,acc=fp32," + spec)) - base  # noqa: E731
    assert [delta(f"smooth={s}") for s in ("k", "qk")] == [1, 3]
    assert delta("qk=int8") == delta("qk=int4") == 0 and delta("qk=mxfp8") == delta("qk=nvfp4") == 1
    assert delta("v=mxfp8") == 1 and delta("p=nvfp4") == 2
    assert delta("gran=thread,vgran=channel") == (3 - 1) + 1 and delta("norm=tile") == 2
    assert delta("qk=fp16") == 8  # unchanged: 16-bit Q/K halve the FP8 throughput
    for remedy in ("fa3-fp8-kernel,smooth=k", "sage2-int8", "sage3-nvfp4", "fa3-mxfp8"):
        assert remedy in DEFAULT_VARIANTS


def test_keys_keep_prepared_tensors_apart():
    a, b = Recipe(), Recipe.from_str("smooth=k")
    assert a.prepare_key("q") != b.prepare_key("q") and a.prepare_key("k") != b.prepare_key("k")
    assert a.prepare_key("v") == b.prepare_key("v")
    c = Recipe.from_str("vgran=channel")
    assert a.prepare_key("v") != c.prepare_key("v") and a.prepare_key("k") == c.prepare_key("k")


def test_families_and_bits():
    assert [family(n) for n in ("e4m3", "int8", "nvfp4")] == ["float", "int", "mx"]
    assert [bits_per_element(n) for n in ("bf16", "e4m3", "int4", "mxfp8", "nvfp4")] == [16, 8, 4, 8.25, 4.5]
    # narrow Q/K take the FA3 kernel's one-byte tiles; fp8 stays "an FP8 float format"
    r = Recipe.from_str("qk=int8")
    assert r.tiles(128) == PRESETS["fa3-fp8"].recipe.tiles(128) and not r.fp8 and r.narrow


def test_tiles_that_cannot_hold_the_scale_groups_are_refused(outl):
    q, k, v = outl
    with pytest.raises(UsageError, match="multiple of 32"):
        emulate(Recipe.from_str("fa3-mxfp8,p=mxfp8,bn=176"), q, k, v)
    with pytest.raises(UsageError, match="gran=thread needs bm"):
        emulate(Recipe.from_str("sage2-int8,bm=48"), q, k, v)


# -- integer Q and K -------------------------------------------------------------------------

def _int_reference(x: torch.Tensor, bits: int, groups: torch.Tensor) -> torch.Tensor:
    """Dequantized symmetric integers: descale float32(amax / qmax) per group (``groups``: the
    amax broadcast against x), codes rounded half away from zero, clamped."""
    qmax = 2 ** (bits - 1) - 1
    a = groups.numpy()
    d = np.where(a > 0, (a / qmax).astype(np.float32).astype(np.float64), 1.0)
    y = x.numpy() / d
    codes = np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -qmax, qmax)
    return torch.from_numpy(codes * d)


def _groups(x, which, gran, bm, bn):
    """amax of |x| per scale group, by loops over tokens (no package code for block/token)."""
    a = x.abs().amax(dim=-1, keepdim=True)
    if gran == "token":
        return a
    if gran == "block":
        rows = bm if which == "q" else bn
        out = torch.empty_like(a)
        for s in range(0, x.shape[2], rows):
            out[:, :, s:s + rows] = a[:, :, s:s + rows].amax(dim=2, keepdim=True)
        return out
    return amax(x, thread_granularities(bm, bn)[0 if which == "q" else 1])  # loop-checked in test_granularity


@pytest.mark.parametrize("fmt,gran", [("int8", "block"), ("int8", "token"), ("int8", "thread"), ("int4", "thread")])
def test_integer_qk_is_float64_attention_on_the_dequantized_codes(outl, fmt, gran):
    """With V, P and O in float32, the emulator's integer path (codes multiplied exactly, per-row
    and per-key descales applied to S) is attention on codes x descales up to float32 rounding."""
    q, k, v = outl
    bm, bn = 64, 64
    r = Recipe.from_str(f"qk={fmt},gran={gran},bm={bm},bn={bn},vgran=channel,{F32}")
    kk = k.repeat_interleave(2, dim=1)
    qd = _int_reference(q, int(fmt[3:]), _groups(q, "q", gran, bm, bn))
    kd = _int_reference(kk, int(fmt[3:]), _groups(kk, "k", gran, bm, bn))
    ref = reference_attention(qd, kd, v.repeat_interleave(2, dim=1))
    out = emulate(r, q, k, v)
    assert rmse(out, ref) < 2e-6 * float(ref.abs().max())
    # and the quantization itself is visible: INT4 is far from exact attention
    assert rmse(out, reference_attention(q, k, v)) > (1e-3 if fmt == "int8" else 1e-2)


# -- microscaling operands -------------------------------------------------------------------

def _mx_ref(x: torch.Tensor, name: str, axis: int, rule: str = "ceil", nvts: str = "tensor") -> torch.Tensor:
    """MXFP8 / NVFP4 dequantized by ml_dtypes casts and frexp scales, along ``axis``."""
    a = np.moveaxis(x.numpy(), axis, -1)
    block = 32 if name == "mxfp8" else 16
    n = a.shape[-1]
    pad = (-n) % block
    p = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]).reshape(*a.shape[:-1], -1, block)
    amx = np.abs(p).max(axis=-1, keepdims=True)
    if name == "mxfp8":
        m, e = np.frexp(np.where(amx > 0, amx, 1.0))
        if rule == "floor":
            scale = np.ldexp(1.0, e - 1 - 8)
        else:  # smallest 2^k with amax / 2^k <= 448
            scale = np.ldexp(1.0, e - 1 - 8)
            scale = np.where(amx / scale > 448, scale * 2, scale)
        scale = np.where(amx > 0, scale, 2.0 ** -127)
        vals = np.clip(p / scale, -448, 448).astype(E4M3).astype(np.float64) * scale
    else:
        t = 1.0
        if nvts == "tensor":
            t = float(np.float32(np.abs(a).max() / 2688.0))
        s = (amx / (6 * t)).astype(E4M3).astype(np.float64)
        den = np.where(s > 0, s * t, 1.0)
        vals = np.where(s > 0, np.clip(p / den, -6, 6).astype(E2M1).astype(np.float64) * den, 0.0)
    vals = vals.reshape(*a.shape[:-1], -1)[..., :n]
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(vals, -1, axis)))


@pytest.mark.parametrize("spec", ["qk=mxfp8,v=mxfp8", "qk=mxfp8,v=mxfp8,mxscale=floor", "qk=nvfp4,v=nvfp4",
                                  "qk=nvfp4,v=nvfp4,nvts=none"])
def test_microscaled_operands_are_float64_attention_on_ml_dtypes_quantized_inputs(outl, spec):
    """Block scales along head_dim for Q and K and along tokens for V, folded into float32
    operands (exact), and the NVFP4 tensor scale folded into the softmax scale and O."""
    q, k, v = outl
    r = Recipe.from_str(f"{spec},p=fp32,out=fp32,poff=0,bn=64")
    name = r.qk
    kw = {"rule": r.mxscale} if name == "mxfp8" else {"nvts": r.nvts}
    ref = reference_attention(_mx_ref(q, name, -1, **kw), _mx_ref(k, name, -1, **kw), _mx_ref(v, name, 2, **kw))
    out = emulate(r, q, k, v)
    assert rmse(out, ref) < 2e-6 * float(ref.abs().max())
    assert rmse(out, reference_attention(q, k, v)) > 1e-3


def test_two_level_p_cast_matches_ml_dtypes():
    """SageAttention3's P: elements divided by the float32 block scale blockmax / 6 and
    dequantized by its E4M3 rounding (``pmatch=kernel``), or divided by the rounding (``scale``)."""
    g = torch.Generator().manual_seed(3)
    p = torch.exp2(torch.rand(2, 5, 96, generator=g, dtype=torch.float64) * -20 + math.log2(2688)).float()
    p[0, 0, 16:32] = 0.0  # a block without mass
    a = p.double().numpy().reshape(2, 5, 6, 16)
    sf = (a.max(axis=-1, keepdims=True) / 6).astype(np.float32).astype(np.float64)
    s8 = sf.astype(E4M3).astype(np.float64)
    for match, div in (("kernel", sf), ("scale", s8)):
        q = np.where(div > 0, (a / np.where(div > 0, div, 1)), 0)
        if match == "kernel":
            q = q.astype(np.float32).astype(np.float64)
        want = np.clip(q, -6, 6).astype(E2M1).astype(np.float64) * s8
        r = Recipe.from_str(f"p=nvfp4,pmatch={match}")
        got = cast_p(p, r).double().numpy().reshape(2, 5, 6, 16)
        assert np.array_equal(got, want), match


# -- smoothing -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["smooth=k", "smooth=qk", "smooth=qk,rot=hadamard", "smooth=qk,algo=standard,poff=0"])
@pytest.mark.parametrize("causal", [False, True])
def test_smoothing_changes_nothing_when_nothing_is_quantized(spec, causal):
    """K - mean(K) shifts every score of a row by one constant; Q - mean(Q_block) is undone by
    the bias q_mean K'^T. With float32 everywhere the output is exact attention."""
    q, k, v = generate("k-bias", AttnShape(1, 4, 300, 64, kv_heads=2), 1, channels=2, bias=20.0)
    ref = reference_attention(q, k, v, causal=causal)
    out = emulate(Recipe.from_str(f"exact,{spec},bm=64,bn=64"), q, k, v, causal=causal)
    assert rmse(out, ref) < 1e-6 * float(ref.abs().max())


def test_smoothing_commutes_with_the_rotation():
    q, k, v = generate("k-bias", AttnShape(1, 2, 128, 64), 2, channels=2, bias=8.0)
    from fa3_numerics.numerics.rotation import make_rotation

    rot = make_rotation("hadamard", 64, 0)
    k_first = rot.apply(k - k.mean(dim=2, keepdim=True))
    pre = prepare(Recipe.from_str("exact,smooth=k,rot=hadamard"), q, k, v, q_index=torch.arange(128))
    assert torch.allclose(pre.k.values.double(), k_first.float().double(), rtol=0, atol=1e-6)


def test_bias_precision_follows_sbias():
    q, k, v = generate("k-bias", AttnShape(1, 2, 256, 64), 3, channels=2, bias=20.0)
    q = q + 3.0  # a large Q mean: the bias carries most of S
    ref = reference_attention(q, k, v)
    e = {f: rmse(emulate(Recipe.from_str(f"exact,smooth=qk,sbias={f},bm=64"), q, k, v), ref) for f in ("fp32", "bf16")}
    assert e["fp32"] < 1e-6 and e["bf16"] > 20 * e["fp32"]


def test_k_smoothing_rescues_per_block_int8_from_a_k_bias():
    """The failure SageAttention's K smoothing was made for: a channel mean shared by every token
    sets every K block's INT8 scale. Removing it lowers the error several times; a Hadamard
    rotation spreads the mean over every channel, which lowers the amax but keeps the mean."""
    q, k, v = generate("k-bias", AttnShape(1, 4, 512, 64), 4, channels=2, bias=20.0)
    ref = reference_attention(q, k, v)
    e = {s: rmse(emulate(Recipe.from_str(f"qk=int8,gran=block,bm=128,bn=64,{F32},{s}"), q, k, v), ref)
         for s in ("smooth=none", "smooth=k", "smooth=none,rot=hadamard")}
    assert e["smooth=none"] > 4 * e["smooth=k"]
    # the rotation lowers the amax (bias 20 spread over 64 channels) but leaves the mean in K
    assert e["smooth=none,rot=hadamard"] > 1.3 * e["smooth=k"]


# -- FlashAttention (norm=tile) and P ---------------------------------------------------------

def _sink(n, gap, d=64, seed=0):
    """Every query sees key 0 about ``gap`` nats above the rest, whose total mass still dominates."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.3
    k = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.3
    v = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    q[..., 0], k[..., 0] = 1.0, 0.0
    k[:, :, 0, 0] = gap * math.sqrt(d)
    return q, k, v


def test_fa1_exact_is_attention_and_fa1_fp16_differs_from_fa2():
    q, k, v = generate("outliers", AttnShape(1, 2, 300, 64), 6, p=0.01, sigma=10.0)
    ref = reference_attention(q, k, v)
    assert rmse(emulate(Recipe.from_str("exact,norm=tile,bm=128,bn=64"), q, k, v), ref) < 1e-6
    fa1 = emulate(PRESETS["fa1-fp16"].recipe, q, k, v)
    fa2 = emulate(dataclasses.replace(PRESETS["fa1-fp16"].recipe, norm="deferred"), q, k, v)
    assert not torch.equal(fa1, fa2)
    assert rmse(fa1, ref) < 2e-3 * float(ref.abs().max()) and rmse(fa2, ref) < 2e-3 * float(ref.abs().max())


def _algorithm1(q, k, v, bn, p_fmt=np.float16):
    """FlashAttention's Algorithm 1, literally, in float64 numpy, with P~ = exp(S - rowmax of the
    tile) rounded to ``p_fmt`` before P~ V (the only rounding)."""
    qn, kn, vn = (t[0, 0].numpy() for t in (q, k, v))
    s_all = qn @ kn.T / math.sqrt(qn.shape[-1])
    o = np.zeros((qn.shape[0], vn.shape[-1]))
    m = np.full((qn.shape[0], 1), -np.inf)
    l = np.zeros((qn.shape[0], 1))  # noqa: E741
    for j in range(0, kn.shape[0], bn):
        s = s_all[:, j:j + bn]
        mt = s.max(axis=1, keepdims=True)
        pt = np.exp(s - mt)
        lt = pt.sum(axis=1, keepdims=True)
        m_new = np.maximum(m, mt)
        l_new = np.exp(m - m_new) * l + np.exp(mt - m_new) * lt
        o = (l * np.exp(m - m_new) * o + np.exp(mt - m_new) * (pt.astype(p_fmt).astype(np.float64) @ vn[j:j + bn]))
        o = o / l_new
        m, l = m_new, l_new  # noqa: E741
    return torch.from_numpy(o)[None, None]


def test_fa1_rounds_p_against_each_tiles_own_max_as_algorithm_1_does():
    """The emulator's norm=tile matches a literal float64 Algorithm 1 far more closely than the
    deferred form (P~ against the running max) does: the FP16 rounding of P~ happens on the
    tile's own scale. (Gaussian data: with outliers, float32 scores already flip FP16 roundings.)"""
    q, k, v = generate("outliers", AttnShape(1, 1, 256, 64), 11, p=0.0, sigma=1.0)
    q = q * 2  # peakier rows: tiles' maxima differ
    lit = _algorithm1(q, k, v, bn=64)
    spec = "qk=fp32,v=fp32,p=fp16,poff=0,out=fp32,order=forward,bm=64,bn=64"
    tile = emulate(Recipe.from_str(spec + ",norm=tile"), q, k, v)
    deferred = emulate(Recipe.from_str(spec), q, k, v)
    assert rmse(tile, lit) < 0.15 * rmse(deferred, lit)


def test_fa1_tile_max_keeps_p_that_a_forward_sink_collapses():
    """P-collapse: visiting tiles forward with P~ in [0, 1] (no offset), a sink in the first tile
    pushes every later P~ below e4m3's normal range. FA1 takes each tile's P~ against the
    tile's own max, so only the sink's tile still underflows; MXFP8 P (a scale per 32 keys) and
    FA3's offset 2^8 remove it."""
    q, k, v = _sink(n=1024, gap=7.0)
    ref = reference_attention(q, k, v)
    base = "qk=fp32,v=fp32,out=fp32,order=forward,bm=128,bn=128"
    e = {s: rmse(emulate(Recipe.from_str(f"{base},{s}"), q, k, v), ref)
         for s in ("p=e4m3,poff=0", "p=e4m3,poff=0,norm=tile", "p=mxfp8,poff=0", "p=e4m3,poff=8")}
    # FA1 rescues every tile but the sink's own (there the others still sit 10 bits down)
    assert e["p=e4m3,poff=0"] > 2 * e["p=e4m3,poff=0,norm=tile"]
    assert e["p=e4m3,poff=0"] > 10 * e["p=mxfp8,poff=0"]
    assert e["p=e4m3,poff=0"] > 10 * e["p=e4m3,poff=8"]  # FA3's own remedy


def test_sage1_fp16_accumulation_is_visible_once_qk_is_exact():
    """SageAttention's FP16 accumulation of P V per 64-key tile: a visible but small cost next to
    float32 (with INT8 Q/K on outliers the Q/K error hides it)."""
    q, k, v = generate("outliers", AttnShape(1, 2, 256, 64), 7, p=0.001, sigma=10.0)
    ref = reference_attention(q, k, v)
    r = dataclasses.replace(PRESETS["sage1"].recipe, qk="fp16", inp="none")  # exact Q/K: no FP16 inputs either
    e16, e32 = (rmse(emulate(dataclasses.replace(r, acc=a), q, k, v), ref) for a in ("fp16", "fp32"))
    assert 1.05 * e32 < e16 < 3 * e32


# -- invariances over every preset of the field --------------------------------------------------

@pytest.mark.parametrize("name", FIELD)
def test_gqa_equals_mha_with_repeated_kv(name):
    q, k, v = generate("k-bias", AttnShape(1, 4, 256, 64, kv_heads=1), 8, channels=2, bias=8.0)
    kk, vv = k.expand(1, 4, 256, 64).contiguous(), v.expand(1, 4, 256, 64).contiguous()
    r = PRESETS[name].recipe
    if name == "sage2-int4":
        r = dataclasses.replace(r, acc="fp32")  # the MMA model is covered by sage2-int8; keep the test fast
    assert torch.equal(emulate(r, q, k, v, causal=True), emulate(r, q, kk, vv, causal=True))


@pytest.mark.parametrize("name", ["sage2-int8", "sage3-nvfp4", "fa3-mxfp8", "fa1-fp16"])
def test_query_rows_sampled_equal_the_same_rows_of_a_full_run(name):
    """Scales, NVFP4 tensor scales and Q's block means see every row even when few are evaluated."""
    q, k, v = generate("outliers", AttnShape(1, 2, 300, 64), 9, p=0.01, sigma=10.0)
    r = dataclasses.replace(PRESETS[name].recipe, nvts="tensor") if name == "sage3-nvfp4" else PRESETS[name].recipe
    idx = torch.tensor([0, 7, 63, 64, 200, 299])
    full = emulate(r, q, k, v, causal=True)
    assert torch.equal(emulate(r, q, k, v, causal=True, q_index=idx), full[:, :, idx])


def test_every_field_preset_is_finite_and_ordered_on_outliers(outl):
    """Not a benchmark: sanity of magnitude. FP16 recipes are near exact, 8-bit ones near FA3's
    FP8 error, NVFP4 worse than 8-bit."""
    q, k, v = outl
    ref = reference_attention(q, k, v)
    e = {n: rmse(emulate(PRESETS[n].recipe, q, k, v), ref) for n in ("fa1-fp16", "sage1", "sage3-nvfp4",
                                                                      "fa3-mxfp8")}
    fp8 = rmse(emulate(Recipe.from_str("fa3-fp8-kernel,acc=fp32"), q, k, v), ref)
    assert all(math.isfinite(x) for x in e.values())
    assert e["fa1-fp16"] < 0.05 * fp8 and e["sage1"] < fp8 and e["fa3-mxfp8"] < 2 * fp8 < e["sage3-nvfp4"]


# -- the ablation's new factors -------------------------------------------------------------------

def test_ablation_field_factors_labels_and_a_tiny_run():
    from fa3_numerics.studies.ablation import factor_recipe, load_ablation, run_ablation, variant_label

    r = factor_recipe({"qkfmt": "int8", "smooth": "k", "vfmt": "nvfp4", "gran": "block", "acc": "fp32"})
    assert (r.qk, r.smooth, r.v, r.gran.short_str()) == ("int8", "k", "nvfp4", "block")
    # labels of recipes that existed before these factors keep their six positional fields
    assert variant_label({}) == "head|none|offset8|fp32|e4m3|amax"
    assert variant_label({"smooth": "k", "qkfmt": "int8"}) == "head|none|offset8|fp32|e4m3|amax|qkfmt=int8|smooth=k"
    ab = load_ablation("ablation", {"designs": ["field"], "seqlen": [256], "head_dim": [64], "heads": 1, "rows": 32,
                                    "seeds": [0], "data": ["k-bias"], "qkfmt": ["e4m3", "int8"], "rot": ["none"],
                                    "gran": ["block"], "smooth": ["none", "k"]})
    assert [d.label for d in ab.data] == ["k-bias bias=8", "k-bias bias=20"] and len(ab.full) == 4
    ds = run_ablation(ab, workers=0, progress=lambda m: None)
    e = np.sqrt((ds["rmse"] ** 2).mean(["seed", "batch", "head"])).squeeze()
    lab = "block|none|offset8|fp32|e4m3|amax|qkfmt=int8"
    # smoothing removes the bias exactly: bias 8 and 20 give the same error once K is smoothed
    sm = e.sel(variant=lab + "|smooth=k").values
    assert abs(sm[0] - sm[1]) < 1e-3 * sm[0]
    assert float(e.sel(variant=lab, data="k-bias bias=20")) > 1.3 * sm[1]
    assert set(ds["smooth"].values) >= {"none", "k"} and "qkfmt" in ds.coords
