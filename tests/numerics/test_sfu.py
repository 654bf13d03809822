"""The bit-exact SFU models (fa3_numerics/numerics/sfu.py) against the H200's own outputs
(tests/fixtures/sfu_h200.npz: pairs cut by tools/sfu_fixture.py from tools/device/mufu_probe.py's
random samples, hard cases included), plus invariants of the reductions they claim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fa3_numerics.numerics import sfu

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sfu_h200.npz"


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy().view(np.uint32)


def f32(u) -> torch.Tensor:
    return torch.from_numpy(np.asarray(u, dtype=np.uint32).view(np.float32).copy())


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("op", ["ex2", "lg2", "rcp"])
def test_device_samples_bit_exact(op, compiled):
    with np.load(FIXTURE) as z:
        ib, ob = z[f"{op}/in"], z[f"{op}/out"]
        prov = json.loads(bytes(z["provenance"]).decode())
    assert prov["device"] == "NVIDIA H200" and len(ib) > 3000
    got = bits(getattr(sfu, op)(f32(ib), compiled=compiled))
    bad = np.flatnonzero(got != ob)
    assert not len(bad), f"{op}: {len(bad)} of {len(ib)} differ, first in={ib[bad[0]]:#x} " \
                         f"device={ob[bad[0]]:#x} model={got[bad[0]]:#x}"


def test_fixture_holds_the_cases_the_old_models_miss():
    # the fixture is only a test if the stand-ins it replaces fail on it
    from fa3_numerics.numerics.emulator import exp2_rz, flush_subnormals
    with np.load(FIXTURE) as z:
        ib, ob = z["ex2/in"], z["ex2/out"]
    old = bits(flush_subnormals(exp2_rz(f32(ib))))
    assert np.mean(old != ob) > 0.1


@pytest.mark.parametrize("op", ["ex2", "lg2", "rcp"])
def test_compiled_loop_equals_torch(op):
    # the C loops (ex2 from the packed cubics + 2-bit codes) against the PyTorch models on any bits
    from fa3_numerics.numerics import native
    if native.status().startswith("PyTorch"):
        pytest.skip("no compiled fast paths on this machine")
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(-2 ** 31, 2 ** 31 - 1, (300000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([raw.view(torch.float32), torch.rand(300000, generator=g) * 300 - 150,
                   torch.rand(300000, generator=g) * 4 - 2])
    f = getattr(sfu, op)
    assert torch.equal(f(x).view(torch.int32), f(x, compiled=False).view(torch.int32))


def test_specials():
    inf, nan = math.inf, math.nan
    x = torch.tensor([0.0, -0.0, 1e-40, -1e-40, inf, -inf, nan, 1.0, -1.0, 200.0, -200.0, 127.99, -126.0, -127.0],
                     dtype=torch.float32)
    e = bits(sfu.ex2(x))
    assert e[:4].tolist() == [0x3F800000] * 4  # ftz inputs are zeros: 2^0
    assert e[4] == 0x7F800000 and e[5] == 0 and e[6] == sfu.NAN_BITS
    assert e[7] == 0x40000000 and e[8] == 0x3F000000 and e[9] == 0x7F800000 and e[10] == 0
    assert np.isfinite(e[11].view(np.float32)) and e[12] == 0x00800000 and e[13] == 0  # 2^-127 flushes
    lg = bits(sfu.lg2(x))
    assert lg[:4].tolist() == [0xFF800000] * 4 and lg[4] == 0x7F800000
    assert lg[5] == sfu.NAN_BITS and lg[6] == sfu.NAN_BITS and lg[7] == 0 and lg[8] == sfu.NAN_BITS
    r = bits(sfu.rcp(x))
    assert r[:4].tolist() == [0x7F800000, 0xFF800000, 0x7F800000, 0xFF800000]
    assert r[4] == 0 and r[5] == 0x80000000 and r[6] == sfu.NAN_BITS and r[7] == 0x3F800000 and r[8] == 0xBF800000
    big = torch.tensor([2.0 ** 127, -(2.0 ** 127), 2.0 ** 126], dtype=torch.float32)
    assert bits(sfu.rcp(big)).tolist() == [0, 0x80000000, 0x00800000]


def test_ex2_reduction_invariants():
    g = torch.Generator().manual_seed(7)
    f = torch.rand(20000, generator=g, dtype=torch.float64).float()  # [0, 1)
    # 23 fraction bits cut toward zero: the 24th bit of |x| in [0.5, 1) never matters
    half = f[f >= 0.5]
    low = (half.view(torch.int32) & ~1).view(torch.float32)
    assert np.array_equal(bits(sfu.ex2(half)), bits(sfu.ex2(low)))
    assert np.array_equal(bits(sfu.ex2(-half)), bits(sfu.ex2(-low)))
    # the integer part only scales: ex2(x + i) = 2^i ex2(x) for x in [0, 1) (16 fraction bits: x + 100 exact)
    f23 = (f * 2 ** 16).floor() / 2 ** 16
    for i in (1, 5, 100, -3):
        xi = f23 + i if i > 0 else -(f23 + (-i))
        base = sfu.ex2(f23) if i > 0 else sfu.ex2(-f23)
        assert torch.equal(sfu.ex2(xi), base * 2.0 ** i)
    # negative fractions are the one's complement of the positive table, halved
    k = torch.randint(1, 2 ** 23, (5000,), generator=g)
    neg = sfu.ex2(-(k.double() / 2 ** 23).float())
    pos = sfu.ex2(((2 ** 23 - 1 - k).double() / 2 ** 23).float())
    assert torch.equal(neg, pos / 2)


def test_error_bounds_and_monotone_tables():
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(200000, generator=g, dtype=torch.float64) * 250 - 125).float()
    y, ref = sfu.ex2(x).double(), torch.exp2(x.double())
    assert ((y - ref).abs() / ref).max() < 2.5 * 2.0 ** -23
    m = (1 + torch.rand(200000, generator=g, dtype=torch.float64)).float()
    r = sfu.rcp(m).double()
    assert ((r * m.double() - 1).abs()).max() < 2.0 ** -23
    assert torch.equal(sfu.rcp(-m), -sfu.rcp(m)) and torch.equal(sfu.rcp(m * 8), sfu.rcp(m) / 8)
    lx = (torch.rand(200000, generator=g, dtype=torch.float64) * 2 - 1).mul(60).exp2().float()
    lref = torch.log2(lx.double())  # absolute error near 1, one rounding toward zero elsewhere
    assert ((sfu.lg2(lx).double() - lref).abs() - lref.abs() * 2.0 ** -23).max() < 2.0 ** -21
    for name, sign in (("ex2", 1), ("lg2_hi", 1), ("lg2_lo", 1), ("rcp", -1)):
        t = sfu.table(name).view(torch.float32)
        assert ((t[1:] - t[:-1]) * sign >= 0).all(), name


def test_float32_only():
    with pytest.raises(TypeError):
        sfu.ex2(torch.zeros(3, dtype=torch.float64))


def test_corrupt_table_is_an_error(tmp_path, monkeypatch):
    bad = tmp_path / "sfu_h200.npz"
    with np.load(sfu.TABLES) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["rcp/code"] = arrays["rcp/code"].copy()
    arrays["rcp/code"][12345] += 1
    np.savez(bad, **arrays)
    monkeypatch.setattr(sfu, "TABLES", bad)
    monkeypatch.setattr(sfu, "_CACHE", {})
    with pytest.raises(RuntimeError, match="SHA-256"):
        sfu.table("rcp")


# -- the recipe key sfu=h200 routes the emulators' exp2/lg2 call sites to these models -------------

def _qkv(seed=0, n=96, d=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, d, generator=g) for _ in range(3)]


class _Count:
    """Wraps sfu.ex2 and sfu.lg2, counting the elements each model is called on."""

    def __init__(self, monkeypatch):
        self.n = {"ex2": 0, "lg2": 0}
        for name in self.n:
            real = getattr(sfu, name)
            monkeypatch.setattr(sfu, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def f(x):
            self.n[name] += x.numel()
            return real(x)
        return f


@pytest.mark.parametrize("spec,lse", [("fa3-fp8-kernel", True), ("fa3-bf16", True), ("fa1-fp16", False),
                                      ("sage1", False), ("sage2-sm90", False),
                                      ("sdpa-flash-bf16,fa2math=torch", True)])
def test_key_routes_the_forward(spec, lse, monkeypatch):
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe
    q, k, v = _qkv()
    base_stats, hw_stats = ({}, {}) if lse else (None, None)
    base = emulate(Recipe.from_str(spec), q, k, v, causal=True, stats=base_stats)
    count = _Count(monkeypatch)
    hw = emulate(Recipe.from_str(spec + ",sfu=h200"), q, k, v, causal=True, stats=hw_stats)
    assert count.n["ex2"] >= q.shape[1] * q.shape[2] * k.shape[2] // 2  # every visible score's P~
    if lse:
        assert count.n["lg2"] > 0
        assert torch.allclose(hw_stats["lse"], base_stats["lse"], atol=1e-5, rtol=0)
    assert torch.isfinite(hw).all()
    assert (hw - base).abs().max() <= 0.02 * base.abs().max()  # one-ulp moves of P~, not another model


def test_key_routes_the_backward(monkeypatch):
    from fa3_numerics.numerics.backward import emulate_backward
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe
    q, k, v = _qkv(1, n=64)
    do = torch.randn_like(q)
    r = Recipe.from_str("sdpa-flash-bf16,fa2math=torch,sfu=h200")
    fwd = _Count(monkeypatch)
    emulate(r, q, k, v, causal=True, stats={})
    n_fwd = fwd.n["ex2"]
    both = _Count(monkeypatch)
    emulate_backward(r, q, k, v, do, causal=True)
    assert both.n["ex2"] > n_fwd  # the backward's P went through the model too


def test_key_needs_ftz():
    from fa3_numerics.errors import UsageError
    from fa3_numerics.numerics.recipe import Recipe
    with pytest.raises(UsageError, match="ftz"):
        Recipe.from_str("fa3-fp8-kernel,ftz=0,sfu=h200")
    assert Recipe.from_str("fa3-fp8-kernel").sfu == "rz"


def test_h200_models_give_more_of_the_sdpa_kernels_lse():
    # PyTorch SDPA's flash forward dumped on an H200 (tests/fixtures/field_h200.safetensors): with
    # fa2math=torch its LSE = fma(m, scale, __logf(l)) and P~ = exp2f(..); the stand-ins (lg2 and exp2
    # rounded toward zero) give 90.4% of its LSE bits, the measured instructions 99.2%
    from safetensors.torch import load_file

    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe
    fix = Path(__file__).resolve().parents[1] / "fixtures" / "field_h200.safetensors"
    t = {k.split("/", 1)[1]: x for k, x in load_file(str(fix)).items() if k.startswith("b_n512_d64_causal/")}
    q, k, v = (t[x].double() for x in ("q", "k", "v"))
    same = {}
    for mode in ("rz", "h200"):
        st: dict = {}
        emulate(Recipe.from_str(f"sdpa-flash-bf16,fa2math=torch,sfu={mode}"), q, k, v, causal=True, stats=st)
        same[mode] = (st["lse"] == t["lse"]).double().mean().item()
    assert same["rz"] < 0.92 and same["h200"] > 0.98, same
