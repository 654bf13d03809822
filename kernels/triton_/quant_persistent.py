"""The persistent quantizer kernel (the float32 fast path, the default): a fixed grid of programs
walks the work items with software-pipelined loads, the +-1 matrix loaded once per program.

Exposed: ``rq_persistent`` (where triton imports), ``resident_programs``.

As many programs run per SM as the compiled kernel's registers and shared memory allow
(``resident_programs``; ``rotate_quant`` caps it). Measured on the H200 against a
device-to-device copy: reports/h200/triton/report.md.
"""

from __future__ import annotations

from ._common import tl, triton
from .quant_launch import fit_per_sm

if triton is not None:
    from .quant_blocks import block_kept_inputs, block_skewed, block_subtiles
    from .quant_device import rotate_tile, scale_cast, tile_descale, work_item

    @triton.jit
    def rq_persistent(X, Y, SIGNS, HADAMARD, SQRT_D, AMAX, DESC,
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
            hadamard = tl.load(HADAMARD + cols[:, None] * D + cols[None, :])
        else:
            hadamard = 0
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
                b, h, blk = work_item(t, H, NBLK, False)
                rows = blk * R + sub
                m = (sub < R) & (rows < N) & ok
                xb = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
                x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
                y = rotate_tile(x, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False)
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
            block_skewed(X, Y, hadamard, SIGNS, SQRT_D, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                         H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D, LOG2D, TILE, ROT, POW2, MBITS, EMIN,
                         FMT_MAX, OUT, SOFT_CAST, DIV, STAGES, HEAD_FAST, SUB)
            return
        if SUB > 1 and REREAD == 3:
            block_kept_inputs(X, Y, hadamard, SIGNS, SQRT_D, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh,
                              sdn, H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D, LOG2D, TILE, ROT, POW2, MBITS, EMIN,
                              FMT_MAX, OUT, SOFT_CAST, DIV, STAGES, HEAD_FAST, SUB)
            return
        if SUB > 1:
            block_subtiles(X, Y, hadamard, SIGNS, SQRT_D, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
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
                b, h, blk = work_item(tt, H, NBLK, False)
            else:
                t = pid + i * nprog
                b, h, blk = work_item(t, H, NBLK, HEAD_FAST)
            rows = blk * R + sub
            m = (sub < R) & (rows < N) & (t < TOTAL)
            xb = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
            x = tl.load(xb + rows[:, None].to(tl.int64) * sxs + cols[None, :] * sxd, mask=m[:, None], other=0.0)
            y = rotate_tile(x, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False)
            if GRAN == 3:
                dt = tile_descale(tl.max(tl.abs(y), axis=1), FMT_MAX, POW2, False)
                tl.store(DESC + b * sdb + h * sdh + rows * sdn, dt, mask=m)
                q = scale_cast(y, dt[:, None], MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
            else:
                if GRAN == 2:
                    d32 = tile_descale(tl.max(tl.max(tl.abs(y), axis=1), axis=0), FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                elif GRAN == 1:
                    hg = h // GROUP
                    d32 = tile_descale(tl.load(AMAX + b * (H // GROUP) + hg).to(tl.float32, bitcast=True),
                                       FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + hg * sdh, d32, mask=(blk == 0) & (h % GROUP == 0) & (t < TOTAL))
                else:
                    d32 = tile_descale(tl.load(AMAX).to(tl.float32, bitcast=True), FMT_MAX, POW2, False)
                    tl.store(DESC, d32, mask=t == 0)
                q = scale_cast(y, d32, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
            yb = Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh
            tl.store(yb + rows[:, None].to(tl.int64) * sys_ + cols[None, :] * syd, q, mask=m[:, None])


_RESIDENT: dict = {}


def resident_programs(args, common: dict, passes, x, y, cap: int) -> int:
    """Programs of the compiled kernel that fit one SM, by its registers and shared memory (a
    persistent grid of more than fit would run a second wave), at most ``cap``. Compiles
    without launching."""
    key = (tuple(common.items()), passes, x.dtype, y.dtype, x.device, tuple(a % 16 == 0 or a == 1 for a in args[7:18]),
           cap)
    if key not in _RESIDENT:
        fit = cap
        for p in passes:
            fit = min(fit, fit_per_sm(rq_persistent.warmup(*args, grid=(1,), PASS=p, **common), common["num_warps"]))
        _RESIDENT[key] = max(1, fit)
    return _RESIDENT[key]

