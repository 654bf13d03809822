"""What every hardware backend checks before it runs, and how it says what is missing: one line,
every missing piece with its fix, ending in the emulator to use meanwhile.

Exposed: ``package_version``, ``gpu_problem``, ``load_problem``, ``refusal``.
"""

from __future__ import annotations

from typing import Callable

import torch


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (None: not installed, or without metadata)."""
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - not installed, or installed without metadata
        return None


def gpu_problem(device: str, ok: Callable[[tuple[int, int]], bool], *, no_gpu: str, wrong_gpu: str,
                kernel: str) -> str | None:
    """Why ``device`` cannot run a kernel whose GPUs pass ``ok(compute capability)`` (None: it can).
    ``no_gpu``: what the kernel needs, said when no GPU is visible; ``wrong_gpu``: said after
    "NAME is sm_XY"; ``kernel``: its name in "KERNEL runs on the GPU"."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible ({no_gpu})"
    idx = torch.device(device).index if device.startswith("cuda") else None
    cap = torch.cuda.get_device_capability(idx)
    if not ok(cap):
        return f"{torch.cuda.get_device_name(idx)} is sm_{cap[0]}{cap[1]}{wrong_gpu}"
    if not device.startswith("cuda"):
        return f"--device {device}: {kernel} runs on the GPU; pass --device cuda"
    return None


def refusal(problems: list[str]) -> str | None:
    """The one line of every missing piece (None when nothing is missing)."""
    return "; ".join(problems) + "; meanwhile use --backend emulate" if problems else None


def load_problem(load: Callable[[], object], failed: str, hint: str) -> str | None:
    """None when ``load()`` works; else ``failed`` with the error's first line and ``hint``."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - an import of a compiled or Triton package fails in many ways
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return f"{failed} ({type(exc).__name__}: {first}); {hint}"
    return None


__all__ = ["package_version", "gpu_problem", "load_problem", "refusal"]
