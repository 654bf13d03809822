"""Where a model's decoder layers live: ``--device-map`` for a model that does not fit one GPU.

Exposed: ``parse_device_map``, ``layer_devices``, ``module_map``, ``place_model``, ``devices_of``.

The spec is what a user writes: ``auto`` (the decoder layers split into equal contiguous runs over
the visible GPUs, in order; the embedding sits with the first run, the final norm and the LM head
with the last), or a per-layer map ``0-14:cuda:0,15-29:cuda:1`` (ranges of layer indices, each to
a device; ``*`` for every layer not named). The model is then dispatched by accelerate
(``dispatch_model``, the hooks that move each module's inputs to its device), the engine users
already run sharded models on; each layer's attention then runs where its Q, K and V are, since
the attention function computes on its inputs' device. Results equal the one-device run's as long
as every device is of one kind (the same kernels do the same arithmetic).
"""

from __future__ import annotations

import re

import torch

from ..errors import UsageError, require

_RANGE = re.compile(r"^\s*(\*|\d+(?:-\d+)?)\s*:\s*(\S+)\s*$")


def _device(name: str) -> str:
    """A device string torch accepts (``cpu``, ``cuda``, ``cuda:1``), or a UsageError naming the fix."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device-map names device {name!r}, which torch does not know; write cpu, cuda or "
                         "cuda:N") from None
    require(dev.type in ("cpu", "cuda"), f"--device-map names device {name!r}; only cpu and cuda:N are supported")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if dev.index is None else dev.index
        require(index < count, f"--device-map names {name}, but this process sees {count} GPU(s); "
                f"{'name cuda:0..cuda:' + str(count - 1) if count else 'run on a machine with a GPU or map to cpu'}")
        return f"cuda:{index}"
    return "cpu"


def parse_device_map(spec: str, num_layers: int, gpus: int | None = None) -> list[str]:
    """The device of each decoder layer (a list of ``num_layers`` device strings) for ``spec``."""
    require(isinstance(spec, str) and spec.strip(), "--device-map is empty; write auto or a map such as "
            "0-14:cuda:0,15-29:cuda:1")
    spec = spec.strip()
    if spec == "auto":
        count = gpus if gpus is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
        require(count >= 1, "--device-map auto spreads layers over the visible GPUs, and this process sees none; "
                "pass --device cpu without --device-map, or a map such as 0-29:cpu")
        per, extra = divmod(num_layers, count)
        out: list[str] = []
        for g in range(count):
            out += [f"cuda:{g}"] * (per + (1 if g < extra else 0))
        return out
    devices: list[str | None] = [None] * num_layers
    rest = None
    for part in spec.split(","):
        m = _RANGE.match(part)
        require(m is not None, f"--device-map entry {part.strip()!r} is not LAYERS:DEVICE (e.g. 0-14:cuda:0, "
                "*:cuda:1)")
        layers, dev = m.group(1), _device(m.group(2))
        if layers == "*":
            require(rest is None, "--device-map names * twice; give the remaining layers one device")
            rest = dev
            continue
        lo, _, hi = layers.partition("-")
        lo, hi = int(lo), int(hi or lo)
        require(lo <= hi < num_layers, f"--device-map range {layers} is outside layers 0-{num_layers - 1}")
        for i in range(lo, hi + 1):
            require(devices[i] is None, f"--device-map places layer {i} twice")
            devices[i] = dev
    missing = [i for i, d in enumerate(devices) if d is None]
    require(not missing or rest is not None, f"--device-map leaves layers {_ranges(missing)} without a device; "
            "name them or add *:DEVICE")
    return [d if d is not None else rest for d in devices]


def _ranges(idx: list[int]) -> str:
    out, start = [], None
    for a, b in zip(idx, idx[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = None
    return ",".join(out)


def _decoder(model):
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    require(isinstance(layers, torch.nn.ModuleList), f"{type(model).__name__} keeps no decoder layers in "
            "base_model.layers; --device-map supports decoder-only models laid out as Llama, Mistral and Qwen2 are")
    prefix = next(name for name, mod in model.named_modules() if mod is base)
    return base, layers, prefix


def module_map(model, devices: list[str]) -> dict[str, str]:
    """accelerate's ``device_map`` for ``model``: every direct child of the decoder and the model's
    other top-level modules, the layers by ``devices``, the rest with the first or the last layer."""
    base, layers, prefix = _decoder(model)
    require(len(devices) == len(layers), f"--device-map gives {len(devices)} layer devices for {len(layers)} layers")
    first, last = devices[0], devices[-1]
    join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    out: dict[str, str] = {}
    for name, _ in base.named_children():
        if name == "layers":
            out.update({join(f"layers.{i}"): d for i, d in enumerate(devices)})
        else:
            # the embedding and the rotary tables feed layer 0; the final norm feeds the LM head
            out[join(name)] = last if name in ("norm", "final_layernorm", "ln_f") else first
    for name, _ in model.named_children():
        if name != prefix.split(".")[0]:
            out[name] = last
    return out


def place_model(model, spec: str):
    """Dispatch ``model`` (on the CPU, float32) over the devices of ``spec``; returns the model."""
    _, layers, _ = _decoder(model)
    devices = parse_device_map(spec, len(layers))
    try:
        from accelerate import dispatch_model
    except ImportError:
        raise UsageError("--device-map needs accelerate: pip install accelerate") from None
    # force_hooks: the hooks that move activations run even when every layer is on one device, so a
    # one-GPU (or CPU) run takes the very path a run over several GPUs takes
    return dispatch_model(model, device_map=module_map(model, devices), force_hooks=True)


def devices_of(model) -> list[str]:
    """The device of each decoder layer's parameters (what ``place_model`` did, read back)."""
    _, layers, _ = _decoder(model)
    return [str(next(layer.parameters()).device) for layer in layers]


def layer_devices(spec: str | None, model) -> list[str] | None:
    """The devices ``spec`` would give ``model``'s layers (None without a spec); for provenance."""
    if spec is None:
        return None
    _, layers, _ = _decoder(model)
    return parse_device_map(spec, len(layers))
