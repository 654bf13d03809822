"""Fused random-Hadamard rotation + scaled FP8 quantization in one Triton kernel.

Exposed: ``QuantOut``, ``rotate_quantize``, ``quantize_qkv``, ``GRAN_CODES``, ``min_bytes``.

Reads Q, K or V once in their own dtype and layout (BF16 (batch, seqlen, heads, dim) as a
model produces them, or the toolkit's float64 (batch, heads, seqlen, dim)), applies
``diag(signs) H_d / sqrt(d)`` along head_dim in registers, reduces the amax at the recipe's
granularity, and writes the saturated FP8 values in the layout the attention kernel reads,
plus float32 descales.

Granularity and passes over the input:

- ``block`` (rows per block, e.g. the kernel's tile) and ``token``: one pass. In the fast
  path's persistent kernel a block of up to 64 rows (at head_dim 128) is one tile; a longer
  block (the FA3 FP8 tiles: 128 rows of Q, 224 of K/V) is walked as 64-row sub-tiles, one per
  pipelined loop step. Two sub-tiles (128 rows) stay in registers, rotated, until the second
  gives the block's amax, and are then cast and stored; longer blocks load theirs a second time
  (L2 hits) after the amax steps; blocks written transposed (V) load them a second time one
  block later, in the same loop steps as the next block's first loads. In the tiled kernel
  (float64 path) the block's amax is likewise taken over sub-tiles and the sub-tiles are rotated
  again to quantize. Either way HBM sees each element once.
- ``head`` (one descale per (batch, kv-head), shared by the heads of a GQA group as the FA3
  kernel's q_descale is) and ``tensor``: a first pass reduces the amax with atomics, a second
  quantizes. No kernel can avoid this second read: every element's scale depends on every
  other element of the head.

Kernels: ``_rq_persistent`` (float32 path, default): a fixed grid of programs (as many per SM
as the compiled kernel's registers and shared memory allow, at most 3, or 4 under a register
cap) walks the tiles with
software-pipelined loads (``cp.async`` into shared memory, ``num_stages``), the +-1 matrix
loaded once per program. Measured on the H200 against a device-to-device copy:
reports/h200/triton/report.md. ``_rq_kernel`` (float64 path; ``persistent=False``): one program
per tile, the first version.

Arithmetic, two modes:

- ``exact=True``: float64 throughout with the emulator's order of operations (the same
  butterflies, the division by sqrt(d), amax / fmt.max in float64 rounded to float32, x /
  descale in float64, round-to-odd to float32, one RNE cast). The bytes equal ``prepare()``'s.
- ``exact=False`` (the fast path): float32, the rotation as a butterfly or as one tensor-core
  dot with the +-1 matrix diag(signs) H (products exact for BF16/FP16 inputs, float32 sums).
  Rounding differs from the float64 emulator in rare near-ties; ``tests`` and the device run
  measure how often. Both kernels compute the same bytes (the persistent one divides through
  the reciprocal and a Markstein correction, which is the IEEE division's result).

Rotation implementations: ``butterfly`` (fast Walsh-Hadamard transform, log2(d) stages of
reshape/split/join in registers) and ``dot`` (x @ (diag(s) H) on the tensor cores).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken

from ._common import f64_to_f32_odd, fp8_params, interpreting, pow2_ceil32, pow2_ceil64, round_fp8, tl, tl_fp8, triton

GRAN_CODES = {PerTensor: 0, PerHead: 1, PerBlock: 2, PerToken: 3}
_LAYOUTS = ("bshd", "bhsd", "bhds")


if triton is not None:

    @triton.jit
    def _stage(y, TILE: tl.constexpr, D: tl.constexpr, HH: tl.constexpr):
        """One butterfly stage: pairs (i, i + HH) inside blocks of 2 HH become (a + b, a - b), the
        emulator's fwht order, so float64 results are bit-identical to it."""
        z = tl.permute(tl.reshape(y, (TILE, D // (2 * HH), 2, HH)), (0, 1, 3, 2))
        a, b = tl.split(z)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (TILE, D))

    @triton.jit
    def _rotate(x, SIGNS, hm, scal_ptr, TILE: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr,
                ROT: tl.constexpr, EXACT: tl.constexpr, RAW: tl.constexpr = False):
        """x [TILE, D] (input dtype) -> rotated [TILE, D] in float64 (EXACT) or float32. ``hm``: the
        +-1 matrix diag(signs) H, loaded once per program (ROT 2). RAW (float32 only): without the
        final multiply by 1/sqrt(d), which the caller applies."""
        cols = tl.arange(0, D)
        if ROT == 2:
            # +-1 entries and BF16/FP16 inputs: every product is exact, the tensor core sums in float32.
            y = tl.dot(x.to(hm.dtype), hm, out_dtype=tl.float32)
            if not RAW:
                y = y * tl.load(scal_ptr + 1)

        else:
            if EXACT:
                y = x.to(tl.float64)
            else:
                y = x.to(tl.float32)
            if ROT == 1:
                y = y * tl.load(SIGNS + cols)[None, :].to(y.dtype)
                # Stages h = 1, 2, 4, ... written out: a loop variable is not a constexpr in
                # Triton's interpreter, and the reshapes need constant shapes.
                y = _stage(y, TILE, D, 1)
                y = _stage(y, TILE, D, 2)
                y = _stage(y, TILE, D, 4)
                y = _stage(y, TILE, D, 8)
                if LOG2D > 4:
                    y = _stage(y, TILE, D, 16)
                if LOG2D > 5:
                    y = _stage(y, TILE, D, 32)
                if LOG2D > 6:
                    y = _stage(y, TILE, D, 64)
                if LOG2D > 7:
                    y = _stage(y, TILE, D, 128)
                if EXACT:
                    y = y / tl.load(scal_ptr)  # x / sqrt(d), as rotation.fwht divides
                elif not RAW:
                    y = y * tl.load(scal_ptr + 1)
        return y

    @triton.jit
    def _descale(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr):
        """amax -> float32 descale, as quant.amax_to_scale: amax / max in the working precision,
        1 where it is 0 or not finite, optionally rounded up to a power of two."""
        if EXACT:
            s = amax / FMT_MAX
        else:
            s = tl.math.div_rn(amax, tl.full(amax.shape, FMT_MAX, tl.float32))
        ok = (s > 0) & (s < float("inf"))
        s = tl.where(ok, s, 1.0)
        if POW2:
            if EXACT:
                s = pow2_ceil64(s)
            else:
                s = pow2_ceil32(s)
        return s.to(tl.float32)

    @triton.jit
    def _cast(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
              EXACT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        """y / descale, saturating RNE cast to FP8. ``d32`` broadcasts against y. RECIP multiplies
        by the float32 reciprocal instead of dividing (one FMUL instead of an IEEE division; one
        more rounding)."""
        if EXACT:
            v = f64_to_f32_odd(y / d32.to(tl.float64))
        elif RECIP:
            v = y * tl.math.div_rn(d32 * 0.0 + 1.0, d32)
        else:
            v = tl.math.div_rn(y, d32 + tl.zeros(y.shape, tl.float32))
        if SOFT_CAST:
            v = round_fp8(v, MBITS, EMIN, FMT_MAX)
        else:
            v = tl.minimum(tl.maximum(v, -FMT_MAX), FMT_MAX)
        return v.to(OUT)

    @triton.jit
    def _scale_cast(y, d32, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                    SOFT_CAST: tl.constexpr, DIV: tl.constexpr):
        """Fast path's y / descale and saturating cast; ``d32`` (float32) broadcasts against y.

        DIV 0: IEEE division (div_rn). 1: y * (1/descale), one more rounding. 2: y / descale
        correctly rounded from the reciprocal with one Markstein correction (q0 = y r,
        e = fma(q0, -d, y) exact, q = fma(e, r, q0)): the bytes of DIV 0 for three FP32
        instructions per element instead of an IEEE division. Needs a fused multiply-add,
        which Triton's CPU interpreter does not have (it rounds the product), so the
        interpreter takes DIV 0. No clamp before the cast: cvt.rn.satfinite (and round_fp8)
        saturate by themselves, and NaN stays NaN as in the emulator's cast."""
        if DIV == 0:
            v = tl.math.div_rn(y, tl.broadcast_to(d32, y.shape))
        else:
            r = tl.math.div_rn(d32 * 0.0 + 1.0, d32)
            v = y * r
            if DIV == 2:
                # -d per row, not -q0 per element: Triton's negation is 0 - x, one more instruction
                v = tl.fma(tl.broadcast_to(r, y.shape), tl.fma(v, tl.broadcast_to(0.0 - d32, y.shape), y), v)
        if SOFT_CAST:
            v = round_fp8(v, MBITS, EMIN, FMT_MAX)
        return v.to(OUT)

    @triton.jit
    def _item(t, H, NBLK, HEAD_FAST: tl.constexpr):
        """Work item t -> (batch, head, block), heads first or sequence first."""
        if HEAD_FAST:
            bk = t // H
            h = t - bk * H
            b = bk // NBLK
            blk = bk - b * NBLK
        else:
            bh = t // NBLK
            blk = t - bh * NBLK
            b = bh // H
            h = bh - b * H
        return b, h, blk

    @triton.jit
    def _opaque(x):
        """x unchanged, through an identity the compiler cannot see through: a tensor that does not
        come from a load or a loop-carried value is the A operand of wgmma in registers (Triton keeps
        the others in shared memory)."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=True, pack=2)

    @triton.jit
    def _store_q(y, d32, yr, offy, r0, sub, end, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr,
                 OUT: tl.constexpr, SOFT_CAST: tl.constexpr, DIV: tl.constexpr):
        """Cast a sub-tile whose first row is r0 and store it at ``yr`` (that row's address) +
        ``offy``; rows r0 + sub < end only."""
        q = _scale_cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
        tl.store(yr + offy, q, mask=((r0 + sub) < end)[:, None])

    @triton.jit
    def _block_subtiles(X, Y, hm, SIGNS, SCAL, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                        H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D: tl.constexpr, LOG2D: tl.constexpr,
                        TILE: tl.constexpr, ROT: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                        EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                        DIV: tl.constexpr, STAGES: tl.constexpr, HEAD_FAST: tl.constexpr, SUB: tl.constexpr,
                        REREAD: tl.constexpr):
        """Per-block scales, a block as SUB sub-tiles of TILE rows (see _rq_persistent). One loop
        step per sub-tile (2 SUB with REREAD), all software-pipelined by the same loop, so the
        next sub-tiles' loads are in flight while one is rotated. The block's amax is the max of
        its sub-tiles' row maxima (max is exact: the same descale as one tile's reduction).

        Registers: a loop step's addresses are one 64-bit row address (scalar) plus offsets
        within the tile that do not change between steps, and the load's mask compares ``sub``
        with a scalar; the store recomputes its mask from scalars. So the pipeline carries a
        few scalars per stage in flight, not per-row offsets and masks (which, next to the
        rotated sub-tiles kept in registers, spilled)."""
        nb = tl.cdiv(TOTAL - pid, nprog)  # blocks of this program: pid, pid + nprog, ...
        STEPS: tl.constexpr = 2 * SUB if REREAD == 1 else SUB
        offx = sub[:, None] * sxs + cols[None, :] * sxd
        offy = sub[:, None] * sys_ + cols[None, :] * syd
        run = tl.zeros((TILE,), tl.float32)
        d32 = tl.zeros((), tl.float32) + 1.0
        s0 = tl.zeros((TILE, D), tl.float32)
        s1 = tl.zeros((TILE, D), tl.float32)
        s2 = tl.zeros((TILE, D), tl.float32)
        for i in tl.range(0, nb * STEPS, num_stages=STAGES):
            k = i // STEPS
            j = i - k * STEPS
            if REREAD == 1:
                js = tl.where(j >= SUB, j - SUB, j)
            else:
                js = j
            b, h, blk = _item(pid + k * nprog, H, NBLK, HEAD_FAST)
            b0 = blk * R  # the block's first row
            r0 = b0 + js * TILE  # this sub-tile's
            end = tl.minimum(b0 + R, N)
            xr = X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r0.to(tl.int64) * sxs)
            x = tl.load(xr + offx, mask=(sub < end - r0)[:, None], other=0.0)
            y = _rotate(x, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
            if REREAD == 2:
                # The pipelined loop reads each sub-tile from HBM once (amax); at the block's last
                # one, the earlier sub-tiles are loaded again (L2 hits) outside the pipeline,
                # rotated again and cast, then the last one, still in registers.
                run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
                if j == SUB - 1:
                    d32 = _descale(tl.max(run, axis=0), FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                    run = tl.zeros((TILE,), tl.float32)
                    xb = X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh)
                    yb = Y + (b.to(tl.int64) * syb + h.to(tl.int64) * syh)
                    for q in tl.static_range(SUB - 1):
                        rq = b0 + q * TILE
                        xq = tl.load(xb + rq.to(tl.int64) * sxs + offx, mask=((rq + sub) < end)[:, None], other=0.0)
                        yq = _rotate(xq, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
                        _store_q(yq, d32, yb + rq.to(tl.int64) * sys_, offy, rq, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                                 SOFT_CAST, DIV)
                    _store_q(y, d32, yb + r0.to(tl.int64) * sys_, offy, r0, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                             SOFT_CAST, DIV)
            elif REREAD == 1:
                if j < SUB:
                    run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
                    if j == SUB - 1:
                        d32 = _descale(tl.max(run, axis=0), FMT_MAX, POW2, False)
                        tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                        run = tl.zeros((TILE,), tl.float32)
                else:
                    yr = Y + (b.to(tl.int64) * syb + h.to(tl.int64) * syh + r0.to(tl.int64) * sys_)
                    _store_q(y, d32, yr, offy, r0, sub, end, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
            else:
                if j == SUB - 1:
                    # The block's amax over every kept sub-tile and this one. Reducing the kept ones
                    # here (not as they arrive) keeps them in the dot's register layout, which their
                    # cast then reads; otherwise the compiler carried a second, converted copy.
                    am = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
                    am = tl.maximum(am, tl.max(tl.max(tl.abs(s0), axis=1), axis=0))
                    if SUB > 2:
                        am = tl.maximum(am, tl.max(tl.max(tl.abs(s1), axis=1), axis=0))
                    if SUB > 3:
                        am = tl.maximum(am, tl.max(tl.max(tl.abs(s2), axis=1), axis=0))
                    d32 = _descale(am, FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                    yb = Y + (b.to(tl.int64) * syb + h.to(tl.int64) * syh)
                    # s0 holds sub-tile SUB - 2, s1 SUB - 3, s2 SUB - 4
                    ra = b0 + (SUB - 2) * TILE
                    _store_q(s0, d32, yb + ra.to(tl.int64) * sys_, offy, ra, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                             SOFT_CAST, DIV)
                    if SUB > 2:
                        rb = b0 + (SUB - 3) * TILE
                        _store_q(s1, d32, yb + rb.to(tl.int64) * sys_, offy, rb, sub, end, MBITS, EMIN, FMT_MAX,
                                 OUT, SOFT_CAST, DIV)
                    if SUB > 3:
                        _store_q(s2, d32, yb + b0.to(tl.int64) * sys_, offy, b0, sub, end, MBITS, EMIN, FMT_MAX,
                                 OUT, SOFT_CAST, DIV)
                    _store_q(y, d32, yb + r0.to(tl.int64) * sys_, offy, r0, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                             SOFT_CAST, DIV)
                else:
                    # shift, not select by j: a select made the compiler keep two copies
                    if SUB > 3:
                        s2 = s1
                    if SUB > 2:
                        s1 = s0
                    s0 = y

    @triton.jit
    def _block_kept_inputs(X, Y, hm, SIGNS, SCAL, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                           H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D: tl.constexpr, LOG2D: tl.constexpr,
                           TILE: tl.constexpr, ROT: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                           EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                           DIV: tl.constexpr, STAGES: tl.constexpr, HEAD_FAST: tl.constexpr, SUB: tl.constexpr):
        """Per-block scales, a block as SUB (2 to 4) sub-tiles of TILE rows, one per pipelined loop
        step, keeping the *inputs* (BF16: half the registers of the rotated float32 values) of the
        first SUB - 1 in registers. Each step rotates its sub-tile and takes its row maxima; the
        block's last step gives the descale, casts its own sub-tile, and rotates the kept inputs
        again (the same dot, the same bits) and casts them. HBM and L2 see each element once.

        Registers: the pipeline carries what the loads need (a row address and a row count per
        stage in flight); the store side recomputes the block's indices from the loop index in a
        form the compiler does not merge with the load side's (otherwise it carries every index
        once per stage)."""
        nb = tl.cdiv(TOTAL - pid, nprog)  # blocks of this program: pid, pid + nprog, ...
        offx = sub[:, None] * sxs + cols[None, :] * sxd
        offy = sub[:, None] * sys_ + cols[None, :] * syd
        run = tl.zeros((TILE,), tl.float32)
        x0 = tl.zeros((TILE, D), X.dtype.element_ty)
        x1 = tl.zeros((TILE, D), X.dtype.element_ty)
        x2 = tl.zeros((TILE, D), X.dtype.element_ty)
        for i in tl.range(0, nb * SUB, num_stages=STAGES):
            k = i // SUB
            j = i - k * SUB
            b, h, blk = _item(pid + k * nprog, H, NBLK, HEAD_FAST)
            r0 = blk * R + j * TILE  # this sub-tile's first row
            xr = X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r0.to(tl.int64) * sxs)
            x = tl.load(xr + offx, mask=(sub < tl.minimum(blk * R + R, N) - r0)[:, None], other=0.0)
            # Row maxima of the rotation before its multiply by 1/sqrt(d): rounding is monotonic, so
            # fl(max|a| s) = max fl(|a| s), the amax of the rotated values, one multiply per block.
            a = _rotate(x, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False, True)
            run = tl.maximum(run, tl.max(tl.abs(a), axis=1))
            # The same k and j, computed anew: (i + SUB) // SUB - 1 == i // SUB.
            k2 = (i + SUB) // SUB - 1
            j2 = i - k2 * SUB
            if j2 == SUB - 1:
                b2, h2, blk2 = _item(pid + k2 * nprog, H, NBLK, HEAD_FAST)
                b0 = blk2 * R
                end = tl.minimum(b0 + R, N)
                am = tl.max(run, axis=0)
                if ROT != 0:
                    sc = tl.load(SCAL + 1)
                    am = am * sc
                    y = a * sc
                else:
                    y = a
                d32 = _descale(am, FMT_MAX, POW2, False)
                tl.store(DESC + b2 * sdb + h2 * sdh + blk2 * sdn, d32)
                run = tl.zeros((TILE,), tl.float32)
                yb = Y + (b2.to(tl.int64) * syb + h2.to(tl.int64) * syh)
                rl = b0 + (SUB - 1) * TILE
                _store_q(y, d32, yb + rl.to(tl.int64) * sys_, offy, rl, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                         SOFT_CAST, DIV)
                # x0 holds sub-tile SUB - 2, x1 SUB - 3, x2 SUB - 4. _opaque: the dot's A operand in
                # registers (a loop-carried A goes through shared memory, which the compiler then
                # allocated at every step).
                ra = b0 + (SUB - 2) * TILE
                ya = _rotate(_opaque(x0) if ROT == 2 else x0, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
                _store_q(ya, d32, yb + ra.to(tl.int64) * sys_, offy, ra, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                         SOFT_CAST, DIV)
                if SUB > 2:
                    rb = b0 + (SUB - 3) * TILE
                    yb1 = _rotate(_opaque(x1) if ROT == 2 else x1, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
                    _store_q(yb1, d32, yb + rb.to(tl.int64) * sys_, offy, rb, sub, end, MBITS, EMIN, FMT_MAX,
                             OUT, SOFT_CAST, DIV)
                if SUB > 3:
                    yc = _rotate(_opaque(x2) if ROT == 2 else x2, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
                    _store_q(yc, d32, yb + b0.to(tl.int64) * sys_, offy, b0, sub, end, MBITS, EMIN, FMT_MAX,
                             OUT, SOFT_CAST, DIV)
            else:
                if SUB > 3:
                    x2 = x1
                if SUB > 2:
                    x1 = x0
                x0 = x

    @triton.jit
    def _block_skewed(X, Y, hm, SIGNS, SCAL, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                      H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D: tl.constexpr, LOG2D: tl.constexpr,
                      TILE: tl.constexpr, ROT: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                      EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                      DIV: tl.constexpr, STAGES: tl.constexpr, HEAD_FAST: tl.constexpr, SUB: tl.constexpr):
        """Per-block scales, read again one block behind: a block as SUB sub-tiles of TILE rows, and
        loop step (k, j) loads sub-tile j of the program's block k (from HBM: its amax) *and* of
        block k - 1 (again, from L2), rotates both, and casts and stores the second with block
        k - 1's descale. Both loads are pipelined. The second pass over the block thus shares the
        first pass's steps (SUB steps a block, not 2 SUB as in REREAD 1), no sub-tile is kept in
        registers, and every step does the same work. The loop runs one block longer than the
        program has, with the loads that fall outside masked off (no traffic).

        The store side recomputes the block indices from the loop index (see _block_kept_inputs)."""
        nb = tl.cdiv(TOTAL - pid, nprog)  # blocks of this program: pid, pid + nprog, ...
        offx = sub[:, None] * sxs + cols[None, :] * sxd
        offy = sub[:, None] * sys_ + cols[None, :] * syd
        run = tl.zeros((TILE,), tl.float32)
        d32 = tl.zeros((), tl.float32) + 1.0  # block k - 1's descale
        for i in tl.range(0, (nb + 1) * SUB, num_stages=STAGES):
            k = i // SUB
            j = i - k * SUB
            # block k, sub-tile j (none past the program's last block)
            b, h, blk = _item(pid + tl.minimum(k, nb - 1) * nprog, H, NBLK, HEAD_FAST)
            r0 = blk * R + j * TILE
            xa = tl.load(X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r0.to(tl.int64) * sxs) + offx,
                         mask=(sub < tl.where(k < nb, tl.minimum(blk * R + R, N) - r0, 0))[:, None], other=0.0)
            # block k - 1, sub-tile j (none before the first)
            bq, hq, blkq = _item(pid + tl.maximum(k - 1, 0) * nprog, H, NBLK, HEAD_FAST)
            rq = blkq * R + j * TILE
            xb = tl.load(X + (bq.to(tl.int64) * sxb + hq.to(tl.int64) * sxh + rq.to(tl.int64) * sxs) + offx,
                         mask=(sub < tl.where(k > 0, tl.minimum(blkq * R + R, N) - rq, 0))[:, None], other=0.0)
            # Row maxima of the rotation before its multiply by 1/sqrt(d): rounding is monotonic, so
            # fl(max|a| s) = max fl(|a| s), the amax of the rotated values, one multiply per block.
            a = _rotate(xa, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False, True)
            run = tl.maximum(run, tl.max(tl.abs(a), axis=1))
            yq = _rotate(xb, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
            # The same k and j, computed anew: (i + SUB) // SUB - 1 == i // SUB.
            k2 = (i + SUB) // SUB - 1
            j2 = i - k2 * SUB
            bp, hp, blkp = _item(pid + tl.maximum(k2 - 1, 0) * nprog, H, NBLK, HEAD_FAST)
            bp0 = blkp * R
            rp = bp0 + j2 * TILE
            _store_q(yq, d32, Y + (bp.to(tl.int64) * syb + hp.to(tl.int64) * syh + rp.to(tl.int64) * sys_), offy, rp,
                     sub, tl.where(k2 > 0, tl.minimum(bp0 + R, N), 0), MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
            if j2 == SUB - 1:
                am = tl.max(run, axis=0)
                if ROT != 0:
                    am = am * tl.load(SCAL + 1)
                d32 = _descale(am, FMT_MAX, POW2, False)
                b2, h2, blk2 = _item(pid + tl.minimum(k2, nb - 1) * nprog, H, NBLK, HEAD_FAST)
                tl.store(DESC + b2 * sdb + h2 * sdh + blk2 * sdn, d32, mask=k2 < nb)
                run = tl.zeros((TILE,), tl.float32)

    @triton.jit
    def _rq_persistent(X, Y, SIGNS, HMAT, SCAL, AMAX, DESC,
                       sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                       H, N, GROUP, R, NBLK, TOTAL,
                       D: tl.constexpr, LOG2D: tl.constexpr, TILE: tl.constexpr, ROT: tl.constexpr,
                       GRAN: tl.constexpr, PASS: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                       EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                       DIV: tl.constexpr, STAGES: tl.constexpr, HEAD_FAST: tl.constexpr,
                       SUB: tl.constexpr = 1, REREAD: tl.constexpr = 0):
        """Fast path (float32), persistent: a fixed grid of programs walks the work items (blocks
        of R <= TILE rows of one (batch, head)). The +-1 matrix is loaded once per program, and
        the loop is software-pipelined (STAGES): the next items' loads are in flight while one
        is rotated, reduced and stored.

        PASS 0 (token/block, one pass): item = pid + k * programs, numbered heads first
        (HEAD_FAST) or sequence first. PASS 1 (head/tensor amax): each program takes one
        contiguous run of items in (batch, head, block) order. PASS 2 (quantize with that
        amax): the same runs backwards, so that its first reads hit the tiles PASS 1 left in L2.

        SUB > 1 (blocks only): a block of R <= SUB * TILE rows is walked as SUB sub-tiles of TILE
        rows, one per loop step, so a stage holds TILE rows and more of them fit in flight. The
        rotated sub-tiles wait in registers (SUB - 1 of them) until the last one gives the block's
        amax; then all are cast and stored. REREAD 1: instead of keeping them, the block's
        sub-tiles are loaded a second time (L2 hits), as SUB more pipelined loop steps, and rotated
        again; REREAD 2: the same second loads, but at the block's last step, outside the pipeline
        (which then holds HBM reads only), and the last sub-tile stays in registers."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, D)
        sub = tl.arange(0, TILE)
        if ROT == 2:
            hm = tl.load(HMAT + cols[:, None] * D + cols[None, :])
        else:
            hm = 0
        run = tl.zeros((TILE,), tl.float32)
        chunk = tl.cdiv(TOTAL, nprog)
        if PASS == 1:
            # amax per (batch, head group) or tensor: each program walks one contiguous run of
            # items in (batch, head, block) order, keeps row maxima in registers, and reduces and
            # adds them to the group's atomic only when the group changes (a few times at most).
            prev = pid * 0 - 1
            for i in tl.range(0, chunk, num_stages=STAGES):
                t = pid * chunk + i
                ok = t < TOTAL
                b, h, blk = _item(t, H, NBLK, False)
                rows = blk * R + sub
                m = (sub < R) & (rows < N) & ok
                xb = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
                x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
                y = _rotate(x, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
                if GRAN == 1:
                    ai = tl.where(ok, b * (H // GROUP) + h // GROUP, prev)
                else:
                    ai = tl.where(ok, 0, prev)
                if (ai != prev) & (prev >= 0):
                    tl.atomic_max(AMAX + prev, tl.max(run, axis=0).to(tl.int32, bitcast=True))
                    run = tl.zeros((TILE,), tl.float32)
                run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
                prev = ai
            if prev >= 0:
                tl.atomic_max(AMAX + prev, tl.max(run, axis=0).to(tl.int32, bitcast=True))
            return
        if SUB > 1 and REREAD == 4:
            _block_skewed(X, Y, hm, SIGNS, SCAL, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                          H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D, LOG2D, TILE, ROT, POW2, MBITS, EMIN,
                          FMT_MAX, OUT, SOFT_CAST, DIV, STAGES, HEAD_FAST, SUB)
            return
        if SUB > 1 and REREAD == 3:
            _block_kept_inputs(X, Y, hm, SIGNS, SCAL, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                               H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D, LOG2D, TILE, ROT, POW2, MBITS, EMIN,
                               FMT_MAX, OUT, SOFT_CAST, DIV, STAGES, HEAD_FAST, SUB)
            return
        if SUB > 1:
            _block_subtiles(X, Y, hm, SIGNS, SCAL, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                            H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D, LOG2D, TILE, ROT, POW2, MBITS, EMIN,
                            FMT_MAX, OUT, SOFT_CAST, DIV, STAGES, HEAD_FAST, SUB, REREAD)
            return
        # PASS 2 walks the same runs as PASS 1 backwards: its first reads are the tiles PASS 1
        # read last, still in L2. PASS 0 interleaves the programs (item = pid + k * programs).
        n_iter = chunk if PASS == 2 else tl.cdiv(TOTAL - pid, nprog)
        for i in tl.range(0, n_iter, num_stages=STAGES):
            if PASS == 2:
                t = pid * chunk + (chunk - 1 - i)
                tt = tl.minimum(t, TOTAL - 1)  # past the end: masked, but indices stay in range
                b, h, blk = _item(tt, H, NBLK, False)
            else:
                t = pid + i * nprog
                b, h, blk = _item(t, H, NBLK, HEAD_FAST)
            rows = blk * R + sub
            m = (sub < R) & (rows < N) & (t < TOTAL)
            xb = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
            x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
            y = _rotate(x, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, False)
            if GRAN == 3:
                dt = _descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, False)
                tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
                q = _scale_cast(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
            else:
                if GRAN == 2:
                    d32 = _descale(tl.max(tl.max(tl.abs(y), axis=1), axis=0), FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                elif GRAN == 1:
                    hg = h // GROUP
                    d32 = _descale(tl.load(AMAX + b * (H // GROUP) + hg).to(tl.float32, bitcast=True),
                                   FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + hg * sdh, d32, mask=(blk == 0) & (h % GROUP == 0) & (t < TOTAL))
                else:
                    d32 = _descale(tl.load(AMAX).to(tl.float32, bitcast=True), FMT_MAX, POW2, False)
                    tl.store(DESC, d32, mask=t == 0)
                q = _scale_cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
            yb = Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh
            tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])

    @triton.jit
    def _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE: tl.constexpr, D: tl.constexpr,
                  LOG2D: tl.constexpr, ROT: tl.constexpr, EXACT: tl.constexpr):
        x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
        return _rotate(x, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)

    @triton.jit
    def _quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN: tl.constexpr,
                     MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                     POW2: tl.constexpr, EXACT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        if GRAN == 3:
            dt = _descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, EXACT)
            tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
            q = _cast(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, RECIP)
        else:
            q = _cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, RECIP)
        tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])

    @triton.jit
    def _rq_kernel(X, Y, SIGNS, HMAT, SCAL, AMAX, DESC,
                   sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                   H, N, GROUP, ROWS_PER_PROG,
                   D: tl.constexpr, LOG2D: tl.constexpr, TILE: tl.constexpr, SINGLE: tl.constexpr,
                   ROT: tl.constexpr, GRAN: tl.constexpr, PASS: tl.constexpr, EXACT: tl.constexpr,
                   POW2: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr,
                   OUT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        # PASS 0: block/token in one pass; 1: amax of a head/tensor (atomics); 2: quantize with it.
        # SINGLE: the program's rows fit one tile, which stays in registers between the amax and
        # the cast (one read of the input); otherwise sub-tiles are read again for the cast.
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        r0 = pid_t * ROWS_PER_PROG
        r_end = r0 + ROWS_PER_PROG
        cols = tl.arange(0, D)
        sub = tl.arange(0, TILE)
        xb = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
        yb = Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh
        if ROT == 2:
            hm = tl.load(HMAT + cols[:, None] * D + cols[None, :])
        else:
            hm = 0
        ai = 0
        if GRAN == 1:
            ai = b * (H // GROUP) + h // GROUP
        if SINGLE:
            rows = r0 + sub
            m = (rows < r_end) & (rows < N)
            y = _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)
            amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
        else:
            if EXACT:
                run = tl.zeros((TILE,), tl.float64)
            else:
                run = tl.zeros((TILE,), tl.float32)
            if PASS == 1 or GRAN == 2:
                for i in range(0, ROWS_PER_PROG, TILE):
                    rows = r0 + i + sub
                    m = (rows < r_end) & (rows < N)
                    y = _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)
                    run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
            amax = tl.max(run, axis=0)
        if PASS == 1:
            # Non-negative IEEE floats order like their bit patterns: integer atomics suffice.
            if EXACT:
                tl.atomic_max(AMAX + ai, amax.to(tl.int64, bitcast=True))
            else:
                tl.atomic_max(AMAX + ai, amax.to(tl.int32, bitcast=True))
        else:
            if GRAN <= 1:
                if EXACT:
                    amax = tl.load(AMAX + ai).to(tl.float64, bitcast=True)
                else:
                    amax = tl.load(AMAX + ai).to(tl.float32, bitcast=True)
            d32 = _descale(amax, FMT_MAX, POW2, EXACT)
            if GRAN == 2:
                tl.store(DESC + b * sdb + h * sdh + pid_t * sdn, d32)
            elif GRAN == 1:
                if (pid_t == 0) & (h % GROUP == 0):
                    tl.store(DESC + b * sdb + (h // GROUP) * sdh, d32)
            elif GRAN == 0:
                if (pid_t == 0) & (pid_bh == 0):
                    tl.store(DESC, d32)
            if SINGLE:
                _quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN, MBITS, EMIN,
                             FMT_MAX, OUT, POW2, EXACT, SOFT_CAST, RECIP)
            else:
                for i in range(0, ROWS_PER_PROG, TILE):
                    rows = r0 + i + sub
                    m = (rows < r_end) & (rows < N)
                    y = _load_rot(xb, rows, m, cols, sxs, sxd, SIGNS, hm, SCAL, TILE, D, LOG2D, ROT, EXACT)
                    _quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN, MBITS,
                                 EMIN, FMT_MAX, OUT, POW2, EXACT, SOFT_CAST, RECIP)


@dataclasses.dataclass
class QuantOut:
    """FP8 values and float32 descales as the attention kernels read them.

    ``values``: FP8 in ``layout`` (bhsd: (batch, heads, seqlen, dim); bshd: (batch, seqlen,
    heads, dim), FA3's; bhds: (batch, heads, dim, seqlen), V transposed for K-major FP8 MMAs).
    ``descale``: float32 (b, h // group, n_desc) for block (n_desc = blocks of ``rows``) and token
    (rows = 1); (b, h // group, 1) for head; (1, 1, 1) for tensor. ``rows``: tokens per descale.
    """

    values: torch.Tensor
    descale: torch.Tensor
    layout: str
    rows: int  # tokens per descale along seqlen
    group: int  # heads per descale
    gran: int  # GRAN_CODES value
    launch: str = ""  # the kernel and launch configuration that wrote it

    def values_bhsd(self) -> torch.Tensor:
        v = self.values
        if self.layout == "bshd":
            return v.transpose(1, 2)
        if self.layout == "bhds":
            return v.transpose(2, 3)
        return v

    def descale_like_prepare(self, heads: int, seqlen: int) -> torch.Tensor:
        """The emulator's broadcast form: [b, heads, 1 or seqlen, 1], or [1, 1, 1, 1] per tensor."""
        d = self.descale
        if self.gran == 0:
            return d.reshape(1, 1, 1, 1)
        if self.gran == 1:
            return d.repeat_interleave(self.group, dim=1).unsqueeze(-1)
        return d.repeat_interleave(self.rows, dim=2)[:, :, :seqlen].unsqueeze(-1)


def _strides(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides of a 4-d tensor in ``layout``."""
    s = x.stride()
    if layout == "bshd":
        return s[0], s[2], s[1], s[3]
    if layout == "bhsd":
        return s[0], s[1], s[2], s[3]
    if layout == "bhds":
        return s[0], s[1], s[3], s[2]
    raise UsageError(f"unknown layout {layout!r}; one of {', '.join(_LAYOUTS)}")


def _dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    if layout == "bshd":
        b, n, h, d = x.shape
    elif layout == "bhsd":
        b, h, n, d = x.shape
    else:
        b, h, d, n = x.shape
    return b, h, n, d


_CONST_CACHE: dict = {}


def _constants(d: int, seed: int, device, exact: bool, dot_dtype):
    key = (d, seed, str(device), exact, dot_dtype)
    if key not in _CONST_CACHE:
        from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

        signs = random_signs(d, seed)
        hm = (signs[:, None] * hadamard_matrix(d)).to(dot_dtype or torch.bfloat16)
        scal = torch.tensor([d ** 0.5, 1.0 / d ** 0.5], dtype=torch.float64)
        ct = torch.float64 if exact else torch.float32
        _CONST_CACHE[key] = (signs.to(device=device, dtype=ct), hm.contiguous().to(device),
                             scal.to(device=device, dtype=ct))
    return _CONST_CACHE[key]


def rotate_quantize(x: torch.Tensor, *, layout: str = "bshd", fmt: str = "e4m3", gran=None, block_rows: int = 0,
                    group: int = 1, pow2: bool = False, rot: str = "none", seed: int = 0, exact: bool = False,
                    out_layout: str = "bhsd", impl: str = "auto", soft_cast: bool | None = None, tile: int = 0,
                    num_warps: int = 0, recip: bool = False, persistent: bool | None = None, stages: int = 0,
                    progs_per_sm: int = 0, head_fast: bool | None = None, sub_tile: int = 0,
                    reread: bool | str | None = None, max_regs: int = 0, keep_last: bool = False,
                    parts: int = 2, stage_in_ring: bool = True, pow2_div: bool = False) -> QuantOut:
    """Rotate (Hadamard or none) and quantize ``x`` into FP8 in one fused kernel (see module doc).

    ``gran``: a granularity object (``PerHead()`` default); ``block_rows`` fills ``PerBlock(0)``;
    ``group``: heads sharing one per-head descale (Q under GQA: heads // kv_heads). ``tile`` (rows
    per tile for token/head/tensor), ``num_warps`` and ``recip`` (multiply by 1/descale, one more
    rounding) tune the fast path. ``persistent`` (default: the fast path) runs the persistent,
    software-pipelined kernel with ``stages`` pipeline stages and ``progs_per_sm`` programs per
    multiprocessor (default: as many as fit, at most 3, or 4 under ``max_regs``; ``head_fast``:
    the order of the work items, default heads first for a (b, s, h, d) input); ``max_regs`` caps
    the registers a thread (Triton's ``maxnreg``) so that more programs fit an SM; ``False`` the
    one-program-per-tile kernel of the first version. Blocks there are walked in sub-tiles of
    ``sub_tile`` rows (default 64 at head_dim 128, i.e. 8192 // head_dim; a sub-tile of at least
    the block's rows: one tile per block), kept in registers until the block's amax is known
    (default for two sub-tiles written row by row), or loaded again from L2 (``reread``: True as
    more pipelined steps, the default for longer blocks written row by row; ``"skewed"`` one
    block later, in the steps of the next block's first loads, the default for blocks written
    transposed; ``"sync"`` at the block's last step, outside the pipeline), or their inputs kept
    in registers and rotated again (``"inputs"``), or held in shared memory and rotated twice there
    (``"smem"``: the Gluon kernel of ``rotate_quant_smem``, Hopper, BF16, the split rotation;
    ``keep_last``: the last sub-tile kept in registers between its passes instead of rotated
    twice; ``parts``: column parts of its split rotation, 2 or 4; ``stage_in_ring``: the FP8
    staging tiles in the short last sub-tile's ring units). "smem" is the default for blocks of
    more than 128 rows written row by row where it runs (``_smem_default``; FA3's 224-row K tile:
    76-83% of a copy on the H200 against the tl kernel's 54-56%, reports/h200/triton/report.md);
    ``persistent=True`` or any launch setting keeps the tl kernel. ``pow2_div``: with
    power-of-two descales, divide (the corrected division of other descales) instead of the
    default one multiply by the reciprocal, which is exact for them: the same bytes, kept to
    measure the difference. Without ``stages``, ``num_warps`` and ``progs_per_sm``,
    blocks take the launch measured fastest for their mode (_SUB_LAUNCH, a register cap
    included). The launch chosen is in the result's ``launch``.
    """
    gran = PerHead() if gran is None else gran
    f = fp8_params(fmt)
    if layout not in _LAYOUTS or out_layout not in _LAYOUTS:
        raise UsageError(f"layouts must be among {', '.join(_LAYOUTS)}")
    if rot not in ("none", "hadamard"):
        raise UsageError(f"rot={rot}: the fused kernel applies the random Hadamard rotation only "
                         "(use the emulator's prepare() for rot=orthogonal)")
    b, h, n, d = _dims(x, layout)
    if d & (d - 1) or not 16 <= d <= 256:
        raise UsageError(f"head_dim {d}: the fused kernel needs a power of two in [16, 256] (Triton tiles)")
    if h % group:
        raise UsageError(f"{h} heads are not a multiple of the descale group {group}")
    if isinstance(gran, PerBlock):
        rows = gran.rows or block_rows
        if not rows:
            raise UsageError("block granularity needs block_rows (the kernel's tile)")
    elif isinstance(gran, PerToken):
        rows = 1
    else:
        rows = n
    code = GRAN_CODES[type(gran)]
    if not isinstance(gran, PerHead):
        group = 1
    if impl == "auto":
        narrow = x.dtype in (torch.bfloat16, torch.float16)
        impl = "dot" if (not exact and narrow and not interpreting()) else "butterfly"
    if impl == "dot" and (exact or x.dtype not in (torch.bfloat16, torch.float16)):
        raise UsageError("impl=dot multiplies on the tensor cores: BF16/FP16 inputs and exact=False only")
    rot_code = 0 if rot == "none" else (2 if impl == "dot" else 1)
    soft = interpreting() if soft_cast is None else soft_cast
    dev = x.device
    signs, hm, scal = _constants(d, seed, dev, exact, x.dtype if rot_code == 2 else None)

    out_shape = {"bshd": (b, n, h, d), "bhsd": (b, h, n, d), "bhds": (b, h, d, n)}[out_layout]
    y = torch.empty(out_shape, dtype=f.torch_dtype, device=dev)
    if code == 2:
        nd = -(-n // rows)
        desc = torch.empty((b, h, nd), dtype=torch.float32, device=dev)
    elif code == 3:
        desc = torch.empty((b, h, n), dtype=torch.float32, device=dev)
    elif code == 1:
        desc = torch.empty((b, h // group, 1), dtype=torch.float32, device=dev)
    else:
        desc = torch.empty((1, 1, 1), dtype=torch.float32, device=dev)
    if smem_candidate(code, rows, rot, reread, persistent, exact, fmt,
                      (tile, num_warps, recip, stages, progs_per_sm, sub_tile, max_regs, soft_cast)) \
            and _smem_default(x, layout, out_layout, rows, d, n, rot, impl):
        reread = "smem"
    if persistent is None:
        # Blocks written transposed (V, (b, h, d, s)) too since run 9: read again one block behind
        # (70% of a copy at 128 rows against the tiled kernel's 57-59%; 57% at 224 against 11%).
        persistent = not exact
    if reread == "smem" and rot == "none":
        from .vquant_smem import quantize_v_smem, vsmem_problem

        why = "per-block scales only" if code != 2 else vsmem_problem(x, layout, out_layout, rows, d, n)
        if why or exact or fmt != "e4m3" or recip or soft or max_regs:
            raise UsageError(f"reread='smem' (V, no rotation): {why or _SMEM_ONLY}")
        how = quantize_v_smem(x, y, desc, layout=layout, rows=rows, pow2=pow2, fmt_max=f.max,
                              progs_per_sm=progs_per_sm, head_fast=head_fast, pow2_mul=not pow2_div)
        return QuantOut(y, desc, out_layout, rows, group, code, how)
    if reread == "smem":
        from .rotate_quant_smem import rotate_quantize_smem, smem_problem

        why = "per-block scales only" if code != 2 else smem_problem(x, layout, out_layout, rows, d, rot)
        if why or exact or fmt != "e4m3" or impl != "dot" or recip or soft:
            raise UsageError(f"reread='smem': {why or _SMEM_ONLY + ', impl=dot'}")
        how = rotate_quantize_smem(x, y, desc, scal, layout=layout, out_layout=out_layout, rows=rows, pow2=pow2,
                                   seed=seed, fmt_max=f.max, keep_last=keep_last, parts=parts,
                                   stage_in_ring=stage_in_ring, progs_per_sm=progs_per_sm, head_fast=head_fast,
                                   max_regs=max_regs, pow2_mul=not pow2_div)
        return QuantOut(y, desc, out_layout, rows, group, code, how)
    if persistent and not exact:
        if code == 2 and _v_short_subtiles(rows, d, rot_code, out_layout, reread,
                                           (sub_tile, stages, num_warps, progs_per_sm, max_regs)):
            sub_tile, stages = 32, 6
        if code == 2:
            ptile, nsub, rr = _block_split(rows, d, sub_tile, reread, out_layout == "bhds")
        else:
            ptile, nsub, rr = _pow2_at_least(tile or _PERSIST_TILE, 16), 1, False
        if ptile * d <= 256 * 128:
            return _launch_persistent(x, y, desc, signs, hm, scal, layout, out_layout, f, fmt, code, rows, group,
                                      pow2, rot_code, soft, ptile, num_warps, recip, stages, progs_per_sm, b, h, n,
                                      d, head_fast, nsub, rr, max_regs, pow2_div)
    # The fast path keeps a whole tile (up to 256 rows x d in float32) in registers and reads the
    # input once; the float64 path works in sub-tiles of 32 rows (registers) and re-reads a block.
    if code == 2:
        per_prog = rows
        tile = tile or (32 if exact else max(16, 1 << (rows - 1).bit_length()))
        if tile * d > 256 * 128:
            tile = max(16, (256 * 128) // d)
    else:
        # 64 rows, 4 warps: fastest of 32/64/128 rows measured on the H200 for per-token and per-head
        # (reports/h200/triton/quant.csv, run 3): more programs per SM hide the loads' latency.
        tile = tile or (32 if exact else 64)
        per_prog = tile if not exact else 8 * tile
    single = per_prog <= tile
    grid = (-(-n // per_prog), b * h)
    amax = torch.zeros(max(1, b * (h // group)) if code == 1 else 1,
                       dtype=torch.int64 if exact else torch.int32, device=dev)
    common = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, SINGLE=single, ROT=rot_code, GRAN=code, EXACT=exact,
                  POW2=bool(pow2), MBITS=f.mbits, EMIN=f.emin, FMT_MAX=f.max, OUT=tl_fp8(fmt), SOFT_CAST=soft,
                  RECIP=bool(recip) and not exact)
    if not interpreting():
        common["num_warps"] = num_warps or (8 if tile * d >= 128 * 128 else 4)
    args = [x, y, signs, hm, scal, amax, desc, *_strides(x, layout), *_strides(y, out_layout),
            desc.stride(0), desc.stride(1), desc.stride(2), h, n, group]
    if code <= 1:
        _rq_kernel[grid](*args, per_prog, PASS=1, **common)
        _rq_kernel[grid](*args, per_prog, PASS=2, **common)
    else:
        _rq_kernel[grid](*args, per_prog, PASS=0, **common)
    return QuantOut(y, desc, out_layout, rows, group, code,
                    f"tiled tile{tile} w{common.get('num_warps', '-')} {'recip' if common['RECIP'] else 'div'}")


# Launch defaults of the persistent kernel: rows per tile for token/head/tensor; pipeline stages
# by (rotation on the tensor cores, tile over 64 x 128 elements); at most this many programs
# per SM (fewer where their shared memory or registers do not fit). The fastest of the H200
# sweeps (reports/h200/triton/quant_sweep.csv): 4 stages for 64-row tiles with the dot, 3
# without (4 were slower there), 2 for blocks of 128 rows in one tile.
_PERSIST_TILE = 64
_PERSIST_STAGES = {(True, False): 4, (True, True): 2, (False, False): 3, (False, True): 2}
# Blocks in sub-tiles: (rotation on the tensor cores, mode, two sub-tiles) -> (stages, register cap;
# 0: none). Modes: 0 kept, 1 reread, 2 reread-sync, 3 kept inputs, 4 reread skewed. Two kept
# sub-tiles (4 warps, ~240 registers) fit 2 programs per SM like the per-token tiles; 3 stages
# measured faster than 4 there (run 6: 0.058 against 0.062 ms). Three kept (8 warps) fit one
# program per SM, so more stages keep loads in flight (still slower). Read again (K at 224 rows):
# 168 registers and 2 stages fit 3 programs per SM (runs 8-9: 0.086 ms, 57-58% of a copy, against
# 0.097-0.099 ms at 4 stages and 2 programs). Skewed, without rotation (V): 3 programs at 168
# registers and 3 stages for 128 rows (run 9: 0.070 ms against 0.074 uncapped); 2 programs and 4
# stages for 224 (0.086 ms against 0.087-0.091 for the others). With the dot, the skewed kernel's
# two tiles a stage and the +-1 matrix leave room for 2 stages.
_SUB_LAUNCH = {(True, 0, True): (3, 0), (True, 0, False): (8, 0), (True, 1, True): (2, 168), (True, 1, False): (2, 168),
               (True, 2, True): (4, 0), (True, 2, False): (4, 0), (True, 3, True): (4, 0), (True, 3, False): (4, 0),
               (True, 4, True): (2, 0), (True, 4, False): (2, 0),
               (False, 0, True): (3, 0), (False, 0, False): (8, 0), (False, 1, True): (4, 0), (False, 1, False): (4, 0),
               (False, 2, True): (4, 0), (False, 2, False): (4, 0), (False, 3, True): (4, 0), (False, 3, False): (4, 0),
               (False, 4, True): (3, 168), (False, 4, False): (4, 0)}
_PERSIST_PPS = 3
_SMEM_PER_SM = 228 * 1024  # Hopper; each resident program also reserves 1 KB
_REGS_PER_SM = 65536
_SMS: dict = {}
_RESIDENT: dict = {}


_SMEM_ONLY = ("the fast path (exact=False) to e4m3 only, with the hardware cast and the exact division "
              "(no soft_cast, no recip)")


def smem_candidate(code: int, rows: int, rot: str, reread, persistent, exact: bool, fmt: str, tuning) -> bool:
    """Whether a call leaves the launch to the library and asks what a shared-memory kernel does:
    per-block scales of more than 128 rows (of at least 128 without rotation: V blocks of 128
    rows moved at 87% of a copy there against the tl kernel's 70%, probe p15; rotated 128-row
    blocks stay in the tl kernel, 89% either way, p13), the fast path to e4m3, no reread mode, no
    ``persistent`` and no launch setting (those keep the tl kernel)."""
    return (code == 2 and (rows >= 128 if rot == "none" else rows > 128) and reread is None and persistent is None
            and not exact and fmt == "e4m3" and not any(tuning))


def _smem_default(x, layout: str, out_layout: str, rows: int, d: int, n: int, rot: str, impl: str) -> bool:
    """Blocks of more than 128 rows (FA3's 224-row K and V tiles at head_dim 128) that a
    shared-memory kernel can run (Hopper, BF16) go there by default. On the H200 a 224-row K tile
    (Hadamard rotation on the tensor cores, rows written (b, h, s, d); probe p13) took 0.057 ms
    (83% of a copy) with power-of-two descales and 0.062 ms (76%) with amax descales, against the
    tl kernel's 0.085-0.089 ms (54-56%), and 0.195-0.238 ms a call with the host's launch against
    0.153-0.236; V (no rotation, written (b, h, d, s)): ``vquant_smem``."""
    if interpreting() or not x.is_cuda:
        return False
    if rot == "none":
        from .vquant_smem import vsmem_problem

        return vsmem_problem(x, layout, out_layout, rows, d, n) is None
    from .rotate_quant_smem import smem_problem

    return impl == "dot" and smem_problem(x, layout, out_layout, rows, d, rot) is None


def _v_short_subtiles(rows: int, d: int, rot_code: int, out_layout: str, reread, tuning) -> bool:
    """V blocks of more than 128 rows at head_dim 128 (no rotation, written (b, h, d, s)) go in
    32-row sub-tiles with 6 pipeline stages, read again one block behind: FA3's 224-row V tile
    took 0.075 ms on the H200 (64% of a copy, probes p1-p3, bytes identical to the tiled kernel)
    against 0.086 ms (56%) in 64-row sub-tiles with 4 stages; 32-row sub-tiles with 4 stages took
    0.087 ms. Only where no launch was asked for, and where the shared-memory V kernel does not
    run (``vquant_smem``: 79-81% at 224 rows)."""
    return (d == 128 and rows > 128 and rot_code == 0 and out_layout == "bhds" and reread is None
            and not any(tuning))


def _block_split(rows: int, d: int, sub_tile: int, reread, transposed: bool = False) -> tuple[int, int, int]:
    """(tile rows, sub-tiles per block, reread mode) for blocks of ``rows`` rows: sub-tiles of
    8192 // d rows (64 at d 128) by default; a block that fits one such tile is one tile. (On
    Hopper, K blocks of more than 128 rows and V blocks of at least 128 go to the shared-memory
    kernels instead where they run: ``smem_candidate``.)

    Default: two sub-tiles (Q's 128-row tile) stay in registers; longer blocks (K's 224 rows) are
    read again from L2 as more pipelined steps; blocks written transposed (V, (b, h, d, s)) are
    read again one block behind, in the first pass's steps ("skewed"). On the H200 (% of a
    device-to-device copy; reports/h200/triton/report.md): 128 rows kept 83-85%, read again 56%,
    skewed 45%, inputs kept 64%; 224 rows read again 50% (57-58% at 3 programs per SM: the
    defaults of _SUB_LAUNCH), skewed 40%, inputs kept 41-42%, 3 sub-tiles kept (8 warps, one
    program per SM by registers) 41-44%, one 256-row tile 47%, read again at the block's end 17%.
    V of 128 rows: skewed 70%, inputs kept 66%, read again 42%, kept 26% (spills); V of 224:
    skewed 56-57% (64% in 32-row sub-tiles with 6 stages: _v_short_subtiles), inputs kept 45%
    (8 warps), read again 37-39%."""
    cap = max(16, 8192 // d)
    t = _pow2_at_least(sub_tile or min(rows, cap), 16)
    nsub = -(-rows // t)
    if nsub == 1:
        return t, 1, 0
    if reread is None:
        rr = 4 if transposed else (1 if nsub > 2 else 0)
    else:
        rr = {"sync": 2, "inputs": 3, "skewed": 4}.get(reread, None) if isinstance(reread, str) else int(bool(reread))
        if rr is None:
            raise UsageError(f"reread={reread!r}: True, False, 'sync', 'inputs' or 'skewed'")
    if nsub > 4 and rr in (0, 3):  # at most 3 sub-tiles kept
        rr = 1
    return t, nsub, rr


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << (max(1, v) - 1).bit_length())


def _programs(dev, total: int, progs_per_sm: int) -> int:
    if interpreting() or dev.type != "cuda":
        return max(1, min(total, 3))  # several items per program: the loop is exercised
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return max(1, min(total, _SMS[key] * progs_per_sm))


def _resident(args, common: dict, passes, x, y, cap: int = 0) -> int:
    """Programs of the compiled kernel that fit one SM, by its registers and shared memory (a
    persistent grid of more than fit would run a second wave). Compiles without launching."""
    key = (tuple(common.items()), passes, x.dtype, y.dtype, x.device, tuple(a % 16 == 0 or a == 1 for a in args[7:18]),
           cap)
    if key not in _RESIDENT:
        fit = cap or _PERSIST_PPS
        for p in passes:
            fit = min(fit, fit_per_sm(_rq_persistent.warmup(*args, grid=(1,), PASS=p, **common), common["num_warps"]))
        _RESIDENT[key] = max(1, fit)
    return _RESIDENT[key]


def fit_per_sm(k, num_warps: int) -> int:
    """Programs of the compiled kernel ``k`` that fit one SM, by its registers (allocated in
    units of 8 a thread) and its shared memory (plus 1 KB reserved a program)."""
    k._init_handles()
    regs = ((max(1, int(getattr(k, "n_regs", 0) or 0)) + 7) // 8) * 8 * 32 * num_warps
    return min(_REGS_PER_SM // regs, _SMEM_PER_SM // (int(k.metadata.shared) + 1024))


def _launch_persistent(x, y, desc, signs, hm, scal, layout, out_layout, f, fmt, code, rows, group, pow2, rot_code, soft,
                       tile, num_warps, recip, stages, progs_per_sm, b, h, n, d, head_fast=None, nsub=1,
                       reread=False, max_regs=0, pow2_div=False) -> QuantOut:
    """The persistent kernel: work items of ``r`` rows (a block, or ``tile`` rows), each in one tile,
    or a block in ``nsub`` sub-tiles of ``tile`` rows."""
    r = rows if code == 2 else tile
    nblk = -(-n // r)
    total = b * h * nblk
    big = tile * d > 64 * 128
    if code <= 1:
        amax = torch.zeros(max(1, b * (h // group)) if code == 1 else 1, dtype=torch.int32, device=x.device)
    else:
        amax = desc  # unused
    kept = 0 if (reread or nsub == 1) else (1 if nsub == 2 else 3)  # sub-tiles held in registers: 1, or up to 3
    reread = int(reread)
    # Shared memory: one input tile per pipeline stage (two for the skewed mode), the +-1 matrix
    # (dot), the FP8 tile's layout change for the store. Stages beyond what fits in ~200 KB are
    # dropped (d = 256 keeps one).
    if nsub > 1:
        st_def, regs_def = _SUB_LAUNCH[(rot_code == 2, reread, nsub == 2)]
        if not (stages or num_warps or progs_per_sm):  # the register cap belongs to its measured launch
            max_regs = max_regs or regs_def
    else:
        st_def = _PERSIST_STAGES[(rot_code == 2, big)]
    st = stages or st_def
    fixed = (d * d * 2 if rot_code == 2 else 0) + tile * d
    loads = 2 if reread == 4 else 1
    while st > 1 and fixed + st * loads * tile * d * x.element_size() > 200 * 1024:
        st -= 1
    common = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, ROT=rot_code, GRAN=code, POW2=bool(pow2), MBITS=f.mbits,
                  EMIN=f.emin, FMT_MAX=f.max, OUT=tl_fp8(fmt), SOFT_CAST=soft,
                  DIV=1 if (recip or (pow2 and not pow2_div)) else (0 if interpreting() else 2), STAGES=st)
    if nsub > 1:
        common["SUB"] = nsub
        common["REREAD"] = reread
    if head_fast is None:  # heads first where a head's rows are strided by the other heads (bshd)
        sb, sh, ss, sd = _strides(x, layout)
        head_fast = sh < ss
    common["HEAD_FAST"] = bool(head_fast)
    if not interpreting():
        if nsub > 1:
            common["num_warps"] = num_warps or (8 if kept == 3 else 4)
        else:
            common["num_warps"] = num_warps or (8 if tile * d >= 128 * 128 else 4)
        if max_regs:
            common["maxnreg"] = max_regs
    args = [x, y, signs, hm, scal, amax, desc, *_strides(x, layout), *_strides(y, out_layout),
            desc.stride(0), desc.stride(1), desc.stride(2), h, n, group, r, nblk, total]
    passes = (1, 2) if code <= 1 else (0,)
    how_pps = ""
    if progs_per_sm:
        pps = progs_per_sm
    elif interpreting() or x.device.type != "cuda":
        pps = 1
    else:
        try:
            pps = _resident(args, common, passes, x, y, _PERSIST_PPS + (1 if max_regs else 0))
        except Exception:  # noqa: BLE001 - no compiled kernel's resources: the shared-memory estimate
            pps = max(1, min(_PERSIST_PPS, _SMEM_PER_SM // (fixed + st * tile * d * x.element_size() + 1024)))
            how_pps = " (estimated)"
    grid = (_programs(x.device, total, pps),)
    for p in passes:
        _rq_persistent[grid](*args, PASS=p, **common)
    mode = ("kept", "reread", "reread-sync", "kept-inputs", "reread-skewed")[reread]
    how = (f"persistent tile{tile}" + (f" x{nsub} {mode}" if nsub > 1 else "") + f" w{common.get('num_warps', '-')}"
           + (f" r{max_regs}" if max_regs else "") + f" s{st} pps{pps}{how_pps}" + ("" if head_fast else " seq-first")
           + (" recip" if recip else (" pow2-mul" if common["DIV"] == 1 else "")))
    return QuantOut(y, desc, out_layout, rows, group, code, how)


def min_bytes(x: torch.Tensor, out: QuantOut) -> int:
    """Bytes a quantizer must move at least: the input read once, values and descales written once."""
    return x.numel() * x.element_size() + out.values.numel() * out.values.element_size() + out.descale.numel() * 4


def quantize_qkv(recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bshd",
                 rotation_seed: int = 0, causal: bool = False, exact: bool = False, impl: str = "auto",
                 v_layout: str = "bhds", qk_layout: str = "bhsd", soft_cast: bool | None = None):
    """Q, K, V of one recipe through the fused kernel, with the emulator's tiles for block scales.

    Returns (q, k, v) ``QuantOut``s: Q and K rotated per the recipe, V not rotated (as
    ``prepare``), V written in ``v_layout`` (default transposed for the attention kernel).
    """
    b, h, n, d = _dims(q, layout)
    hkv = _dims(k, layout)[1]
    bm, bn = recipe.tiles(d, causal)
    g = recipe.gran
    kw = dict(layout=layout, pow2=recipe.pow2, exact=exact, impl=impl, soft_cast=soft_cast)
    qo = rotate_quantize(q, fmt=recipe.qk, gran=g, block_rows=bm, group=h // hkv, rot=recipe.rot, seed=rotation_seed,
                         out_layout=qk_layout, **kw)
    ko = rotate_quantize(k, fmt=recipe.qk, gran=g, block_rows=bn, rot=recipe.rot, seed=rotation_seed,
                         out_layout=qk_layout, **kw)
    vo = rotate_quantize(v, fmt=recipe.v, gran=g, block_rows=bn, rot="none", out_layout=v_layout, **kw)
    return qo, ko, vo
