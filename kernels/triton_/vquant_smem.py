"""Per-block FP8 quantization of V written transposed, the block's inputs resident in shared memory
(Gluon, sm_90).

Exposed: ``quantize_v_smem`` (``rotate_quant.rotate_quantize(..., rot="none", reread="smem")``, the
default for V blocks of more than 128 rows written (b, h, d, s)), ``vsmem_problem``.

Why: FA3's FP8 kernel takes V as (b, h, d, s) with one descale per block of its 224-row KV tile
at head_dim 128. The tl kernel must wait for a block's amax before it casts any row, so it reads
the block again from L2 one block behind ("skewed"): 64-67% of a copy on the H200 (probes p1-p3,
p14), the last granularity under 70%. Here, as ``rotate_quant_smem`` does for K, the block's BF16
rows come by TMA into a ring of shared memory that the kernel owns (one block: seven 32-row units
at 224 rows, 56 KB), pass 1 takes the amax from there, pass 2 reads each unit again, scales and
casts it, turns it to (d, s) through a layout conversion in registers and shared memory, and stores
it by TMA through two 4 KB staging tiles; a unit takes the next block's TMA load as soon as pass 2
has read it. HBM reads each element once, L2 nothing twice.

Values: no rotation, so the bytes are the tl kernel's and ``prepare()``'s exactly: power-of-two
descales cast with one multiply by the reciprocal (exact), amax descales with the corrected
division (``rotate_quant_smem._scale_cast``, the IEEE quotient). Rows past the sequence's end are
zero-filled by the TMA loads (|0| leaves the amax as it is) and clipped by the TMA stores.
"""

from __future__ import annotations

import torch

from .quant_launch import dims, programs
from .rotate_quant_smem import _MAX_ROWS, _view3, hopper_bf16_problem, resident

try:  # Gluon ships with triton >= 3.5; absent, vsmem_problem says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - exercised where triton is absent or older
    gluon = gl = None

_UNIT = 32  # rows of a ring unit: 8 KB of BF16 at head_dim 128, 4 KB of FP8 staged


if gluon is not None:
    from .quant_device import work_item
    from .rotate_quant_smem import _block_descale, _scale_cast

    @gluon.jit
    def _issue_v(x_desc, xs, bars, t, pred, H, NBLK, R, XOB, XOH, XCH, J: gl.constexpr, U: gl.constexpr,
                 HEAD_FAST: gl.constexpr):
        """TMA load of unit J (rows J U .. J U + U - 1) of item t into its buffer; barrier J."""
        b, h, blk = work_item(t, H, NBLK, HEAD_FAST)
        bar = bars.index(J)
        mbarrier.expect(bar, x_desc.block_type.nbytes, pred)
        tma.async_copy_global_to_shared(x_desc, [b * XOB + h * XOH, blk * R + J * U, h * XCH], bar, xs.index(J), pred)

    @gluon.jit
    def _vq_block_smem(x_desc, y_desc, DESC, sdb, sdh, sdn, H, N, R, NBLK, TOTAL, XOB, XOH, XCH,
                       U: gl.constexpr, D: gl.constexpr, SUB: gl.constexpr, POW2: gl.constexpr, MUL: gl.constexpr,
                       FMT_MAX: gl.constexpr, HEAD_FAST: gl.constexpr, num_warps: gl.constexpr):
        """Persistent: program pid takes items pid, pid + programs, ... (a block of R = SUB U rows
        of one (batch, head)); unit J of the ring with mbarrier J."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        nb = gl.cdiv(TOTAL - pid, nprog)
        X2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        Y2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        # loads: 4 rows x 8 consecutive d a thread (16-byte loads), so that after the transpose a
        # thread holds 4 consecutive s (4-byte stores into the layout conversion's scratch, 86 STS
        # against 254 with 1 row a thread); stores to the (d, s) staging tile: 8 consecutive s a
        # thread, a warp's 8 rows of d contiguous (256 B, no bank conflict)
        LX: gl.constexpr = gl.BlockedLayout([4, 8], [2, 16], [num_warps, 1], [1, 0])
        LY: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        xs = gl.allocate_shared_memory(gl.bfloat16, [SUB] + x_desc.block_type.shape, x_desc.layout)
        ys = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape, y_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SUB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SUB):
            mbarrier.init(bars.index(i), count=1)
        for j in gl.static_range(SUB):
            _issue_v(x_desc, xs, bars, pid, nb > 0, H, NBLK, R, XOB, XOH, XCH, j, U, HEAD_FAST)
        for k in range(nb):
            t = pid + k * nprog
            b, h, blk = work_item(t, H, NBLK, HEAD_FAST)
            # pass 1: the block's amax, elementwise maxima in registers and one reduction
            run = gl.zeros([U, D], gl.float32, LX)
            for j in gl.static_range(SUB):
                mbarrier.wait(bars.index(j), k & 1)
                v = xs.index(j)._reinterpret(gl.bfloat16, [U, D], X2).load(LX)
                run = gl.maximum(run, gl.abs(v.to(gl.float32)))
            am = gl.max(gl.max(run, axis=1), axis=0)
            s, r = _block_descale(am, FMT_MAX, POW2)
            gl.store(DESC + b * sdb + h * sdh + blk * sdn, s)
            more = k + 1 < nb
            # pass 2: read each unit again, hand it to the next block's load, cast, store (d, s)
            for j in gl.static_range(SUB):
                v = xs.index(j)._reinterpret(gl.bfloat16, [U, D], X2).load(LX).to(gl.float32)
                if MUL:  # power-of-two descales: r = 2^-e exactly, v * r is v / s
                    q = (v * r).to(y_desc.dtype)
                else:
                    q = _scale_cast(v, s, r, y_desc.dtype)
                qt = gl.convert_layout(gl.permute(q, [1, 0]), LY)
                # the staging tile of two units ago has been read (the unit before this block's first
                # used the same tile when SUB is odd: then none may be pending) ...
                tma.store_wait(pendings=0 if (j == 0 and SUB % 2 == 1) else 1)
                gl.thread_barrier()  # ... and every warp has read unit j
                _issue_v(x_desc, xs, bars, t + nprog, more, H, NBLK, R, XOB, XOH, XCH, j, U, HEAD_FAST)
                st = ys.index(j % 2)
                st._reinterpret(y_desc.dtype, [D, U], Y2).store(qt)
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(y_desc, [b * H + h, 0, blk * R + j * U], st)
        tma.store_wait(pendings=0)
        for i in gl.static_range(SUB):
            mbarrier.invalidate(bars.index(i))


def vsmem_problem(x: torch.Tensor, layout: str, out_layout: str, rows: int, d: int, n: int) -> str | None:
    """Why this kernel cannot run a case, or None."""
    why = hopper_bf16_problem(x, "the shared-memory V kernel", "TMA")
    if why:
        return why
    if layout not in ("bshd", "bhsd") or out_layout != "bhds":
        return "the shared-memory V kernel reads rows of head_dim and writes (b, h, d, s)"
    if d != 128:
        return "the shared-memory V kernel is built for head_dim 128 (FA3's 224-row V tile)"
    if not x.is_contiguous():
        return "the shared-memory V kernel needs a contiguous input (TMA descriptor)"
    if rows % _UNIT:
        return f"the shared-memory V kernel needs blocks of a multiple of {_UNIT} rows"
    if rows > _MAX_ROWS:
        return f"the shared-memory V kernel holds a block in shared memory: at most {_MAX_ROWS} rows"
    if n % 16:
        return "the shared-memory V kernel writes rows of s by TMA: seqlen must be a multiple of 16"
    return None


def quantize_v_smem(x: torch.Tensor, y: torch.Tensor, desc: torch.Tensor, *, layout: str, rows: int, pow2: bool,
                    fmt_max: float, progs_per_sm: int = 0, head_fast: bool | None = None,
                    pow2_mul: bool = True) -> str:
    """Fill ``y`` (FP8, (b, h, d, s)) and ``desc`` (float32 (b, h, blocks)) with per-block scales
    of ``rows`` rows (a multiple of 32) of ``x`` (BF16, ``layout``); returns the launch
    description. ``progs_per_sm`` defaults to what the compiled kernel's registers and shared
    memory fit (3 at 224 rows: 56 KB of ring, 8 KB of staging and the layout change's scratch).
    ``pow2_mul``: power-of-two descales cast with one multiply by the reciprocal (exact) instead of
    the corrected division."""
    b, h, n, d = dims(x, layout)
    u = _UNIT
    sub = rows // u
    nblk = -(-n // rows)
    total = b * h * nblk
    x3, xob, xoh, xch = _view3(x, layout)
    y3 = y.view(b * h, d, n)
    # Host-side TMA descriptors, made per call: a cache of them would hold the tensors alive.
    xd = TensorDescriptor.from_tensor(x3, [1, u, d], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16,
                                                                         rank=3))
    yd = TensorDescriptor.from_tensor(y3, [1, d, u], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8,
                                                                         rank=3))
    if head_fast is None:
        head_fast = layout == "bshd"
    args = (xd, yd, desc, desc.stride(0), desc.stride(1), desc.stride(2), h, n, rows, nblk, total, xob, xoh, xch)
    kw = dict(U=u, D=d, SUB=sub, POW2=bool(pow2), MUL=bool(pow2 and pow2_mul), FMT_MAX=float(fmt_max),
              HEAD_FAST=bool(head_fast), num_warps=4)
    if not progs_per_sm:
        # without a compiled kernel's resources: the ring, the staging tiles and the conversion's scratch
        est = (228 * 1024) // (sub * u * d * 2 + 2 * d * u + u * d + 2048)
        progs_per_sm = resident(_vq_block_smem, args, kw, est)
    grid = (programs(x.device, total, progs_per_sm),)
    _vq_block_smem[grid](*args, **kw)
    return (f"gluon smem-v unit{u} x{sub} w4 pps{progs_per_sm}{' pow2-mul' if kw['MUL'] else ''}"
            + ("" if head_fast else " seq-first"))


__all__ = ["quantize_v_smem", "vsmem_problem"]
