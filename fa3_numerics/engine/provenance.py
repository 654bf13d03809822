"""Provenance recorded in every dataset: versions, device, git commit, command line.

Exposed: ``provenance``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

_PACKAGES = ("fa3-numerics", "torch", "numpy", "scipy", "xarray", "h5netcdf", "seaborn", "typer", "transformers")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def provenance(device: str = "cpu") -> dict[str, str]:
    attrs = {f"version_{n.replace('-', '_')}": _version(n) for n in _PACKAGES}
    attrs.update({
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "device": device,
        "device_name": device_name(device),
        "git_commit": git_commit(),
        "command": shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tf32": "off",
    })
    if device == "cpu":  # float32 GEMMs sum in another order on another thread count
        attrs["torch_threads"] = torch.get_num_threads()
    return attrs
