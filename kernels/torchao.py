"""torchao's FP8 low-precision attention as a backend (``--backend torchao-fp8``).

Exposed: ``TorchaoFp8Backend``, ``kernel_problem``, ``load_quantizer``, ``reference_descales``,
``kernel_inputs``, ``INSTALL_HINT``.

What a torchao user gets from ``apply_low_precision_attention(model)`` (torchao 0.18, backend
FP8_FA3, ``hadamard=NONE``) is ``fp8_fa3_sdpa``: torchao's Triton kernels
(``prototype/attention/quantization/triton_qkv_quantization.py``, ``triton_fp8_sdpa_quantize``)
quantize the model's BF16 Q, K, V ([B, H, S, D]) to E4M3 with one scale per (batch, head) -- Q's
per KV-head group, so q_descale is (B, H_kv) as FA3 takes it: scale = 448 / amax, descale =
amax / 448 in float32, 1 where amax <= 1e-12, q8 = e4m3(x * scale) -- and then torch's
``_scaled_dot_product_attention_quantized`` runs FA3's FP8 forward (``torch/nn/attention/_fa3.py``:
the BHSD tensors transposed to BSHD views, ``torch.ops.flash_attn_3.fwd`` with the three
descales, ``num_splits=0``, BF16 O, cast to the input dtype).

torch finds FA3 only as an upstream build registering ``torch.ops.flash_attn_3`` (module
``flash_attn_interface``); the ``fa3-fwd`` wheel registers ``torch.ops.fa3_fwd``. So this backend
runs torchao's own quantization kernels and hands their FP8 tensors and descales to the FA3
kernel the ``fa3`` backend loads, with the arguments torch's FA3 path passes (BSHD, descales,
softmax scale, causal, ``num_splits=0``, ``pack_gqa=None``): the same bytes into the same
kernel, so it measures what torchao users get, without torch's dispatcher in between.
"""

from __future__ import annotations

import importlib
import importlib.util
import math

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerHead
from fa3_numerics.numerics.recipe import Recipe
from .availability import gpu_problem, load_problem, package_version, refusal

INSTALL_HINT = ("pip install torchao==0.18.0 (its low-precision attention needs torch >= 2.11, triton and a "
                "Hopper GPU) and the FA3 kernel: pip install fa3-fwd==0.0.3")
QUANT_MODULE = "torchao.prototype.attention.quantization.triton_qkv_quantization"
FP8_MAX = 448.0
EPS = 1e-12  # torchao's: an amax at or below it gets scale and descale 1

_KERNEL: dict = {}


def _version() -> str | None:
    return package_version("torchao")


def kernel_problem(device: str = "cuda") -> str | None:
    """None when torchao's FP8 attention can run on ``device``; else every missing piece and its fix, one line."""
    from fa3_numerics.kernels.fa3 import kernel_problem as fa3_problem

    gpu = gpu_problem(device, lambda cap: cap[0] == 9, no_gpu="torchao's FP8_FA3 attention needs a Hopper GPU, sm90",
                      wrong_gpu="; torchao's FP8_FA3 backend needs Hopper (sm90)", kernel="torchao's attention")
    problems = [gpu] if gpu else []
    if importlib.util.find_spec("triton") is None:
        problems.append("triton is not installed (pip install triton)")
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"module torchao missing: {INSTALL_HINT}")
    else:
        ver = _version()
        if ver is not None and not ver.startswith("0.18"):
            problems.append(f"torchao {ver} is installed; this backend reads torchao 0.18's quantizer: {INSTALL_HINT}")
    if problems:
        return refusal(problems)
    why = fa3_problem(device)
    if why is not None:
        return f"torchao's FP8 attention runs on the FA3 kernel, which cannot run: {why}"
    return load_problem(load_quantizer, "torchao is installed but its FP8 quantizer does not import", INSTALL_HINT)


def load_quantizer():
    """(torchao's triton_fp8_sdpa_quantize, version string); imported once."""
    if not _KERNEL:
        if importlib.util.find_spec("torchao") is None:
            raise UsageError(f"torchao is not installed: {INSTALL_HINT}")
        mod = importlib.import_module(QUANT_MODULE)
        _KERNEL.update(fn=mod.triton_fp8_sdpa_quantize, version=f"torchao {_version() or 'unknown'}")
    return _KERNEL["fn"], _KERNEL["version"]


def reference_descales(x: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's scale rule on any device, in PyTorch: float32 (scale, descale), each (B, kv_heads),
    over each (batch, kv-head group) of x ([B, H, S, D], the BF16 values): scale = 448 / amax,
    descale = amax / 448 as its Triton kernel divides (``div.full.f32``: x * recip32(y), the model
    ``sage_quant`` measured on the H200), both 1 where amax <= 1e-12."""
    from fa3_numerics.numerics.sage_quant import recip32

    b = x.shape[0]
    a = x.to(torch.float32).abs().reshape(b, kv_heads, -1).amax(dim=-1)
    ok = a > EPS
    safe = torch.where(ok, a, torch.ones_like(a))
    scale = (FP8_MAX * recip32(safe).double()).to(torch.float32)
    descale = (a.double() * recip32(torch.full_like(a, FP8_MAX)).double()).to(torch.float32)
    one = torch.ones_like(a)
    return torch.where(ok, scale, one), torch.where(ok, descale, one)


def kernel_inputs(recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """(q, k, v) as a torchao user's model hands them: the float64 inputs rounded once to BF16
    (the emulator's ``input_round``, so both see the same BF16 values), contiguous [B, H, S, D]."""
    from fa3_numerics.numerics.sage_quant import input_round

    return tuple(input_round(x.to(torch.float64), recipe.inp).to(torch.bfloat16).contiguous() for x in (q, k, v))


class TorchaoFp8Backend(Backend):
    """torchao 0.18's FP8 attention: its Triton quantizer, then the FA3 FP8 kernel. ``quantize_fn``
    and ``fa3_fn`` (None = torchao's and the installed FA3 kernel) let stand-ins with their
    signatures replace them (tests)."""

    name = "torchao-fp8"
    label = "torchao-fp8 (torchao 0.18 triton_fp8_sdpa_quantize + FA3 FP8 forward)"
    description = ("torchao 0.18's low-precision attention (fp8_fa3_sdpa): BF16 Q/K/V quantized per (batch, head) by "
                   "torchao's Triton kernels, FA3's FP8 forward with per-(batch, kv-head) descales, BF16 O")
    hardware = True
    quantize_fn = None
    fa3_fn = None
    #: torch's _fa3.py passes num_splits=0 (FA3's split-KV heuristic) unless deterministic algorithms are on
    num_splits = 0

    def check(self, device: str) -> str | None:
        return kernel_problem(device)

    def provenance(self) -> dict[str, str]:
        from .fa3 import load_kernel as load_fa3

        _, module, version = load_fa3()
        return {"kernel_module": f"torchao quantizer + {module}", "kernel_version": f"{load_quantizer()[1]}, {version}"}

    def supports(self, recipe: Recipe) -> str | None:
        alt = "use --backend emulate"
        want = {"algo": "flash", "qk": "e4m3", "v": "e4m3", "p": "e4m3", "out": "bf16", "pscale": "offset",
                "rot": "none", "in": "bf16", "fquant": "torchao", "pow2": False, "dscale": "amax"}
        for key, val in want.items():
            if recipe.get(key) != val:
                return f"{key}={recipe.get(key)}: torchao's FP8 attention computes {key}={val} (the torchao-fp8 preset); {alt}"
        if recipe.p_offset != 8.0:
            return f"poff={recipe.p_offset:g}: FA3's FP8 kernel scales P by the fixed offset 2^8 (poff=8); {alt}"
        if not isinstance(recipe.gran, PerHead):
            return f"gran={recipe.gran.short_str()}: torchao scales per (batch, head) (gran=head); {alt}"
        if recipe.bm or recipe.bn:
            return f"bm/bn set: the kernel's tiles are fixed by its build; drop bm=/bn= or {alt}"
        if recipe.order != "reverse":
            return f"order={recipe.order}: the FA3 kernel visits KV tiles last to first; {alt}"
        return None

    # -- validation hooks (read by fa3_numerics.studies.validate) ------------------------------
    def validation_recipe(self, case) -> Recipe:
        """The torchao-fp8 preset: BF16 inputs, per-head scales, whatever the case's granularity."""
        from fa3_numerics.numerics.recipe import get_recipe

        return get_recipe("torchao-fp8").recipe

    def validation_skip(self, case) -> str | None:
        if case.rot != "none":
            return ("rotation: torchao's Hadamard mode (QKV) rotates V too and O back, which no recipe models; "
                    "this backend runs hadamard=NONE")
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        from fa3_numerics.kernels.fa3 import load_kernel

        why = self.supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run as torchao's FP8 attention: {why}")
        if self.quantize_fn is None and not q.is_cuda:
            raise UsageError("torchao's attention needs the inputs on a CUDA device; pass --device cuda")
        n, d = q.shape[2], q.shape[3]
        quantize = self.quantize_fn or load_quantizer()[0]
        fa3 = self.fa3_fn or load_kernel()[0]
        qb, kb, vb = kernel_inputs(recipe, q, k, v)
        q8, k8, v8, dq, dk, dv = quantize(qb, kb, vb)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        # torch's _fa3.py: BSHD views of the BHSD tensors, last dim contiguous, heuristics on.
        lay = lambda x: x.transpose(1, 2)  # noqa: E731
        out = fa3(lay(q8), lay(k8), lay(v8), softmax_scale=scale, causal=causal, q_descale=dq, k_descale=dk,
                  v_descale=dv, num_splits=self.num_splits, pack_gqa=None)
        o = (out[0] if isinstance(out, (tuple, list)) else out).transpose(1, 2).to(qb.dtype)
        if q_index.numel() != n:
            o = o.index_select(2, q_index.to(o.device))
        return o.to(torch.float64)
