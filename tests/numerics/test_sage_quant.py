"""SageAttention's quantizer arithmetic (numerics/sage_quant.py): the fused multiply-add that forms
SageAttention2's per-thread scales, checked against exact rational arithmetic, at the value where the
H200 kernel showed it, and on rows of a kernel head dumped on the H200 (tests/fixtures/sage2_h200_rows.npz,
written by tools/sage2_fixture.py from tools/device/dump_sage.py's dump of the stress case
fp8-n2048-d128-h8-causal-p0.02s100-tensor, head 3)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from fa3_numerics.numerics import sage_quant
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.granularity import PerThread
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.sage_quant import fma32, triton_quantize_int

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sage2_h200_rows.npz"
f32 = np.float32


def _rn32(x: Fraction) -> np.float32:
    """The float32 nearest to the rational ``x``, ties to even (exact comparisons)."""
    y = np.float32(float(x))
    cands = [np.nextafter(y, f32(-np.inf)), y, np.nextafter(y, f32(np.inf))]
    best = min(abs(Fraction(float(c)) - x) for c in cands)
    near = [c for c in cands if abs(Fraction(float(c)) - x) == best]
    return near[0] if len(near) == 1 else [c for c in near if int(np.array(c).view(np.int32)) % 2 == 0][0]


def _two_roundings(a, b, c):
    return ((a.to(torch.float32) * b.to(torch.float32)).to(torch.float32) + c.to(torch.float32)).to(torch.float32)


def test_fma32_rounds_once_where_float64_would_round_twice():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a float32 midpoint; + 2^-80 lies above it, but its
    # float64 sum is the midpoint itself, which float32 then rounds down to even
    a = torch.tensor([1 + 2.0 ** -12] * 2, dtype=torch.float32)
    c = torch.tensor([2.0 ** -80, -2.0 ** -80], dtype=torch.float32)
    up, down = 1 + 2.0 ** -11 + 2.0 ** -23, 1 + 2.0 ** -11
    assert fma32(a, a, c).tolist() == [up, down]
    naive = (a.double() * a.double() + c.double()).to(torch.float32)  # negative control
    assert naive.tolist() == [down, down]


def test_fma32_matches_exact_arithmetic_on_random_operands():
    g = np.random.default_rng(11)
    a = (g.standard_normal(3000) * np.exp2(g.integers(-20, 20, 3000))).astype(f32)
    b = (g.standard_normal(3000) * np.exp2(g.integers(-20, 20, 3000))).astype(f32)
    c = (g.standard_normal(3000) * np.exp2(g.integers(-60, 20, 3000))).astype(f32)
    got = fma32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
    want = np.array([_rn32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)])
    assert np.array_equal(got, want)
    assert not np.array_equal(_two_roundings(*map(torch.from_numpy, (a, b, c))).numpy(), want)


def test_sage2_scale_is_one_ffma_as_the_kernel_rounds_it():
    """The group of the stress case's key 416 (tile 3, thread 0): amax 275, so the scale is
    fma(275, rcp(127), 1e-7) = 0x400a952b, one ulp above the two-rounding 0x400a952a, and the
    value 137.5 codes 63 (its quotient 63.4999924) where the two-rounding scale gives exactly 63.5,
    so 64. The kernel's output for the rows that attend to that key is reproduced only with 63."""
    x = torch.zeros(1, 1, 128, 128, dtype=torch.float64)
    x[0, 0, 0, 0], x[0, 0, 1, 75] = 275.0, 137.5  # keys 0 and 1: one thread's group
    got = triton_quantize_int(x, "int8", PerThread(128, 2), block_rows=128, scale=1.0, eps=1e-7)
    assert int(got.descale[0, 0, 0, 0].view(torch.int32)) == 0x400A952B
    assert int(got.values[0, 0, 1, 75]) == 63 and int(got.values[0, 0, 0, 0]) == 127
    # sage1's quantizer (no 1e-7) has no add to fuse: its scale is the rounded product
    plain = triton_quantize_int(x, "int8", PerThread(128, 2), block_rows=128, scale=1.0)
    assert int(plain.descale[0, 0, 0, 0].view(torch.int32)) == 0x400A952A


def _rebuild(fx):
    """tools/sage2_fixture.py's whole-sequence inputs: the kept Q rows (zeros elsewhere), the visited
    keys, then the K stand-in (one key repeated, a last one) and V's per-channel amax row, zeros."""
    meta = json.loads(str(fx["meta"]))
    n, nk, d = int(meta["seqlen"]), fx["k"].shape[0], fx["q"].shape[1]
    q = np.zeros((n, d), np.float16)
    q[fx["rows"]] = fx["q"]
    c1, c2 = fx["k_rest"]
    k = np.concatenate([fx["k"], np.repeat(c1[None], n - nk - 1, 0), c2[None]])
    v = np.zeros((n, d), np.float16)
    v[:nk], v[nk] = fx["v"], fx["v_rest"]
    t = lambda x: torch.from_numpy(x.astype(np.float64))[None, None]  # noqa: E731
    return meta, t(q), t(k), t(v)


@pytest.fixture(scope="module")
def dumped():
    with np.load(FIXTURE) as z:
        fx = {key: z[key] for key in z.files}
    meta, q, k, v = _rebuild(fx)
    rows = torch.from_numpy(fx["rows"].astype(np.int64))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=meta["softmax_scale"])
    return meta, q, k, v, rows, torch.from_numpy(fx["o_kernel"].astype(np.float64)), ref[0, 0, rows]


def _fidelity(meta, q, k, v, rows, o_kernel, ref):
    r = Recipe.from_str(meta["spec"])
    o = emulate(r, q, k, v, causal=True, softmax_scale=meta["softmax_scale"], q_index=rows)[0, 0]
    f = float((o - o_kernel).pow(2).mean().sqrt() / (o_kernel - ref).pow(2).mean().sqrt())
    return f, o


def test_preset_reproduces_the_dumped_kernel_rows(dumped):
    """Rows 432-463 of the H200 kernel's head: rows 446 and 452 put nearly all their weight on key
    416 (tile 3) in exact arithmetic; the kernel gives them key 247's V. The preset reproduces every
    row, and with the scale rounded twice it misses those two rows by most of their norm."""
    meta, q, k, v, rows, o_kernel, ref = dumped
    assert meta["spec"].startswith("qk=int8,gran=thread") and "iquant=triton-eps" in meta["spec"]
    f, o = _fidelity(*dumped)
    assert f <= 0.01
    assert float((o == o_kernel).double().mean()) >= 0.999
    i446, i452 = int((rows == 446).nonzero()), int((rows == 452).nonzero())
    assert torch.equal(o[i446], o_kernel[i446]) and torch.equal(o[i452], o_kernel[i452])


def test_two_roundings_miss_the_dumped_rows(dumped, monkeypatch):
    monkeypatch.setattr(sage_quant, "fma32", _two_roundings)
    f, o = _fidelity(*dumped)
    assert f > 0.5  # negative control: the old model's F on these rows
    meta, q, k, v, rows, o_kernel, ref = dumped
    err = (o - o_kernel).pow(2).sum(-1)
    two = err[(rows == 446) | (rows == 452)].sum()
    assert float(two / err.sum()) > 0.99  # nearly all of it from the two rows that attend to key 416
