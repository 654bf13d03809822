"""``acc=fp22,flush=N``: the MMA chain added into float32 every N KV tiles (vLLM's fix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.accumulators import FlushEvery, accumulator_for
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.formats import get_format
from fa3_numerics.numerics.recipe import Recipe

get_recipe = Recipe.from_str


def _inputs(n=900, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 128, generator=g, dtype=torch.float64) for _ in range(3))
    v += 2.0  # a V mean: the chain grows and its 13 bits drop small increments
    k[0, :, 3] *= 4.0  # an early strong key: the max jumps on the last tile visited
    return q, k, v


def _bits(x):
    return x.view(torch.int64)


def test_flush_1_is_two_level_bit_for_bit():
    q, k, v = _inputs()
    rows = torch.tensor([0, 100, 450, 899])
    a = emulate(get_recipe("fa3-fp8-kernel,acc=fp22,flush=1"), q, k, v, causal=True, q_index=rows)
    b = emulate(get_recipe("fa3-fp8-kernel,acc=two-level"), q, k, v, causal=True, q_index=rows)
    assert torch.equal(_bits(a), _bits(b))


def test_flush_past_the_last_tile_is_the_unbroken_chain():
    q, k, v = _inputs()
    rows = torch.arange(0, 900, 37)
    a = emulate(get_recipe("fa3-fp8-kernel,acc=fp22,flush=64"), q, k, v, q_index=rows)
    b = emulate(get_recipe("fa3-fp8-kernel,acc=fp22"), q, k, v, q_index=rows)
    assert torch.equal(a, b)


def test_flush_changes_the_numbers_between_its_limits():
    """flush=2 is neither the chain nor two-level here: the key is not silently ignored."""
    q, k, v = _inputs()
    rows = torch.arange(0, 900, 37)
    outs = {f: emulate(get_recipe(f"fa3-fp8-kernel,acc=fp22,flush={f}"), q, k, v, q_index=rows) for f in (0, 1, 2)}
    assert not torch.equal(outs[2], outs[0]) and not torch.equal(outs[2], outs[1])


@pytest.mark.parametrize("spec, words", [("fa3-fp8-kernel,acc=fp32,flush=4", "acc=fp22"),
                                          ("fa3-fp8-kernel,acc=two-level,flush=2", "flush=1"),
                                          ("fa3-fp8-kernel,acc=fp22,flush=-1", "N >= 1")])
def test_flush_without_the_chain_is_refused(spec, words):
    with pytest.raises(UsageError, match=words):
        get_recipe(spec)


def test_spelled_and_round_tripped():
    r = get_recipe("fa3-fp8-kernel,acc=fp22,flush=4")
    assert "flush=4" in r.short_str()
    assert get_recipe(r.short_str()) == r
    assert "flush" not in get_recipe("fa3-fp8-kernel").short_str()  # default keeps stored specs unchanged


# -- an independent model of one tile sequence, in numpy -------------------------------------

def _np_mma_step(c, a, b):
    """One 32-key k-step of the Hopper FP8 MMA model on float64 arrays: c [R, D], a [R, 32], b [32, D]."""
    def e(x):  # floor(log2|x|) clamped at e4m3's smallest normal exponent
        return np.maximum(np.floor(np.log2(np.abs(np.where(x == 0, 1.0, x)))), -6.0)

    prod = a[:, :, None] * b[None, :, :]  # [R, 32, D]
    ep = e(a)[:, :, None] + e(b)[None, :, :]
    ep = np.where(prod != 0, ep, -np.inf)
    emax = ep.max(axis=1)
    ec = np.floor(np.log2(np.abs(np.where(c == 0, 1.0, c))))
    emax = np.where(c != 0, np.maximum(emax, ec), emax)
    out = np.zeros_like(c)
    live = np.isfinite(emax)
    ulp = np.exp2(np.where(live, emax, 0.0) - 13)
    total = np.trunc(prod / ulp[:, None, :]).sum(axis=1) + np.trunc(c / ulp)
    d = total * ulp
    lead = np.floor(np.log2(np.abs(np.where(d == 0, 1.0, d))))
    q = np.exp2(lead - 13)
    out = np.where(live & (d != 0), np.trunc(d / q) * q, 0.0)
    return out.astype(np.float32).astype(np.float64)


def _np_flush_every(tiles, n):
    """acc (float32) and chain over a list of (rescale [R,1], p [R, bn], v [bn, D]) tiles."""
    acc = chain = None
    for i, (r, p, v) in enumerate(tiles):
        r32 = r.astype(np.float32)
        if acc is None:
            acc = np.zeros((p.shape[0], v.shape[1]), dtype=np.float32)
        acc = (acc * r32).astype(np.float32)
        if chain is not None:
            chain = (chain.astype(np.float32) * r32).astype(np.float64)
        c = np.zeros_like(acc, dtype=np.float64) if chain is None else chain
        for k0 in range(0, p.shape[1], 32):
            c = _np_mma_step(c, p[:, k0:k0 + 32], v[k0:k0 + 32])
        chain = c
        if (i + 1) % n == 0:
            acc = (acc + chain.astype(np.float32)).astype(np.float32)
            chain = None
    if chain is not None:
        acc = (acc + chain.astype(np.float32)).astype(np.float32)
    return acc


def _e4m3(rng, shape, scale):
    x = rng.standard_normal(shape) * scale
    return torch.from_numpy(x).to(torch.float32).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64).numpy()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_flush_every_matches_a_numpy_model_of_a_tile_sequence(n):
    rng = np.random.default_rng(n)
    tiles = []
    for t in range(5):
        p = np.abs(_e4m3(rng, (4, 64), 60.0))
        v = _e4m3(rng, (64, 8), 3.0) + 0.0
        r = np.where(rng.random((4, 1)) < 0.4, np.exp2(-rng.random((4, 1)) * 6), 1.0)
        tiles.append((r if t else np.ones((4, 1)), p, v))
    want = _np_flush_every(tiles, n)
    fmt = get_format("e4m3")
    acc_fn = FlushEvery(n)
    acc = torch.zeros(4, 8)
    for r, p, v in tiles:
        r_t = torch.from_numpy(r).to(torch.float32)
        acc = acc * r_t
        acc_fn.rescale(r_t)
        acc = acc_fn(acc, torch.from_numpy(p).to(torch.float32), torch.from_numpy(v).to(torch.float32), (fmt, fmt))
    got = acc_fn.finish(acc)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


def test_accumulator_for_gives_fresh_state():
    r = get_recipe("fa3-fp8-kernel,acc=fp22,flush=2")
    a, b = accumulator_for(r), accumulator_for(r)
    assert isinstance(a, FlushEvery) and a is not b
    assert not isinstance(accumulator_for(get_recipe("fa3-fp8-kernel,acc=fp22")), FlushEvery)
