"""Start CUDA in a background thread while torch is still being imported.

Exposed: ``wants_cuda``, ``start_cuda_early``, ``settle``.

A command on the GPU first pays for CUDA's start: the driver (``cuInit``) and the device's
primary context, about 0.3 s on the H200 machine. Importing torch takes 1.2 s there and needs no
GPU. The thread calls the driver through ctypes, which releases the GIL for each call, so the two
overlap; torch's runtime later finds the driver started and adopts the same primary context.
(Starting CUDA through torch in a thread overlapped little: torch's own start holds the GIL,
``tools/device/cli_profile.sh``.) Only the console script does this, and only when its
arguments name a CUDA device. Any failure is left to the command itself, which reports a missing
GPU with its fix.
"""

from __future__ import annotations

import threading

_THREADS: list[threading.Thread] = []


def wants_cuda(argv: list[str]) -> str | None:
    """The CUDA device that ``argv`` asks for (``--device cuda``, ``--device=cuda:1``), or None.
    None too when work goes to other processes (``--workers N``, ``--scheduler``): a CUDA
    context in this process would be of no use to them, and forked workers must not inherit one."""
    device = None
    for i, arg in enumerate(argv):
        if arg.startswith(("--workers", "--scheduler")):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if arg.startswith("--scheduler") or value.strip() not in ("", "0"):
                return None
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.partition("=")[2]
    return device if device is not None and device.startswith("cuda") else None


def _driver_start(ordinal: int) -> None:
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0:
            # Held for the life of the process, as torch's runtime holds it: never released.
            cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    except (OSError, AttributeError):  # no driver here: the command says so itself
        pass


def start_cuda_early(argv: list[str]) -> threading.Thread | None:
    """Start the CUDA driver and the primary context of the device that ``argv`` names, in a
    daemon thread; None when it names none."""
    device = wants_cuda(argv)
    if device is None:
        return None
    index = device.partition(":")[2]
    t = threading.Thread(target=_driver_start, args=(int(index) if index.isdigit() else 0,),
                         name="fa3n-cuda-start", daemon=True)
    t.start()
    _THREADS.append(t)
    return t


def settle() -> None:
    """Wait until the driver start has returned (at once when it has, as it has by the time torch
    is imported): a fork while that thread is inside the driver would copy its locks held."""
    for t in _THREADS:
        t.join()


__all__ = ["wants_cuda", "start_cuda_early", "settle"]
