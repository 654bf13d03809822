"""Host side of the quantizer kernels: what they write (``QuantOut``), the layouts they read and
write, the rotation's constants, and how many programs a grid gets.

Exposed: ``QuantOut``, ``GRAN_CODES``, ``LAYOUTS``, ``strides``, ``dims``, ``rotation_constants``,
``programs``, ``fit_per_sm``, ``descale_buffer``, ``launch``, ``SMEM_PER_SM``, ``REGS_PER_SM``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import torch

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken

from ._common import interpreting

GRAN_CODES = {PerTensor: 0, PerHead: 1, PerBlock: 2, PerToken: 3}
LAYOUTS = ("bshd", "bhsd", "bhds")
SMEM_PER_SM = 228 * 1024  # Hopper; each resident program also reserves 1 KB
REGS_PER_SM = 65536
_SMS: dict = {}


@dataclasses.dataclass
class QuantOut:
    """FP8 values and float32 descales as the attention kernels read them.

    ``values``: FP8 in ``layout`` (bhsd: (batch, heads, seqlen, dim); bshd: (batch, seqlen,
    heads, dim), FA3's; bhds: (batch, heads, dim, seqlen), V transposed for K-major FP8 MMAs).
    ``descale``: float32 (b, h // group, n_desc) for block (n_desc = blocks of ``rows``) and token
    (rows = 1); (b, h // group, 1) for head; (1, 1, 1) for tensor. ``rows``: tokens per descale.
    """

    values: torch.Tensor
    descale: torch.Tensor
    layout: str
    rows: int  # tokens per descale along seqlen
    group: int  # heads per descale
    gran: int  # GRAN_CODES value
    launch: str = ""  # the kernel and launch configuration that wrote it

    def values_bhsd(self) -> torch.Tensor:
        v = self.values
        if self.layout == "bshd":
            return v.transpose(1, 2)
        if self.layout == "bhds":
            return v.transpose(2, 3)
        return v

    def descale_like_prepare(self, heads: int, seqlen: int) -> torch.Tensor:
        """The emulator's broadcast form: [b, heads, 1 or seqlen, 1], or [1, 1, 1, 1] per tensor."""
        d = self.descale
        if self.gran == 0:
            return d.reshape(1, 1, 1, 1)
        if self.gran == 1:
            return d.repeat_interleave(self.group, dim=1).unsqueeze(-1)
        return d.repeat_interleave(self.rows, dim=2)[:, :, :seqlen].unsqueeze(-1)


def descale_buffer(gran_code: int, b: int, h: int, n: int, rows: int, group: int, device) -> torch.Tensor:
    """The float32 descales a quantizer writes, in ``QuantOut.descale``'s shape: (b, h, blocks of
    ``rows``) per block, (b, h, n) per token, (b, h // group, 1) per head, (1, 1, 1) per tensor."""
    shape = {2: (b, h, -(-n // rows)), 3: (b, h, n), 1: (b, h // group, 1)}.get(gran_code, (1, 1, 1))
    return torch.empty(shape, dtype=torch.float32, device=device)


def strides(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides of a 4-d tensor in ``layout``."""
    s = x.stride()
    if layout == "bshd":
        return s[0], s[2], s[1], s[3]
    if layout == "bhsd":
        return s[0], s[1], s[2], s[3]
    if layout == "bhds":
        return s[0], s[1], s[3], s[2]
    raise UsageError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")


def dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    if layout == "bshd":
        b, n, h, d = x.shape
    elif layout == "bhsd":
        b, h, n, d = x.shape
    else:
        b, h, d, n = x.shape
    return b, h, n, d


_CONSTANTS: dict = {}


def rotation_constants(d: int, seed: int, device, exact: bool, dot_dtype):
    """(signs, hadamard, sqrt_d) on ``device``, cached: the random signs of the rotation (float64
    on the exact path, else float32), the +-1 matrix diag(signs) H in ``dot_dtype`` (the input's
    dtype for the tensor-core dot), and [sqrt(d), 1/sqrt(d)]."""
    key = (d, seed, str(device), exact, dot_dtype)
    if key not in _CONSTANTS:
        from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

        signs = random_signs(d, seed)
        hadamard = (signs[:, None] * hadamard_matrix(d)).to(dot_dtype or torch.bfloat16)
        sqrt_d = torch.tensor([d ** 0.5, 1.0 / d ** 0.5], dtype=torch.float64)
        ct = torch.float64 if exact else torch.float32
        _CONSTANTS[key] = (signs.to(device=device, dtype=ct), hadamard.contiguous().to(device),
                           sqrt_d.to(device=device, dtype=ct))
    return _CONSTANTS[key]


def programs(dev, total: int, progs_per_sm: int) -> int:
    """Programs of a persistent grid: ``progs_per_sm`` per SM, at most one per work item."""
    if interpreting() or dev.type != "cuda":
        return max(1, min(total, 3))  # several items per program: the loop is exercised
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return max(1, min(total, _SMS[key] * progs_per_sm))


def fit_per_sm(k, num_warps: int) -> int:
    """Programs of the compiled kernel ``k`` that fit one SM, by its registers (allocated in
    units of 8 a thread) and its shared memory (plus 1 KB reserved a program)."""
    k._init_handles()
    regs = ((max(1, int(getattr(k, "n_regs", 0) or 0)) + 7) // 8) * 8 * 32 * num_warps
    return min(REGS_PER_SM // regs, SMEM_PER_SM // (int(k.metadata.shared) + 1024))


_COMPILED: dict = {}


def launch(kernel, grid: tuple, args: list, consts: dict) -> str:
    """``kernel[grid](*args, **consts)``, through the compiled kernel once it is known; returns
    how it launched ("compiled", or "jit" and why), which the callers put in their ``launch``.

    Why: a JIT launch binds and specialises every argument again (about 0.1 ms for the fused
    pre-pass's ~45 arguments and ~25 constants on the H200's host). Timed per call, its three
    operands' six launches cost more than the kernels themselves. The compiled kernel is the one
    ``kernel.warmup`` returns for these arguments, on the current device. The cache key holds
    what Triton 3.6 specialises on (``native_specialize_impl``): each tensor's dtype, and its
    pointer's 16-byte alignment (only aligned calls are cached; others take the JIT launch);
    each integer's ``== 1``, ``% 16 == 0`` and 32-bit range; the constants; and the device,
    whose loaded binary the compiled kernel is. Not in it: Triton's global knobs (debug,
    instrumentation), which this package does not change between calls.
    ``FA3N_TRITON_FAST_LAUNCH=0`` always takes the JIT launch. Triton's interpreter has no
    compiled kernels, so there both launches are the JIT's."""
    if interpreting() or os.environ.get("FA3N_TRITON_FAST_LAUNCH", "1") == "0":
        kernel[grid](*args, **consts)
        return "jit"
    key = [id(kernel), torch.cuda.current_device()]
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.data_ptr() % 16:
                kernel[grid](*args, **consts)
                return "jit (unaligned pointer)"
            key.append((a.dtype, a.device))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append((type(a).__name__, a if isinstance(a, bool) else None))
        else:
            key.append((a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31))
    key.append(tuple(sorted((k, str(v)) for k, v in consts.items())))
    key = tuple(key)
    hit = _COMPILED.get(key)
    if hit is None:
        try:
            compiled = kernel.warmup(*args, grid=grid, **consts)
            names = set(kernel.arg_names)
            hit = (compiled, inspect.signature(kernel.fn), {k: v for k, v in consts.items() if k in names})
        except Exception as exc:  # noqa: BLE001 - another Triton's internals: its own launch still works
            hit = f"jit ({type(exc).__name__}: {str(exc)[:80]})"
        _COMPILED[key] = hit
    if isinstance(hit, str):
        kernel[grid](*args, **consts)
        return hit
    compiled, sig, fixed = hit
    bound = sig.bind(*args, **fixed)
    bound.apply_defaults()
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*bound.arguments.values())
    return "compiled"
