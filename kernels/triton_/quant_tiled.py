"""The tiled quantizer kernel: one program per tile of rows of one (batch, head); the float64
path (``exact=True``, the emulator's order of operations, bytes equal to ``prepare()``'s) and
``persistent=False``.

Exposed (where triton imports): ``rq_tiled`` (launched by ``rotate_quant.rotate_quantize``).

Per-token and per-block scales take one pass; per-head and per-tensor scales two (PASS 1: the
amax with integer atomics on the float bits, PASS 2: quantize with it). A program whose rows fit
one tile keeps it in registers between the amax and the cast; longer blocks are read again in
sub-tiles for the cast.
"""

from __future__ import annotations

from ._common import tl, triton

if triton is not None:
    from .quant_device import cast_fp8, rotate_tile, tile_descale

    @triton.jit
    def load_rotate(xb, rows, m, cols, sxs, sxd, SIGNS, hadamard, SQRT_D, TILE: tl.constexpr, D: tl.constexpr,
                    LOG2D: tl.constexpr, ROT: tl.constexpr, EXACT: tl.constexpr):
        x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
        return rotate_tile(x, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, EXACT)

    @triton.jit
    def quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN: tl.constexpr,
                    MBITS: tl.constexpr, EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                    POW2: tl.constexpr, EXACT: tl.constexpr, SOFT_CAST: tl.constexpr, RECIP: tl.constexpr):
        if GRAN == 3:
            dt = tile_descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, EXACT)
            tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
            q = cast_fp8(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, RECIP)
        else:
            q = cast_fp8(y, d32, MBITS, EMIN, FMT_MAX, OUT, EXACT, SOFT_CAST, RECIP)
        tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])

    @triton.jit
    def rq_tiled(X, Y, SIGNS, HADAMARD, SQRT_D, AMAX, DESC,
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
            hadamard = tl.load(HADAMARD + cols[:, None] * D + cols[None, :])
        else:
            hadamard = 0
        ai = 0
        if GRAN == 1:
            ai = b * (H // GROUP) + h // GROUP
        if SINGLE:
            rows = r0 + sub
            m = (rows < r_end) & (rows < N)
            y = load_rotate(xb, rows, m, cols, sxs, sxd, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, EXACT)
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
                    y = load_rotate(xb, rows, m, cols, sxs, sxd, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, EXACT)
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
            d32 = tile_descale(amax, FMT_MAX, POW2, EXACT)
            if GRAN == 2:
                tl.store(DESC + b * sdb + h * sdh + pid_t * sdn, d32)
            elif GRAN == 1:
                if (pid_t == 0) & (h % GROUP == 0):
                    tl.store(DESC + b * sdb + (h // GROUP) * sdh, d32)
            elif GRAN == 0:
                if (pid_t == 0) & (pid_bh == 0):
                    tl.store(DESC, d32)
            if SINGLE:
                quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN, MBITS, EMIN,
                            FMT_MAX, OUT, POW2, EXACT, SOFT_CAST, RECIP)
            else:
                for i in range(0, ROWS_PER_PROG, TILE):
                    rows = r0 + i + sub
                    m = (rows < r_end) & (rows < N)
                    y = load_rotate(xb, rows, m, cols, sxs, sxd, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, EXACT)
                    quant_store(y, d32, yb, rows, m, cols, sys_, syd, DESC, b, h, sdb, sdh, sdn, GRAN, MBITS,
                                EMIN, FMT_MAX, OUT, POW2, EXACT, SOFT_CAST, RECIP)
