"""Registry of input distributions for Q, K, V.

Exposed: ``AttnShape``, ``register``, ``get``, ``available``, ``generate``, ``param_label``,
``param_long_name``, ``param_symbol``, ``incoming_gradient``.

A distribution is a function ``fn(shape, seed, **params) -> (q, k, v)`` returning float64
tensors laid out (batch, heads, seqlen, head_dim) for Q and (batch, kv_heads, seqlen,
head_dim) for K and V. It draws from an explicit ``torch.Generator`` seeded with ``seed``
so that a (distribution, params, seed) triple always gives the same tensors on every
machine (generation happens on the CPU in float64; callers move the result).

Add a family as one module in this package that calls ``register``: every module here is
imported on first use, so no list needs editing. Third-party families can register from
anywhere.

An entry also says how reports and datasets write it: ``labels`` gives each parameter its
symbol, its long name (the dataset coordinate's CF ``long_name``) and its axis label (``p``:
"p", "outlier probability per entry", "outlier probability p (per entry)"), and ``histogram`` the sentence a report
puts under the |Q|, |K| histogram of inputs drawn from it (what the shape of the counts shows;
empty when the family has nothing to add), with ``bulk`` whether the N(0,1) bulk alone is the
reference curve to draw beside the counts.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Callable, Protocol

import torch

from ...errors import UsageError, require


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """Shape of one attention problem. K and V have ``kv_heads`` heads (GQA when fewer)."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int
    kv_heads: int | None = None
    seqlen_k: int | None = None

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.seqlen_k is None:
            object.__setattr__(self, "seqlen_k", self.seqlen)
        for f in ("batch", "heads", "seqlen", "head_dim", "kv_heads", "seqlen_k"):
            require(getattr(self, f) >= 1, f"{f} must be a positive integer, got {getattr(self, f)}")
        require(
            self.heads % self.kv_heads == 0,
            f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}) for GQA",
        )

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.seqlen_k, self.head_dim)


class Distribution(Protocol):
    def __call__(self, shape: AttnShape, seed: int, **params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    fn: Distribution
    description: str
    # name -> (default, help); the CLI and dataset coordinates read these.
    params: dict[str, tuple[float, str]]
    validate: Callable[[dict], None] | None = None
    # True: ``fn`` takes ``device=`` and draws there (a CUDA generator on a GPU); False: drawn on
    # the CPU and moved.
    on_device: bool = False
    # parameter -> (symbol, long name, axis label) as datasets and reports write them
    labels: dict[str, tuple[str, str, str]] = dataclasses.field(default_factory=dict)
    # the sentence under a histogram of |Q| and |K| drawn from this family; whether the N(0,1) bulk
    # alone is drawn beside the counts as their reference
    histogram: str = ""
    bulk: bool = False
    # the family's own incoming gradient dO for what ``fn`` draws (same arguments), or None: a
    # function returning (dO [B, H, N, D] float64, where it comes from) or None when it has none
    grads: Callable | None = None


_REGISTRY: dict[str, Entry] = {}
_loaded = False


def register(name: str, *, description: str, params: dict[str, tuple[float, str]] | None = None,
             validate: Callable[[dict], None] | None = None, on_device: bool = False,
             labels: dict[str, tuple[str, str, str]] | None = None, histogram: str = "", bulk: bool = False,
             grads: Callable | None = None):
    """Decorator: register ``fn`` under ``name`` with its parameters' defaults and help.
    ``on_device``: ``fn`` accepts ``device=`` and draws its tensors there. ``labels``: parameter ->
    (symbol, long name, axis label) for datasets and reports (default: the name and its help); ``histogram``, ``bulk``:
    what a report says under, and draws beside, a histogram of inputs from this family. ``grads``:
    ``fn(shape, seed, **params)`` -> (dO, source) or None, the family's real incoming gradient for
    the Q, K, V ``fn`` draws (``incoming_gradient``; a capture made with ``--grads``)."""

    def deco(fn):
        _REGISTRY[name] = Entry(name, fn, description, dict(params or {}), validate, on_device, dict(labels or {}),
                                histogram, bulk, grads)
        return fn

    return deco


def _load_builtin():
    global _loaded
    if not _loaded:
        _loaded = True
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")


def available() -> dict[str, Entry]:
    _load_builtin()
    return dict(_REGISTRY)


def get(name: str) -> Entry:
    _load_builtin()
    # "captured:FILE" style names: the prefix selects the family, the rest is its argument.
    key = name.split(":", 1)[0] + ":" if ":" in name else name
    if key in _REGISTRY:
        return _REGISTRY[key]
    raise UsageError(f"unknown distribution {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")


def param_symbol(name: str) -> str:
    """How reports write parameter ``name`` in a cell ("σ" for sigma): the first registered family
    that labels it, else the name itself."""
    for entry in available().values():
        if name in entry.labels:
            return entry.labels[name][0]
    return name


def _label(name: str, i: int) -> str:
    entries = available().values()
    for entry in entries:
        if name in entry.labels:
            return entry.labels[name][i]
    return next((text for entry in entries for p, (_, text) in entry.params.items() if p == name), "")


def param_long_name(name: str) -> str:
    """The long name of parameter ``name`` (a dataset coordinate's ``long_name``): its family's,
    else its help text; '' when no registered family takes it."""
    return _label(name, 1)


def param_label(name: str) -> str:
    """The axis label of parameter ``name`` in a report's figures (its family's, else its help)."""
    return _label(name, 2)


def generate(name: str, shape: AttnShape, seed: int, *, device: str = "cpu",
             **params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw (q, k, v) in float64 on ``device``. Unknown parameters are refused.

    Streams: on the CPU, ``torch.Generator("cpu").manual_seed(seed)`` (MT19937); on a CUDA
    device, families registered ``on_device`` draw from ``torch.Generator("cuda")`` seeded the
    same way (Philox4x32-10), which takes milliseconds where the CPU takes seconds at paper
    size. The two streams differ, so a seed gives other (equally distributed) tensors on a GPU
    than on the CPU; each is reproducible on its own kind of device, and datasets record which
    was used (``rng_stream``). Other families draw on the CPU and are moved."""
    entry = get(name)
    unknown = set(params) - set(entry.params)
    require(not unknown, f"distribution {entry.name!r} takes no parameter {sorted(unknown)}; it takes {sorted(entry.params)}")
    full = {k: v[0] for k, v in entry.params.items()} | params
    if entry.validate is not None:
        entry.validate(full)
    if ":" in name:
        full["arg"] = name.split(":", 1)[1]
    if str(device).startswith("cuda") and entry.on_device:
        return entry.fn(shape, seed, device=device, **full)
    if entry.on_device:
        full["device"] = "cpu"
    q, k, v = entry.fn(shape, seed, **full)
    return tuple(t.to(device) for t in (q, k, v)) if str(device) != "cpu" else (q, k, v)


def incoming_gradient(name: str, shape: AttnShape, seed: int, **params) -> tuple[torch.Tensor, str] | None:
    """The family's own dO for the Q, K, V ``generate`` draws with the same arguments (float64 [B, H, N, D]
    on the CPU) and a sentence saying where it comes from, or None when the family has none (the caller
    then draws a synthetic dO and says so)."""
    entry = get(name)
    if entry.grads is None:
        return None
    full = {k: v[0] for k, v in entry.params.items()} | params
    if ":" in name:
        full["arg"] = name.split(":", 1)[1]
    return entry.grads(shape, seed, **full)


def rng_stream(name: str, device: str) -> str:
    """Which random stream ``generate`` uses for family ``name`` on ``device`` (for provenance)."""
    if str(device).startswith("cuda") and get(name).on_device:
        return "torch.Generator('cuda') Philox4x32-10, float64 on the GPU"
    return "torch.Generator('cpu') MT19937, float64 on the CPU"


def generator(seed: int, device: str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g
