"""FlashAttention-2's forward as PyTorch SDPA's flash kernel runs it on Hopper (``loop=fa2``).

Exposed: ``FA2_FWD_TILES``, ``FA2_BWD_TILES``, ``fa2_tiles``, ``fa2_bwd_tiles``, ``fa2_num_splits``,
``split_block_n``, ``flash_fa2``.

torch's ``_scaled_dot_product_flash_attention`` is FlashAttention-2 (aten/src/ATen/native/transformers/
cuda/flash_attn/), compiled for sm80 and run as mma.sync on an H100/H200. What it computes, from its
source:

- tiles (flash_fwd_launch_template.h, sm90 is not ``is_sm8x``): kBlockM x kBlockN = 128 x 128 at head
  dim 64, 128 x 64 at 96, 128 and 192, 64 x 64 at 256 (an H200's 228 KB per SM takes the 2-CTA
  branch); the KV tiles visited last to first (``for (; n_block >= n_block_min; --n_block)``);
- the online softmax of FA3's model (exp2 of an FFMA with the max scaled by scale log2(e), per-thread
  partial row sums in the mma accumulator layout, a quad reduction at the end, O times 1 / l), so
  the tile step is ``emulator._flash``'s;
- split-KV (flash_api.cpp ``set_params_splitkv``, called by ``mha_fwd`` with num_splits = 0): when
  batch x heads x ceil(seqlen_q / 64) is below 0.8 x 2 x SMs, ``num_splits_heuristic`` picks the
  smallest split count within 85% of the best wave efficiency (at most 128 splits, at most the KV
  tiles). The split kernel (``run_mha_fwd_splitkv_dispatch``) has its own tiles, kBlockM 64 and
  kBlockN 256 / 128 / 64 for head dims <= 64 / <= 128 / larger; split s takes KV tiles
  [s ceil(T / S), (s + 1) ceil(T / S)), writes its O normalised by its own row sum and its LSE in
  float32 (-inf where it saw no key), and ``flash_fwd_splitkv_combine_kernel`` adds them:
  m = max_s lse_s (0 if all are -inf), lse = log(sum_s exp(lse_s - m)) + m,
  O = sum_s exp(lse_s - lse) O_s (one FFMA per split, in split order), then O in BF16/FP16;
- backward tiles (flash_bwd_launch_template.h, >= 144 KB shared memory per block): 128 x 128 at 64,
  64 x 128 at 96 and 128, 64 x 64 at 192 and 256.

Modelling choices, stated: under ``fa2math=torch`` with ``sfu=h200`` the combine's exp and log are
libdevice's accurate ``expf``/``logf`` bit for bit (``numerics/libdevice.py``: torch builds FA2 without
fast-math, so the combine kernel's ``expf``/``logf`` are not the ``__expf``/``__logf`` intrinsics; their ex2 is
the H200's) and its O update one exact FFMA per split; otherwise they are correctly rounded float32 (the
kernel's are within 2 ulp). The split count assumes an H200's 132 SMs.

``fa2math=torch`` (``keys/fa2math.py``) is the arithmetic of torch's build of FA2, which the default
(FA3's tile step) differs from in four places, each found on the H200 dumps (reports/h200/backward/):

- torch defines ``UNFUSE_FMA`` (pytorch #121558), so softmax.h ``scale_apply_exp2`` computes
  exp2f(__fmul_rn(S, scale_log2) - max_scaled): S scaled with its own rounding, then the subtract
  (FA3: one FFMA). Forward O F 0.0106 -> 0.0048 on the causal d 64 dump;
- exp2f's result taken rounded toward zero (``emulator.exp2_rz``): the hardware's ex2 lands below the correctly rounded
  value more often than above it (the backward alone from the kernel's O and LSE: dV F 0.0079 ->
  0.0005 at head dim 128);
- the LSE is ``normalize_softmax_lse``'s row_max * softmax_scale + __logf(row_sum): the plain scale
  (not scale_log2 ln 2) in one FFMA, and __logf = lg2.approx times ln 2 with lg2 taken rounded toward
  zero (rows that only the first split sees, whose LSE is the split kernel's own: 83% identical
  with a correctly rounded log, 90% with this);
- the combine's sum of exp(lse_s - max) is an ``Allreduce`` over kMaxSplits lanes (the split count
  rounded up to a power of two, one split per lane): a butterfly, xor kMaxSplits/2 first;
- the rescale of a KV tile after the first: nvcc contracts softmax_rescale_o's ``row_sum *= scale``
  with reduce_sum's first ``row_sum + P~`` (each thread's column 2t of the tile) into one FFMA
  (``_rescaled_row_sum``; default -fmad=true); O's rescale stays a multiply. On the n 1024 d 128 GQA
  dump (2 splits of 4 KV tiles) the separate multiply missed 1.6% of the LSE rows, every one a row
  whose max moved; with the FFMA none.
"""

from __future__ import annotations

import dataclasses
import math

import torch

H200_SMS = 132
LOG2E = math.log2(math.e)
# head_dim -> (kBlockM, kBlockN), forward and backward, on sm90 with no dropout
FA2_FWD_TILES = {64: (128, 128), 96: (128, 64), 128: (128, 64), 192: (128, 64), 256: (64, 64)}
FA2_BWD_TILES = {64: (128, 128), 96: (64, 128), 128: (64, 128), 192: (64, 64), 256: (64, 64)}
_SPLIT_BLOCK_M = 64


def _table(table: dict, head_dim: int) -> tuple[int, int]:
    d = min((k for k in table if k >= head_dim), default=max(table))
    return table[d]


def fa2_tiles(head_dim: int) -> tuple[int, int]:
    """(kBlockM, kBlockN) of FA2's (unsplit) forward on sm90."""
    return _table(FA2_FWD_TILES, head_dim)


def fa2_bwd_tiles(head_dim: int) -> tuple[int, int]:
    """(kBlockM, kBlockN) of FA2's backward on sm90."""
    return _table(FA2_BWD_TILES, head_dim)


def split_block_n(head_dim: int) -> int:
    return 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)


def fa2_num_splits(*, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   num_sms: int = H200_SMS) -> int:
    """FA2's split count for ``mha_fwd`` (flash_api.cpp ``num_splits_heuristic`` with 2 x SMs)."""
    n_blocks = -(-seqlen_k // split_block_n(head_dim))
    work = batch * heads * -(-seqlen_q // _SPLIT_BLOCK_M)
    sms = 2 * num_sms
    if work >= 0.8 * sms:
        return 1
    most = min(128, sms, n_blocks)
    eligible = lambda s: s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))  # noqa: E731
    eff = [0.0] * (most + 1)
    for s in range(1, most + 1):
        if eligible(s):
            waves = work * s / sms
            eff[s] = waves / math.ceil(waves)
    best = max(eff)
    return next((s for s in range(1, most + 1) if eligible(s) and eff[s] >= 0.85 * best), 1)


def _log2_toward_zero(x: torch.Tensor) -> torch.Tensor:
    r = torch.log2(x.double())
    y = r.to(torch.float32)
    return torch.where(y.double().abs() > r.abs(), torch.nextafter(y, torch.zeros_like(y)), y)


def _rescaled_row_sum(rs4: torch.Tensor, alpha: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``row_sum *= scores_scale`` and then reduce_sum's first ``row_sum + P~``, which nvcc contracts
    into one FFMA (-fmad=true, inlined: rs alpha + p0 rounded once), then the thread's other columns
    added in order (``emulator._quad_row_sum``). Found on the n 1024 d 128 GQA dump (2 splits of 4 KV
    tiles): the separate multiply missed 1.6% of the LSE rows, all of them rows whose max moved."""
    from .emulator import _fma32, _quad_row_sum

    pad = (-p.shape[-1]) % 8
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    first = p.reshape(*p.shape[:-1], -1, 4, 2)[..., 0, :, 0]  # each quad thread's first column: 2t
    rs4 = _fma32(rs4, alpha, first)
    rs4 = rs4 + p.reshape(*p.shape[:-1], -1, 4, 2)[..., 0, :, 1]
    return _quad_row_sum(rs4, p[..., 8:])


def _flash_torch(recipe, pre, q_index: torch.Tensor, causal: bool, scale: float, stats: dict | None,
                 tile_range: tuple[int, int] | None = None) -> torch.Tensor:
    """One pass of torch's FA2 forward (``fa2math=torch``, module docstring) over the KV tiles of
    ``tile_range`` last to first: O in the recipe's output format (float64), ``stats["lse"]`` float32
    (+inf where a row saw no key)."""
    from ..errors import UsageError
    from .accumulators import accumulator_for, hopper_mma_on
    from .emulator import _fma32, _quad_row_sum, _quad_total, exp2_rz, write_out
    from .families import element_format, family, mma_format
    from .formats import get_format, quantize_dequantize
    from .mma import hopper_mma
    from .reference import causal_mask
    from . import sfu

    # sfu=h200: the measured ex2/lg2.approx.ftz in place of the rounded-toward-zero stand-ins
    ex2, log2z = (sfu.ex2, sfu.lg2) if sfu.wanted(recipe) else (exp2_rz, _log2_toward_zero)
    uniform = all(t.descale.shape[2] == 1 and t.descale.shape[3] == 1 for t in (pre.q, pre.k, pre.v))
    if pre.bias is not None or not uniform or family(recipe.qk) != "float" or family(recipe.p) != "float":
        raise UsageError(f"recipe {recipe.short_str()}: fa2math=torch models float Q/K/P with one descale per "
                         "head (no smoothing bias); use fa2math=fa3")
    f32 = torch.float32
    dev = pre.q.values.device
    qv = pre.q.values.to(f32)
    kn, vn = pre.k.values, pre.v.values
    b, h, r, _ = qv.shape
    nk = pre.seqlen_k
    # the host's float32 scale_softmax and scale_softmax_log2, times the per-head descales on the device
    sc32 = torch.tensor(float(torch.tensor(scale, dtype=f32)), dtype=f32, device=dev)
    desc = (pre.q.descale * pre.k.descale).to(f32)
    sl2 = (torch.tensor(float(sc32) * LOG2E, dtype=f32, device=dev) * desc).to(f32)
    sc = (sc32 * desc).to(f32)
    qk_elem = element_format(recipe.qk)
    mma_s = hopper_mma_on(recipe.acc, qk_elem)
    accumulate = accumulator_for(recipe)
    acc_fmts = (mma_format(recipe.p), mma_format(recipe.v))
    p_fmt = get_format(recipe.p)
    m = torch.full((b, h, r, 1), -math.inf, dtype=f32, device=dev)
    rs4 = torch.zeros((b, h, r, 4), dtype=f32, device=dev)
    acc = torch.zeros((b, h, r, vn.shape[-1]), dtype=f32, device=dev)
    n_tiles = -(-nk // pre.block_n)
    t_lo, t_hi = tile_range if tile_range is not None else (0, n_tiles)
    for t in range(t_hi - 1, t_lo - 1, -1):
        s0, s1 = t * pre.block_n, min(nk, (t + 1) * pre.block_n)
        k_t = kn[:, :, s0:s1].to(f32).transpose(-1, -2)
        s = hopper_mma(qv, k_t, a_fmt=qk_elem, b_fmt=qk_elem) if mma_s else torch.matmul(qv, k_t)
        if causal:
            s = s.masked_fill(~causal_mask(q_index, s0, s1, pre.seqlen_q, nk), -math.inf)
        m_prev = m
        m = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        finite = torch.isfinite(m)
        m_cur = torch.where(finite, m, torch.zeros_like(m))
        alpha = None
        if t != t_hi - 1:
            # softmax_rescale_o: exp2f((m_prev - m_cur) * scale_log2), the row sum and O rescaled
            alpha = ex2(((m_prev - m_cur) * sl2).to(f32))
            acc = acc * alpha
        max_scaled = torch.where(finite, (m * sl2).to(f32), torch.zeros_like(m))
        p = ex2(((s * sl2).to(f32) - max_scaled).to(f32))  # UNFUSE_FMA: two roundings
        rs4 = _quad_row_sum(rs4, p) if alpha is None else _rescaled_row_sum(rs4, alpha, p)
        acc = accumulate(acc, quantize_dequantize(p, p_fmt), vn[:, :, s0:s1].to(f32), acc_fmts)
    row_sum = _quad_total(rs4)
    bad = (row_sum == 0) | torch.isnan(row_sum)
    ln2 = torch.tensor(math.log(2.0), dtype=f32, device=dev)
    logl = (log2z(torch.where(bad, torch.ones_like(row_sum), row_sum)) * ln2).to(f32)  # __logf
    lse = _fma32(m, sc, logl)
    if stats is not None:
        stats["lse"] = torch.where(bad, torch.full_like(lse, math.inf), lse).squeeze(-1)
    inv = torch.where(bad, torch.ones_like(row_sum), 1.0 / row_sum)
    return write_out(acc * (inv * pre.v.descale.to(f32)).to(f32), recipe)


def _butterfly_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The combine kernel's Allreduce of one term per lane over kMaxSplits lanes (a power of two;
    lanes past the last split hold exp(-inf) = 0), xor kMaxSplits/2 first."""
    lanes = 2
    while lanes < len(terms):
        lanes *= 2
    x = terms + [torch.zeros_like(terms[0])] * (lanes - len(terms))
    off = lanes // 2
    while off:
        x = [x[i] + x[i ^ off] for i in range(lanes)]
        off //= 2
    return x[0]


def flash_fa2(recipe, pre, q_index: torch.Tensor, causal: bool, scale: float, stats: dict | None = None,
              *, num_sms: int = H200_SMS) -> torch.Tensor:
    """The forward of torch's FA2 (module docstring) on the emulator's prepared inputs: [B, H, R, Dv]
    float64 holding values of the output format; ``stats["lse"]`` the LSE its backward reads."""
    from .emulator import _flash, write_out

    b, h = pre.q.values.shape[:2]
    d = pre.q.values.shape[-1]
    nk = pre.seqlen_k
    rev = dataclasses.replace(recipe, order="reverse")
    torch_math = getattr(recipe, "fa2math", "fa3") == "torch"
    tile_pass = _flash_torch if torch_math else _flash  # torch's tile step, or FA3's
    splits = fa2_num_splits(batch=b, heads=h, seqlen_q=pre.seqlen_q, seqlen_k=nk, head_dim=d, num_sms=num_sms)
    if splits <= 1:
        return tile_pass(rev, pre, q_index, causal, scale, stats)
    bn = split_block_n(d)
    ps = dataclasses.replace(pre, block_m=_SPLIT_BLOCK_M, block_n=bn)
    n_tiles = -(-nk // bn)
    per = -(-n_tiles // splits)
    part = dataclasses.replace(rev, out="fp32")
    f32 = torch.float32
    o_parts, lse_parts = [], []
    for s in range(splits):
        t0, t1 = s * per, min(n_tiles, (s + 1) * per)
        if t1 <= t0:
            continue  # an empty split writes O = 0 and lse = -inf: it adds nothing
        st: dict = {}
        o_parts.append(tile_pass(part, ps, q_index, causal, scale, st, tile_range=(t0, t1)).to(f32))
        lse = st["lse"]
        lse_parts.append(torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -math.inf)))
    lse_all = torch.stack(lse_parts)  # [S, B, H, R]
    m = lse_all.amax(dim=0)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    from . import sfu

    if torch_math and sfu.wanted(recipe):
        # the combine kernel's own expf/logf: libdevice's accurate ones (torch builds FA2 without
        # fast-math), whose ex2.approx is the H200's; its O update is one FFMA per split
        from .libdevice import expf, fma32, logf

        total = _butterfly_sum([expf((x - m).to(f32)) for x in lse_all])
        bad = (total == 0) | torch.isnan(total)
        lse = torch.where(bad, torch.full_like(total, math.inf),
                          (logf(torch.where(bad, torch.ones_like(total), total)) + m).to(f32))
        out = torch.zeros_like(o_parts[0])
        for x, o_s in zip(lse_all, o_parts):
            out = fma32(expf((x - lse).to(f32)).unsqueeze(-1), o_s, out)
        if stats is not None:
            stats["lse"] = lse
        return write_out(out, recipe)
    if torch_math:
        total = _butterfly_sum([torch.exp((x - m).double()).to(f32) for x in lse_all])
    else:
        total = torch.zeros_like(m)
        for x in lse_all:
            total = total + torch.exp((x - m).double()).to(f32)
    lse = torch.where((total == 0) | torch.isnan(total), torch.full_like(total, math.inf),
                      (torch.log(total.double()).to(f32) + m).to(f32))
    out = torch.zeros_like(o_parts[0])
    for x, o_s in zip(lse_all, o_parts):
        w = torch.exp((x - lse).double()).to(f32).unsqueeze(-1)
        out = (w.double() * o_s.double() + out.double()).to(f32)
    if stats is not None:
        stats["lse"] = lse
    return write_out(out, recipe)


__all__ = ["FA2_FWD_TILES", "FA2_BWD_TILES", "fa2_tiles", "fa2_bwd_tiles", "fa2_num_splits", "split_block_n",
           "flash_fa2"]
