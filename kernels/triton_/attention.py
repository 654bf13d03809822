"""FP8 attention forward in Triton with per-block (or per-token) Q and K descales.

Exposed: ``Plan``, ``plan_tiles``, ``attention_fp8``, ``kv_chunks``.

The arithmetic is the FA3 FP8 forward's as the emulator models it (fa3_numerics.numerics.emulator),
so that every step has a counterpart there:

- KV tiles of ``BLOCK_N`` keys, visited last to first (``REVERSE``) or first to last. A tile need
  not be a power of two: Triton's tiles must be, so a tile is up to three power-of-two chunks
  (FA3's d=128 tile 224 = 128 + 64 + 32). Its row max is taken over all chunks before any
  exponential, and the P.V products of the chunks follow each other in one MMA chain, so the
  tile behaves as one tile of ``BLOCK_N`` keys.
- S = Q K^T on the FP8 tensor cores from the raw FP8 values. Descales uniform per (batch,
  head) fold into ``scale_log2`` (``FOLD``): P~ = exp2(fma(S, sl2, -(fma(m, sl2, -offset))))
  with m the running max of raw S. Per-block / per-token descales (``FOLD`` off) multiply S
  element-wise first, c_ij = (qd_i * kd_j) * scale_log2, and the max is taken over scaled S.
- P~ lies in [0, 2^offset]; the row sum is over float32 P~; P~ is cast to FP8 (RNE, saturating).
- P.V: ``chained`` (the FA3 way): O += P V inside the MMA accumulator, O rescaled in float32
  between tiles. ``two-level``: each tile's P V from a zero accumulator, added to O in float32.
  A V descale per (batch, kv-head) multiplies O at the end; one per KV tile (the paper's block
  quantization of V) is applied exactly: in the chained kernel by carrying O in units of the
  current tile's descale (rescale by vd_prev / vd_cur, exact for power-of-two descales), in the
  two-level kernel by scaling each tile's P V before the float32 add.
- Causal masks are aligned bottom-right; K/V heads are shared by ``heads // kv_heads`` Q heads.
- Compiled without FMA contraction (``enable_fp_fusion=False``): the fused multiply-adds are the
  explicit ``tl.fma`` where the kernel and the emulator fuse, nothing else.

Layouts: Q (b, h, s, d), K (b, hkv, s, d), V transposed (b, hkv, d, s) (FP8 MMAs read both
operands K-major, so V^T is what the P.V product wants), output (b, h, s, d); any strides work.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fa3_numerics.errors import UsageError

from ._common import interpreting, round_fp8, tl, tl_fp8, triton

PV_MODES = ("chained", "two-level")


def kv_chunks(block_n: int) -> tuple[int, int, int] | None:
    """``block_n`` as up to three decreasing powers of two, each >= 32 (the FP8 MMA's k-step);
    None when impossible."""
    if block_n <= 0 or block_n % 32 or block_n > 512:
        return None
    parts = [1 << i for i in range(9, 4, -1) if block_n & (1 << i)]
    if len(parts) > 3:
        return None
    return tuple(parts + [0] * (3 - len(parts)))


if triton is not None:

    @triton.jit
    def _scores(q, K, kd_base, qd, crow, k0, offs_m, N_K, causal_off, base, s_ks, s_kdn,
                NC: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, FOLD: tl.constexpr,
                K_ROWS: tl.constexpr, K_TILE: tl.constexpr):
        offs_n = k0 + tl.arange(0, NC)
        offs_d = tl.arange(0, D)
        kp = K + offs_n[:, None].to(tl.int64) * s_ks + offs_d[None, :]
        if MASK:
            k = tl.load(kp, mask=(offs_n < N_K)[:, None], other=0.0)
        else:
            k = tl.load(kp)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
        if not FOLD:
            if K_TILE:
                # One K descale for the whole tile: c_i = (qd_i * kd) * base, same rounding steps.
                s = s * crow[:, None]
            else:
                kd = tl.load(kd_base + (offs_n // K_ROWS) * s_kdn, mask=offs_n < N_K, other=1.0)
                s = s * ((qd[:, None] * kd[None, :]) * base)
        if MASK:
            vis = (offs_n < N_K)[None, :]
            if CAUSAL:
                vis = vis & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            s = tl.where(vis, s, float("-inf"))
        return s

    @triton.jit
    def _probs(s, ms, sl2, FOLD: tl.constexpr):
        if FOLD:
            return tl.exp2(tl.fma(s, sl2, -ms[:, None]))
        return tl.exp2(s - ms[:, None])

    @triton.jit
    def _cast_p(p, P_DT: tl.constexpr, P_MBITS: tl.constexpr, P_EMIN: tl.constexpr, P_MAX: tl.constexpr,
                SOFT_CAST: tl.constexpr):
        if SOFT_CAST:
            return round_fp8(p, P_MBITS, P_EMIN, P_MAX).to(P_DT)
        return p.to(P_DT)

    @triton.jit
    def _v_chunk(Vt, k0, N_K, s_vs, s_vd, NC: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr):
        offs_n = k0 + tl.arange(0, NC)
        offs_d = tl.arange(0, D)
        vp = Vt + offs_n[:, None].to(tl.int64) * s_vs + offs_d[None, :].to(tl.int64) * s_vd
        if MASK:
            return tl.load(vp, mask=(offs_n < N_K)[:, None], other=0.0)
        return tl.load(vp)

    @triton.jit
    def _tile(acc, l_i, m_i, vd_prev, q, qd, t, K, Vt, kd_base, vd_base, offs_m, N_K, causal_off, base, sl2,
              s_ks, s_kdn, s_vs, s_vd, s_vdt,
              D: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr, MASK: tl.constexpr,
              CAUSAL: tl.constexpr, FOLD: tl.constexpr, K_ROWS: tl.constexpr, K_TILE: tl.constexpr,
              V_TILE: tl.constexpr,
              V_ROWS: tl.constexpr, TWO_LEVEL: tl.constexpr, P_OFFSET: tl.constexpr, P_DT: tl.constexpr,
              P_MBITS: tl.constexpr, P_EMIN: tl.constexpr, P_MAX: tl.constexpr, SOFT_CAST: tl.constexpr):
        BN: tl.constexpr = N1 + N2 + N3
        k0 = t * BN
        crow = qd
        if not FOLD:
            if K_TILE:
                crow = (qd * tl.load(kd_base + (k0 // K_ROWS) * s_kdn)) * base
        s1 = _scores(q, K, kd_base, qd, crow, k0, offs_m, N_K, causal_off, base, s_ks, s_kdn, N1, D, MASK, CAUSAL,
                     FOLD, K_ROWS, K_TILE)
        mt = tl.max(s1, 1)
        if N2 > 0:
            s2 = _scores(q, K, kd_base, qd, crow, k0 + N1, offs_m, N_K, causal_off, base, s_ks, s_kdn, N2, D, MASK,
                         CAUSAL, FOLD, K_ROWS, K_TILE)
            mt = tl.maximum(mt, tl.max(s2, 1))
        if N3 > 0:
            s3 = _scores(q, K, kd_base, qd, crow, k0 + N1 + N2, offs_m, N_K, causal_off, base, s_ks, s_kdn, N3, D,
                         MASK, CAUSAL, FOLD, K_ROWS, K_TILE)
            mt = tl.maximum(mt, tl.max(s3, 1))
        m_new = tl.maximum(m_i, mt)
        # A row with no visible key yet keeps max -inf; the kernel then uses 0 so exp2 gives 0.
        finite = m_new > float("-inf")
        m_cur = tl.where(finite, m_new, 0.0)
        if FOLD:
            rescale = tl.exp2((m_i - m_cur) * sl2)
            ms = tl.where(finite, tl.fma(m_cur, sl2, -P_OFFSET), 0.0)
        else:
            rescale = tl.exp2(m_i - m_cur)
            ms = tl.where(finite, m_cur - P_OFFSET, 0.0)
        p1 = _probs(s1, ms, sl2, FOLD)
        rs = tl.sum(p1, 1)
        if N2 > 0:
            p2 = _probs(s2, ms, sl2, FOLD)
            rs = rs + tl.sum(p2, 1)
        if N3 > 0:
            p3 = _probs(s3, ms, sl2, FOLD)
            rs = rs + tl.sum(p3, 1)
        l_i = l_i * rescale + rs
        alpha = rescale
        if V_TILE:
            vd_cur = tl.load(vd_base + (k0 // V_ROWS) * s_vdt)
            if not TWO_LEVEL:
                # O is carried in units of the current tile's V descale.
                alpha = alpha * (vd_prev / vd_cur)
        else:
            vd_cur = vd_prev
        v1 = _v_chunk(Vt, k0, N_K, s_vs, s_vd, N1, D, MASK)
        p8 = _cast_p(p1, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST)
        if TWO_LEVEL:
            # A zero the compiler cannot see, so that `acc + dot(p, v, 0)` is not folded back
            # into a chained dot(p, v, acc).
            o = tl.dot(p8, v1, (l_i * 0.0)[:, None] + tl.zeros_like(acc), out_dtype=tl.float32)
        else:
            o = tl.dot(p8, v1, acc * alpha[:, None], out_dtype=tl.float32)
        if N2 > 0:
            v2 = _v_chunk(Vt, k0 + N1, N_K, s_vs, s_vd, N2, D, MASK)
            o = tl.dot(_cast_p(p2, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST), v2, o, out_dtype=tl.float32)
        if N3 > 0:
            v3 = _v_chunk(Vt, k0 + N1 + N2, N_K, s_vs, s_vd, N3, D, MASK)
            o = tl.dot(_cast_p(p3, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST), v3, o, out_dtype=tl.float32)
        if TWO_LEVEL:
            if V_TILE:
                o = o * vd_cur
            acc = acc * alpha[:, None] + o
        else:
            acc = o
        return acc, l_i, m_new, vd_cur

    @triton.jit
    def _fwd_kernel(Q, K, Vt, O, QD, KD, VD, base_ptr,
                    s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vd, s_vs, s_ob, s_oh, s_os,
                    s_qdb, s_qdh, s_qdn, s_kdb, s_kdh, s_kdn, s_vdb, s_vdh, s_vdt,
                    H, GROUP, N_Q, N_K,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr,
                    CAUSAL: tl.constexpr, FOLD: tl.constexpr, Q_ROWS: tl.constexpr, K_ROWS: tl.constexpr,
                    K_TILE: tl.constexpr, V_TILE: tl.constexpr, V_ROWS: tl.constexpr, TWO_LEVEL: tl.constexpr,
                    REVERSE: tl.constexpr,
                    P_OFFSET: tl.constexpr, P_DT: tl.constexpr, P_MBITS: tl.constexpr, P_EMIN: tl.constexpr,
                    P_MAX: tl.constexpr, OUT_DT: tl.constexpr, SOFT_CAST: tl.constexpr, WS: tl.constexpr = False):
        BN: tl.constexpr = N1 + N2 + N3
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUP
        m0 = pid_m * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < N_Q
        qp = Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None].to(tl.int64) * s_qs + offs_d[None, :]
        q = tl.load(qp, mask=row_ok[:, None], other=0.0)
        Kb = K + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
        Vb = Vt + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh
        kd_base = KD + b * s_kdb + hk * s_kdh
        vd_base = VD + b * s_vdb + hk * s_vdh
        base = tl.load(base_ptr)
        if FOLD:
            # The host rounds softmax_scale * log2(e) to float32; the device multiplies it by
            # (q_descale * k_descale), as the FA3 kernel does.
            qd = tl.load(QD + b * s_qdb + h * s_qdh)
            sl2 = base * (qd * tl.load(kd_base))
        else:
            qd = tl.load(QD + b * s_qdb + h * s_qdh + (offs_m // Q_ROWS) * s_qdn, mask=row_ok, other=1.0)
            sl2 = 1.0
        causal_off = N_K - N_Q
        # Tiles with any key visible to this row block, and the first tile needing no mask.
        n_tiles = tl.cdiv(N_K, BN)
        n_clean = N_K // BN
        if CAUSAL:
            last_key = m0 + BLOCK_M - 1 + causal_off
            n_tiles = tl.maximum(tl.minimum(n_tiles, last_key // BN + 1), 0)
            n_clean = tl.maximum(tl.minimum(n_clean, (m0 + causal_off + 1) // BN), 0)
            n_clean = tl.where(m0 + causal_off + 1 > 0, n_clean, 0)
            n_tiles = tl.where(last_key >= 0, n_tiles, 0)
        n_clean = tl.minimum(n_clean, n_tiles)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        if V_TILE:
            first = tl.maximum(n_tiles - 1, 0) if REVERSE else 0
            vd_prev = tl.load(vd_base + ((first * BN) // V_ROWS) * s_vdt)
        else:
            vd_prev = tl.load(vd_base)
        if REVERSE:
            # Masked tiles (the diagonal and a ragged end) come first when walking backwards.
            for j in range(0, n_tiles - n_clean):
                t = n_tiles - 1 - j
                acc, l_i, m_i, vd_prev = _tile(acc, l_i, m_i, vd_prev, q, qd, t, Kb, Vb, kd_base, vd_base, offs_m,
                                               N_K, causal_off, base, sl2, s_ks, s_kdn, s_vs, s_vd, s_vdt,
                                               D, N1, N2, N3, True, CAUSAL, FOLD, K_ROWS, K_TILE, V_TILE, V_ROWS,
                                               TWO_LEVEL, P_OFFSET, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST)
            # WS asks Triton to warp-specialize the unmasked loop (a probe: benchmarks/sm90_compile.py
            # --warp-specialize; Triton 3.6 fails or ignores it on sm_90, so no launch sets it).
            for j in tl.range(0, n_clean, warp_specialize=WS):
                t = n_clean - 1 - j
                acc, l_i, m_i, vd_prev = _tile(acc, l_i, m_i, vd_prev, q, qd, t, Kb, Vb, kd_base, vd_base, offs_m,
                                               N_K, causal_off, base, sl2, s_ks, s_kdn, s_vs, s_vd, s_vdt,
                                               D, N1, N2, N3, False, CAUSAL, FOLD, K_ROWS, K_TILE, V_TILE, V_ROWS,
                                               TWO_LEVEL, P_OFFSET, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST)
        else:
            for t in tl.range(0, n_clean, warp_specialize=WS):
                acc, l_i, m_i, vd_prev = _tile(acc, l_i, m_i, vd_prev, q, qd, t, Kb, Vb, kd_base, vd_base, offs_m,
                                               N_K, causal_off, base, sl2, s_ks, s_kdn, s_vs, s_vd, s_vdt,
                                               D, N1, N2, N3, False, CAUSAL, FOLD, K_ROWS, K_TILE, V_TILE, V_ROWS,
                                               TWO_LEVEL, P_OFFSET, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST)
            for t in range(n_clean, n_tiles):
                acc, l_i, m_i, vd_prev = _tile(acc, l_i, m_i, vd_prev, q, qd, t, Kb, Vb, kd_base, vd_base, offs_m,
                                               N_K, causal_off, base, sl2, s_ks, s_kdn, s_vs, s_vd, s_vdt,
                                               D, N1, N2, N3, True, CAUSAL, FOLD, K_ROWS, K_TILE, V_TILE, V_ROWS,
                                               TWO_LEVEL, P_OFFSET, P_DT, P_MBITS, P_EMIN, P_MAX, SOFT_CAST)
        ok = (l_i > 0) & (l_i < float("inf"))
        inv = tl.where(ok, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), tl.where(ok, l_i, 1.0)), 0.0)
        if V_TILE:
            if TWO_LEVEL:
                o = acc * inv[:, None]
            else:
                o = acc * (inv * vd_prev)[:, None]
        else:
            o = acc * (inv * vd_prev)[:, None]
        op = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None].to(tl.int64) * s_os + offs_d[None, :]
        if SOFT_CAST:
            if OUT_DT == tl.bfloat16:
                o = round_fp8(o, 7, -126, 3.3895313892515355e38, 100)
            elif OUT_DT == tl.float16:
                o = round_fp8(o, 10, -14, 65504.0, 16)
        tl.store(op, o.to(OUT_DT), mask=row_ok[:, None])


@dataclasses.dataclass(frozen=True)
class Plan:
    """Launch configuration: tiles, warps and stages. ``block_n`` is the KV tile in keys.
    ``maxnreg`` caps the registers a thread (0: the compiler's choice): the default 64 x 128 tile
    takes 238-243, two programs an SM; 168 fits three at the price of a few spilled bytes. Of the
    fields only ``block_n`` changes results (the online softmax's tile); the others change the
    speed alone (byte for byte on the H200, ``tools/device/triton_attn_h200.py``)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    maxnreg: int = 0


def plan_tiles(head_dim: int, block_n: int, block_m: int = 0) -> Plan:
    if kv_chunks(block_n) is None:
        raise UsageError(f"KV tile {block_n}: the Triton kernel needs a multiple of 32 (<= 512) made of at most "
                         "three powers of two (e.g. 128, 160 = 128 + 32, 224 = 128 + 64 + 32)")
    # Fastest of five launch configurations measured on the H200 (reports/h200/triton: 64 x 128,
    # 4 warps, 3 stages: 3.01 ms against 3.66 ms for 128 x 128, 8 warps, 2 stages, per-head FP8,
    # batch 4, seqlen 8192, 16 heads, d 128).
    bm = block_m or 64
    return Plan(block_m=bm, block_n=block_n, num_warps=4 if bm <= 64 else 8, num_stages=3)


_OUT_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_FMT = {torch.float8_e4m3fn: ("e4m3", 3, -6, 448.0), torch.float8_e5m2: ("e5m2", 2, -14, 57344.0)}


def _desc3(d: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    if d.dim() != 3:
        raise UsageError(f"descales are 3-d (batch, heads, blocks); got shape {tuple(d.shape)}")
    return d, (d.stride(0) if d.shape[0] > 1 else 0, d.stride(1) if d.shape[1] > 1 else 0,
               d.stride(2) if d.shape[2] > 1 else 0)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, qd: torch.Tensor, kd: torch.Tensor,
                  vd: torch.Tensor, *, q_rows: int, k_rows: int, v_rows: int, causal: bool = False,
                  softmax_scale: float | None = None, p_fmt: str = "e4m3", p_offset: float = 8.0,
                  pv: str = "chained", reverse: bool = True, out_dtype=torch.bfloat16, plan: Plan | None = None,
                  out: torch.Tensor | None = None, soft_cast: bool | None = None) -> torch.Tensor:
    """FP8 attention forward. q (b, h, n, d), k (b, hkv, nk, d), vt (b, hkv, d, nk), FP8.

    Descales are float32 3-d tensors (batch or 1, heads or kv-heads or 1, blocks or 1);
    ``*_rows`` is the number of tokens one descale covers along the sequence (>= n for one
    per head). Q and K uniform per (batch, head) fold into the softmax scale. A V descale must
    be uniform per head or constant on each KV tile (``v_rows`` a multiple of the tile).
    Returns (b, h, n, d) in ``out_dtype``.
    """
    if pv not in PV_MODES:
        raise UsageError(f"pv={pv!r}: one of {', '.join(PV_MODES)}")
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if d & (d - 1) or d not in (32, 64, 128, 256):
        raise UsageError(f"head_dim {d}: the Triton kernel takes 32, 64, 128 or 256 (powers of two)")
    if h % hkv:
        raise UsageError(f"{h} query heads are not a multiple of {hkv} KV heads")
    for t in (q, k, vt):
        if t.dtype not in _FMT:
            raise UsageError(f"Q, K, V must be float8 (e4m3fn or e5m2), got {t.dtype}")
    if k.dtype != q.dtype:
        raise UsageError("Q and K must share one FP8 format")
    if _FMT[vt.dtype][0] != p_fmt:
        raise UsageError(f"P ({p_fmt}) and V ({_FMT[vt.dtype][0]}) must share one FP8 format in the P.V dot")
    if q.stride(3) != 1 or k.stride(3) != 1:
        raise UsageError("Q and K need a contiguous head dim")
    plan = plan or plan_tiles(d, 128)
    n1, n2, n3 = kv_chunks(plan.block_n)
    bn = plan.block_n
    fold = qd.shape[2] == 1 and kd.shape[2] == 1 and q_rows >= n and k_rows >= nk
    v_tile = not (vd.shape[2] == 1 and v_rows >= nk)
    if v_tile and v_rows % bn:
        raise UsageError(f"V descales cover {v_rows} tokens, not a multiple of the KV tile {bn}: they cannot be "
                         "applied per tile")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    # float32(scale) * log2(e) rounded to float32, as the emulator and the FA3 host code do.
    base = torch.tensor([float(torch.tensor(scale, dtype=torch.float32)) * math.log2(math.e)], dtype=torch.float32,
                        device=q.device)
    if out is None:
        out = torch.empty((b, h, n, d), dtype=out_dtype, device=q.device)
    qd, sq = _desc3(qd)
    kd, sk = _desc3(kd)
    vd, sv = _desc3(vd)
    pname, pm, pe, pmax = {"e4m3": ("e4m3", 3, -6, 448.0), "e5m2": ("e5m2", 2, -14, 57344.0)}[p_fmt]
    soft = interpreting() if soft_cast is None else soft_cast
    grid = (triton.cdiv(n, plan.block_m), b * h)
    odt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[out.dtype]
    extra = {} if interpreting() else dict(num_warps=plan.num_warps, num_stages=plan.num_stages,
                                           enable_fp_fusion=False)
    if plan.maxnreg and not interpreting():
        extra["maxnreg"] = plan.maxnreg
    _fwd_kernel[grid](
        q, k, vt, out, qd, kd, vd, base,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        vt.stride(0), vt.stride(1), vt.stride(2), vt.stride(3), out.stride(0), out.stride(1), out.stride(2),
        *sq, *sk, *sv, h, h // hkv, n, nk,
        D=d, BLOCK_M=plan.block_m, N1=n1, N2=n2, N3=n3, CAUSAL=bool(causal), FOLD=fold,
        Q_ROWS=max(1, min(q_rows, n)), K_ROWS=max(1, min(k_rows, nk)), K_TILE=(not fold and k_rows % bn == 0),
        V_TILE=v_tile, V_ROWS=max(1, v_rows),
        TWO_LEVEL=(pv == "two-level"), REVERSE=bool(reverse), P_OFFSET=float(p_offset), P_DT=tl_fp8(pname),
        P_MBITS=pm, P_EMIN=pe, P_MAX=pmax, OUT_DT=odt, SOFT_CAST=soft, **extra)
    return out
