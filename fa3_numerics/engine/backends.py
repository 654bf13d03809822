"""Backends: where an attention variant is computed.

Exposed: ``Backend``, ``BACKENDS``, ``register_backend``, ``get_backend``, ``available_backends``.

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

A backend whose results come from hardware sets ``hardware = True``; recipes it cannot
compute are refused by ``supports`` with the reason, never silently emulated.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import ClassVar

import torch

from ..errors import UsageError
from ..numerics.recipe import Recipe


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
                  q_index: torch.Tensor, rotation_seed: int, cache: dict) -> torch.Tensor:
        raise NotImplementedError


class EmulateBackend(Backend):
    name = "emulate"
    description = "kernel-faithful emulator in PyTorch (CPU or CUDA, float32 matmuls, TF32 off)"

    def check(self, device: str) -> str | None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            return "no CUDA GPU is visible; use --device cpu"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache):
        from ..numerics.emulator import emulate

        return emulate(recipe, q, k, v, causal=causal, q_index=q_index, rotation_seed=rotation_seed, cache=cache)


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
}


def register_backend(name: str, requires: str | None, target: str) -> None:
    BACKENDS[name] = (requires, target)


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    requires, target = BACKENDS[name]
    if requires is not None and importlib.util.find_spec(requires) is None:
        raise UsageError(f"backend {name!r} needs the Python module {requires!r}, which is not installed; "
                         f"run `fa3-numerics backends` for how to get it")
    mod, cls = target.split(":")
    return getattr(importlib.import_module(mod), cls)()


def available_backends(device: str) -> dict[str, str | None]:
    """name -> None if usable on ``device``, else the reason and fix."""
    out = {}
    for name in BACKENDS:
        try:
            out[name] = get_backend(name).check(device)
        except (UsageError, ImportError) as exc:
            out[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return out


def backend_table(device: str) -> list[dict]:
    """One row per registered backend: name, usable, reason/fix, hardware, description."""
    rows = []
    status = available_backends(device)
    for name in BACKENDS:
        try:
            b = get_backend(name)
            desc, hw = b.description, b.hardware
        except (UsageError, ImportError):
            desc, hw = "", False
        rows.append({"name": name, "usable": status[name] is None, "why": status[name] or "",
                     "hardware": hw, "description": desc})
    return rows
