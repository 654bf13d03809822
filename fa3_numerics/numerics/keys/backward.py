"""Recipe keys ``bwd.*``: the backward pass of a recipe, beside its forward, in the same spec.

A recipe's forward keys say how O and the log-sum-exp are computed; these say how the backward
(``fa3_numerics.numerics.backward``) computes dQ, dK, dV from them. Each GEMM of the backward is a
key whose value names the formats of its two operands, ``A:B`` (one name: both the same):

============  =====================  =====================================================
key           product                operands (A:B)
============  =====================  =====================================================
``bwd.s``     S = Q K^T (recompute)  Q : K; P = exp(S scale - LSE) from the saved LSE
``bwd.dv``    dV = P^T dO            P : dO
``bwd.dp``    dP = dO V^T            dO : V
``bwd.ds``    dS = P (dP - D)        dO : O, the inputs of D = rowsum(dO O); dS in float32
``bwd.dq``    dQ = dS K scale        dS : K
``bwd.dk``    dK = dS^T Q scale      dS : Q
============  =====================  =====================================================

Formats are float formats (fp32, bf16, fp16, e4m3, e5m2) or int8. 16-bit and fp32 operands are
used unscaled; FP8 and INT8 operands take one float32 descale per group at ``bwd.gran``
(``tensor``: cuDNN's and TransformerEngine's FP8 backward; ``head``; ``block``: the backward's
tiles, ``bwd.bm`` query rows or ``bwd.bn`` keys, and for P and dS one scale per bm x bn tile;
``token``: per row). The same operand may take different formats in two products (SageBwd keeps
dO in FP16 for dP and INT8 for dV), as a kernel that casts it twice does.

``bwd.acc`` models the backward's tensor-core accumulation (``fp32``, or ``fp22``: the Hopper MMA
model of ``numerics.mma`` for FP8 and BF16/FP16 operands, chained where FA3's backward chains:
dK and dV across query tiles in registers, dQ per KV tile into a float32 accumulator; ``fp64``:
every step in float64, which with fp64 operands is the exact algorithm the tests hold to autograd);
``bwd.order`` the order of the query tiles while dK and dV accumulate (FA2: last to first; it
changes the MMA model's chaining, and float32 rounding); ``bwd.gqa`` where grouped-query dK and dV
are rounded (FA3: summed in float32, written once; FA2 and SDPA on repeated K, V: each query
head's written, then summed and written again);
``bwd.dqcast`` how dS reaches its FP8 format for dQ (``direct``: one cast of the float32 value, as
for dK; ``fp16``: rounded to FP16 first, two roundings, as cuDNN's Hopper kernel does for dQ only; a dS
that is not FP8 is cast as it is, so per-product attribution can set bwd.dq's formats freely);
``bwd.pexp`` how P's exponent is recomputed from S and the saved natural-log LSE (``fa3``: exp2(S (scale
log2e) - LSE log2e), a float32 multiply and subtract, then exp2 correctly rounded; ``cudnn``: x = S' c - LSE
as one FFMA on the MMA's raw S' with c = (scale descale_Q) descale_K in float32, then CUDA's __expf,
ex2.approx.ftz(x log2e), bit for bit as the H200's MUFU.EX2 (``numerics.sfu``), and under
``bwd.pscale=offset`` P cast as the float32 product P scale_s, scale_s = float32(2^poff): cuDNN's Hopper kernel);
``bwd.dsform`` how dS is formed for its FP8 casts (``fa3``: P (dP - D) cast as x / descale, the softmax
scale applied to dQ and dK at the end; ``cudnn``: cuDNN's graph order, D from the FP8 codes' products
times the descales, dS = P (dP - D) attn_scale times scale_dP = max / amax in float32, dP - D as a multiply
then a subtraction: a what-if, it wins on most saved case-arms but not all; ``cudnn-ffma``: the same with
dP' descale_dO descale_V - D as one FFMA on the MMA's raw dP', which gives cuDNN's Amax_dP bit for bit on
every saved case-arm and which cudnn-fp8-kernel sets);
``bwd.dqscale`` where dQ's descales multiply (``tile``: each KV tile's product before the float32 sum over
tiles; ``end``: once on that sum of raw products, as cuDNN's matmul_fp8 epilogue, which cudnn-fp8-kernel sets);
``bwd.out`` the format dQ, dK, dV are written in (FP8 with a per-tensor scale, as cuDNN's
outputs); ``bwd.outscale`` how an FP8 gradient is scaled (``descale``: x / (amax / max) in
float64; ``scale``: x times scale = max / amax, both float32, as cuDNN's epilogue multiplies by
scale_dQ/dK/dV); ``bwd.rot`` a random Hadamard along head_dim on Q, K, V and dO before they are
quantized (a what-if: no public backward rotates), the gradients rotated back in float64.

Every key defaults to the exact backward (float32 operands, float32 accumulation, float32
outputs), so existing recipes, their spec strings and their forwards are unchanged; the backward
presets (``recipe.BACKWARD_PRESETS``) set them. None of these keys touches the forward.
"""

from __future__ import annotations

from ...errors import UsageError
from ..families import family, operand_name
from ..granularity import PerBlock, PerHead, PerTensor, PerToken, parse_granularity
from . import RecipeKey, parse_int, register_check, register_key

#: product key -> (what it computes, names of its operands A and B)
PRODUCTS = {
    "bwd.s": ("S = Q K^T, P recomputed from the saved LSE", ("Q", "K")),
    "bwd.dv": ("dV = P^T dO", ("P", "dO")),
    "bwd.dp": ("dP = dO V^T", ("dO", "V")),
    "bwd.ds": ("dS = P (dP - D), D = rowsum(dO O)", ("dO", "O")),
    "bwd.dq": ("dQ = dS K scale", ("dS", "K")),
    "bwd.dk": ("dK = dS^T Q scale", ("dS", "Q")),
}
_GRANS = (PerTensor, PerHead, PerBlock, PerToken)


def _one(name: str, key: str) -> str:
    return operand_name(name, ("float", "int"), f"{key}'s operands")


def operand_pair(value) -> tuple[str, str]:
    """``"e5m2:e4m3"`` -> ("e5m2", "e4m3"); ``"bf16"`` -> ("bf16", "bf16"); canonical names."""
    parts = [p.strip() for p in str(value).split(":")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"{value!r} is not A:B (two formats) or one format for both operands")
    return _one(parts[0], "a backward product"), _one(parts[1], "a backward product")


def _pair_text(value) -> str:
    a, b = operand_pair(value)
    if "int4" in (a, b):
        raise UsageError("int4 operands are not offered in the backward (no backward kernel uses them); use int8")
    return a if a == b else f"{a}:{b}"


def _bwd_granularity(value):
    g = parse_granularity(value) if isinstance(value, str) else value
    if not isinstance(g, _GRANS) or (isinstance(g, PerBlock) and g.rows):
        raise UsageError(f"bwd.gran={getattr(g, 'short_str', lambda: g)()} is not one of tensor, head, block, token "
                         "(block = the backward's tiles, bwd.bm rows and bwd.bn keys)")
    return g


def _tile(value) -> int:
    value = int(value)
    if value < 0:
        raise UsageError("backward tiles bwd.bm and bwd.bn must be >= 0 (0 = FA3's backward tiles)")
    return value


for _key, (_what, (_a, _b)) in PRODUCTS.items():
    register_key(RecipeKey(_key, "fp32", f"backward {_what}: formats of {_a}:{_b} (one name for both)",
                           field=_key.replace(".", "_"), normalize=_pair_text))
register_key(RecipeKey("bwd.gran", PerTensor(), "scale granularity of the backward's FP8/INT8 operands: tensor "
                       "(cuDNN, TransformerEngine), head, block (the backward's tiles), token",
                       field="bwd_gran", parse=parse_granularity, normalize=_bwd_granularity))
register_key(RecipeKey("bwd.acc", "fp32", "accumulator of the backward's GEMMs: fp32, fp22 (Hopper MMA model for "
                       "FP8 and BF16/FP16 operands, chained as FA3's backward chains), or fp64 (float64 arithmetic "
                       "throughout: the algorithm itself, checked against autograd)", field="bwd_acc",
                       choices=("fp32", "fp22", "fp64")))
register_key(RecipeKey("bwd.out", "fp32", "format dQ, dK, dV are written in (FP8 with a per-tensor scale, as cuDNN's)",
                       field="bwd_out", normalize=lambda v: operand_name(v, ("float",), "bwd.out")))
register_key(RecipeKey("bwd.rot", "none", "random Hadamard along head_dim on Q, K, V, dO before the backward "
                       "quantizes them (what-if), gradients rotated back", field="bwd_rot",
                       choices=("none", "hadamard")))
register_key(RecipeKey("bwd.bm", 0, "backward query tile kBlockM (0 = FA3's backward tile for this head dim)",
                       field="bwd_bm", parse=parse_int, normalize=_tile))
register_key(RecipeKey("bwd.bn", 0, "backward key tile kBlockN (0 = FA3's backward tile for this head dim)",
                       field="bwd_bn", parse=parse_int, normalize=_tile))
register_key(RecipeKey("bwd.order", "forward", "order the backward visits query tiles in while it accumulates dK and dV "
                       "(forward: first to last; reverse: last to first, FlashAttention-2's "
                       "for (; m_block >= m_block_min; --m_block))", field="bwd_order",
                       choices=("forward", "reverse")))
register_key(RecipeKey("bwd.gqa", "accum", "grouped-query dK, dV: accum (the query heads of a KV head summed in "
                       "float32, written once: FA3's dKaccum/dVaccum) or expand (each query head's dK, dV written in "
                       "bwd.out, then summed in float32 and written again: FlashAttention-2's dk_expanded with "
                       "at::sum, and K, V repeated per query head before SDPA)", field="bwd_gqa",
                       choices=("accum", "expand")))


def backward_pairs(r) -> dict[str, tuple[str, str]]:
    """product key -> (format of A, format of B) of recipe ``r``."""
    return {k: operand_pair(getattr(r, k.replace(".", "_"))) for k in PRODUCTS}


@register_check
def _mma_scales(r) -> str | None:
    # the MMA model takes the operands' own FP8/BF16 values: descales must factor out of the product
    if r.bwd_acc == "fp22" and not isinstance(r.bwd_gran, (PerTensor, PerHead)):
        narrow = [k for k, ab in backward_pairs(r).items() for f in ab if family(f) != "float" or f in ("e4m3", "e5m2")]
        if narrow:
            return (f"bwd.acc=fp22 models the tensor core on the operands' FP8 values, which descales per "
                    f"{r.bwd_gran.short_str()} along the contraction cannot be taken out of: use bwd.gran=tensor or "
                    "head, "
                    "or bwd.acc=fp32")
    return None


register_key(RecipeKey("bwd.pscale", "amax", "scale of P in dV = P^T dO: amax (P's amax over the call, current "
                       "scaling) or offset (the forward's fixed 2^poff: cuDNN's scale_s)", field="bwd_pscale",
                       choices=("amax", "offset")))

register_key(RecipeKey("bwd.dqcast", "direct", "how dS reaches its format for dQ = dS K: direct (the float32 dS, "
                       "scaled, cast once, as for dK) or fp16 (rounded to FP16 first, then cast: two roundings; "
                       "cuDNN's Hopper FP8 backward, whose dK reads the direct cast); only an FP8 dS takes the "
                       "FP16 step, other formats are cast as they are", field="bwd_dqcast",
                       choices=("direct", "fp16")))


__all__ = ["PRODUCTS", "operand_pair", "backward_pairs"]
register_key(RecipeKey("bwd.pexp", "fa3", "P's exponent in the backward: fa3 (exp2(S scale log2e - LSE log2e), "
                       "multiply then subtract, exp2 rounded to nearest) or cudnn (FFMA(S', (scale descale_Q) "
                       "descale_K, -LSE) on the raw S', then ex2.approx.ftz of it times log2e, the H200's MUFU.EX2 "
                       "bit for bit, P cast as P times float32(2^poff) under bwd.pscale=offset: cuDNN's "
                       "sdpa_fp8_backward)", field="bwd_pexp", choices=("fa3", "cudnn")))
register_key(RecipeKey("bwd.outscale", "descale", "how an FP8 gradient is written: descale (the cast of x / (amax / "
                       "max) in float64) or scale (the cast of the float32 product x scale, scale = max / amax "
                       "rounded to float32: cuDNN's scale_dQ/dK/dV, which its epilogue multiplies by)",
                       field="bwd_outscale", choices=("descale", "scale")))
register_key(RecipeKey("bwd.dqscale", "tile", "where dQ's descales multiply: tile (each KV tile's product, "
                       "then the float32 sum over tiles, FA3's dQaccum) or end (the raw products summed in float32 "
                       "over KV tiles, times descale_dS descale_K once: cuDNN's Hopper FP8 backward; per-tensor FP8 "
                       "dS and K only, otherwise tile)", field="bwd_dqscale", choices=("tile", "end")))
register_key(RecipeKey("bwd.dsform", "fa3", "how dS is formed for its FP8 casts: fa3 (P (dP - D), D = rowsum of dO "
                       "O's values, cast as x / (amax / max), the softmax scale applied to dQ and dK at the end) or "
                       "cudnn (cuDNN's graph: D = rowsum of the FP8 codes' products times descale_dO, then "
                       "descale_O; dS = P (dP - D) attn_scale, cast as the float32 product with scale_dP = max / "
                       "amax; per-tensor FP8 dS only, otherwise fa3) or cudnn-ffma (cudnn with dP' descale_dO descale_V - D "
                       "as one FFMA on the MMA's raw dP', FFMA(dP', descale_dO descale_V, -D))", field="bwd_dsform",
                       choices=("fa3", "cudnn", "cudnn-ffma")))
