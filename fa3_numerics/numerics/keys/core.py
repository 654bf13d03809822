"""The original recipe keys and ablation factors.

The order of ``register_key`` calls is the order of ``Recipe``'s fields and of every spec
string stored in datasets: append, never reorder. Each of these keys appears in every full
spec (``in_spec``) and is already part of the emulator's prepare cache keys.
"""

from __future__ import annotations

import math

from ...errors import UsageError
from ..accumulators import accumulator_names
from ..families import family, is_narrow, operand_name
from ..granularity import PerBlock, PerHead, PerTensor, PerThread, PerToken, parse_granularity
from ..rotation import ROTATIONS
from . import Factor, RecipeKey, parse_bool, parse_float, parse_int, register_factor, register_key


def _format(value) -> str:
    return operand_name(value, ("float",), "this key")


# Issue 11: Q and K also take integer (INT8/INT4) and microscaling (MXFP8/NVFP4) formats, V and
# P microscaling ones (``numerics/families.py`` says which and why).
def _qk_format(value) -> str:
    return operand_name(value, ("float", "int", "mx"), "qk")


def _vp_format(value) -> str:
    return operand_name(value, ("float", "mx"), "v and p")


def _mx_cost(v, cost: int) -> int:
    # block scales need a block-scaled MMA (Blackwell, sm100) and a quantizer that writes them
    return cost if family(v) == "mx" else 0


def _granularity(value):
    return parse_granularity(value) if isinstance(value, str) else value


def _p_offset(value) -> float:
    value = float(value)
    if not (math.isfinite(value) and 0 <= value <= 15):
        raise UsageError(f"poff={value:g} must lie in [0, 15]")
    return value


def _tile(value) -> int:
    value = int(value)
    if value < 0:
        raise UsageError("tiles bm and bn must be >= 0 (0 = the kernel's)")
    return value


# per thread (SageAttention2): as many scales as per block plus their fragment-aware layout
_GRAN_COST = {PerTensor: 0, PerHead: 1, PerBlock: 3, PerThread: 3, PerToken: 4}
_ROT_COST = {"none": 0, "hadamard": 2, "orthogonal": 4}


def _core(k: str, default, help: str, **kw) -> None:
    register_key(RecipeKey(k, default, help, in_spec=True, emulator_cache=True, backends="any", **kw))


_core("algo", "flash", "flash: tile by tile with online softmax (FA2/FA3); standard: S and P materialised",
      choices=("flash", "standard"),
      # S and P materialised in memory: the costliest change to a kernel (audit's cost order).
      cost=lambda v: 6 if v == "standard" else 0)
_core("qk", "e4m3", "format Q and K are cast to: a float format, int8/int4 (SageAttention), mxfp8/nvfp4 "
      "(microscaling along head_dim)", normalize=_qk_format, stages=("qk",), exact="fp32", tensors=("q", "k"),
      # 16-bit Q/K halve the tensor-core throughput of FP8; block scales need sm100 and a quantizer.
      cost=lambda v: (0 if is_narrow(v) else 8) + _mx_cost(v, 1))
_core("v", "e4m3", "format V is cast to: a float format or mxfp8/nvfp4 (microscaling along keys)",
      normalize=_vp_format, stages=("v",), exact="fp32", tensors=("v",), cost=lambda v: _mx_cost(v, 1))
_core("p", "e4m3", "format P is cast to before the P.V product: a float format, mxfp8, or nvfp4 (SageAttention3's "
      "two-level P)", normalize=_vp_format, stages=("p",), exact="fp32",
      # P is quantized in registers per KV tile: its block amax is an extra reduction per tile
      cost=lambda v: _mx_cost(v, 2))
_core("gran", PerHead(), "scale granularity of Q, K and V: tensor, head, block (the kernel's tile), blockN, token, "
      "thread (SageAttention2: Q per bm/4-row warp slice, K per bn-key tile, in MMA-fragment groups)",
      parse=parse_granularity, normalize=_granularity, stages=("qk", "v"), exact=PerHead(), tensors=("q", "k", "v"),
      # per (kv-)head is the kernel's descale shape; per block needs a kernel change.
      cost=lambda v: _GRAN_COST.get(type(v), 2))
_core("pow2", False, "round descales up to powers of two", parse=parse_bool, normalize=bool, stages=("qk", "v"),
      exact=False, tensors=("q", "k", "v"))
_core("rot", "none", "rotation of Q and K along head_dim before quantization", choices=lambda: tuple(ROTATIONS),
      stages=("qk",), exact="none", tensors=("q", "k"),
      # a random Hadamard is an extra O(d log d) pass over Q and K; a dense rotation a GEMM.
      cost=lambda v: _ROT_COST.get(v, 2))
_core("pscale", "offset", "P handling: offset (P~ = exp2(x - (max - poff)), as FA3) or tensor (P scaled per tensor)",
      field="p_scale", choices=("offset", "tensor"), stages=("p",), exact="offset")
_core("poff", 8.0, "P offset: P~ lies in [0, 2^poff] (FA3 FP8: 8)", field="p_offset", parse=parse_float,
      normalize=_p_offset, stages=("p",), exact=8.0)
_core("s", "fp32", "format S is held in (standard algo)", normalize=_format)
_core("sscale", "after", "where the standard algo applies the softmax scale: after Q K^T, or split as sqrt(scale) "
      "on Q and K (PyTorch's math SDPA)", choices=("after", "split"))
_core("softmax", "fp32", "format of softmax intermediates (standard algo)", normalize=_format)
_core("acc", "fp32", "P.V accumulator model", choices=lambda: tuple(accumulator_names()), stages=("acc",),
      exact="fp32")
_core("out", "bf16", "output format", normalize=_format, stages=("out",), exact="fp32")
_core("bm", 0, "query tile kBlockM (0 = the FA3 kernel's for this head dim)", parse=parse_int, normalize=_tile,
      tensors=("q",))
_core("bn", 0, "key tile kBlockN (0 = the FA3 kernel's)", parse=parse_int, normalize=_tile, tensors=("k", "v"))
_core("order", "reverse", "order the KV tiles are visited in (FA3: last to first)", choices=("reverse", "forward"))
_core("tiles", "fa3", "whose tile table fills bm=0 / bn=0: fa3 (FA3's tile_size.h) or cudnn (cuDNN's FP8 SDPA "
      "forward on Hopper, measured per head dim: numerics/tiles.py)", field="tile_table", choices=("fa3", "cudnn"),
      tensors=("q", "k", "v"))

# Ablation factors: levels over the public kernel's recipe (fa3-fp8-kernel at acc=fp32).
register_factor(Factor("gran", "head", "scale granularity: tensor, head, block (kernel tiles), blockN, token"))
register_factor(Factor("rot", "none", "rotation: none, hadamard, orthogonal"))
register_factor(Factor("p", "offset8", "P handling: offset8 (FA3), no-offset (P in [0, 1]), scale448 (P~ fills e4m3)",
                       {"offset8": "poff=8", "no-offset": "poff=0", "scale448": "poff=8.80735"}))
register_factor(Factor("acc", "fp32", "accumulator: fp32, fp22 (Hopper MMA model), two-level"))
register_factor(Factor("fmt", "e4m3", "formats: e4m3, v-e5m2, p-e5m2, vp-e5m2",
                       {"e4m3": "", "v-e5m2": "v=e5m2", "p-e5m2": "p=e5m2", "vp-e5m2": "v=e5m2,p=e5m2"}))
register_factor(Factor("scale", "amax", "descale rounding: amax (amax/max exact) or pow2 (as the paper's presets)",
                       {"amax": "pow2=0", "pow2": "pow2=1"}))
