"""How the persistent quantizer walks a block longer than one tile (per-block scales): in sub-tiles
of ``TILE`` rows, one per software-pipelined loop step, with the block's sub-tiles either kept
in registers until the last gives the amax (``block_subtiles``, REREAD 0), loaded again from
L2 (``block_subtiles``, REREAD 1 as more pipelined steps, REREAD 2 at the block's last step),
kept as inputs and rotated again (``block_kept_inputs``), or loaded again one block later in
the next block's steps (``block_skewed``). ``rq_persistent`` calls them; ``rotate_quant``
chooses the mode (``_block_split``) and its launch.

Exposed (where triton imports): ``block_subtiles``, ``block_kept_inputs``, ``block_skewed``.
"""

from __future__ import annotations

from ._common import tl, triton

if triton is not None:
    from .quant_device import opaque, rotate_tile, store_subtile, tile_descale, work_item

    @triton.jit
    def block_subtiles(X, Y, hadamard, SIGNS, SQRT_D, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
                       H, N, R, NBLK, TOTAL, pid, nprog, cols, sub, D: tl.constexpr, LOG2D: tl.constexpr,
                       TILE: tl.constexpr, ROT: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                       EMIN: tl.constexpr, FMT_MAX: tl.constexpr, OUT: tl.constexpr, SOFT_CAST: tl.constexpr,
                       DIV: tl.constexpr, STAGES: tl.constexpr, HEAD_FAST: tl.constexpr, SUB: tl.constexpr,
                       REREAD: tl.constexpr):
        """Per-block scales, a block as SUB sub-tiles of TILE rows (see rq_persistent). One loop
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
            b, h, blk = work_item(pid + k * nprog, H, NBLK, HEAD_FAST)
            b0 = blk * R  # the block's first row
            r0 = b0 + js * TILE  # this sub-tile's
            end = tl.minimum(b0 + R, N)
            xr = X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r0.to(tl.int64) * sxs)
            x = tl.load(xr + offx, mask=(sub < end - r0)[:, None], other=0.0)
            y = rotate_tile(x, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False)
            if REREAD == 2:
                # The pipelined loop reads each sub-tile from HBM once (amax); at the block's last
                # one, the earlier sub-tiles are loaded again (L2 hits) outside the pipeline,
                # rotated again and cast, then the last one, still in registers.
                run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
                if j == SUB - 1:
                    d32 = tile_descale(tl.max(run, axis=0), FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                    run = tl.zeros((TILE,), tl.float32)
                    xb = X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh)
                    yb = Y + (b.to(tl.int64) * syb + h.to(tl.int64) * syh)
                    for q in tl.static_range(SUB - 1):
                        rq = b0 + q * TILE
                        xq = tl.load(xb + rq.to(tl.int64) * sxs + offx, mask=((rq + sub) < end)[:, None], other=0.0)
                        yq = rotate_tile(xq, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False)
                        store_subtile(yq, d32, yb + rq.to(tl.int64) * sys_, offy, rq, sub, end, MBITS, EMIN, FMT_MAX,
                                      OUT, SOFT_CAST, DIV)
                    store_subtile(y, d32, yb + r0.to(tl.int64) * sys_, offy, r0, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                                  SOFT_CAST, DIV)
            elif REREAD == 1:
                if j < SUB:
                    run = tl.maximum(run, tl.max(tl.abs(y), axis=1))
                    if j == SUB - 1:
                        d32 = tile_descale(tl.max(run, axis=0), FMT_MAX, POW2, False)
                        tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                        run = tl.zeros((TILE,), tl.float32)
                else:
                    yr = Y + (b.to(tl.int64) * syb + h.to(tl.int64) * syh + r0.to(tl.int64) * sys_)
                    store_subtile(y, d32, yr, offy, r0, sub, end, MBITS, EMIN, FMT_MAX, OUT, SOFT_CAST, DIV)
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
                    d32 = tile_descale(am, FMT_MAX, POW2, False)
                    tl.store(DESC + b * sdb + h * sdh + blk * sdn, d32)
                    yb = Y + (b.to(tl.int64) * syb + h.to(tl.int64) * syh)
                    # s0 holds sub-tile SUB - 2, s1 SUB - 3, s2 SUB - 4
                    ra = b0 + (SUB - 2) * TILE
                    store_subtile(s0, d32, yb + ra.to(tl.int64) * sys_, offy, ra, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                                  SOFT_CAST, DIV)
                    if SUB > 2:
                        rb = b0 + (SUB - 3) * TILE
                        store_subtile(s1, d32, yb + rb.to(tl.int64) * sys_, offy, rb, sub, end, MBITS, EMIN, FMT_MAX,
                                      OUT, SOFT_CAST, DIV)
                    if SUB > 3:
                        store_subtile(s2, d32, yb + b0.to(tl.int64) * sys_, offy, b0, sub, end, MBITS, EMIN, FMT_MAX,
                                      OUT, SOFT_CAST, DIV)
                    store_subtile(y, d32, yb + r0.to(tl.int64) * sys_, offy, r0, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                                  SOFT_CAST, DIV)
                else:
                    # shift, not select by j: a select made the compiler keep two copies
                    if SUB > 3:
                        s2 = s1
                    if SUB > 2:
                        s1 = s0
                    s0 = y

    @triton.jit
    def block_kept_inputs(X, Y, hadamard, SIGNS, SQRT_D, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
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
            b, h, blk = work_item(pid + k * nprog, H, NBLK, HEAD_FAST)
            r0 = blk * R + j * TILE  # this sub-tile's first row
            xr = X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r0.to(tl.int64) * sxs)
            x = tl.load(xr + offx, mask=(sub < tl.minimum(blk * R + R, N) - r0)[:, None], other=0.0)
            # Row maxima of the rotation before its multiply by 1/sqrt(d): rounding is monotonic, so
            # fl(max|a| s) = max fl(|a| s), the amax of the rotated values, one multiply per block.
            a = rotate_tile(x, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False, True)
            run = tl.maximum(run, tl.max(tl.abs(a), axis=1))
            # The same k and j, computed anew: (i + SUB) // SUB - 1 == i // SUB.
            k2 = (i + SUB) // SUB - 1
            j2 = i - k2 * SUB
            if j2 == SUB - 1:
                b2, h2, blk2 = work_item(pid + k2 * nprog, H, NBLK, HEAD_FAST)
                b0 = blk2 * R
                end = tl.minimum(b0 + R, N)
                am = tl.max(run, axis=0)
                if ROT != 0:
                    sc = tl.load(SQRT_D + 1)
                    am = am * sc
                    y = a * sc
                else:
                    y = a
                d32 = tile_descale(am, FMT_MAX, POW2, False)
                tl.store(DESC + b2 * sdb + h2 * sdh + blk2 * sdn, d32)
                run = tl.zeros((TILE,), tl.float32)
                yb = Y + (b2.to(tl.int64) * syb + h2.to(tl.int64) * syh)
                rl = b0 + (SUB - 1) * TILE
                store_subtile(y, d32, yb + rl.to(tl.int64) * sys_, offy, rl, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                              SOFT_CAST, DIV)
                # x0 holds sub-tile SUB - 2, x1 SUB - 3, x2 SUB - 4. opaque: the dot's A operand in
                # registers (a loop-carried A goes through shared memory, which the compiler then
                # allocated at every step).
                ra = b0 + (SUB - 2) * TILE
                ya = rotate_tile(opaque(x0) if ROT == 2 else x0, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False)
                store_subtile(ya, d32, yb + ra.to(tl.int64) * sys_, offy, ra, sub, end, MBITS, EMIN, FMT_MAX, OUT,
                              SOFT_CAST, DIV)
                if SUB > 2:
                    rb = b0 + (SUB - 3) * TILE
                    yb1 = rotate_tile(opaque(x1) if ROT == 2 else x1, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT,
                                      False)
                    store_subtile(yb1, d32, yb + rb.to(tl.int64) * sys_, offy, rb, sub, end, MBITS, EMIN, FMT_MAX,
                                  OUT, SOFT_CAST, DIV)
                if SUB > 3:
                    yc = rotate_tile(opaque(x2) if ROT == 2 else x2, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT,
                                     False)
                    store_subtile(yc, d32, yb + b0.to(tl.int64) * sys_, offy, b0, sub, end, MBITS, EMIN, FMT_MAX,
                                  OUT, SOFT_CAST, DIV)
            else:
                if SUB > 3:
                    x2 = x1
                if SUB > 2:
                    x1 = x0
                x0 = x

    @triton.jit
    def block_skewed(X, Y, hadamard, SIGNS, SQRT_D, DESC, sxb, sxh, sxs, sxd, syb, syh, sys_, syd, sdb, sdh, sdn,
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

        The store side recomputes the block indices from the loop index (see block_kept_inputs)."""
        nb = tl.cdiv(TOTAL - pid, nprog)  # blocks of this program: pid, pid + nprog, ...
        offx = sub[:, None] * sxs + cols[None, :] * sxd
        offy = sub[:, None] * sys_ + cols[None, :] * syd
        run = tl.zeros((TILE,), tl.float32)
        d32 = tl.zeros((), tl.float32) + 1.0  # block k - 1's descale
        for i in tl.range(0, (nb + 1) * SUB, num_stages=STAGES):
            k = i // SUB
            j = i - k * SUB
            # block k, sub-tile j (none past the program's last block)
            b, h, blk = work_item(pid + tl.minimum(k, nb - 1) * nprog, H, NBLK, HEAD_FAST)
            r0 = blk * R + j * TILE
            xa = tl.load(X + (b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r0.to(tl.int64) * sxs) + offx,
                         mask=(sub < tl.where(k < nb, tl.minimum(blk * R + R, N) - r0, 0))[:, None], other=0.0)
            # block k - 1, sub-tile j (none before the first)
            bq, hq, blkq = work_item(pid + tl.maximum(k - 1, 0) * nprog, H, NBLK, HEAD_FAST)
            rq = blkq * R + j * TILE
            xb = tl.load(X + (bq.to(tl.int64) * sxb + hq.to(tl.int64) * sxh + rq.to(tl.int64) * sxs) + offx,
                         mask=(sub < tl.where(k > 0, tl.minimum(blkq * R + R, N) - rq, 0))[:, None], other=0.0)
            # Row maxima of the rotation before its multiply by 1/sqrt(d): rounding is monotonic, so
            # fl(max|a| s) = max fl(|a| s), the amax of the rotated values, one multiply per block.
            a = rotate_tile(xa, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False, True)
            run = tl.maximum(run, tl.max(tl.abs(a), axis=1))
            yq = rotate_tile(xb, SIGNS, hadamard, SQRT_D, TILE, D, LOG2D, ROT, False)
            # The same k and j, computed anew: (i + SUB) // SUB - 1 == i // SUB.
            k2 = (i + SUB) // SUB - 1
            j2 = i - k2 * SUB
            bp, hp, blkp = work_item(pid + tl.maximum(k2 - 1, 0) * nprog, H, NBLK, HEAD_FAST)
            bp0 = blkp * R
            rp = bp0 + j2 * TILE
            store_subtile(yq, d32, Y + (bp.to(tl.int64) * syb + hp.to(tl.int64) * syh + rp.to(tl.int64) * sys_),
                          offy, rp, sub, tl.where(k2 > 0, tl.minimum(bp0 + R, N), 0), MBITS, EMIN, FMT_MAX, OUT,
                          SOFT_CAST, DIV)
            if j2 == SUB - 1:
                am = tl.max(run, axis=0)
                if ROT != 0:
                    am = am * tl.load(SQRT_D + 1)
                d32 = tile_descale(am, FMT_MAX, POW2, False)
                b2, h2, blk2 = work_item(pid + tl.minimum(k2, nb - 1) * nprog, H, NBLK, HEAD_FAST)
                tl.store(DESC + b2 * sdb + h2 * sdh + blk2 * sdn, d32, mask=k2 < nb)
                run = tl.zeros((TILE,), tl.float32)

