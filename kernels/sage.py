"""SageAttention 1's Triton kernel as a backend (``--backend sage1``).

Exposed: ``SageBackend``, ``kernel_problem``, ``load_kernel``, ``kernel_inputs``, ``HEAD_DIMS``,
``INSTALL_HINT``.

The kernel is ``sageattn`` of the ``sageattention`` 1.x wheel (thu-ml/SageAttention, pure Python
and Triton: INT8 Q and K with one scale per 128-query / 64-key block, FP16 P and V, runs on sm80
and later, Hopper included). As a user would, the backend rotates the float64 inputs when the
recipe says so (the emulator's own rotation, so emulator and kernel see the same tensors), rounds
Q, K and V to the recipe's input format (``in``: fp16 or bf16) and calls
``sageattn(q, k, v, tensor_layout="HND", is_causal=..., sm_scale=..., smooth_k=...)`` on every
query row; the kernel smooths K, quantizes and computes attention itself, and returns the rows
asked for. The ``sage1`` preset is the emulator's model of that arithmetic; ``validate --backend
sage1`` measures how well it matches.

``sageattn`` refuses head dims other than 64, 96 and 128 (an assert in ``core.py``) and causal
attention with seqlen_q != seqlen_k; ``validation_skip`` says so for a validation case.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.recipe import Recipe
from .availability import gpu_problem, load_problem, package_version, refusal

HEAD_DIMS = (64, 96, 128)
INSTALL_HINT = "pip install sageattention==1.0.6 (pure Python + Triton; needs triton and a CUDA GPU, sm80+)"
# The kernel's input dtypes by the recipe's ``in`` key; it writes the input dtype.
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Models of the kernel's FP16 P V accumulation (numerics/accumulators.py); the first is the preset's.
KERNEL_ACCS = ("fp16-hopper", "fp16")

_KERNEL: dict = {}


def _version() -> str | None:
    return package_version("sageattention")


def kernel_problem(device: str = "cuda") -> str | None:
    """None when the SageAttention 1 kernel can run on ``device``; else every missing piece and
    its fix, one line."""
    gpu = gpu_problem(device, lambda cap: cap >= (8, 0),
                      no_gpu="sageattn's Triton kernel needs an NVIDIA GPU, sm80 or later",
                      wrong_gpu="; sageattn's INT8 kernel needs sm80 or later", kernel="the SageAttention kernel")
    problems = [gpu] if gpu else []
    if importlib.util.find_spec("triton") is None:
        problems.append("triton is not installed (pip install triton)")
    if importlib.util.find_spec("sageattention") is None:
        problems.append(f"module sageattention missing: {INSTALL_HINT}")
    else:
        ver = _version()
        if ver is not None and not ver.startswith("1."):
            problems.append(f"sageattention {ver} is installed, whose sageattn is not SageAttention 1's Triton kernel: "
                            f"{INSTALL_HINT}")
    return refusal(problems) or load_problem(load_kernel, "sageattention is installed but does not import",
                                             INSTALL_HINT)


def load_kernel():
    """(sageattn, version string); imported once."""
    if not _KERNEL:
        if importlib.util.find_spec("sageattention") is None:
            raise UsageError(f"SageAttention is not installed: {INSTALL_HINT}")
        mod = importlib.import_module("sageattention")
        _KERNEL.update(fn=mod.sageattn, version=f"sageattention {_version() or 'unknown'}")
    return _KERNEL["fn"], _KERNEL["version"]


def kernel_inputs(recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation_seed: int) -> tuple:
    """(q, k, v) as the caller of ``sageattn`` hands them: the recipe's rotation applied to Q and
    K in float64 (as the emulator's ``prepare`` applies it), then all three rounded once to the input
    format by the emulator's ``input_round``, contiguous [B, H, N, D] ("HND"). torch's own cast from
    float64 to FP16/BF16 goes through float32 and so rounds twice: about 7 in 10^5 values of a
    Gaussian tensor land one FP16 ulp away from the once-rounded value the emulator quantizes."""
    from fa3_numerics.numerics.rotation import make_rotation
    from fa3_numerics.numerics.sage_quant import input_round

    dtype = _DTYPES[recipe.inp]
    rot = make_rotation(recipe.rot, q.shape[-1], rotation_seed)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return input_round(x, recipe.inp).to(dtype).contiguous()  # exact: the value is an FP16/BF16 one

    return rounded(rot.apply(q.to(torch.float64))), rounded(rot.apply(k.to(torch.float64))), \
        rounded(v.to(torch.float64))


class SageBackend(Backend):
    """``sageattn`` of SageAttention 1. ``kernel_fn`` (None = the installed kernel) lets a stand-in
    with its signature replace it (tests)."""

    name = "sage1"
    label = "sage1 (sageattn, SageAttention 1 Triton kernel)"
    kernel_fn = None
    description = ("SageAttention 1's Triton kernel (sageattention 1.x sageattn): INT8 Q/K per 128/64-row block, "
                   "K smoothed, FP16 P and V with FP16 accumulation per 64-key tile; FP16/BF16 in and out, "
                   "head dims 64, 96, 128")
    hardware = True

    def check(self, device: str) -> str | None:
        return kernel_problem(device)

    def provenance(self) -> dict[str, str]:
        return {"kernel_module": "sageattention", "kernel_version": load_kernel()[1]}

    def supports(self, recipe: Recipe) -> str | None:
        alt = "use --backend emulate"
        want = {"algo": "flash", "qk": "int8", "p": "fp16", "v": "fp16", "ties": "away", "order": "forward",
                "iquant": "triton", "loop": "triton", "pscale": "offset"}
        for key, val in want.items():
            if recipe.get(key) != val:
                return f"{key}={recipe.get(key)}: sageattn computes {key}={val} (see the sage1 preset); {alt}"
        if recipe.p_offset != 0.0:
            return f"poff={recipe.p_offset:g}: sageattn takes P~ = exp2(S - max) (poff=0); {alt}"
        if recipe.gran.short_str() != "block" or recipe.bm not in (0, 128) or recipe.bn not in (0, 64):
            return (f"gran={recipe.gran.short_str()},bm={recipe.bm},bn={recipe.bn}: sageattn quantizes Q per 128 rows "
                    f"and K per 64 keys (gran=block,bm=128,bn=64); {alt}")
        if recipe.smooth not in ("none", "k"):
            return f"smooth={recipe.smooth}: sageattn smooths K only (smooth_k=True) or nothing (smooth=none); {alt}"
        if recipe.inp not in _DTYPES:
            return f"in={recipe.inp}: this backend hands sageattn FP16 or BF16 tensors (in=fp16 or in=bf16); {alt}"
        if recipe.out != recipe.inp:
            return f"out={recipe.out}: sageattn writes its input dtype (out={recipe.inp}); {alt}"
        if recipe.kpad != "zero":
            return f"kpad={recipe.kpad}: sageattn does not mask the keys past the end of the last tile (kpad=zero); {alt}"
        if recipe.acc not in KERNEL_ACCS:
            return f"acc={recipe.acc}: sageattn accumulates P V in FP16 per tile (acc={KERNEL_ACCS[0]}); {alt}"
        return None

    # -- validation hooks (read by fa3_numerics.studies.validate) ------------------------------
    #: P V accumulator models the validation runs against this kernel: the preset's (the fitted
    #: FP16 wgmma), one FP16 rounding of the exact sum per 16 keys, and float32 for contrast.
    validation_accs: tuple = ("fp16-hopper", "fp16", "fp32")

    def validation_recipe(self, case) -> Recipe:
        """The recipe this kernel computes for a validation case: the sage1 preset, FP16 in and
        out (BF16 for the grid's BF16 cases), with the case's rotation applied before the call."""
        from fa3_numerics.numerics.recipe import get_recipe

        r = get_recipe("sage1").recipe
        fmt = "bf16" if case.dtype == "bf16" else "fp16"
        return dataclasses.replace(r, inp=fmt, out=fmt, rot=case.rot)

    def validation_skip(self, case) -> str | None:
        """Why sageattn refuses a validation case's shape (None: it runs)."""
        if case.head_dim not in HEAD_DIMS:
            return f"head dim {case.head_dim}: sageattn takes head dims {', '.join(map(str, HEAD_DIMS))} only"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        why = self.supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on sageattn: {why}")
        d, n, nk = q.shape[-1], q.shape[2], k.shape[2]
        if d not in HEAD_DIMS:
            raise UsageError(f"head dim {d}: sageattn takes head dims {', '.join(map(str, HEAD_DIMS))}; use --backend "
                             "emulate")
        if causal and n != nk:
            raise UsageError(f"causal with seqlen_q {n} != seqlen_k {nk}: sageattn's causal kernel needs them equal")
        if self.kernel_fn is None and not q.is_cuda:
            raise UsageError("the SageAttention kernel needs the inputs on a CUDA device; pass --device cuda")
        fn = self.kernel_fn or load_kernel()[0]
        qi, ki, vi = kernel_inputs(recipe, q, k, v, rotation_seed)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        # sageattn smooths K in place (k -= km): ki is this call's own copy.
        o = fn(qi, ki, vi, tensor_layout="HND", is_causal=causal, sm_scale=scale, smooth_k=recipe.smooth == "k")
        if q_index.numel() != n:
            o = o.index_select(2, q_index.to(o.device))
        return o.to(torch.float64)
