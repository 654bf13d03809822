"""Compile the fused quantizer's kernels for sm_90 on this CPU (no GPU needed) and print what
decides their speed before any device time is spent: registers a thread, spilled bytes, shared
memory, how many programs fit one SM by each, and the SASS instruction mix (tensor-core MMAs,
TMA and asynchronous copies, stores, barriers, spills).

    python benchmarks/sm90_compile.py                        # tl kernel, 224-row K tile (read again)
    python benchmarks/sm90_compile.py --sub 2 --reread 0 --stages 3 --maxnreg 0   # the 128-row Q tile
    python benchmarks/sm90_compile.py --kernel smem          # the shared-memory kernel, 224 rows
    python benchmarks/sm90_compile.py --kernel smem --rows 128 --parts 4
    python benchmarks/sm90_compile.py --kernel attn --warp-specialize   # can Triton warp-specialize it?

Needs triton (``pip install triton==3.6.0``; it brings ptxas and nvdisasm). The launch the
library would pick is in ``rotate_quantize``'s ``launch``; this probe compiles the same kernel
for the constants given.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def compile_kernel(*, d=128, tile=64, rot=2, gran=2, sub=4, reread=1, stages=2, warps=4, maxnreg=0, passes=0,
                   head_fast=True, out_layout="bhsd", div=2):
    import triton

    from fa3_numerics.kernels.triton_ import quant_persistent

    fn = quant_persistent.rq_persistent
    ptr = {"X": "*bf16", "Y": "*fp8e4nv", "SIGNS": "*fp32", "HADAMARD": "*bf16", "SQRT_D": "*fp32", "AMAX": "*i32",
           "DESC": "*fp32"}
    # strides of a (b, s, h, d) input and a (b, h, s, d) or (b, h, d, s) output: the ones that are 1
    # are specialised to constants by Triton's launcher, the others are multiples of 16.
    ones = {"sxd"} | ({"syd"} if out_layout == "bhsd" else {"sys_"})
    consts = dict(D=d, LOG2D=int(math.log2(d)), TILE=tile, ROT=rot, GRAN=gran, PASS=passes, POW2=True, MBITS=3,
                  EMIN=-6, FMT_MAX=448.0, OUT=triton.language.float8e4nv, SOFT_CAST=False, DIV=div, STAGES=stages,
                  HEAD_FAST=head_fast)
    if sub > 1:
        consts.update(SUB=sub, REREAD=reread)
    return _compile(fn, ptr, consts, ones, lambda n: n.startswith("s"), {"num_warps": warps}, maxnreg)


def _compile(fn, ptr: dict, consts: dict, ones: set, aligned, opts: dict, maxnreg: int):
    """Compile ``fn`` for sm_90 as Triton's launcher would specialise it: pointers and the integers
    ``aligned(name)`` names divisible by 16, the ``ones`` equal to 1 (constants), ``consts``
    constexpr, every other argument an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts)
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = ptr[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ones:
            sig[n] = "constexpr"
            consts[n] = 1
        else:
            sig[n] = "i32"
            if aligned(n):
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = dict(opts)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    src = ASTSource(fn, sig, constexprs={k: v for k, v in consts.items() if k in fn.arg_names}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=opts)


def compile_rope_kernel(*, tiled=False, d=128, tile=64, gran=1, passes=2, stages=3, warps=4, maxnreg=0,
                        interleaved=False, rot=True, soft_cast=False, split=3, table_per_head=False):
    """The fused RoPE pre-pass for a (b, s, h, d) BF16 input, half-width float32 tables and a
    (b, s, h, d) FP8 output (FA3's layout): ``rope_persistent.rp_persistent`` (the fast path), or
    with ``tiled`` ``rope_quant._rope_quant_kernel`` on its float32 path (the kernel before it)."""
    import triton

    from fa3_numerics.kernels.triton_ import rope_persistent, rope_quant

    fp8 = triton.language.float8e4nv
    common = dict(ROPE=1 if interleaved else 2, HAS_POS=False, SMOOTH=False, GRAN=gran, PASS=passes, POW2=False,
                  MBITS=3, EMIN=-6, FMT_MAX=448.0, OUT=fp8, SOFT_CAST=soft_cast, BIAS=7, SUBQ=2.0 ** 9, NAN=0x7F,
                  DOT_F32=False)
    if tiled:
        fn = rope_quant._rope_quant_kernel
        common.update(D=d, LOG2D=d.bit_length() - 1, TILE=tile, SINGLE=True, TABLE_FULL=False, ROT=int(rot),
                      EXACT=False, ROPE=1 if interleaved else 2)
        ptr = {"X": "*bf16", "Y": "*u8" if soft_cast else "*fp8e4nv", "COS": "*fp32", "SIN": "*fp32", "POS": "*i64",
               "SIGNS": "*fp32", "HMAT": "*bf16", "SCAL": "*fp32", "MU": "*fp64", "AMAX": "*i32", "DESC": "*fp32"}
    else:
        fn = rope_persistent.rp_persistent
        common.update(HALF=d // 2, TILE=tile, INTERLEAVED=interleaved, ROPE=True, FULL=False, ROT=rot,
                      DIV=2, STAGES=stages, SPLIT=split, TABLE_PER_HEAD=table_per_head)
        ptr = {"X": "*bf16", "Y": "*u8" if soft_cast else "*fp8e4nv", "COS": "*fp32", "SIN": "*fp32", "POS": "*i64",
               "HM": "*bf16", "SQRT_D": "*fp32", "MU": "*fp32", "AMAX": "*i32", "DESC": "*fp32"}
    # The strides of the input, the output and the tables are multiples of 16 (0 too, which the
    # launcher specialises alike); the inner ones are 1.
    aligned = {"sxb", "sxh", "sxs", "syb", "syh", "sys_", "stb", "stn"}
    return _compile(fn, ptr, common, {"sxd", "syd", "std"}, aligned.__contains__,
                    {"num_warps": warps, "enable_fp_fusion": False}, maxnreg)


def compile_smem_kernel(*, rows=224, keep_last=False, parts=2, stage_in_ring=True, pow2=True, head_fast=True,
                        maxnreg=0, mul=True):
    """The shared-memory (Gluon) per-block kernel of ``rotate_quant_smem``, for a (b, s, h, d)
    BF16 input and a (b, h, s, d) FP8 output at head_dim 128."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from fa3_numerics.kernels.triton_ import rotate_quant_smem as rs

    tile = rs._TILE
    pw, unit, sub = 128 // parts, tile // 2, -(-rows // tile)

    def desc(dt, ty, shape):
        return f"tensordesc<{ty}[{', '.join(map(str, shape))}],{gl.NVMMASharedLayout.get_default_for(shape, dt)!r}>"

    fn = rs._rq_block_smem
    sig = {"x_desc": desc(gl.bfloat16, "bf16", [1, tile, pw]), "xl_desc": desc(gl.bfloat16, "bf16", [1, unit, pw]),
           "y_desc": desc(gl.float8e4nv, "fp8e4nv", [1, tile, pw]),
           "yl_desc": desc(gl.float8e4nv, "fp8e4nv", [1, unit, pw]),
           "h_desc": desc(gl.bfloat16, "bf16", [pw, pw]), "SQRT_D": "*fp32", "DESC": "*fp32"}
    consts = dict(TILE=tile, PART=pw, NP=parts, SUB=sub, SHORT=rows - (sub - 1) * tile == unit, KEEP_LAST=keep_last,
                  STAGE_IN_RING=stage_in_ring, POW2=pow2, MUL=pow2 and mul, FMT_MAX=448.0, HEAD_FAST=head_fast, num_warps=4, sdn=1)
    for n in fn.arg_names:
        if n not in sig:
            sig[n] = "constexpr" if n in consts else "i32"
    opts = {"num_warps": 4}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    src = GluonASTSource(fn, sig, constexprs={k: v for k, v in consts.items() if k in fn.arg_names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=opts)


def compile_vsmem_kernel(*, rows=224, pow2=True, head_fast=True):
    """The shared-memory (Gluon) V kernel of ``vquant_smem``: a (b, s, h, d) BF16 input, a
    (b, h, d, s) FP8 output at head_dim 128."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from fa3_numerics.kernels.triton_ import vquant_smem as vs

    u, d = vs._UNIT, 128

    def desc(ty, bits, shape):
        return f"tensordesc<{ty}[{', '.join(map(str, shape))}],{gl.NVMMASharedLayout(0, bits, rank=3)!r}>"

    fn = vs._vq_block_smem
    sig = {"x_desc": desc("bf16", 16, [1, u, d]), "y_desc": desc("fp8e4nv", 8, [1, d, u]), "DESC": "*fp32"}
    consts = dict(U=u, D=d, SUB=rows // u, POW2=pow2, MUL=pow2, FMT_MAX=448.0, HEAD_FAST=head_fast, num_warps=4, sdn=1)
    for n in fn.arg_names:
        if n not in sig:
            sig[n] = "constexpr" if n in consts else "i32"
    src = GluonASTSource(fn, sig, constexprs={k: v for k, v in consts.items() if k in fn.arg_names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": 4})


def compile_attn_kernel(*, d=128, block_m=64, block_n=128, warps=4, stages=3, fold=False, causal=False,
                        two_level=False, maxnreg=0, nq=8192, heads=16, extra=None):
    """The Triton FP8 attention forward (``attention._fwd_kernel``) as ``attention_fp8`` launches it
    for (b, h, s, d) FP8 Q and K and (b, h, d, s) V: the paper's ``fa3-fp8`` recipe (per-block
    descales of 128 rows, ``fold`` off) or per-head descales (``fold``). ``extra``: more constexprs
    (a kernel variant's switches)."""
    import triton

    from fa3_numerics.kernels.triton_ import attention as at

    n1, n2, n3 = at.kv_chunks(block_n)
    fp8 = triton.language.float8e4nv
    consts = dict(D=d, BLOCK_M=block_m, N1=n1, N2=n2, N3=n3, CAUSAL=causal, FOLD=fold,
                  Q_ROWS=nq if fold else 128, K_ROWS=nq if fold else 128, K_TILE=not fold and 128 % block_n == 0,
                  V_TILE=not fold, V_ROWS=nq if fold else 128, TWO_LEVEL=two_level, REVERSE=True, P_OFFSET=8.0,
                  P_DT=fp8, P_MBITS=3, P_EMIN=-6, P_MAX=448.0, OUT_DT=triton.language.bfloat16, SOFT_CAST=False)
    # A constexpr with a default must still be named here: _compile makes any other argument an i32.
    consts = {"WS": False, **consts, **(extra or {})}
    ptr = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "Vt": "*fp8e4nv", "O": "*bf16", "QD": "*fp32", "KD": "*fp32",
           "VD": "*fp32", "base_ptr": "*fp32"}
    # V^T's sequence stride, the descales' block strides (per block) and GROUP (MHA) are 1.
    ones = {"s_vs", "GROUP"} | (set() if fold else {"s_qdn", "s_kdn", "s_vdt"})
    return _compile(at._fwd_kernel, ptr, consts, ones, lambda n: n.startswith("s_") or n.startswith("N_"),
                    {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}, maxnreg)


def sass_mix(cubin: bytes) -> dict:
    nvdisasm = Path(__import__("triton").__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text, re.M)
    mix = {}
    # HGMMA: BF16/FP16 tensor-core products; QGMMA: the FP8 ones.
    for key in ("HGMMA", "QGMMA", "WARPGROUP", "MUFU.EX2", "F2FP", "FMUL", "FADD", "FFMA", "FMNMX", "HMMA", "UTMALDG", "UTMASTG", "SYNCS", "LDGSTS", "STG", "LDG", "STL", "LDL", "BAR", "SHFL",
                "WARPSYNC", "LDS", "STS"):
        mix[key] = sum(1 for o in ops if o.startswith(key))
    mix["total"] = len(ops)
    return mix


def _warp_specialized(a, plain) -> str:
    """The attention kernel compiled again with ``WS`` (``tl.range(..., warp_specialize=True)`` on
    its unmasked loop): one line saying whether this Triton split the loop into producer and
    consumer warps on sm_90, i.e. whether a product could overlap the softmax."""
    import os

    import triton

    # A failing pass prints an assertion and a whole MLIR reproducer on the process's stderr:
    # keep them out of the output, and quote the assertion.
    with tempfile.TemporaryFile(mode="w+") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            ws = compile_attn_kernel(d=a.d, block_m=a.block_m, block_n=a.block_n, warps=a.warps, stages=a.stages,
                                     fold=a.fold, causal=a.causal, two_level=a.two_level, maxnreg=a.maxnreg,
                                     extra={"WS": True})
            failed = None
        except Exception as exc:  # the compiler's own failure is the finding
            failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        said = [ln.strip() for ln in err if "Assertion" in ln or "error:" in ln]
    head = f"warp specialization (Triton {triton.__version__}, sm_90, {a.warps} warps):"
    if failed:
        where = [re.sub(r".*?([\w]+\.cpp:\d+):.*?(Assertion .*)", r"\1: \2", ln) for ln in said]
        return f"{head} the compiler failed ({failed}; {where[0][:160] if where else 'no message'})"
    if ws.asm["cubin"] == plain.asm["cubin"] or sass_mix(ws.asm["cubin"]) == sass_mix(plain.asm["cubin"]):
        return f"{head} not applied (the same code as without it: {int(ws.metadata.num_warps)} warps, no partitions)"
    return (f"{head} applied: {int(ws.metadata.num_warps)} warps; SASS "
            + ", ".join(f"{k} {v}" for k, v in sass_mix(ws.asm["cubin"]).items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--rot", type=int, default=2, help="tl kernel: 0 none, 1 butterfly, 2 dot")
    ap.add_argument("--gran", type=int, default=2, help="0 tensor, 1 head, 2 block, 3 token")
    ap.add_argument("--sub", type=int, default=4)
    ap.add_argument("--reread", type=int, default=1, help="0 kept, 1 reread, 2 sync, 3 inputs, 4 skewed")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="register cap (default: the library's: 168 for the tl kernel's 224-row tile, none for smem)")
    ap.add_argument("--passes", type=int, default=0)
    ap.add_argument("--out-layout", default="bhsd")
    ap.add_argument("--kernel", default="tl", choices=("tl", "smem", "vsmem", "rope", "rope-tiled", "attn"),
                    help="tl: quant_persistent.rq_persistent; smem: rotate_quant_smem._rq_block_smem (Gluon); "
                         "vsmem: vquant_smem._vq_block_smem (Gluon, V written (b, h, d, s)); rope: "
                         "rope_persistent.rp_persistent (--gran, --passes, --tile, --stages, --warps, --interleaved); "
                         "rope-tiled: rope_quant._rope_quant_kernel's float32 path; attn: attention._fwd_kernel "
                         "(--block-m, --block-n, --warps, --stages, --fold, --causal)")
    ap.add_argument("--block-m", type=int, default=64, help="attn: query rows a program")
    ap.add_argument("--block-n", type=int, default=128, help="attn: KV tile")
    ap.add_argument("--fold", action="store_true", help="attn: per-head descales (folded into the softmax scale)")
    ap.add_argument("--causal", action="store_true", help="attn: causal")
    ap.add_argument("--two-level", action="store_true", help="attn: the two-level P.V accumulation")
    ap.add_argument("--warp-specialize", action="store_true",
                    help="attn: also ask Triton to warp-specialize the unmasked KV loop and say whether it could")
    ap.add_argument("--interleaved", action="store_true", help="rope: the interleaved RoPE layout")
    ap.add_argument("--table-per-head", action="store_true", help="rope: cos/sin rows read per head")
    ap.add_argument("--split", type=int, default=3, help="rope: SPLIT (3, 2, 1 BF16 parts; 4 two TF32 parts)")
    ap.add_argument("--soft-cast", action="store_true", help="rope: the hand-encoded cast (the interpreter's)")
    ap.add_argument("--rows", type=int, default=224, help="smem: rows per block")
    ap.add_argument("--keep-last", action="store_true",
                    help="smem: the last sub-tile kept rotated in registers between the passes (not rotated twice)")
    ap.add_argument("--parts", type=int, default=2, help="smem: column parts of the split rotation (2 or 4)")
    ap.add_argument("--no-mul", action="store_true",
                    help="smem: the corrected division for power-of-two descales too (not one multiply)")
    ap.add_argument("--div", type=int, default=2, help="tl: DIV of _scale_cast (2: corrected division, 1: multiply)")
    ap.add_argument("--staging-buffer", action="store_true",
                    help="smem: a staging buffer, not the kept sub-tile's units")
    a = ap.parse_args(argv)
    if a.maxnreg is None:
        a.maxnreg = 168 if a.kernel == "tl" else 0
    if a.kernel == "attn" and "--stages" not in " ".join(argv or sys.argv):
        a.stages = 3  # plan_tiles' default
    if a.kernel.startswith("rope") and a.gran == 2 and a.passes == 0 and "--gran" not in " ".join(argv or sys.argv):
        a.gran, a.passes = 1, 2  # the rope kernels' default probe: per-head scales, the quantizing pass
    try:
        if a.kernel == "attn":
            k = compile_attn_kernel(d=a.d, block_m=a.block_m, block_n=a.block_n, warps=a.warps, stages=a.stages,
                                    fold=a.fold, causal=a.causal, two_level=a.two_level, maxnreg=a.maxnreg)
        elif a.kernel in ("rope", "rope-tiled"):
            k = compile_rope_kernel(tiled=a.kernel == "rope-tiled", d=a.d, tile=a.tile, gran=a.gran,
                                    passes=a.passes, stages=a.stages, warps=a.warps, maxnreg=a.maxnreg,
                                    interleaved=a.interleaved, rot=a.rot != 0, soft_cast=a.soft_cast,
                                    split=a.split, table_per_head=a.table_per_head)
        elif a.kernel == "vsmem":
            k = compile_vsmem_kernel(rows=a.rows)
        elif a.kernel == "smem":
            k = compile_smem_kernel(rows=a.rows, keep_last=a.keep_last, parts=a.parts,
                                    stage_in_ring=not a.staging_buffer, maxnreg=a.maxnreg, mul=not a.no_mul)
        else:
            k = compile_kernel(d=a.d, tile=a.tile, rot=a.rot, gran=a.gran, sub=a.sub, reread=a.reread,
                               stages=a.stages, warps=a.warps, maxnreg=a.maxnreg, passes=a.passes,
                               out_layout=a.out_layout, div=a.div)
    except ImportError as exc:
        print(f"error: {exc}; install triton==3.6.0 to compile for sm_90 here", file=sys.stderr)
        return 2
    if a.kernel == "attn" and a.warp_specialize:
        print(_warp_specialized(a, k))
    md = k.metadata
    ptx = k.asm["ptx"]
    ptxas = Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.ptx"
        p.write_text(ptx)
        args = [str(ptxas), "-v", "--gpu-name=sm_90a", str(p), "-o", str(Path(tmp) / "k.o")]
        if a.maxnreg:
            args.insert(2, f"--maxrregcount={a.maxnreg}")
        info = subprocess.run(args, capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    smem = int(md.shared)
    warps = int(k.metadata.num_warps)
    regs_r = ((regs + 7) // 8) * 8 * 32 * warps
    fit = min(65536 // regs_r, (228 * 1024) // (smem + 1024))
    mix = sass_mix(k.asm["cubin"])
    print(f"d {a.d} tile {a.tile} rot {a.rot} gran {a.gran} sub {a.sub} reread {a.reread} stages {a.stages} "
          f"warps {warps} maxnreg {a.maxnreg or '-'}")
    print(f"  registers {regs}, spill stores {spill.group(1)} B, spill loads {spill.group(2)} B, "
          f"shared {smem / 1024:.1f} KB")
    print(f"  programs per SM: {65536 // regs_r} by registers, {(228 * 1024) // (smem + 1024)} by shared memory "
          f"-> {fit}")
    print("  SASS: " + ", ".join(f"{k} {v}" for k, v in mix.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
