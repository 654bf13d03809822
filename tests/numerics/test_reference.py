import math

import torch

from fa3_numerics.numerics.reference import expand_kv, reference_attention


def naive(q, k, v, causal, scale):
    h = q.shape[1]
    k, v = expand_kv(k, h), expand_kv(v, h)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n, nk = q.shape[2], k.shape[2]
        mask = torch.ones(n, nk, dtype=torch.bool).tril(diagonal=nk - n)
        s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def test_chunked_equals_unchunked_and_naive():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 333, 64, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 333, 64, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 333, 64, generator=g, dtype=torch.float64)
    for causal in (False, True):
        full = reference_attention(q, k, v, causal=causal, chunk=10_000)
        for chunk in (1, 7, 100):
            assert torch.allclose(reference_attention(q, k, v, causal=causal, chunk=chunk), full, rtol=0, atol=1e-14)
        assert torch.allclose(full, naive(q, k, v, causal, 1 / 8), rtol=0, atol=1e-13)


def test_query_rows_subset():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 100, 64, generator=g, dtype=torch.float64) for _ in range(3))
    idx = torch.tensor([3, 50, 99])
    for causal in (False, True):
        # equal up to BLAS blocking (a different number of rows may sum in another order)
        assert torch.allclose(reference_attention(q, k, v, causal=causal, q_index=idx),
                              reference_attention(q, k, v, causal=causal)[:, :, idx], rtol=0, atol=1e-15)


def test_causal_first_row_is_v0():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 10, 64, generator=g, dtype=torch.float64) for _ in range(3))
    o = reference_attention(q, k, v, causal=True)
    assert torch.equal(o[0, 0, 0], v[0, 0, 0])


def test_causal_with_fewer_queries_than_keys_aligns_bottom_right():
    """seqlen_q < seqlen_k (decode against a cache): query i sees keys 0..i + nk - nq. The last
    query sees every key, the first sees nk - nq + 1 of them."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 12, 64, generator=g, dtype=torch.float64) for _ in range(2))
    o = reference_attention(q, k, v, causal=True)
    full = reference_attention(q, k, v, causal=False)
    assert torch.allclose(o[:, :, -1], full[:, :, -1], rtol=0, atol=1e-15)
    first = reference_attention(q[:, :, :1], k[:, :, :8], v[:, :, :8], causal=False)
    assert torch.allclose(o[:, :, :1], first, rtol=0, atol=1e-15)
    assert torch.allclose(o, naive(q, k, v, True, 1 / 8), rtol=0, atol=1e-13)
