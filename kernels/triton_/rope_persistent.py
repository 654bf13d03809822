"""The fused RoPE pre-pass's fast path (``rope_quantize(..., exact=False)``): a persistent kernel on
pair halves, with the rotation split along RoPE's pairs and the hardware FP8 cast.

Exposed: ``rp_persistent`` (where triton imports), ``half_matrices``.

Why a second kernel beside ``rope_quant._rope_quant_kernel``: that one measured 12-13% of a copy's
bandwidth on the H200 (reports/h200/rope). It gathers each channel's RoPE partner and the tables
with a second, permuted load, rotates with three d x d tensor-core products, and casts by hand.
Here:

- **Pair halves.** RoPE pairs channel i with its partner: i + d/2 in the half-split layout, i + 1
  (i even) in the interleaved one. The kernel loads the two halves of every pair as two
  [TILE, d/2] tensors, ``x1`` (first channels) and ``x2`` (partners): two contiguous loads
  (half-split), or one load split in registers (interleaved). Every load is a contiguous row
  segment; there are no gathers. The same goes for the tables and K smoothing's mean.
- **The rotation split along the pairs.** In Sylvester order H_d = H_2 kron H_{d/2} = H_{d/2} kron
  H_2. For u = RoPE(x) with halves u1, u2 and the signs s1, s2 of their channels:
  ``u diag(s) H_d`` is ``p1 + p2`` on the first channels and ``p1 - p2`` on the partners, with
  ``p_k = u_k (diag(s_k) H_{d/2})``. This holds for both layouts, each with its own channel
  order. The cost is two products with K = N = d/2, half the multiply-adds of one d x d product.
  u is float32, not BF16, so each u_k is split exactly into three BF16 parts
  (8 + 8 + 8 significant bits). Every product is then exact and only the float32 sums round.
  The ±1 matrices (2 x (d/2)^2 BF16, 16 KB at d 128) are loaded once per program.
- **Persistent, tables once per row block.** A fixed grid of programs walks the row blocks (a
  tile of rows of one batch) and, inside each, the heads, software-pipelined. The float32
  cos/sin rows of a block are loaded once for all its heads; they hold twice the bytes of the
  BF16 rows they rotate. In FA3's (b, s, h, d) layout, consecutive heads are adjacent rows of
  memory.
  - Per head and per tensor, pass 1 reduces each tile's amax into its (batch, head group)'s
    atomic. Pass 2 walks the row blocks in reverse, so that its first reads hit what pass 1 left
    in L2. No kernel can avoid this second read: each value's scale depends on its whole head.
  - Token and block (R <= TILE rows) scales take one pass.
- **The cast.** The hardware's saturating cast (``cvt.rn.satfinite``) after the corrected
  division of ``quant_device.scale_cast``. In Triton's interpreter, the soft cast and hand
  encoding of ``quant_device.encode_fp8`` are used instead.

Measured on the H200 (reports/h200/rope, 2026-12-03): Q, K and V with per-head scales in 0.31-1.13 ms
over four shapes, 1.7-1.8x faster than the tiled kernel. The bound is the exact rotation: Q alone takes
0.131 ms, 0.062 without the rotation, and each of the three BF16 products about 0.025 ms. Cutting
the parts by truncation (``split="bf16x3t"``, no conversion instructions) saved 3%.

Rounding (what the bytes depend on): RoPE as in ``rope_quant`` (float32 products rounded before
the sum: the kernel is compiled without FMA contraction), the rotation's float32 sums in the
tensor core's order and then ``p1 +- p2``, times 1/sqrt(d), minus the mean, divided by the
descale. The float64 emulator's butterflies sum in another order, so rare near-ties round the other
way by one FP8 step (tests/kernels/test_kernels_rope.py measures how often).
"""

from __future__ import annotations

import torch

from ._common import round_fp8, tl, triton

if triton is not None:
    from .quant_device import encode_fp8, scale_cast, scale_div, tile_descale

    @triton.jit
    def _pair_halves(R, m, sd, TILE: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
        """[TILE, HALF] float32 first channels and partners of the rows at ``R`` ([TILE, 1] addresses;
        column stride ``sd``). Rows outside ``m`` read 0."""
        if INTERLEAVED:
            x = tl.load(R + tl.arange(0, 2 * HALF)[None, :] * sd, mask=m[:, None], other=0.0)
            a, b = tl.split(tl.reshape(x, (TILE, HALF, 2)))
        else:
            hc = tl.arange(0, HALF)
            a = tl.load(R + hc[None, :] * sd, mask=m[:, None], other=0.0)
            b = tl.load(R + (hc + HALF)[None, :] * sd, mask=m[:, None], other=0.0)
        return a.to(tl.float32), b.to(tl.float32)

    @triton.jit
    def _table_halves(T, m, std, TILE: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                      FULL: tl.constexpr):
        """A cos or sin table's values for the first channels and for the partners: one [TILE, HALF]
        tensor twice for tables of d/2 columns (a pair shares its angle), or both halves of a
        d-column table."""
        if FULL:
            return _pair_halves(T, m, std, TILE, HALF, INTERLEAVED)
        t = tl.load(T + tl.arange(0, HALF)[None, :] * std, mask=m[:, None], other=0.0).to(tl.float32)
        return t, t

    @triton.jit
    def _split3(u):
        """float32 u = hi + mid + lo exactly, as three BF16 tensors (8 + 8 + 8 significant bits)."""
        hi = u.to(tl.bfloat16)
        r = u - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        return hi, mid, lo

    @triton.jit
    def _split3_truncated(u):
        """float32 u = hi + mid + lo exactly, each part cut from the bits with integer operations, no
        conversion instructions. hi: u's top 16 bits (a BF16 value, truncated); r = u - hi is exact
        (same sign and exponent, at most 16 significant bits); mid: r's top 16 bits; lo = r - mid has
        at most 8 significant bits, so its top 16 bits are all of it. Each part's BF16 tensor is
        those 16 bits, reinterpreted. Exact for normal floats (checked on 2 million values from
        1e-13 to 1e13 times N(0, 1)); a subnormal u (|u| < 2^-126) has fewer significant bits
        above its 16th and loses its lowest ones in lo."""
        ub = u.to(tl.int32, bitcast=True)
        hi = (ub >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        r = u - (ub & -65536).to(tl.float32, bitcast=True)
        rb = r.to(tl.int32, bitcast=True)
        mid = (rb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        lo = r - (rb & -65536).to(tl.float32, bitcast=True)
        lo = (lo.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return hi, mid, lo

    @triton.jit
    def _product(u, hm, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):
        """u [TILE, HALF] float32 times a ±1 matrix ``hm``, float32 sums.

        SPLIT 3: three BF16 products of u's exact parts (rounded to nearest), smallest first: every
        product exact. 5: the same with the parts cut by truncation (``_split3_truncated``): exact
        too, without the conversion instructions. 2 and 1: two or one BF16 parts (u's low 8 or 16 significant bits dropped; kept to
        measure what the third product costs). 4: two TF32 products of u's parts split by masking
        (hi: the top 11 significant bits, lo: the rest, of which the tensor core reads 11 of 13),
        no conversion instructions; ``hm`` float32 there. DOT_F32 (Triton's interpreter, whose
        BF16 dot is wrong): the same parts multiplied in float32."""
        if SPLIT == 4:
            hi = (u.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            if DOT_F32:
                p = tl.dot(u - hi, hm, out_dtype=tl.float32)
                p = tl.dot(hi, hm, p, out_dtype=tl.float32)
            else:
                p = tl.dot(u - hi, hm, input_precision="tf32", out_dtype=tl.float32)
                p = tl.dot(hi, hm, p, input_precision="tf32", out_dtype=tl.float32)
        else:
            if SPLIT == 3:
                hi, mid, lo = _split3(u)
                parts = (lo, mid, hi)
            elif SPLIT == 5:
                hi, mid, lo = _split3_truncated(u)
                parts = (lo, mid, hi)
            elif SPLIT == 2:
                hi = u.to(tl.bfloat16)
                parts = ((u - hi.to(tl.float32)).to(tl.bfloat16), hi)
            else:
                parts = (u.to(tl.bfloat16),)
            if DOT_F32:
                h32 = hm.to(tl.float32)
                p = tl.dot(parts[0].to(tl.float32), h32, out_dtype=tl.float32)
                for i in tl.static_range(1, len(parts)):
                    p = tl.dot(parts[i].to(tl.float32), h32, p, out_dtype=tl.float32)
            else:
                p = tl.dot(parts[0], hm, out_dtype=tl.float32)
                for i in tl.static_range(1, len(parts)):
                    p = tl.dot(parts[i], hm, p, out_dtype=tl.float32)
        return p

    @triton.jit
    def _angles(COS, SIN, POS, b, rows, m, stb, stn, std, spb, spn, TILE: tl.constexpr, HALF: tl.constexpr,
                INTERLEAVED: tl.constexpr, FULL: tl.constexpr, HAS_POS: tl.constexpr):
        """cos and sin of the rows' positions for the first channels and the partners: (c1, c2, s1, s2)."""
        if HAS_POS:
            pos = tl.load(POS + b * spb + rows * spn, mask=m, other=0).to(tl.int64)
        else:
            pos = rows.to(tl.int64)
        toff = b.to(tl.int64) * stb + pos[:, None] * stn
        c1, c2 = _table_halves(COS + toff, m, std, TILE, HALF, INTERLEAVED, FULL)
        s1, s2 = _table_halves(SIN + toff, m, std, TILE, HALF, INTERLEAVED, FULL)
        return c1, c2, s1, s2

    @triton.jit
    def _tile(X, MU, c1, c2, s1, s2, hm1, hm2, inv_sqrt_d, b, h, rows, m, sxb, sxh, sxs, sxd, smb, smh,
              TILE: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROPE: tl.constexpr,
              ROT: tl.constexpr, SMOOTH: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):
        """The rows of one (batch, head): RoPE, rotation, smoothing -> (y1, y2), the values of the
        first channels and of the partners, float32 [TILE, HALF]. Rows outside ``m`` are 0."""
        xr = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + rows[:, None].to(tl.int64) * sxs
        x1, x2 = _pair_halves(xr, m, sxd, TILE, HALF, INTERLEAVED)
        if ROPE:
            # fl(fl(x c) -+ fl(x' s)): products rounded before the sum (no FMA contraction).
            u1 = x1 * c1 - x2 * s1
            u2 = x2 * c2 + x1 * s2
        else:
            u1 = x1
            u2 = x2
        if ROT:
            p1 = _product(u1, hm1, DOT_F32, SPLIT)
            p2 = _product(u2, hm2, DOT_F32, SPLIT)
            y1 = (p1 + p2) * inv_sqrt_d
            y2 = (p1 - p2) * inv_sqrt_d
        else:
            y1 = u1
            y2 = u2
        if SMOOTH:
            mr = MU + b * smb + h * smh + tl.zeros((TILE, 1), tl.int32)
            mu1, mu2 = _pair_halves(mr, m, 1, TILE, HALF, INTERLEAVED)
            y1 = y1 - mu1
            y2 = y2 - mu2
        # Rows past the block or the sequence would be -mean after smoothing: out of every amax.
        return tl.where(m[:, None], y1, 0.0), tl.where(m[:, None], y2, 0.0)

    @triton.jit
    def _row_absmax(y1, y2):
        """max |y| of each row over both halves."""
        return tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1))

    @triton.jit
    def _cast(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
              SOFT_CAST: tl.constexpr, DIV: tl.constexpr, BIAS: tl.constexpr, SUBQ: tl.constexpr, NAN: tl.constexpr):
        if SOFT_CAST:
            q = encode_fp8(round_fp8(scale_div(y, d32, DIV), MBITS, EMIN, FMT_MAX), MBITS, EMIN, BIAS, SUBQ, NAN)
        else:
            q = scale_cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, False, DIV)
        return q

    @triton.jit
    def _store(Y, q1, q2, b, h, rows, m, syb, syh, sys_, syd, TILE: tl.constexpr, HALF: tl.constexpr,
               INTERLEAVED: tl.constexpr):
        yr = Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh + rows[:, None].to(tl.int64) * sys_
        if INTERLEAVED:
            q = tl.reshape(tl.join(q1, q2), (TILE, 2 * HALF))
            tl.store(yr + tl.arange(0, 2 * HALF)[None, :] * syd, q, mask=m[:, None])
        else:
            hc = tl.arange(0, HALF)
            tl.store(yr + hc[None, :] * syd, q1, mask=m[:, None])
            tl.store(yr + (hc + HALF)[None, :] * syd, q2, mask=m[:, None])

    @triton.jit
    def rp_persistent(X, Y, COS, SIN, POS, HM, SQRT_D, MU, AMAX, DESC,
                      sxb, sxh, sxs, sxd, syb, syh, sys_, syd, stb, stn, std, spb, spn, smb, smh, sdb, sdh, sdn,
                      H, N, GROUP, R, NBLK, TOTAL,
                      HALF: tl.constexpr, TILE: tl.constexpr, INTERLEAVED: tl.constexpr, ROPE: tl.constexpr,
                      FULL: tl.constexpr, HAS_POS: tl.constexpr, ROT: tl.constexpr, SMOOTH: tl.constexpr,
                      GRAN: tl.constexpr, PASS: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                      EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                      DIV: tl.constexpr, STAGES: tl.constexpr, BIAS: tl.constexpr, SUBQ: tl.constexpr,
                      NAN: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr = 3,
                      TABLE_PER_HEAD: tl.constexpr = False):
        """Persistent: a fixed grid of programs walks the row blocks (R <= TILE rows of one batch: a
        scale block, or a tile for token/head/tensor scales; TOTAL = batch x NBLK of them), and in
        each the H heads, software-pipelined (STAGES). The cos/sin rows of a row block are loaded
        once for all its heads: float32 tables of d/2 columns are twice the bytes of the BF16 rows
        they rotate, so loading them per head would move three times the input's bytes through L2.

        GRAN 0 tensor, 1 head (one descale per (batch, head group of GROUP)), 2 block, 3 token.
        PASS 0 (block/token) casts at once. PASS 1 (head/tensor) reduces each (batch, head)'s
        amax into its group's atomic (the bits of non-negative floats order as the floats); PASS 2
        casts with that amax's descale, walking the row blocks in the reverse order of PASS 1, so
        that its first reads are the rows PASS 1 left in L2."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        sub = tl.arange(0, TILE)
        hc = tl.arange(0, HALF)
        if ROT:
            if SPLIT == 4:
                hm1 = tl.load(HM + hc[:, None] * HALF + hc[None, :]).to(tl.float32)
                hm2 = tl.load(HM + HALF * HALF + hc[:, None] * HALF + hc[None, :]).to(tl.float32)
            else:
                hm1 = tl.load(HM + hc[:, None] * HALF + hc[None, :])
                hm2 = tl.load(HM + HALF * HALF + hc[:, None] * HALF + hc[None, :])
            inv_sqrt_d = tl.load(SQRT_D + 1)
        else:
            hm1 = 0
            hm2 = 0
            inv_sqrt_d = 1.0
        for k in range(pid, TOTAL, nprog):
            # + pid * 0: a tensor in Triton's interpreter too, whose range() yields Python ints
            if PASS == 2:
                rb = TOTAL - 1 - k + pid * 0
            else:
                rb = k + pid * 0
            b = rb // NBLK
            blk = rb - b * NBLK
            rows = blk * R + sub
            m = (sub < R) & (rows < N)
            if ROPE and not TABLE_PER_HEAD:
                c1, c2, s1, s2 = _angles(COS, SIN, POS, b, rows, m, stb, stn, std, spb, spn, TILE, HALF, INTERLEAVED,
                                         FULL, HAS_POS)
            else:
                c1 = 0
                c2 = 0
                s1 = 0
                s2 = 0
            for hh in tl.range(0, H, num_stages=STAGES):
                h = hh + pid * 0
                if ROPE and TABLE_PER_HEAD:
                    # Fewer registers held across the loop, the rows read again per head (L1/L2 hits).
                    a1, a2, b1, b2 = _angles(COS, SIN, POS, b, rows, m, stb, stn, std, spb, spn, TILE, HALF,
                                             INTERLEAVED, FULL, HAS_POS)
                else:
                    a1 = c1
                    a2 = c2
                    b1 = s1
                    b2 = s2
                y1, y2 = _tile(X, MU, a1, a2, b1, b2, hm1, hm2, inv_sqrt_d, b, h, rows, m, sxb, sxh, sxs, sxd, smb,
                               smh, TILE, HALF, INTERLEAVED, ROPE, ROT, SMOOTH, DOT_F32, SPLIT)
                if PASS == 1:
                    am = tl.max(_row_absmax(y1, y2), axis=0)
                    if GRAN == 1:
                        tl.atomic_max(AMAX + b * (H // GROUP) + h // GROUP, am.to(tl.int32, bitcast=True))
                    else:
                        tl.atomic_max(AMAX, am.to(tl.int32, bitcast=True))
                else:
                    if GRAN == 3:
                        dt = tile_descale(_row_absmax(y1, y2), FMT_MAX, POW2, False)
                        tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
                        d32 = dt[:, None]
                    elif GRAN == 2:
                        d32 = tile_descale(tl.max(_row_absmax(y1, y2), axis=0), FMT_MAX, POW2, False)
                        tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                    elif GRAN == 1:
                        hg = h // GROUP
                        d32 = tile_descale(tl.load(AMAX + b * (H // GROUP) + hg).to(tl.float32, bitcast=True),
                                           FMT_MAX, POW2, False)
                        tl.store(DESC + b * sdb + hg * sdh, d32, mask=(blk == 0) & (h % GROUP == 0))
                    else:
                        d32 = tile_descale(tl.load(AMAX).to(tl.float32, bitcast=True), FMT_MAX, POW2, False)
                        tl.store(DESC, d32, mask=rb == 0)
                    q1 = _cast(y1, d32, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV, BIAS, SUBQ, NAN)
                    q2 = _cast(y2, d32, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV, BIAS, SUBQ, NAN)
                    _store(Y, q1, q2, b, h, rows, m, syb, syh, sys_, syd, TILE, HALF, INTERLEAVED)


_HALVES: dict = {}


def half_matrices(d: int, seed: int, interleaved: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([2, d/2, d/2] BF16, [sqrt(d), 1/sqrt(d)] float32) on ``device``, cached: diag(s1) H_{d/2} and
    diag(s2) H_{d/2}, with s1 the random signs of the pairs' first channels and s2 those of their
    partners (see the module doc)."""
    key = (d, seed, interleaved, str(device))
    if key not in _HALVES:
        from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

        s = random_signs(d, seed)
        s1, s2 = (s[0::2], s[1::2]) if interleaved else (s[:d // 2], s[d // 2:])
        hh = hadamard_matrix(d // 2)
        hm = torch.stack([s1[:, None] * hh, s2[:, None] * hh]).to(torch.bfloat16).contiguous()
        sqrt_d = torch.tensor([d ** 0.5, 1.0 / d ** 0.5], dtype=torch.float32)
        _HALVES[key] = (hm.to(device), sqrt_d.to(device))
    return _HALVES[key]
