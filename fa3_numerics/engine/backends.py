"""Backends: where an attention variant is computed.

Exposed: ``Backend``, ``BACKENDS``, ``register_backend``, ``get_backend``, ``available_backends``,
``backend_table``, ``refusal``, ``backward_refusal``, ``check_device``, ``DEVICE_HELP``.

A backend turns (recipe, float64 Q, K, V) into the attention output for the chosen query
rows. ``emulate`` is the kernel-faithful emulator (CPU or CUDA, same code). Other backends
(the compiled FA3 kernel, PyTorch SDPA) register here by name with the optional module they
need, as xarray's BACKEND_ENTRYPOINTS do; they are imported only when asked for, and
``available_backends`` says for each why it can or cannot run on this machine.

Registered:

- ``emulate``: the emulator (``fa3_numerics.numerics.emulator``), any recipe, CPU or CUDA.
- ``fa3``: the compiled FA3 forward kernel (``fa3_fwd_interface`` from the ``fa3-fwd`` wheel,
  or ``flash_attn_interface`` from an upstream build) on a Hopper GPU; FP8 with per-(batch,
  kv-head) or per-tensor descales and BF16. The recipe's rotation and quantization are
  applied before the call by the emulator's own ``prepare``, so both see identical inputs.
- ``sdpa`` (PyTorch's choice), ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``,
  ``sdpa-math``: ``torch.nn.functional.scaled_dot_product_attention`` pinned to one of
  PyTorch's kernels, FP16/BF16 recipes only.

- ``sage1``: SageAttention 1's Triton kernel (``sageattn`` of the ``sageattention`` 1.x wheel) on
  an sm80+ GPU; FP16/BF16 inputs, head dims 64, 96, 128 (``fa3_numerics.kernels.sage``).

- ``sage2``: SageAttention2's Hopper CUDA kernel (``sageattn_qk_int8_pv_fp8_cuda_sm90``, built from
  source by tools/device/sage2_build.sh, found through ``FA3N_SAGE2_PATH``) on sm90; FP16/BF16
  inputs, head dims up to 128 (``fa3_numerics.kernels.sage2``).

- ``cudnn-fp8``: cuDNN's fused FP8 SDPA forward (cudnn-frontend ``sdpa_fp8``, TransformerEngine's FP8
  attention) on sm90+; per-tensor E4M3, FP8 O on Hopper (``fa3_numerics.kernels.cudnn``).

- ``torchao-fp8``: torchao 0.18's FP8 attention (its Triton quantizer, then the FA3 FP8 kernel) on
  a Hopper GPU (``fa3_numerics.kernels.torchao``).

- ``fa3-mock``: the ``fa3`` backend with a float32 stand-in for the kernel (CPU or CUDA), so the
  whole hardware path (``validate``, ``run --backend``) is testable anywhere. Never hardware.

A backend that also computes gradients sets ``backward = True`` and implements ``gradients`` and
``backward_supports`` (``emulate`` and ``cudnn-fp8``); ``run backward --backend`` reads them.

A backend whose results come from hardware sets ``hardware = True``; recipes it cannot
compute are refused with the reason, never silently emulated (``refusal``: the backend's own
``supports``, and every recipe key whose non-default value the backend is not listed for in the
key registry, so a key added later is refused everywhere but the emulator until a backend
implements it).

Add a backend: one module with a ``Backend`` subclass and one line in ``BACKENDS`` (or
``register_backend`` from anywhere, or an entry point ``NAME = "module:Class"`` in the group
``fa3_numerics.backends`` for a package of your own). The CLI's ``--backend`` help, ``backends``
and every study read this registry.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import ClassVar

import torch

from ..errors import UsageError, require
from ..numerics.recipe import Recipe

ENTRY_POINT_GROUP = "fa3_numerics.backends"
DEVICE_HELP = "cpu, cuda or cuda:N"


def check_device(device: str, option: str = "--device") -> str:
    """``device`` if it names a device this toolkit runs on (cpu, cuda, cuda:N), else UsageError."""
    ok = device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())
    require(ok, f"{option} {device!r} is not a device here; use {DEVICE_HELP}")
    return device


class Backend:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True when results come from hardware rather than emulation.
    hardware: ClassVar[bool] = False

    def check(self, device: str) -> str | None:
        """None when the backend can run on ``device``, else why not and the fix (one line)."""
        return None

    def supports(self, recipe: Recipe) -> str | None:
        """None when ``recipe`` can run here, else why not."""
        return None

    def attention(self, recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  q_index: torch.Tensor, rotation_seed: int, cache: dict,
                  softmax_scale: float | None = None, **masking) -> torch.Tensor:
        """Output rows ``q_index`` ([B, H, R, Dv], float64). ``softmax_scale`` None = 1/sqrt(head_dim).
        ``masking``: ``window_size``, ``softcap``, ``sinks`` (``numerics/masking.py``), passed only
        to a backend whose ``masking_refusal`` accepts them."""
        raise NotImplementedError

    #: True when the backend computes gradients too (``gradients``: ``run backward --backend NAME``).
    backward: ClassVar[bool] = False

    def backward_supports(self, recipe: Recipe) -> str | None:
        """None when ``gradients`` computes ``recipe``'s forward and backward here, else why not. A
        backend with a backward checks every ``bwd.*`` key itself (``backward_refusal``)."""
        return None if self.backward else (f"backend {self.name!r} computes the forward only; use --backend "
                                           "emulate, or one `fa3-numerics backends` marks fwd+bwd")

    def gradients(self, recipe: Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                  causal: bool, rotation_seed: int, cache: dict, softmax_scale: float | None = None) -> dict:
        """The forward and backward over every query row, float64: {"o" [B, H, N, Dv], "dq" [B, H, N, D],
        "dk" [B, Hkv, N, D], "dv" [B, Hkv, N, Dv]} from float64 Q, K, V and the incoming gradient dO."""
        raise NotImplementedError

    def provenance(self) -> dict[str, str]:
        """Where the results come from, for a dataset's attributes (e.g. ``kernel_module``,
        ``kernel_version``); studies ask the backend rather than import its module."""
        return {}

    def masking_refusal(self, mk) -> str | None:
        """Why this backend cannot compute a sliding window, softcap or sinks (``numerics.masking.Masking``);
        None when it can. Backends that never take them refuse every non-plain one."""
        return None if mk.plain else (f"backend {self.name!r} computes plain (causal or full) attention only, not "
                                      f"{mk.describe()}; use --backend emulate")


class EmulateBackend(Backend):
    name = "emulate"
    description = "kernel-faithful emulator in PyTorch (CPU or CUDA, float32 matmuls, TF32 off)"

    def check(self, device: str) -> str | None:
        if not (device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
            return f"device {device!r} is not one the emulator runs on; use {DEVICE_HELP}"
        if device.startswith("cuda") and not torch.cuda.is_available():
            return "no CUDA GPU is visible; use --device cpu"
        if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
            return f"{device}: only {torch.cuda.device_count()} GPU(s) are visible"
        return None

    def masking_refusal(self, mk) -> str | None:
        return None

    backward = True

    def backward_supports(self, recipe: Recipe) -> str | None:
        return None

    def gradients(self, recipe, q, k, v, do, *, causal, rotation_seed, cache, softmax_scale=None):
        from ..numerics.backward import emulate_backward

        gr = emulate_backward(recipe, q, k, v, do, causal=causal, softmax_scale=softmax_scale,
                              rotation_seed=rotation_seed, cache=cache)
        return {"o": gr.forward.o, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None, **masking):
        from ..numerics.emulator import emulate

        return emulate(recipe, q, k, v, causal=causal, softmax_scale=softmax_scale, q_index=q_index,
                       rotation_seed=rotation_seed, cache=cache, **masking)


# name -> (module that must import, "module:Class"); add entries to register new backends.
# The kernel backends need no module to be *constructed*: their ``check`` explains what is
# missing (GPU, architecture, package) and how to get it, so ``supports`` works everywhere.
BACKENDS: dict[str, tuple[str | None, str]] = {
    "emulate": (None, "fa3_numerics.engine.backends:EmulateBackend"),
    "fa3": (None, "fa3_numerics.kernels.fa3:Fa3Backend"),
    "sdpa": (None, "fa3_numerics.kernels.sdpa:SdpaDefault"),
    "sdpa-flash": (None, "fa3_numerics.kernels.sdpa:SdpaFlash"),
    "sdpa-cudnn": (None, "fa3_numerics.kernels.sdpa:SdpaCudnn"),
    "sdpa-efficient": (None, "fa3_numerics.kernels.sdpa:SdpaEfficient"),
    "sdpa-math": (None, "fa3_numerics.kernels.sdpa:SdpaMath"),
    "fa3-mock": (None, "fa3_numerics.kernels.fa3:MockFa3Backend"),
    "sage1": (None, "fa3_numerics.kernels.sage:SageBackend"),
    "sage2": (None, "fa3_numerics.kernels.sage2:Sage2Backend"),
    "cudnn-fp8": (None, "fa3_numerics.kernels.cudnn:CudnnFp8Backend"),
    "torchao-fp8": (None, "fa3_numerics.kernels.torchao:TorchaoFp8Backend"),
    "triton": (None, "fa3_numerics.kernels.triton_.backend:TritonBackend"),
    "triton-two-level": (None, "fa3_numerics.kernels.triton_.backend:TritonTwoLevelBackend"),
    "triton-fused": (None, "fa3_numerics.kernels.triton_.backend:TritonFusedBackend"),
}


def register_backend(name: str, requires: str | None, target: str) -> None:
    """One line registers a backend: its name, the module it needs (or None), "module:Class"."""
    BACKENDS[name] = (requires, target)


_entry_points_loaded = False


def _load_entry_points() -> None:
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            BACKENDS.setdefault(ep.name, (None, ep.value))


def names() -> list[str]:
    """Every registered backend name."""
    _load_entry_points()
    return list(BACKENDS)


def get_backend(name: str) -> Backend:
    _load_entry_points()
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    requires, target = BACKENDS[name]
    if requires is not None and importlib.util.find_spec(requires) is None:
        raise UsageError(f"backend {name!r} needs the Python module {requires!r}, which is not installed; "
                         f"run `fa3-numerics backends` for how to get it")
    mod, cls = target.split(":")
    return getattr(importlib.import_module(mod), cls)()


def refusal(backend: Backend, recipe: Recipe) -> str | None:
    """Why ``backend`` cannot compute ``recipe`` (None: it can): its own ``supports``, then every
    key set away from its default that the key registry does not list the backend for."""
    why = backend.supports(recipe)
    if why is not None or backend.name == "emulate":
        return why
    for k, value in recipe.nondefault():
        if k.backends != "any" and backend.name not in k.backends:
            from ..numerics.keys import fmt_value

            return (f"{k.key}={fmt_value(value)} is not implemented by backend {backend.name!r} "
                    f"(only {', '.join(('emulate',) + tuple(k.backends))}); drop it or use --backend emulate")
    return None


def backward_refusal(backend: Backend, recipe: Recipe) -> str | None:
    """Why ``backend`` cannot compute ``recipe``'s forward and backward (None: it can): its own
    ``backward_supports`` (which answers for the ``bwd.*`` keys), then ``refusal``'s key check for the
    rest."""
    sup = getattr(backend, "backward_supports", None)
    why = sup(recipe) if sup is not None else f"backend {backend.name!r} computes the forward only; use --backend emulate"
    if why is not None or backend.name == "emulate":
        return why
    for k, value in recipe.nondefault():
        if not k.key.startswith("bwd.") and k.backends != "any" and backend.name not in k.backends:
            from ..numerics.keys import fmt_value

            return (f"{k.key}={fmt_value(value)} is not implemented by backend {backend.name!r} "
                    f"(only {', '.join(('emulate',) + tuple(k.backends))}); drop it or use --backend emulate")
    return None


def available_backends(device: str) -> dict[str, str | None]:
    """name -> None if usable on ``device``, else the reason and fix."""
    try:
        check_device(device)
    except UsageError as exc:
        return {name: str(exc) for name in names()}
    out = {}
    for name in names():
        try:
            out[name] = get_backend(name).check(device)
        except (UsageError, ImportError) as exc:
            out[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return out


def backend_table(device: str) -> list[dict]:
    """One row per registered backend: name, usable, reason/fix, hardware, description."""
    rows = []
    status = available_backends(device)
    for name in names():
        try:
            b = get_backend(name)
            desc, hw, bwd = b.description, b.hardware, bool(getattr(b, "backward", False))
        except (UsageError, ImportError):
            desc, hw, bwd = "", False, False
        rows.append({"name": name, "usable": status[name] is None, "why": status[name] or "",
                     "hardware": hw, "backward": bwd, "description": desc})
    return rows
