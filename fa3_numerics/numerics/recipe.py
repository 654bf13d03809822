"""Recipes: one frozen spec object that drives every quantizer and the emulator.

Exposed: ``Recipe``, ``PRESETS``, ``get_recipe``, ``parse_recipes``.

A recipe is written as a preset name, a spec string, or a preset followed by overrides:

    fa3-fp8
    algo=flash,qk=e4m3,v=e4m3,p=e4m3,gran=block,rot=hadamard
    fa3-fp8,acc=fp22,bn=128

``short_str`` gives the canonical spec string (stored in datasets); ``from_str`` parses
it back, so a dataset's variant names always reproduce their numbers.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import UsageError
from .formats import get_format
from .granularity import Granularity, PerBlock, PerHead, PerTensor, parse_granularity
from .rotation import ROTATIONS
from .tiles import fa3_tiles

ALGOS = ("flash", "standard")
ACCUMULATORS = ("fp32", "fp22", "two-level")
P_SCALES = ("offset", "tensor")
ORDERS = ("reverse", "forward")
S_SCALES = ("after", "split")


@dataclasses.dataclass(frozen=True)
class Recipe:
    # "flash": tile by tile with online softmax (FA2/FA3). "standard": S and P materialised.
    algo: str = "flash"
    qk: str = "e4m3"  # format Q and K are cast to
    v: str = "e4m3"  # format V is cast to
    p: str = "e4m3"  # format P is cast to before the P.V product
    gran: Granularity = PerHead()  # scale granularity of Q, K and V (FP8 formats only)
    pow2: bool = False  # round descales up to powers of two
    rot: str = "none"  # rotation applied to Q and K before quantization
    # P handling. "offset": P~ = exp2(x - (max - p_offset)), so P~ lies in [0, 2^p_offset]
    # (FA3 FP8 uses 8; log2(448) fills e4m3 exactly). "tensor": P scaled by fmt.max/amax(P)
    # over the whole tensor, as a plain PyTorch FP8 baseline would.
    p_scale: str = "offset"
    p_offset: float = 8.0
    s: str = "fp32"  # format S is held in (standard algo materialises it)
    # Where the standard algo applies softmax_scale: "after" the Q K^T product, or "split" as
    # sqrt(scale) on Q and on K before it (what PyTorch's math SDPA does, rounding each in
    # the Q/K format).
    sscale: str = "after"
    softmax: str = "fp32"  # format of softmax intermediates (standard algo)
    acc: str = "fp32"  # P.V accumulator model
    out: str = "bf16"  # output format
    bm: int = 0  # query tile (kBlockM); 0 = the FA3 kernel's for this head dim and dtype
    bn: int = 0  # key tile (kBlockN); 0 = likewise
    order: str = "reverse"  # order the KV tiles are visited in (FA3: last to first)

    def __post_init__(self):
        for f in ("qk", "v", "p", "s", "softmax", "out"):
            object.__setattr__(self, f, get_format(getattr(self, f)).name)
        if isinstance(self.gran, str):
            object.__setattr__(self, "gran", parse_granularity(self.gran))
        checks = [(self.algo, ALGOS, "algo"), (self.acc, ACCUMULATORS, "acc"), (self.p_scale, P_SCALES, "p_scale"),
                  (self.order, ORDERS, "order"), (self.rot, tuple(ROTATIONS), "rot"),
                  (self.sscale, S_SCALES, "sscale")]
        for value, allowed, name in checks:
            if value not in allowed:
                raise UsageError(f"recipe field {name}={value!r} is not one of {', '.join(allowed)}")
        if not (math.isfinite(self.p_offset) and 0 <= self.p_offset <= 15):
            raise UsageError(f"recipe field poff={self.p_offset} must lie in [0, 15]")
        if self.bm < 0 or self.bn < 0:
            raise UsageError("recipe tiles bm and bn must be >= 0 (0 = the kernel's)")

    @property
    def fp8(self) -> bool:
        return get_format(self.qk).mbits <= 3

    def tiles(self, head_dim: int, causal: bool = False) -> tuple[int, int]:
        """(kBlockM, kBlockN) with zeros filled from the FA3 kernel's table."""
        m, n = fa3_tiles(head_dim, fp8=self.fp8, causal=causal)
        return (self.bm or m, self.bn or n)

    # -- strings -------------------------------------------------------------------------
    def short_str(self) -> str:
        """Canonical spec: every field that differs from the defaults, in field order."""
        default = Recipe()
        parts = []
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if val != getattr(default, f.name):
                parts.append(f"{_KEY_OF[f.name]}={_fmt(val)}")
        return ",".join(parts) or "algo=flash"

    def spec(self) -> str:
        """Every field, for provenance."""
        return ",".join(f"{_KEY_OF[f.name]}={_fmt(getattr(self, f.name))}" for f in dataclasses.fields(self))

    @classmethod
    def from_str(cls, text: str) -> "Recipe":
        text = text.strip()
        if not text:
            raise UsageError("empty recipe; give a preset name (see `fa3-numerics variants`) or key=value pairs")
        parts = [p.strip() for p in text.split(",") if p.strip()]
        base = Recipe()
        if "=" not in parts[0]:
            base = get_recipe(parts[0]).recipe
            parts = parts[1:]
        kw = {}
        for part in parts:
            if "=" not in part:
                raise UsageError(f"recipe part {part!r} is not key=value; keys: {', '.join(sorted(_FIELD_OF))}")
            k, v = (s.strip() for s in part.split("=", 1))
            if k not in _FIELD_OF:
                raise UsageError(f"unknown recipe key {k!r}; keys: {', '.join(sorted(_FIELD_OF))}")
            kw[_FIELD_OF[k]] = _parse(_FIELD_OF[k], v)
        return dataclasses.replace(base, **kw)


_KEY_OF = {"algo": "algo", "qk": "qk", "v": "v", "p": "p", "gran": "gran", "pow2": "pow2", "rot": "rot",
           "p_scale": "pscale", "p_offset": "poff", "s": "s", "sscale": "sscale", "softmax": "softmax", "acc": "acc", "out": "out",
           "bm": "bm", "bn": "bn", "order": "order"}
_FIELD_OF = {v: k for k, v in _KEY_OF.items()}


def _fmt(val) -> str:
    if hasattr(val, "short_str"):
        return val.short_str()
    if isinstance(val, bool):
        return "1" if val else "0"
    if isinstance(val, float):
        return f"{val:g}"
    return str(val)


def _parse(field: str, text: str):
    try:
        if field == "gran":
            return parse_granularity(text)
        if field == "pow2":
            if text.lower() not in ("0", "1", "true", "false"):
                raise ValueError
            return text.lower() in ("1", "true")
        if field == "p_offset":
            return float(text)
        if field in ("bm", "bn"):
            return int(text)
    except UsageError:
        raise
    except ValueError:
        raise UsageError(f"recipe value {text!r} is not valid for {_KEY_OF[field]}") from None
    return text


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    recipe: Recipe
    description: str
    paper_rmse: float | None = None  # FA3 paper, Table 3


# Standard attention in FP16 as PyTorch's math SDPA computes it in half precision.
_FP16_STD = Recipe(algo="standard", qk="fp16", v="fp16", p="fp16", s="fp16", softmax="fp16", out="fp16", sscale="split")
_FLASH16 = Recipe(algo="flash", qk="fp16", v="fp16", p="fp16", out="fp16", p_offset=0.0)
# The paper's FA3 FP8 recipes use power-of-two scales (shared exponents, as MX block formats
# do). With them, block quantization alone changes nothing but subnormals and saturation, which
# is the paper's finding (without incoherent processing FA3 FP8 is as bad as the baseline).
# With amax/448 scales each block's largest value becomes exact, and block quantization alone
# lowers the error on this data by ~15% (try `fa3-fp8-no-incoherent,pow2=0`).
_FA3_FP8 = Recipe(algo="flash", qk="e4m3", v="e4m3", p="e4m3", gran=PerBlock(), pow2=True, rot="hadamard", out="bf16")

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("baseline-fp16", _FP16_STD,
           "standard attention in FP16 (as PyTorch's math SDPA): S = QK^T and P = softmax(S) materialised in FP16", 3.2e-4),
    Preset("fa2-fp16", dataclasses.replace(_FLASH16, bm=128, bn=64),
           "FlashAttention-2 FP16: 128x64 tiles, online softmax in FP32, P cast to FP16, FP32 accumulator", 1.9e-4),
    Preset("fa3-fp16", _FLASH16,
           "FlashAttention-3 FP16: the kernel's tiles, online softmax in FP32, P cast to FP16", 1.9e-4),
    Preset("baseline-fp8", Recipe(algo="standard", qk="e4m3", v="e4m3", p="e4m3", gran=PerTensor(), s="fp32",
                                  softmax="fp16", p_scale="tensor", out="fp16"),
           "per-tensor FP8 Q/K/V, FP32 accumulators, softmax kept in FP16, P cast to FP8 with a per-tensor scale", 2.4e-2),
    Preset("fa3-fp8", _FA3_FP8,
           "FA3 FP8: block quantization (power-of-two scales) at the kernel's tiles + random Hadamard on Q and K, P offset 2^8", 9.1e-3),
    Preset("fa3-fp8-no-block-quant", dataclasses.replace(_FA3_FP8, gran=PerTensor()),
           "FA3 FP8 with one scale per tensor instead of per block (rotation kept)", 9.3e-3),
    Preset("fa3-fp8-no-incoherent", dataclasses.replace(_FA3_FP8, rot="none"),
           "FA3 FP8 with block quantization but no Hadamard rotation", 2.4e-2),
    # The two presets below model the public FA3 FP8 kernel itself, so they use the Hopper MMA
    # model (acc=fp22) that makes 99.99% of its BF16 outputs bit-identical (reports/h200/). It
    # costs ~40-100x a float32 GEMM on a CPU: add acc=fp32 for speed. Against float64 the two
    # differ by ~3% of the error in quadrature, i.e. ~0.05% of the RMSE, which is why the
    # Table 3 presets keep fp32.
    Preset("fa3-fp8-kernel", Recipe(gran=PerHead(), rot="none", acc="fp22"),
           "what the public FA3 FP8 kernel computes: one descale per (batch, kv-head), no rotation, Hopper MMA model"),
    Preset("fa3-fp8-kernel-hadamard", Recipe(gran=PerHead(), rot="hadamard", acc="fp22"),
           "the public FA3 FP8 kernel with per-head descales after a random Hadamard on Q and K, Hopper MMA model"),
    Preset("exact", Recipe(qk="fp32", v="fp32", p="fp32", out="fp32", p_offset=0.0),
           "tile-by-tile FP32 attention without quantization: checks the emulator itself"),
]}

TABLE3 = ("baseline-fp16", "fa2-fp16", "fa3-fp16", "baseline-fp8", "fa3-fp8", "fa3-fp8-no-block-quant",
          "fa3-fp8-no-incoherent")


def get_recipe(name: str) -> Preset:
    if name in PRESETS:
        return PRESETS[name]
    raise UsageError(f"unknown variant {name!r}; presets: {', '.join(PRESETS)} (or a key=value spec)")


def parse_recipes(text: str) -> list[tuple[str, Recipe]]:
    """``a;b;c`` or preset names separated by commas -> [(label, recipe)].

    Preset names may be separated by commas; spec strings (which contain commas) are
    separated by semicolons.
    """
    items: list[str] = []
    for chunk in text.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        if "=" in chunk:
            items.append(chunk)
        else:
            items.extend(c.strip() for c in chunk.split(",") if c.strip())
    if not items:
        raise UsageError("no variants given; name presets (see `fa3-numerics variants`) or key=value specs")
    out = []
    for item in items:
        r = Recipe.from_str(item)
        out.append((item, r))
    labels = [l for l, _ in out]
    if len(set(labels)) != len(labels):
        raise UsageError(f"variants repeat: {', '.join(labels)}")
    return out
