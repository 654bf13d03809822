"""Sliding windows, soft-capping and sink logits: the float64 reference against a brute-force
softmax written independently, the emulator's exact recipe against the reference, fully masked
tiles and rows, negative controls, and the plain path left bit for bit as it was."""

import math

import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.masking import masking, softcap_constants
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.numerics.reference import reference_attention

U32 = 2.0 ** -24
EXACT = PRESETS["exact"].recipe


def brute(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, sinks=None):
    """One query and one key at a time in Python loops over the mask, float64: shares no code
    with the reference (no chunking, no masked_fill, the sink as an explicit extra term)."""
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = h // hkv
    off = nk - n
    left, right = window
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                keys = []
                for j in range(nk):
                    rel = j - (i + off)
                    if causal and rel > 0:
                        continue
                    if right >= 0 and rel > right:
                        continue
                    if left >= 0 and rel < -left:
                        continue
                    keys.append(j)
                logits = [float(q[bi, hi, i] @ k[bi, hi // g, j]) * scale for j in keys]
                if softcap:
                    logits = [softcap * math.tanh(x / softcap) for x in logits]
                extra = [] if sinks is None else [float(sinks[hi])]
                if not keys:
                    continue  # no visible key: 0
                top = max(logits + extra)
                w = [math.exp(x - top) for x in logits]
                den = sum(w) + sum(math.exp(x - top) for x in extra)
                for wj, j in zip(w, keys):
                    out[bi, hi, i] += wj / den * v[bi, hi // g, j]
    return out


def _qkv(h=4, hkv=2, n=40, nk=40, d=64, seed=0, sigma=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g, dtype=torch.float64) * sigma
    k = torch.randn(1, hkv, nk, d, generator=g, dtype=torch.float64) * sigma
    v = torch.randn(1, hkv, nk, d, generator=g, dtype=torch.float64)
    return q, k, v


CASES = [
    dict(causal=True, window=(7, 0)),                     # Mistral / Gemma sliding layer
    dict(causal=False, window=(5, 3)),                    # two-sided local window
    dict(causal=False, window=(-1, 2)),
    dict(causal=True, window=(-1, -1), softcap=2.0),      # Gemma 2 (a small cap so it bites)
    dict(causal=True, window=(4, 0), softcap=1.5),
    dict(causal=True, window=(-1, -1), sinks=(0.5, -1.0, 3.0, 0.0)),   # gpt-oss
    dict(causal=True, window=(6, 0), sinks=(2.0, 2.0, -3.0, 1.0)),
]


def _kw(case):
    kw = dict(causal=case["causal"], window_size=case["window"], softcap=case.get("softcap"))
    if "sinks" in case:
        kw["sinks"] = torch.tensor(case["sinks"], dtype=torch.float64)
    return kw


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("n,nk", [(40, 40), (24, 40), (40, 24)])
def test_reference_matches_brute_force(case, n, nk):
    q, k, v = _qkv(n=n, nk=nk, d=16, sigma=1.5)
    scale = 16 ** -0.5
    kw = _kw(case)
    want = brute(q, k, v, scale=scale, causal=case["causal"], window=case["window"],
                 softcap=case.get("softcap", 0.0), sinks=kw.get("sinks"))
    for chunk in (None, 7):
        got = reference_attention(q, k, v, softmax_scale=scale, chunk=chunk, **kw)
        assert torch.allclose(got, want, rtol=0, atol=1e-13), case


def test_each_feature_changes_the_reference():
    """Negative controls: each option, set, moves the output far beyond rounding."""
    q, k, v = _qkv(n=64, nk=64, sigma=2.0)
    plain = reference_attention(q, k, v, causal=True)
    for kw in (dict(window_size=(7, 0)), dict(softcap=2.0), dict(sinks=torch.full((4,), 1.0))):
        assert (reference_attention(q, k, v, causal=True, **kw) - plain).abs().max() > 1e-2, kw


def test_sink_known_value():
    """Q = 0: every visible score is 0, so row i's output is mean(V over its keys) * m / (m + e^sink)."""
    _, k, v = _qkv(h=2, hkv=2, n=10, nk=10, d=64)
    q = torch.zeros(1, 2, 10, 64, dtype=torch.float64)
    sinks = torch.tensor([0.0, 2.0], dtype=torch.float64)
    o = reference_attention(q, k, v, causal=True, sinks=sinks)
    oe = emulate(EXACT, q, k, v, causal=True, sinks=sinks)
    for hi in range(2):
        for i in range(10):
            m = i + 1
            want = v[0, hi, :m].mean(0) * m / (m + math.exp(float(sinks[hi])))
            assert torch.allclose(o[0, hi, i], want, rtol=0, atol=1e-14)
            assert torch.allclose(oe[0, hi, i], want, rtol=0, atol=64 * U32)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("bn", [None, 16])
def test_exact_recipe_matches_reference(case, bn):
    """The emulator's exact recipe (float32 everywhere) equals the float64 reference to float32
    rounding, with the kernel's tiles and with tiles (bn=16) of which many are fully masked for
    some rows and not others."""
    q, k, v = _qkv(n=120, nk=120, sigma=1.5)
    kw = _kw(case)
    ref = reference_attention(q, k, v, **kw)
    rec = EXACT if bn is None else Recipe.from_str(f"exact,bn={bn}")
    out = emulate(rec, q, k, v, **kw)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 4 * (120 + 64) * U32 * ref.abs().max(), case
    # the standard (materialised) algorithm too
    std = emulate(Recipe.from_str("exact,algo=standard"), q, k, v, **kw)
    assert (std - ref).abs().max() <= 4 * (120 + 64) * U32 * ref.abs().max(), case


def test_window_smaller_than_a_tile_skips_tiles_and_gives_no_nan():
    """Window 3 against 160-key tiles, 600 keys: most KV tiles are outside every row of a query
    block; the rows are finite and match the reference, the FP8 kernel recipe included, and a
    sample of rows equals the same rows of a full run bit for bit (a tile skipped for the
    sample contributes nothing in the full run either)."""
    q, k, v = _qkv(n=600, nk=600, sigma=1.0)
    kw = dict(causal=True, window_size=(3, 0))
    ref = reference_attention(q, k, v, **kw)
    rows = torch.tensor([0, 1, 2, 3, 299, 300, 599])
    for spec in ("exact", "fa3-fp8-kernel", "fa3-fp8-kernel,acc=fp32"):
        full = emulate(Recipe.from_str(spec), q, k, v, **kw)
        assert torch.isfinite(full).all(), spec
        rel = ((full - ref).norm() / ref.norm()).item()
        assert rel < (1e-6 if spec == "exact" else 0.1), (spec, rel)
        part = emulate(Recipe.from_str(spec), q, k, v, q_index=rows, **kw)
        assert torch.equal(part, full[:, :, rows]), spec


def test_rows_with_no_visible_key_are_zero():
    """Non-causal window (-1, -1) shifted: with seqlen_q > seqlen_k and causal, the first rows see
    nothing; a window keeps them empty; FlashAttention returns 0 for them, never NaN."""
    q, k, v = _qkv(h=1, hkv=1, n=30, nk=10)
    for spec in ("exact", "fa3-fp8-kernel", "exact,algo=standard"):
        for kw in (dict(window_size=(2, 0)), dict(window_size=(2, 0), softcap=5.0),
                   dict(window_size=(2, 0), sinks=torch.tensor([1.0]))):
            o = emulate(Recipe.from_str(spec), q, k, v, causal=True, **kw)
            assert torch.isfinite(o).all(), (spec, kw)
            assert torch.equal(o[0, 0, :20], torch.zeros_like(o[0, 0, :20])), (spec, kw)
            assert (o[0, 0, 20:] != 0).any()


def test_features_are_not_silently_dropped():
    """Negative controls through the emulator: with softcap / sinks / window the exact recipe
    is far from the plain reference and close to the matching one."""
    q, k, v = _qkv(n=96, nk=96, sigma=2.0)
    plain = reference_attention(q, k, v, causal=True)
    for kw in (dict(window_size=(9, 0)), dict(softcap=2.0), dict(sinks=torch.full((4,), 1.5))):
        o = emulate(EXACT, q, k, v, causal=True, **kw)
        own = reference_attention(q, k, v, causal=True, **kw)
        assert (o - plain).abs().max() > 1e-2, kw
        assert (o - own).abs().max() < 1e-5, kw


@pytest.mark.parametrize("spec", ["fa3-fp8-kernel", "exact", "fa3-fp8", "baseline-fp8", "sage2-int8"])
def test_plain_options_leave_the_default_path_bit_identical(spec):
    """window (-1, -1), softcap 0, no sinks, and windows that reach past the sequence (FA3 turns
    them into unbounded ones) give exactly the output of a call without the options."""
    q, k, v = _qkv(n=200, nk=200, sigma=3.0)
    for causal in (False, True):
        base = emulate(Recipe.from_str(spec), q, k, v, causal=causal)
        for kw in (dict(window_size=(-1, -1), softcap=0.0, sinks=None), dict(window_size=(199, 0 if causal else 199))):
            assert torch.equal(emulate(Recipe.from_str(spec), q, k, v, causal=causal, **kw), base), (spec, kw)


def test_non_causal_window_minus_one_zero_is_causal():
    q, k, v = _qkv(n=50, nk=50)
    r = Recipe.from_str("fa3-fp8-kernel")
    assert torch.equal(emulate(r, q, k, v, window_size=(-1, 0)), emulate(r, q, k, v, causal=True))
    assert masking(False, (-1, 0)).causal


def test_softcap_constants_follow_the_kernel():
    """scale / softcap rounded to float32 from float32 operands; softcap * log2(e) narrowed once."""
    mult, l2 = softcap_constants(256 ** -0.5, 50.0)
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    assert mult == f32(f32(0.0625) / 50.0)
    assert l2 == f32(50.0 * math.log2(math.e))


def test_fp8_softcap_is_close_to_its_reference_and_far_from_the_uncapped_one():
    q, k, v = _qkv(n=256, nk=256, sigma=3.0)
    r = Recipe.from_str("fa3-fp8-kernel")
    for cap in (5.0, 30.0):
        o = emulate(r, q, k, v, causal=True, softcap=cap)
        ref = reference_attention(q, k, v, causal=True, softcap=cap)
        plain = reference_attention(q, k, v, causal=True)
        assert torch.isfinite(o).all()
        err = ((o - ref).norm() / ref.norm()).item()
        assert err < 0.1, err
        if cap == 5.0:
            assert ((o - plain).norm() / plain.norm()).item() > 3 * err


@pytest.mark.parametrize("bad", [
    dict(window_size=(-2, 0)), dict(window_size=(3, 2), causal=True), dict(softcap=-1.0),
    dict(softcap=float("nan")), dict(sinks=torch.zeros(3)), dict(sinks=torch.tensor([0.0, math.inf, 0.0, 0.0])),
])
def test_bad_options_are_one_line_usage_errors(bad):
    q, k, v = _qkv(n=8, nk=8)
    kw = {"causal": False, **bad}
    with pytest.raises(UsageError):
        emulate(EXACT, q, k, v, **kw)
    with pytest.raises(UsageError):
        reference_attention(q, k, v, **kw)


def test_unsupported_loops_refuse_rather_than_ignore():
    q, k, v = _qkv(n=8, nk=8)
    with pytest.raises(UsageError, match="loop=fa3"):
        emulate(Recipe.from_str("exact,norm=tile"), q, k, v, causal=True, sinks=torch.zeros(4))


def test_fa3_backend_passes_window_and_softcap_and_refuses_what_the_build_lacks(monkeypatch):
    """Through the float32 stand-in (fa3-mock, any device): the window and the softcap reach the
    call with FA3's meaning (its output is close to the reference with them and far without), and
    the feature check reads the build flags: the fa3-fwd 0.0.3 wheel's (local attention compiled
    out, softcap in) refuse a window, take a softcap, and no build takes sinks."""
    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.kernels import fa3 as k3

    q, k, v = _qkv(n=128, nk=128, sigma=2.0)
    rows = torch.arange(128)
    mock = get_backend("fa3-mock")
    r = Recipe.from_str("fa3-fp8-kernel")
    for kw in (dict(window_size=(9, 0)), dict(softcap=2.0)):
        o = mock.attention(r, q, k, v, causal=True, q_index=rows, rotation_seed=0, cache={}, **kw)
        own = reference_attention(q, k, v, causal=True, **kw)
        plain = reference_attention(q, k, v, causal=True)
        err_own, err_plain = ((o - own).norm() / own.norm()).item(), ((o - plain).norm() / plain.norm()).item()
        assert err_own < 0.15 and err_plain > 5 * err_own, (kw, err_own, err_plain)  # FP8 error vs the option
    wheel = {"window": False, "softcap": True, "sinks": False, "source": "fa3_fwd_config.CONFIG"}
    assert "no sliding windows" in k3.masking_problem(masking(True, (9, 0)), wheel)
    assert k3.masking_problem(masking(True, None, 30.0), wheel) is None
    assert "sink" in k3.masking_problem(masking(True, sinks=torch.zeros(2)), wheel)
    # a window past the sequence is rewritten as unbounded (plain), as FA3's mha_fwd does
    assert masking(True, (500, 0), seqlen_q=128, seqlen_k=128).plain
    # backends that never take these options refuse them, naming the emulator
    assert "--backend emulate" in get_backend("sdpa-math").masking_refusal(masking(True, (9, 0)))
    assert get_backend("sdpa-math").masking_refusal(masking(True)) is None
