"""PyTorch's scaled_dot_product_attention kernels as backends (``--backend sdpa[-KIND]``).

Exposed: ``SdpaBackend`` and its pinned variants ``SdpaDefault``, ``SdpaFlash``,
``SdpaCudnn``, ``SdpaEfficient``, ``SdpaMath``; ``sdp_backend`` (a variant's kind -> PyTorch's
``SDPBackend``, for callers that pin the same kernel around their own call).

Each variant pins one kernel with ``torch.nn.attention.sdpa_kernel``: ``flash`` (PyTorch's
FlashAttention-2), ``cudnn`` (cuDNN's fused attention), ``efficient`` (memory-efficient
attention), ``math`` (S and P materialised by plain matmuls and softmax) or, for ``sdpa``,
whichever PyTorch picks. FP16/BF16 only. ``math`` keeps S and the softmax in the input
format when the recipe's ``softmax`` format is FP16/BF16 (PyTorch's
``allow_fp16_bf16_reduction_math_sdp``), as the paper's "baseline FP16" does; otherwise it
upcasts to FP32 inside, as PyTorch does by default. K and V are expanded for GQA.
"""

from __future__ import annotations

import contextlib
import math
from typing import ClassVar

import torch

from fa3_numerics.engine.backends import Backend
from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.recipe import Recipe

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def sdp_backend(kind: str):
    """PyTorch's ``SDPBackend`` of a variant's ``kind`` (flash, cudnn, efficient, math)."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[kind]


class SdpaBackend(Backend):
    kind: ClassVar[str] = ""  # "" = PyTorch's own choice
    hardware = True

    def check(self, device: str) -> str | None:
        gpu_only = self.kind in ("flash", "cudnn", "efficient")
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                alt = "use --device cpu with sdpa-math, or --backend emulate" if gpu_only else "use --device cpu"
                return f"no CUDA GPU is visible; {alt}"
            cap = torch.cuda.get_device_capability(torch.device(device).index)
            if self.kind in ("flash", "cudnn") and cap < (8, 0):
                return f"SDPA {self.kind} needs an sm_80 or newer GPU, found sm_{cap[0]}{cap[1]}; use sdpa-efficient or sdpa-math"
            if self.kind == "cudnn" and not torch.backends.cudnn.is_available():
                return "cuDNN is not available to this PyTorch build; use sdpa-flash or sdpa-efficient"
            return None
        if gpu_only:
            why = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"--device {device}"
            return (f"{why}: SDPA {self.kind} is a GPU kernel; run on a CUDA GPU with --device cuda, "
                    "or use sdpa-math / --backend emulate here")
        return None

    def supports(self, recipe: Recipe) -> str | None:
        fmts = {recipe.qk, recipe.v}
        if len(fmts) != 1 or recipe.qk not in _DTYPES:
            return (f"qk={recipe.qk}, v={recipe.v}: PyTorch SDPA runs FP16 or BF16 (Q, K, V alike); "
                    "for FP8 use --backend fa3 or --backend emulate")
        if recipe.out != recipe.qk:
            return f"SDPA writes its input format ({recipe.qk}), not out={recipe.out}"
        if self.kind == "math":
            if recipe.algo != "standard":
                return "sdpa-math materialises S and P (algo=standard); for algo=flash use sdpa-flash or sdpa-cudnn"
            return None
        if recipe.algo != "flash":
            return (f"sdpa{'-' + self.kind if self.kind else ''} computes tile by tile (algo=flash); "
                    "for materialised S and P (algo=standard) use sdpa-math")
        if recipe.p != recipe.qk:
            return f"the SDPA kernels cast P to the input format ({recipe.qk}), not p={recipe.p}"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        from fa3_numerics.numerics.emulator import prepare

        why = self.supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on backend {self.name!r}: {why}")
        n, d = q.shape[2], q.shape[3]
        rows = torch.arange(n, device=q.device) if causal else q_index
        pre = prepare(recipe, q, k, v, q_index=rows, rotation_seed=rotation_seed, causal=causal, cache=cache)
        dt = _DTYPES[recipe.qk]
        qq, kk, vv = (t.values.to(dt) for t in (pre.q, pre.k, pre.v))
        reduced = self.kind == "math" and recipe.softmax != "fp32"
        with contextlib.ExitStack() as stack:
            if self.kind:
                from torch.nn.attention import sdpa_kernel

                stack.enter_context(sdpa_kernel([sdp_backend(self.kind)]))
            if reduced and hasattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp"):
                prev = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
                stack.callback(torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp, prev)
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                                 scale=softmax_scale if softmax_scale is not None
                                                                 else 1.0 / math.sqrt(d))
        if causal and q_index.numel() != n:
            o = o.index_select(2, q_index.to(o.device))
        return o.to(torch.float64)


class SdpaDefault(SdpaBackend):
    name = "sdpa"
    kind = ""
    description = "torch.nn.functional.scaled_dot_product_attention, kernel chosen by PyTorch (FP16/BF16)"

    def supports(self, recipe: Recipe) -> str | None:
        fmts = {recipe.qk, recipe.v}
        if len(fmts) != 1 or recipe.qk not in _DTYPES:
            return (f"qk={recipe.qk}, v={recipe.v}: PyTorch SDPA runs FP16 or BF16 (Q, K, V alike); "
                    "for FP8 use --backend fa3 or --backend emulate")
        if recipe.out != recipe.qk:
            return f"SDPA writes its input format ({recipe.qk}), not out={recipe.out}"
        return None


class SdpaFlash(SdpaBackend):
    name = "sdpa-flash"
    kind = "flash"
    description = "PyTorch SDPA pinned to its FlashAttention-2 kernel (CUDA, FP16/BF16), forward and backward"
    backward = True

    def backward_supports(self, recipe: Recipe) -> str | None:
        why = self.supports(recipe)
        if why is not None:
            return why
        fmts = {getattr(recipe, f) for f in ("bwd_s", "bwd_dv", "bwd_dp", "bwd_ds", "bwd_dq", "bwd_dk", "bwd_out")}
        if fmts != {recipe.qk}:
            return (f"bwd.* formats {', '.join(sorted(fmts))}: SDPA's flash backward computes in its input format "
                    f"({recipe.qk}) throughout; set every bwd.* format to {recipe.qk} (the sdpa-flash-bf16 preset)")
        if recipe.bwd_rot != "none" or recipe.rot != "none":
            return "rot/bwd.rot set: SDPA's flash kernel takes no rotation; use --backend emulate"
        return None

    def gradients(self, recipe, q, k, v, do, *, causal, rotation_seed, cache, softmax_scale=None,
                  keep_heads: bool = False):
        """O, dQ, dK, dV as SDPA users get them (the public call, K and V repeated per query head for
        GQA and autograd summing their gradients), and the LSE the backward read (natural log, float32):
        the one autograd saved, else the aten op the public call dispatches to, kept only where its O is
        the public call's. ``keep_heads`` (the device dump tools) adds what the kernel read and wrote in
        its own dtype: "read" (Q, K, V, dO as cast), "own" (O, dQ, dK, dV as written) and "dk_heads",
        "dv_heads" (the gradients of the repeated K, V, per query head, before autograd sums them)."""
        from torch.nn.attention import sdpa_kernel

        why = self.backward_supports(recipe)
        if why is not None:
            raise UsageError(f"recipe {recipe.short_str()} cannot run on backend {self.name!r}'s backward: {why}")
        if not q.is_cuda:
            raise UsageError("SDPA's flash kernel needs the inputs on a CUDA device; pass --device cuda")
        dt = _DTYPES[recipe.qk]
        g = q.shape[1] // k.shape[1]
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
        from fa3_numerics.numerics.formats import cast

        # One rounding from float64, as the emulator's: torch's own float64 -> BF16 goes through float32
        # (two roundings: 29 of 4 million N(0, 1) values land elsewhere), and one such input moves a
        # whole row of S, so the kernel and the emulator would not read the same inputs.
        qb, kb, vb = (cast(t, recipe.qk).requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel([sdp_backend(self.kind)]):
            ke, ve = (kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)) if g > 1 else (kb, vb)
            if keep_heads and g > 1:
                ke.retain_grad()
                ve.retain_grad()
            dob = cast(do, recipe.qk) if do.dtype == torch.float64 else do.to(dt)
            try:
                o = torch.nn.functional.scaled_dot_product_attention(qb, ke, ve, is_causal=causal, scale=scale)
                lse = getattr(o.grad_fn, "_saved_logsumexp", None)
                lse = None if lse is None else lse.detach().to(torch.float32)
                o.backward(dob)
            except RuntimeError as exc:
                from fa3_numerics.errors import KernelDeclined

                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise KernelDeclined(f"SDPA's flash kernel declines [B {q.shape[0]}, H {q.shape[1]}/{k.shape[1]}, "
                                     f"N {q.shape[2]}, D {q.shape[3]}] ({first})") from None
            if lse is None:  # a torch whose autograd node does not expose it: one more forward, the aten op's
                try:
                    with torch.no_grad():
                        fwd = torch.ops.aten._scaled_dot_product_flash_attention(
                            qb.detach(), ke.detach(), ve.detach(), 0.0, causal, False, scale=scale)
                    if torch.equal(fwd[0], o.detach()):
                        lse = fwd[1].to(torch.float32)
                except (RuntimeError, TypeError, AttributeError):  # another torch's aten signature: no LSE
                    lse = None
        out = {"o": o.detach().to(torch.float64), "dq": qb.grad.to(torch.float64), "dk": kb.grad.to(torch.float64),
               "dv": vb.grad.to(torch.float64), "lse": lse}
        if keep_heads:
            out["read"] = {"q": qb.detach(), "k": kb.detach(), "v": vb.detach(), "do": dob}
            out["own"] = {"o": o.detach(), "dq": qb.grad, "dk": kb.grad, "dv": vb.grad}
            out["dk_heads"], out["dv_heads"] = (ke.grad, ve.grad) if g > 1 else (kb.grad, vb.grad)
        return out

    def validation_backward_recipe(self, case):
        """The sdpa-flash-bf16 preset (the fitted FA2-in-torch forward and backward) for every case."""
        from fa3_numerics.numerics.recipe import get_recipe

        return get_recipe("sdpa-flash-bf16").recipe

    def validation_backward_skip(self, case) -> str | None:
        if case.head_dim > 256 or case.head_dim % 8:
            return f"head dim {case.head_dim}: SDPA's flash kernel takes multiples of 8 up to 256"
        return None


class SdpaCudnn(SdpaBackend):
    name = "sdpa-cudnn"
    kind = "cudnn"
    description = "PyTorch SDPA pinned to cuDNN fused attention (CUDA, FP16/BF16)"


class SdpaEfficient(SdpaBackend):
    name = "sdpa-efficient"
    kind = "efficient"
    description = "PyTorch SDPA pinned to memory-efficient attention (CUDA, FP16/BF16)"


class SdpaMath(SdpaBackend):
    name = "sdpa-math"
    kind = "math"
    description = ("PyTorch SDPA math: S and P materialised (CPU or CUDA, FP16/BF16; softmax kept in the input "
                   "format when the recipe's softmax is FP16/BF16)")
