"""Kernel dumps as the device scripts write them (tools/device/dump_*.py): one safetensors file whose
tensors are named ``GROUP/NAME`` (a case, a probe run) and whose metadata holds a JSON ``info``
record (versions, each group's configuration and scales)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_grouped(path: str | Path, meta_key: str = "info") -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """({group: {name: tensor}}, the metadata's ``meta_key`` JSON, {} when absent) of one dump."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        raw = (f.metadata() or {}).get(meta_key)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, x in load_file(str(path)).items():
        group, name = key.split("/", 1)
        groups.setdefault(group, {})[name] = x
    return groups, (json.loads(raw) if raw else {})


__all__ = ["read_grouped"]
