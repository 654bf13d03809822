"""loop=fa2 (FlashAttention-2's forward as torch SDPA's flash kernel runs it) and the backward keys
FA2 needs (bwd.order, bwd.gqa, its D order): independent references and negative controls."""

from __future__ import annotations

import math

import pytest
import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.backward import Forward, _fa2_dot_do_o, backward_from, emulate_backward
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.fa2_loop import fa2_bwd_tiles, fa2_num_splits, fa2_tiles
from fa3_numerics.numerics.recipe import Recipe
from fa3_numerics.numerics.reference import reference_attention


def _qkv(b=1, h=4, hkv=4, n=512, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    return q, k, v


def test_split_counts_follow_fa2s_heuristic():
    # batch x heads x ceil(n / 64) against 0.8 x 264 (2 x 132 SMs); KV tiles of 128 (d 128) / 256 (d 64)
    assert fa2_num_splits(batch=1, heads=4, seqlen_q=512, seqlen_k=512, head_dim=128) == 4  # 4 KV tiles, eff 0.48
    assert fa2_num_splits(batch=1, heads=4, seqlen_q=512, seqlen_k=512, head_dim=64) == 2
    assert fa2_num_splits(batch=1, heads=8, seqlen_q=1024, seqlen_k=1024, head_dim=128) == 2  # eff 0.97 at 2
    assert fa2_num_splits(batch=1, heads=8, seqlen_q=2048, seqlen_k=2048, head_dim=128) == 1  # 256 >= 211
    assert fa2_tiles(128) == (128, 64) and fa2_tiles(64) == (128, 128) and fa2_bwd_tiles(128) == (64, 128)


def test_split_path_is_attention_in_exact_formats():
    # with float32 operands the split-KV combine is exact attention up to float32 rounding
    q, k, v = _qkv(h=4, n=300, d=64)
    for causal in (False, True):
        ref = reference_attention(q, k, v, causal=causal)
        stats: dict = {}
        o = emulate(Recipe.from_str("exact,loop=fa2"), q, k, v, causal=causal, stats=stats)
        assert (o - ref).abs().max() < 1e-5
        s = (q @ k.transpose(-1, -2)) / math.sqrt(64)
        if causal:
            s = s.masked_fill(~torch.ones(300, 300, dtype=torch.bool).tril(), -math.inf)
        assert (stats["lse"].double() - torch.logsumexp(s, -1)).abs().max() < 1e-4


def test_split_kv_changes_bf16_bits_and_the_fa3_loop_does_not_split():
    q, k, v = _qkv(h=4, n=512, d=128)
    fa2 = emulate(Recipe.from_str("fa3-bf16,loop=fa2"), q, k, v)
    one_pass = emulate(Recipe.from_str("fa3-bf16,bm=128,bn=64"), q, k, v)  # FA2's tiles, no split
    assert 0 < (fa2 != one_pass).double().mean() < 0.5  # 4 splits round differently, not wrongly
    ref = reference_attention(q, k, v)
    assert (fa2 - ref).pow(2).mean().sqrt() < 2 * (one_pass - ref).pow(2).mean().sqrt()


def test_fa2_loop_refuses_what_it_does_not_model():
    with pytest.raises(UsageError):
        Recipe.from_str("fa3-bf16,loop=fa2,norm=tile")
    q, k, v = _qkv(h=1, hkv=1, n=64, d=64)
    with pytest.raises(UsageError):
        emulate(Recipe.from_str("fa3-bf16,loop=fa2"), q, k, v, window_size=(16, 0))


def test_fa2_d_order_is_a_float32_rowsum():
    g = torch.Generator().manual_seed(3)
    do, o = (torch.randn(2, 3, 17, 128, generator=g, dtype=torch.float64).to(torch.bfloat16).double()
             for _ in range(2))
    d = _fa2_dot_do_o(do, o)
    exact = (do * o).sum(-1, keepdim=True)
    assert d.dtype == torch.float32 and d.shape == exact.shape
    assert ((d.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max() < 1e-5
    # an independent loop in FA2's order: thread t chains columns 8t..8t+7 of each 64-block, then xor 4, 2, 1
    row_do, row_o = do[0, 0, 0].float(), o[0, 0, 0].float()
    parts = []
    for t in range(8):
        acc = None
        for blk in range(2):
            for e in range(8):
                c = 64 * blk + 8 * t + e
                prod = row_do[c].double() * row_o[c].double()
                acc = prod.float() if acc is None else (prod + acc.double()).float()
        parts.append(acc)
    for off in (4, 2, 1):
        parts = [parts[i] + parts[i ^ off] for i in range(8)]
    assert d[0, 0, 0, 0] == parts[0]


def test_bwd_gqa_expand_rounds_each_query_heads_gradient():
    q, k, v = _qkv(h=4, hkv=1, n=96, d=64, seed=5)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    base = "fa3-bf16-bwd-bf16"
    fwd = emulate_backward(Recipe.from_str(base), q, k, v, do).forward
    expand = backward_from(Recipe.from_str(base + ",bwd.gqa=expand"), q, k, v, fwd, do)
    accum = backward_from(Recipe.from_str(base), q, k, v, fwd, do)
    # independent: the MHA backward on K, V repeated per query head, each head's dK/dV in BF16, then summed
    per_head = backward_from(Recipe.from_str(base), q, k.expand(-1, 4, -1, -1), v.expand(-1, 4, -1, -1), fwd, do)
    for got, heads, other in ((expand.dk, per_head.dk, accum.dk), (expand.dv, per_head.dv, accum.dv)):
        want = heads.sum(dim=1, keepdim=True).to(torch.float32).to(torch.bfloat16).double()
        assert torch.equal(got, want)
        assert not torch.equal(got, other)  # negative control: summing before the rounding differs
    assert torch.equal(expand.dq, accum.dq)


def test_bwd_order_reverse_only_reorders_the_sum():
    q, k, v = _qkv(h=2, hkv=2, n=200, d=64, seed=7)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    base = "fa3-bf16-bwd-bf16,bwd.bm=64"
    fwd = emulate_backward(Recipe.from_str(base), q, k, v, do).forward
    fw = backward_from(Recipe.from_str(base), q, k, v, fwd, do)
    rv = backward_from(Recipe.from_str(base + ",bwd.order=reverse"), q, k, v, fwd, do)
    for a, b in ((fw.dk, rv.dk), (fw.dv, rv.dv)):
        assert (a - b).abs().max() <= 2 ** -7 * a.abs().max()  # a BF16 ulp at most: the same sum, reordered
    assert torch.equal(fw.dq, rv.dq)  # dQ does not chain over query tiles
    # under the MMA model the chaining order decides bits (its truncation is order-dependent)
    f22 = backward_from(Recipe.from_str(base + ",bwd.acc=fp22"), q, k, v, fwd, do)
    r22 = backward_from(Recipe.from_str(base + ",bwd.acc=fp22,bwd.order=reverse"), q, k, v, fwd, do)
    assert not torch.equal(f22.dv, r22.dv)
    assert (f22.dv - r22.dv).abs().max() <= 2 ** -7 * f22.dv.abs().max()


def test_exp2_toward_zero_is_the_float32_below_exp2():
    # fa2math=torch's model of exp2f (the forward's P~ and rescale, the backward's P)
    from fa3_numerics.numerics.emulator import exp2_rz as exp2_toward_zero

    x = torch.linspace(-30, 3, 20001, dtype=torch.float32)
    y = exp2_toward_zero(x)
    true = torch.exp2(x.double())
    assert y.dtype == torch.float32
    assert (y.double() <= true).all()  # never above
    assert (torch.nextafter(y, torch.full_like(y, math.inf)).double() > true).all()  # the float32 just below
    rn = torch.exp2(x.double()).to(torch.float32)
    assert 0.3 < (y != rn).double().mean() < 0.7  # negative control: round-to-nearest differs about half the time
    assert exp2_toward_zero(torch.tensor([0.0, 1.0, -math.inf])).tolist() == [1.0, 2.0, 0.0]


def test_combine_sum_is_the_butterfly_over_lanes():
    from fa3_numerics.numerics.fa2_loop import _butterfly_sum

    e = [torch.tensor([v], dtype=torch.float32) for v in (1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24)]
    # lanes 0..3, xor 2 then xor 1: (e0 + e2) + (e1 + e3) = 1 + 2^-23; in order the 2^-24 terms vanish
    assert _butterfly_sum(e).item() == 1.0 + 2.0 ** -23
    seq = e[0]
    for x in e[1:]:
        seq = seq + x
    assert seq.item() == 1.0
    # three splits take four lanes, the fourth adds exp(-inf) = 0
    assert _butterfly_sum(e[:3]).item() == ((e[0] + e[2]) + e[1]).item()


def test_fa2math_torch_forward_matches_an_independent_loop():
    # one pass (no split: 200 keys fit one KV tile of the split kernel's 256) on float32 S, row by row
    q, k, v = _qkv(h=2, hkv=2, n=200, d=64, seed=11)
    q, k, v = (x.to(torch.bfloat16).double() for x in (q, k, v))
    assert fa2_num_splits(batch=1, heads=2, seqlen_q=200, seqlen_k=200, head_dim=64) == 1
    spec = "sdpa-flash-bf16,acc=fp32"
    for causal in (False, True):
        stats: dict = {}
        o = emulate(Recipe.from_str(spec), q, k, v, causal=causal, stats=stats)
        f32 = torch.float32
        sl2 = torch.tensor(0.125 * math.log2(math.e), dtype=f32)
        s_all = torch.matmul(q.float(), k.float().transpose(-1, -2))
        ln2 = torch.tensor(math.log(2.0), dtype=f32)
        for hh, i in ((0, 0), (1, 57), (0, 199)):
            m = torch.tensor(-math.inf)
            parts = torch.zeros(4, dtype=f32)
            acc = torch.zeros(64, dtype=f32)
            for t0 in (128, 0):  # FA2's 128-key tiles at head dim 64, last to first
                s = s_all[0, hh, i, t0:t0 + 128].clone()
                if causal:
                    s[torch.arange(t0, t0 + s.numel()) > i] = -math.inf
                m_new = torch.maximum(m, s.max())
                m_cur = m_new if torch.isfinite(m_new) else torch.tensor(0.0)  # FA2's Check_inf: a -inf max is 0
                if t0 != 128:
                    r = torch.exp2(((m - m_cur) * sl2).double())
                    a = r.float() if r.float().double() <= r else torch.nextafter(r.float(), torch.tensor(0.0))
                    parts, acc = parts * a, acc * a
                m = m_new
                x = (s * sl2).float() - (m_cur * sl2).float()
                p = torch.exp2(x.double())
                pf = p.float()
                pf = torch.where(pf.double() > p, torch.nextafter(pf, torch.zeros_like(pf)), pf)
                for j in range(s.numel()):
                    parts[(j % 8) // 2] += pf[j]
                acc = acc + (pf.to(torch.bfloat16).double() @ v[0, hh, t0:t0 + 128].double()).float()
            l_ = (parts[0] + parts[2]) + (parts[1] + parts[3])
            lg = torch.log2(l_.double())
            lg2 = lg.float() if lg.float().double() <= lg else torch.nextafter(lg.float(), torch.tensor(0.0))
            lse = (m.double() * 0.125 + (lg2 * ln2).float().double()).float()
            assert stats["lse"][0, hh, i] == lse, (causal, hh, i)
            assert (o[0, hh, i] - (acc / l_).to(torch.bfloat16).double()).abs().max() <= 2 ** -7 * o[0, hh, i].abs().max()
    # negative control: FA3's tile step gives other LSE bits on some rows
    st3: dict = {}
    emulate(Recipe.from_str(spec + ",fa2math=fa3"), q, k, v, stats=st3)
    assert (st3["lse"] != stats["lse"]).any()


def test_fa2math_torch_needs_loop_fa2():
    with pytest.raises(UsageError):
        Recipe.from_str("fa3-bf16,fa2math=torch")
