"""Compiled fast paths of the emulator's hot loops (CPU), each with a PyTorch reference.

Exposed: ``mma``, ``softmax_step``, ``round_f64``, ``round_f32``, ``fwht``, ``to_float32``, ``status``,
``build``.

The emulator's inner loops are elementwise work over every S entry (the online softmax) or
every product of a GEMM (the Hopper MMA model). PyTorch expresses them as a dozen full-size
temporaries per KV tile, so a CPU run spends most of its time allocating and streaming memory.
``_native.c`` computes the same numbers in one pass per row, in registers (C with OpenMP; gcc
vectorises it for the CPU it runs on):

- ``fa3n_mma_fp22_f32``: the Hopper FP8 MMA model (``numerics/mma.py``), exact in float32 for FP8
  operands (AVX2 where the CPU has it);
- ``fa3n_softmax_step``: one KV tile of the flash algorithm (``numerics/emulator.py``);
- ``fa3n_round_f64``, ``fa3n_round_f32``: float64 or float32 to a narrow format with one
  rounding (``numerics/formats.py``);
- ``fa3n_fwht``: the random Hadamard rotation (``numerics/rotation.py``), same butterflies;
- ``fa3n_decode_u8``: FP8 to float32 by table lookup;
- ``fa3n_rescale_rows``: the O rescale between KV tiles, with the kernel's flush to zero;
- ``fa3n_abs_stats``: histogram, amax and non-finite count of an input in one pass;
- ``fa3n_scaled_round_f64``: float64 divided by a per-row descale and rounded to FP8 in one pass
  (``quant._scaled_cast``);
- ``fa3n_row_absmax``: max |x| per row of float64 (the amax of every scale granularity);
- ``fa3n_box_muller16``: torch.randn's map from uniforms to normals (float64), on every thread;
- ``fa3n_mt_uniform64``: torch.rand's float64 uniforms from the generator's own MT19937 state
  (torch draws them through a per-element call, 2-3x slower), the state set after as torch's.

Each returns what its PyTorch reference returns; tests/numerics/test_native.py compares them. (The
softmax's float32 exp2 is computed in double by each path's own exp2, so the two could differ
where 2^x lies within ~2^-51 of a float32 rounding boundary; none does on the test data.)

The library is compiled on first use with the system's C compiler into a per-user cache
(``$FA3N_CACHE`` or ``~/.cache/fa3-numerics``), keyed by the source, flags and CPU, and
written atomically, so concurrent processes never load a half-written file. Without a
compiler, or with ``FA3N_NATIVE=0``, every function here returns None and callers use the
PyTorch path (same numbers, slower). CUDA tensors always take the PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("_native.c")
# -ffp-contract=off: every float operation rounds as written (no fused multiply-adds the
# PyTorch reference does not have). -fno-trapping-math: floating-point exception flags are
# never read, and without it gcc will not vectorise loops whose selects compare floats.
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off",
          "-fno-trapping-math"]
_STATE: dict = {}


def _cache_dir() -> Path:
    root = os.environ.get("FA3N_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                          os.path.expanduser("~/.cache"), "fa3-numerics")
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_flags() -> str:
    # -march=native code must not be reused on another CPU that shares the cache folder.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha1(line.encode()).hexdigest()[:8]
    except OSError:
        pass
    return ""


def build() -> Path:
    """Compile the library (unless cached) and return its path; RuntimeError on failure."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src = _SRC.read_bytes()
    key = hashlib.sha1(src + " ".join([cc, *_FLAGS, platform.machine(), platform.processor(),
                                       _cpu_flags()]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"fa3n-native-{key}.so"
    if lib.is_file():
        return lib
    if lib.parent.exists() and not lib.parent.is_dir():
        raise RuntimeError(f"the build folder {lib.parent} (FA3N_CACHE) is a file")
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fa3n-native.", suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip().splitlines()
            raise RuntimeError(f"{cc} failed: {msg[0] if msg else res.returncode}")
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def _lib():
    if "lib" in _STATE:
        return _STATE["lib"]
    _STATE["lib"] = None
    if os.environ.get("FA3N_NATIVE", "1") == "0":
        _STATE["why"] = "disabled by FA3N_NATIVE=0"
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        _STATE["why"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fix = ("Install gcc to get them." if "compiler" in _STATE["why"] or "failed" in _STATE["why"] else
               "Point FA3N_CACHE at a writable folder to get them.")
        warnings.warn(f"fa3-numerics: compiled fast paths unavailable ({_STATE['why']}); using the PyTorch "
                      f"reference (same numbers, slower). {fix}", RuntimeWarning, stacklevel=3)
        return None
    i64, i32, p, f32, f64 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
    lib.fa3n_mma_fp22_f32.argtypes = [i64, i64, i64, i64, p, p, p, p, p, p, p, i32, i32, i32, i32]
    lib.fa3n_mma_fp22_f32.restype = ctypes.c_int
    lib.fa3n_softmax_step.argtypes = [i64, i64, i64, p, p, p, p, f32, p, p, p, p, f64, i32, i32, i32, i32, f64, f64,
                                      i32, i32]
    lib.fa3n_mma_model_f64.argtypes = [i64, i64, i64, i64, p, p, p, p, p, p, p, i32, i32, i32, i32, i32, i32]
    lib.fa3n_mma_model_f64.restype = ctypes.c_int
    lib.fa3n_round_f64.argtypes = [i64, p, p, i32, i32, f64, f64, i32, i32]
    lib.fa3n_round_f32.argtypes = [i64, p, p, i32, i32, f64, f64, i32, i32]
    lib.fa3n_fwht.argtypes = [i64, i64, p, p, f64, p, i32]
    lib.fa3n_decode_u8.argtypes = [i64, p, p, p, i32]
    lib.fa3n_rescale_rows.argtypes = [i64, i64, p, p, i32, i32]
    lib.fa3n_abs_stats.argtypes = [i64, p, p, i32, p, p, p, i32]
    lib.fa3n_box_muller16.argtypes = [i64, p, f64, f64, i32]
    lib.fa3n_mt_uniform64.argtypes = [p, p, p, i64, p]
    lib.fa3n_scaled_round_f64.argtypes = [i64, i64, p, p, f64, p, i32, i32, f64, f64, i32, i32]
    lib.fa3n_row_absmax.argtypes = [i64, i64, p, p, i32]
    lib.fa3n_sfu.argtypes = [i64, p, p, p, i32, i32]
    lib.fa3n_sfu_ex2_packed.argtypes = [i64, p, p, p, p, i32]
    for fn in (lib.fa3n_softmax_step, lib.fa3n_round_f64, lib.fa3n_round_f32, lib.fa3n_fwht,
               lib.fa3n_decode_u8, lib.fa3n_rescale_rows, lib.fa3n_abs_stats, lib.fa3n_box_muller16,
               lib.fa3n_mt_uniform64, lib.fa3n_scaled_round_f64, lib.fa3n_row_absmax, lib.fa3n_sfu,
               lib.fa3n_sfu_ex2_packed):
        fn.restype = None
    _STATE["lib"] = lib
    _STATE["why"] = None
    return lib


def status() -> str:
    """One line: which implementation the CPU hot loops use, and why."""
    return "native (C, OpenMP)" if _lib() is not None else f"PyTorch reference ({_STATE.get('why')})"


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _fmt_args(fmt) -> tuple[int, int, int, float, float, int]:
    """(kind, mbits, emin, max, overflow threshold, saturate) of a Format; kind 0 = keep float32."""
    if fmt is None or fmt.dtype is None or (fmt.name == "fp32"):
        return 0, 23, -126, float("inf"), float("inf"), 0
    # IEEE formats overflow to inf from max plus half an ulp of the top binade; saturating
    # ones never do.
    ovf = math.inf if fmt.saturate else fmt.max + 2.0 ** (math.frexp(fmt.max)[1] - 1 - fmt.mbits - 1)
    return 1, fmt.mbits, fmt.emin, fmt.max, ovf, int(fmt.saturate)


def _flat3(x: torch.Tensor, lead, r: int, c: int) -> tuple[torch.Tensor, ctypes.Array]:
    """x as float32 broadcast to lead + (r, c), viewed as [L, r, c] (a copy only where the
    strides do not allow a view, e.g. a transposed K stays a view), and its element strides."""
    x = x.to(torch.float32).expand(*lead, r, c).reshape(math.prod(lead), r, c)
    return x, (ctypes.c_int64 * 3)(*x.stride())


def mma(device: torch.device):
    """The compiled Hopper FP8 MMA model for ``device`` (same arguments as
    ``mma.hopper_fp8_mma_reference``), or None. The returned function gives None for operands
    it cannot take exactly (non-finite values, float64 values that float32 cannot hold, values
    outside the float form's range: see ``_native.c``), and the caller then uses the reference.
    ``portable=True`` runs the plain C step instead of the AVX2 one (for the tests)."""
    if device.type != "cpu" or _lib() is None:
        return None

    def run(a, b, c=None, *, a_min_exp, b_min_exp, portable=False):
        for t in (a, b):
            if not t.is_floating_point() or (t.dtype == torch.float64 and not torch.equal(t.float().double(), t)):
                return None  # the reference multiplies these values exactly; float32 would round them
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        m, k = a.shape[-2:]
        n = b.shape[-1]
        big_l = math.prod(lead) if lead else 1
        out = torch.empty(*lead, m, n, dtype=torch.float32)
        if out.numel() == 0:
            return out
        (aa, sa), (bb, sb) = _flat3(a, lead, m, k), _flat3(b, lead, k, n)
        cc, sc = (None, None) if c is None else _flat3(c, lead, m, n)
        rc = _lib().fa3n_mma_fp22_f32(big_l, m, k, n, _ptr(aa), sa, _ptr(bb), sb, _ptr(cc), sc, _ptr(out),
                                      int(a_min_exp), int(b_min_exp), _threads(), int(portable))
        if rc == 2:
            raise MemoryError("the compiled MMA model could not allocate its operand buffers")
        return None if rc else out

    return run


def mma_general(device: torch.device):
    """The compiled tensor-core model for any finite float32 operands (``fa3n_mma_model_f64``: the
    reference's arithmetic in double, for operands the float form above cannot take, e.g. FP8 V
    times a per-token descale), or None. Same arguments as ``mma.hopper_fp8_mma_reference`` plus
    ``model`` (an ``mma.MmaModel``); the returned function gives None for non-finite or float64
    operands, which the reference takes."""
    if device.type != "cpu" or _lib() is None:
        return None

    def run(a, b, c=None, *, a_min_exp, b_min_exp, model):
        if any(t is not None and t.dtype != torch.float32 for t in (a, b, c)):
            return None
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        m, k = a.shape[-2:]
        n = b.shape[-1]
        out = torch.empty(*lead, m, n, dtype=torch.float32)
        if out.numel() == 0 or k == 0:
            return None if k == 0 else out
        (aa, sa), (bb, sb) = _flat3(a, lead, m, k), _flat3(b, lead, k, n)
        cc, sc = (None, None) if c is None else _flat3(c, lead, m, n)
        rc = _lib().fa3n_mma_model_f64(math.prod(lead) if lead else 1, m, k, n, _ptr(aa), sa, _ptr(bb), sb, _ptr(cc),
                                       sc, _ptr(out), int(a_min_exp), int(b_min_exp), int(model.k_step),
                                       int(model.bits), int(model.final_bits), _threads())
        if rc == 2:
            raise MemoryError("the compiled MMA model could not allocate its operand buffers")
        return None if rc else out

    return run


def softmax_step(device: torch.device):
    """The compiled KV-tile step of the flash algorithm for ``device``, or None.

    ``step(s, *, sl2, qd, kd, base, lim, m, rs4, offset, ftz, fmt) -> (p, rescale)``: s
    [B, H, R, N] float32 S of the tile (overwritten with P~ cast to ``fmt``); sl2 [.., 1, 1]
    per-(batch, head) scale_log2 or None (then S is scaled by qd [B, H, R, 1] and kd
    [B, H, N, 1] times ``base``); lim [R] the last visible key per row (causal) or None;
    m [B, H, R, 1] and rs4 [B, H, R, 4] float32, updated in place. Returns (p, rescale
    [B, H, R, 1])."""
    if device.type != "cpu" or _lib() is None:
        return None

    def run(s, *, sl2, qd, kd, base, lim, m, rs4, offset, ftz, fmt):
        b, h, r, n = s.shape
        s = s.contiguous()
        big_l = b * h
        sl2_l = None if sl2 is None else sl2.to(torch.float32).expand(b, h, 1, 1).reshape(big_l).contiguous()
        qd_l = None if qd is None else qd.to(torch.float32).expand(b, h, r, 1).reshape(big_l * r).contiguous()
        kd_l = None if kd is None else kd.to(torch.float32).expand(b, h, n, 1).reshape(big_l * n).contiguous()
        lim_l = None if lim is None else lim.to(torch.int64).contiguous()
        assert m.is_contiguous() and rs4.is_contiguous()
        rescale = torch.empty((b, h, r, 1), dtype=torch.float32)
        kind, mbits, emin, fmax, ovf, sat = _fmt_args(fmt)
        _lib().fa3n_softmax_step(big_l, r, n, _ptr(s), _ptr(sl2_l), _ptr(qd_l), _ptr(kd_l), float(base), _ptr(lim_l),
                                 _ptr(m), _ptr(rs4), _ptr(rescale), float(offset), int(ftz), kind, mbits, emin,
                                 fmax, ovf, sat, _threads())
        return s, rescale

    return run


def round_f64(x: torch.Tensor, fmt) -> torch.Tensor | None:
    """float64 ``x`` rounded to ``fmt`` (ties to even, one rounding; saturating or overflowing
    as the format does), as float32; None when the compiled path is unavailable."""
    if x.device.type != "cpu" or x.dtype != torch.float64 or _lib() is None:
        return None
    kind, mbits, emin, fmax, ovf, sat = _fmt_args(fmt)
    if kind == 0:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().fa3n_round_f64(x.numel(), _ptr(x), _ptr(out), mbits, emin, fmax, ovf, sat, _threads())
    return out


def round_f32(x: torch.Tensor, fmt) -> torch.Tensor | None:
    """float32 ``x`` rounded to a narrower ``fmt`` (as ``formats.cast``), as float32; None
    when the compiled path does not apply."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or _lib() is None:
        return None
    kind, mbits, emin, fmax, ovf, sat = _fmt_args(fmt)
    if kind == 0:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib().fa3n_round_f32(x.numel(), _ptr(x), _ptr(out), mbits, emin, fmax, ovf, sat, _threads())
    return out


# Values of one slice of ``scaled_round_f64``'s float32 rounding (16 MB), so that a paper-shape K
# or V never has a whole float32 copy (134 MB) beside its FP8 codes.
_ROUND_SLICE = 1 << 22


def scaled_round_f64(x: torch.Tensor, d: torch.Tensor, fmt, dtype: torch.dtype) -> torch.Tensor | None:
    """``x / d`` rounded to ``fmt``, in ``dtype`` (``quant._scaled_cast``'s cast(x.double() / d.double(),
    fmt): the same division and single rounding, in one pass), for a float64 CPU ``x`` [.., N, D]
    and a float32 descale ``d`` of one value per row ([.., N, 1] or [.., 1, 1], broadcast) or one in
    all; None when the compiled path does not apply. The rounded values are float32 one slice
    of rows at a time, then stored in ``dtype`` (exact: they are values of ``fmt``)."""
    if x.device.type != "cpu" or x.dtype != torch.float64 or x.dim() < 2 or _lib() is None:
        return None
    kind, mbits, emin, fmax, ovf, sat = _fmt_args(fmt)
    if kind == 0 or d.dtype != torch.float32 or d.device.type != "cpu" or d.dim() > x.dim() or (
            d.dim() and d.shape[-1] != 1):
        return None
    lead = x.shape[:-1]
    try:
        dd = d.expand(*lead, 1)
    except RuntimeError:
        return None
    xc = x.contiguous()
    rows, width = xc.numel() // max(1, x.shape[-1]), x.shape[-1]
    out = torch.empty(xc.shape, dtype=dtype)
    if rows == 0 or width == 0:
        return out
    scalar = dd.numel() == 1 or all(st == 0 for st in dd.stride())
    dl = None if scalar else dd.reshape(rows).contiguous()
    one = float(dd.reshape(-1)[0]) if scalar else 0.0
    x2, o2 = xc.view(rows, width), out.view(rows, width)
    step = max(1, _ROUND_SLICE // width)
    tmp = torch.empty((min(step, rows), width), dtype=torch.float32)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        t = tmp[:b - a]
        _lib().fa3n_scaled_round_f64(b - a, width, _ptr(x2[a:b]), None if scalar else _ptr(dl[a:b]), one, _ptr(t),
                                     mbits, emin, fmax, ovf, sat, _threads())
        o2[a:b].copy_(t)
    return out


def row_absmax(x: torch.Tensor) -> torch.Tensor | None:
    """max |x| over the last dim of a float64 CPU tensor (x.shape[:-1], float64; NaN where a row
    holds one), as ``torch.linalg.vector_norm(x, inf, dim=-1)``; None when not compiled."""
    if x.device.type != "cpu" or x.dtype != torch.float64 or x.dim() < 1 or x.shape[-1] == 0 or _lib() is None:
        return None
    xc = x.contiguous()
    out = torch.empty(xc.shape[:-1], dtype=torch.float64)
    if out.numel():
        _lib().fa3n_row_absmax(out.numel(), xc.shape[-1], _ptr(xc), _ptr(out), _threads())
    return out


def sfu(op: int, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """``numerics/sfu.py``'s model ``op`` (0 ex2, 1 lg2, 2 rcp) of float32 x through its int32 table,
    or None when the compiled path does not apply (then the caller runs the PyTorch model)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or table.device.type != "cpu" or _lib() is None:
        return None
    xc = x.contiguous()
    y = torch.empty_like(xc)
    _lib().fa3n_sfu(xc.numel(), _ptr(xc), _ptr(y), _ptr(table), op, _threads())
    return y


def sfu_ex2_packed(x: torch.Tensor, coef: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """``sfu.ex2`` from its packed table (float64 cubics [64, 4] and 2-bit codes), or None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or _lib() is None:
        return None
    xc = x.contiguous()
    y = torch.empty_like(xc)
    _lib().fa3n_sfu_ex2_packed(xc.numel(), _ptr(xc), _ptr(y), _ptr(coef), _ptr(packed), _threads())
    return y


def rescale_rows(acc: torch.Tensor, scale: torch.Tensor, ftz: bool) -> torch.Tensor | None:
    """``flush(acc * scale)`` for float32 acc [.., R, D] and scale [.., R, 1], in place on a
    contiguous acc; None when the compiled path does not apply (then nothing was changed)."""
    if acc.device.type != "cpu" or acc.dtype != torch.float32 or not acc.is_contiguous() or _lib() is None:
        return None
    s = scale.to(torch.float32).expand(*acc.shape[:-1], 1).contiguous()
    _lib().fa3n_rescale_rows(acc.numel() // acc.shape[-1], acc.shape[-1], _ptr(acc), _ptr(s), int(ftz), _threads())
    return acc


def abs_stats(x: torch.Tensor, edges) -> tuple | None:
    """(histogram of |x| over ``edges`` as int64 counts, amax of the finite |x|, count of
    non-finite values) in one pass, for a float64 CPU tensor; None when not compiled."""
    if x.device.type != "cpu" or x.dtype != torch.float64 or _lib() is None:
        return None
    xc = x.contiguous()
    e = torch.as_tensor(edges, dtype=torch.float64).contiguous()
    counts = torch.zeros(e.numel(), dtype=torch.int64)
    amax = torch.zeros(1, dtype=torch.float64)
    nonfinite = torch.zeros(1, dtype=torch.int64)
    _lib().fa3n_abs_stats(xc.numel(), _ptr(xc), _ptr(e), e.numel(), _ptr(counts), _ptr(amax), _ptr(nonfinite),
                          _threads())
    return counts, float(amax), int(nonfinite)


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.float32)``; one-byte (FP8) tensors on the CPU by a 256-entry table."""
    if x.device.type != "cpu" or x.element_size() != 1 or not x.is_floating_point() or _lib() is None:
        return x.to(torch.float32)
    lut = torch.arange(256, dtype=torch.uint8).view(x.dtype).to(torch.float32)
    xc = x.contiguous()
    out = torch.empty(xc.shape, dtype=torch.float32)
    _lib().fa3n_decode_u8(xc.numel(), _ptr(xc), _ptr(lut), _ptr(out), _threads())
    return out


def fwht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor | None:
    """``rotation.fwht(x * signs)`` for float64 ``x`` on the CPU with a power-of-two last dim
    (<= 1024), bit for bit; None when the compiled path does not apply."""
    d = x.shape[-1]
    if (x.device.type != "cpu" or x.dtype != torch.float64 or d & (d - 1) or d > 1024 or _lib() is None):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    s = signs.to(torch.float64).contiguous()
    _lib().fa3n_fwht(x.numel() // d, d, _ptr(x), _ptr(s), float(d ** 0.5), _ptr(out), _threads())
    return out


# torch's CPU generator state (get_state's bytes: CPUGeneratorImplState in ATen/CPUGeneratorImpl.cpp):
# uint64 seed, int32 left, int32 seeded, uint64 next, uint64 state[624], three doubles and an int of
# the old normal cache, then a float and a bool; 5056 bytes on x86-64.
_GEN_BYTES, _GEN_LEFT, _GEN_NEXT, _GEN_WORDS = 5056, 8, 16, 24


def _rand_fast(n: int, g: torch.Generator) -> torch.Tensor | None:
    """``torch.rand(n, generator=g, dtype=torch.float64)`` drawn by ``fa3n_mt_uniform64`` from
    ``g``'s own MT19937 state, which is then set to where torch's draws would leave it; None when
    the state is not the layout above."""
    import numpy as np

    state = g.get_state()
    if state.numel() != _GEN_BYTES or state.dtype != torch.uint8:
        return None
    raw = state.numpy()
    words = raw[_GEN_WORDS:_GEN_WORDS + 624 * 8].view(np.uint64)
    mt = words.astype(np.uint32)  # the engine keeps 32-bit words; the legacy layout stores them widened
    left = np.array(raw[_GEN_LEFT:_GEN_LEFT + 4].view(np.int32))
    nxt = np.array(raw[_GEN_NEXT:_GEN_NEXT + 8].view(np.uint64).astype(np.uint32))
    if not (0 < int(left[0]) <= 624 and int(nxt[0]) <= 624):
        return None
    out = torch.empty(n, dtype=torch.float64)
    _lib().fa3n_mt_uniform64(mt.ctypes.data, left.ctypes.data, nxt.ctypes.data, n, _ptr(out))
    words[:] = mt
    raw[_GEN_LEFT:_GEN_LEFT + 4] = left.view(np.uint8)
    raw[_GEN_NEXT:_GEN_NEXT + 8] = nxt.astype(np.uint64).view(np.uint8)
    g.set_state(state)
    return out


def _randn_fast(n: int, g: torch.Generator) -> torch.Tensor:
    x = _rand_fast(n, g)
    if x is None:
        x = torch.rand(n, generator=g, dtype=torch.float64)
    _lib().fa3n_box_muller16(n // 16, _ptr(x), 0.0, 1.0, _threads())
    if n % 16:  # as torch: 16 fresh uniforms for the last 16 values, mapped as one block
        tail = torch.rand(16, generator=g, dtype=torch.float64)
        _lib().fa3n_box_muller16(1, _ptr(tail), 0.0, 1.0, 1)
        x[n - 16:] = tail
    return x


def _randn_matches_torch() -> bool:
    """Whether the compiled transform gives torch.randn's bits here (checked once: another torch
    or libm could compute them otherwise, and then torch.randn is used)."""
    if "randn_ok" not in _STATE:
        ok = True
        for n in (16, 40, 1000, 1337):  # 1000 and 1337 values: several refreshes of the 624 words
            ga, gb = torch.Generator().manual_seed(12345 + n), torch.Generator().manual_seed(12345 + n)
            if n == 1337:  # a generator part-way through its words, as the second tensor of a draw is
                torch.rand(3, generator=ga), torch.rand(3, generator=gb)
            a = torch.randn(n, generator=ga, dtype=torch.float64)
            b = _randn_fast(n, gb)
            ok = ok and torch.equal(a.view(torch.int64), b.view(torch.int64))
            ok = ok and torch.equal(ga.get_state(), gb.get_state())  # the next draws are torch's too
        _STATE["randn_ok"] = ok
    return _STATE["randn_ok"]


def randn(shape, g: torch.Generator) -> torch.Tensor:
    """``torch.randn(shape, generator=g, dtype=torch.float64)``, the same values and the same
    state of ``g`` after it. On the CPU torch maps its uniforms to normals on one thread, 60% of
    the time of drawing Q, K and V at the paper's shape; here that map runs compiled on every
    thread (``fa3n_box_muller16``). Elsewhere, or without the compiled path, torch.randn."""
    n = math.prod(shape)
    if g.device.type != "cpu" or n < 16 or _lib() is None or not _randn_matches_torch():
        return torch.randn(shape, generator=g, dtype=torch.float64, device=g.device)
    return _randn_fast(n, g).view(shape)


if __name__ == "__main__":  # python -m fa3_numerics.numerics.native: build and report
    print(status())
    sys.exit(0 if _lib() is not None else 1)
