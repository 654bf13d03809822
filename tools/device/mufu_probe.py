"""Record the exact outputs of the GPU's special-function instructions (``ex2.approx.ftz.f32``,
``lg2.approx.ftz.f32``, ``rcp.approx.ftz.f32``, and their non-ftz forms) so that bit-exact CPU
models of them can be built offline (tools/mufu_tables.py reads and checks what this writes).

The emulators model ex2.approx as float32 exp2 rounded toward zero (``exp2_rz``); the remaining
mismatches to the real kernels (outputs on an FP8 tie, an LSE one ulp low) trace to these
instructions. Each instruction runs through a Triton kernel that wraps it in
``tl.inline_asm_elementwise`` (the PTX and SASS are checked for it and their lines recorded) on:

- exhaustive grids: ex2 at every k/2^24 in [0, 1) and -k/2^24 in [-1, 0) (every float32 of
  0.5 <= |x| < 1, and every fixed-point fraction up to 24 bits), lg2 at every float32 of [1, 2) and
  [0.5, 1), rcp at every float32 of [1, 2); stored as int8 ulp distances from float64 references
  rounded to float32 (exceptions listed), decodable exactly (SHA-256 of the outputs recorded);
- random inputs (numpy PCG64, seeds recorded) over the ranges that matter: ex2 on [-130, 1]
  (uniform, log-uniform magnitudes down to 2^-40, short fixed-point fractions, any bit pattern),
  lg2 on positive normals log-uniform over [2^-126, 2^128) plus near 1, subnormals and specials,
  rcp on normals of both signs plus specials; stored as raw input and output bits, the non-ftz
  forms as ulp distances from the ftz output.

Files: mufu.json (versions, seeds, sizes, PTX/SASS evidence, timings, file contents) and at most
six ``mufu_N.npz``, each under 14 MiB, written whole. ``--dry`` runs on the CPU without Triton
(torch float32 exp2/log2/reciprocal with subnormals flushed stand in for the GPU; labelled dry) at
reduced sizes, through the same storing path::

    python3 tools/device/mufu_probe.py --out DIR [--dry]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/, for mufu_tables
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/device/, for common

from common import log  # noqa: E402

import numpy as np  # noqa: E402

from mufu_tables import (REF_METHOD, bits_of, encode_ulps, f32, grid_inputs, ordered,  # noqa: E402
                         ref_float64_to_bits, sha, decode_ulps, grid_reference)

try:  # Triton exists on the device only; --dry and the CPU tests never touch it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

# name: (PTX instruction, family); "X.ftz" is the form the attention kernels use, "X" its non-ftz form
OPS = {"ex2.ftz": ("ex2.approx.ftz.f32", "ex2"), "ex2": ("ex2.approx.f32", "ex2"),
       "lg2.ftz": ("lg2.approx.ftz.f32", "lg2"), "lg2": ("lg2.approx.f32", "lg2"),
       "rcp.ftz": ("rcp.approx.ftz.f32", "rcp"), "rcp": ("rcp.approx.f32", "rcp")}
OP_INDEX = {name: i for i, name in enumerate(OPS)}

if triton is not None:
    # One kernel, the instruction picked by a constexpr integer (a compile-time branch: each OP
    # compiles to its own kernel holding only that instruction).
    @triton.jit
    def sfu_kernel(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=1.0)
        if OP == 0:
            y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
        elif OP == 1:
            y = tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
        elif OP == 2:
            y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
        elif OP == 3:
            y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
        elif OP == 4:
            y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            y = tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=m)

MIB = 1 << 20
FILE_LIMIT = 14 * MIB - 64 * 1024  # zip directory and headers on top of the measured members
MAX_FILES = 6
GRIDS = {"ex2_pos": "ex2", "ex2_neg": "ex2", "lg2_hi": "lg2", "lg2_lo": "lg2", "rcp": "rcp"}
SEEDS = {"ex2": 20261202, "lg2": 20261203, "rcp": 20261204}
FULL = {"grid_bits": 24, "ex2": 1_500_000, "lg2": 1_000_000, "rcp": 500_000}
DRY = {"grid_bits": 14, "ex2": 20_000, "lg2": 10_000, "rcp": 5_000}
FLT_MIN = np.float32(2.0 ** -126)


# -- the instructions ---------------------------------------------------------------------------

class Runner:
    """Applies an instruction to uint32 input bits and returns the output bits; on the GPU through
    the inline-asm kernel (recording its PTX/SASS lines once per instruction), dry through torch."""

    def __init__(self, dry: bool):
        import torch

        self.torch, self.dry = torch, dry
        self.evidence: dict[str, dict] = {}
        self.kernel_s: dict[str, float] = {}

    def __call__(self, op: str, in_bits: np.ndarray) -> np.ndarray:
        torch = self.torch
        ptx, fam = OPS[op]
        x = torch.from_numpy(in_bits.view(np.int32).copy()).view(torch.float32)
        if self.dry:
            y = self._stand_in(fam, op.endswith(".ftz"), x)
            return y.view(torch.int32).numpy().view(np.uint32)
        x = x.cuda()
        y = torch.empty_like(x)
        block = 1024
        grid = (triton.cdiv(x.numel(), block),)
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = sfu_kernel[grid](x, y, x.numel(), OP=OP_INDEX[op], BLOCK=block)
        torch.cuda.synchronize()
        self.kernel_s[op] = self.kernel_s.get(op, 0.0) + time.perf_counter() - t
        if op not in self.evidence:
            self.evidence[op] = self._evidence(op, ptx, h)
        return y.view(torch.int32).cpu().numpy().view(np.uint32)

    def _stand_in(self, fam: str, ftz: bool, x):
        torch = self.torch

        def flush(v):
            return torch.where(v.abs() < float(FLT_MIN), v * 0.0, v) if ftz else v
        fn = {"ex2": torch.exp2, "lg2": torch.log2, "rcp": torch.reciprocal}[fam]
        return flush(fn(flush(x)))

    @staticmethod
    def _evidence(op: str, ptx: str, h) -> dict:
        try:
            text = h.asm["ptx"]
        except Exception as exc:  # the outputs are still worth having; the JSON says unverified
            log(f"WARNING: no PTX of the {op} kernel ({type(exc).__name__}: {exc}); instruction unverified")
            return {"ptx_error": f"{type(exc).__name__}: {exc}"[:300], "verified": False}
        lines = [ln.strip() for ln in text.splitlines() if "approx" in ln]
        others = [ln for ln in lines if ptx not in ln]
        if not any(ptx in ln for ln in lines):
            raise SystemExit(f"error: the compiled kernel for {op} does not hold {ptx} (approx lines: {lines[:5]})")
        if others:
            log(f"WARNING: the {op} kernel holds other approx instructions too: {others[:3]}")
        ev = {"ptx_lines": lines[:8], "verified": True, "other_approx_lines": others[:8]}
        try:
            sass = h.asm["sass"]
            ev["sass_lines"] = [ln.strip() for ln in sass.splitlines() if "MUFU" in ln or "FSETP" in ln
                                or ("FMUL" in ln and op in ("ex2", "lg2", "rcp"))][:16]
        except Exception as exc:  # the disassembler is optional evidence
            ev["sass_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return ev


def device_reference(op_family: str, in_bits: np.ndarray, dry: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 reference on the device (torch; CUDA unless dry), rounded to float32 to nearest, and
    the near-midpoint mask."""
    import torch

    x = torch.from_numpy(in_bits.view(np.int32).copy()).view(torch.float32)
    if not dry:
        x = x.cuda()
    xd = x.double()
    r = {"ex2": torch.exp2, "lg2": torch.log2, "rcp": torch.reciprocal}[op_family](xd)
    return ref_float64_to_bits(r.cpu().numpy())


# -- inputs ---------------------------------------------------------------------------------------

SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 128.0, 127.0, 126.0, -126.0, -127.0, -127.5, -128.0,
                    -149.0, -150.0, -1e-30, 1e-30, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -126, 2.0 ** -149,
                    1.0 - 2.0 ** -24, 1.0 + 2.0 ** -23, np.inf, -np.inf, np.nan], dtype=np.float32)


def sample_inputs(fam: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(seed))
    if fam == "ex2":
        a, b, c = int(n * 0.40), int(n * 0.30), int(n * 0.25)
        d = n - a - b - c - len(SPECIAL)
        uni = rng.uniform(-130.0, 1.0, a)
        mag = 2.0 ** rng.uniform(-40.0, np.log2(130.0), b)
        neg = rng.random(b) < 0.85
        logu = np.where(neg, -mag, np.minimum(mag, 2.0 ** rng.uniform(-40.0, 0.0, b)))
        # short fixed-point fractions: I + j / 2^F, F in 12..24 (the reduction's fraction width)
        fb = rng.integers(12, 25, c)
        frac = rng.integers(0, 2 ** 24, c) >> (24 - fb)
        fix = rng.integers(-130, 1, c) + frac / 2.0 ** fb
        vals = np.concatenate([uni, logu, fix]).astype(np.float32)
        raw = rng.integers(0, 2 ** 32, d, dtype=np.uint64).astype(np.uint32)
        return np.concatenate([bits_of(vals), raw, bits_of(SPECIAL)])
    if fam == "lg2":
        a, b = int(n * 0.90), int(n * 0.05)
        c = n - a - b - len(SPECIAL)
        normal = (rng.integers(1, 255, a).astype(np.uint32) << 23) | rng.integers(0, 2 ** 23, a).astype(np.uint32)
        near1 = (0x3F800000 + rng.integers(-(2 ** 16), 2 ** 16, b)).astype(np.uint32)
        sub = rng.integers(1, 2 ** 23, c // 2).astype(np.uint32)
        raw = rng.integers(0, 2 ** 32, c - c // 2, dtype=np.uint64).astype(np.uint32)
        return np.concatenate([normal, near1, sub, raw, bits_of(SPECIAL)])
    a = int(n * 0.90)
    b = n - a - len(SPECIAL)
    normal = ((rng.integers(1, 255, a).astype(np.uint32) << 23) | rng.integers(0, 2 ** 23, a).astype(np.uint32)
              | (rng.integers(0, 2, a).astype(np.uint32) << 31))
    raw = rng.integers(0, 2 ** 32, b, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([normal, raw, bits_of(SPECIAL)])


# -- storing --------------------------------------------------------------------------------------

def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def pack(sizes: dict[str, int]) -> list[list[str]]:
    """Records into files under FILE_LIMIT, first fit by decreasing size."""
    files: list[list[str]] = []
    used: list[int] = []
    for name in sorted(sizes, key=lambda k: -sizes[k]):
        for i, u in enumerate(used):
            if u + sizes[name] <= FILE_LIMIT:
                files[i].append(name)
                used[i] += sizes[name]
                break
        else:
            files.append([name])
            used.append(sizes[name])
    return files


# Files as the sizes expected on the device put them (each compressed once); if one comes out over
# the limit, the records are measured one by one and packed anew.
LAYOUT = [["ex2_pos"], ["ex2_neg"], ["lg2_hi", "lg2_lo"], ["rcp", "samples_rcp"], ["samples_ex2"], ["samples_lg2"]]


def write_files(out: Path, records: dict[str, dict[str, np.ndarray]], samples: dict[str, dict], meta: dict) -> None:
    """Write the records into at most MAX_FILES files under 14 MiB, each whole: the LAYOUT first;
    else each record measured compressed and packed (the largest sample set cut to 70% while they
    do not fit; the JSON records the sizes kept)."""
    from fa3_numerics.files import atomic_write

    def content(names):
        return npz_bytes({f"{n}/{k}": v for n in names for k, v in records[n].items()})

    assert sorted(n for f in LAYOUT for n in f) == sorted(records)
    blobs = []
    for names in LAYOUT:
        data = content(names)
        if len(data) >= 14 * MIB:
            log(f"{'+'.join(names)} compresses to {len(data) / MIB:.2f} MiB: packing the records anew")
            blobs = None
            break
        blobs.append((names, data))
    if blobs is None:
        blobs = [(names, content(names)) for names in repack(records, samples, meta)]
    meta["files"] = {}
    for i, (names, data) in enumerate(blobs):
        if len(data) >= 14 * MIB:
            raise SystemExit(f"error: file {i} would be {len(data) / MIB:.2f} MiB")
        fname = f"mufu_{i}.npz"
        atomic_write(out / fname, data)
        meta["files"][fname] = {"records": names, "bytes": len(data)}
        log(f"wrote {fname}: {len(data) / MIB:.2f} MiB ({', '.join(names)})")


def repack(records: dict[str, dict[str, np.ndarray]], samples: dict[str, dict], meta: dict) -> list[list[str]]:
    sizes = {name: len(npz_bytes(rec)) for name, rec in records.items()}
    for _ in range(12):
        files = pack(sizes)
        too_big = [n for n in sizes if sizes[n] > FILE_LIMIT]
        if len(files) <= MAX_FILES and not too_big:
            return files
        grids_over = [n for n in too_big if not n.startswith("samples_")]
        if grids_over:
            raise SystemExit(f"error: grid {grids_over[0]} alone compresses to {sizes[grids_over[0]] / MIB:.1f} MiB")
        name = max((n for n in sizes if n.startswith("samples_")), key=lambda n: sizes[n])
        fam = name[len("samples_"):]
        keep = int(len(records[name]["in"]) * 0.7)
        records[name] = sample_arrays(samples[fam], keep, meta["samples"][fam])
        sizes[name] = len(npz_bytes(records[name]))
        log(f"samples {fam} cut to {keep} to fit the files")
    raise SystemExit(f"error: the records do not fit {MAX_FILES} files of 14 MiB: {sizes}")


def grid_record(run: Runner, name: str, g: int, dry: bool, meta: dict) -> dict[str, np.ndarray]:
    fam = GRIDS[name]
    ib = grid_inputs(name, g)
    out = run(f"{fam}.ftz", ib)
    ref, near = device_reference(fam, ib, dry)
    np_ref, _ = grid_reference(fam, ib)
    # The reader rebuilds the reference with numpy: the inputs where this machine's numpy disagrees
    # with the device's float64 (none expected outside the near-midpoint ones) get their bits stored too.
    patch = near | (np_ref != ref)
    rec = encode_ulps(out, ref)
    if sha(decode_ulps(rec, ref)) != sha(out):
        raise SystemExit(f"error: grid {name}: the ulp encoding does not round-trip")
    idx = np.flatnonzero(patch)
    rec.update({"tie_idx": idx.astype(np.uint32), "tie_ref": ref[idx]})
    d = ordered(out) - ordered(ref)
    gm = {"op": fam, "instruction": OPS[f"{fam}.ftz"][0], "n": int(len(ib)), "out_sha256": sha(out),
          "near_midpoint": int(near.sum()), "numpy_ref_disagrees": int((np_ref != ref).sum()),
          "numpy_ref_disagrees_off_midpoint": int(((np_ref != ref) & ~near).sum()),
          "ulp_min": int(d.min()), "ulp_max": int(d.max()), "exceptions": int(len(rec["exc_idx"])),
          "nonfinite_out": int((~np.isfinite(f32(out))).sum()), "variants": {}}
    variant = fam  # the non-ftz form: on these grids it should differ nowhere (no subnormals)
    vo = run(variant, ib)
    vi = np.flatnonzero(vo != out)
    # as ulp distances from the ftz outputs: a few bytes if they agree, int8 codes if they do not
    rec.update({f"{variant}/{k}": v for k, v in encode_ulps(vo, out).items()})
    gm["variants"][variant] = {"instruction": OPS[variant][0], "differs": int(len(vi))}
    meta["grids"][name] = gm
    log(f"grid {name}: {len(ib)} inputs, ulps [{gm['ulp_min']}, {gm['ulp_max']}], "
        f"{gm['exceptions']} exceptions, {len(idx)} reference bits stored, non-ftz differs at {len(vi)}")
    return rec


def sample_record(run: Runner, fam: str, n: int, meta: dict) -> dict:
    """The family's random inputs, the ftz outputs and the non-ftz outputs (all kept, so that the
    stored record can be cut to fit the files)."""
    ib = sample_inputs(fam, n, SEEDS[fam])
    full = {"in": ib, "out": run(f"{fam}.ftz", ib), "variant": run(fam, ib)}
    sm = {"op": fam, "instruction": OPS[f"{fam}.ftz"][0], "seed": SEEDS[fam], "generator": "numpy PCG64",
          "drawn": int(len(ib)), "variants": {fam: {"instruction": OPS[fam][0]}}}
    meta["samples"][fam] = sm
    log(f"samples {fam}: {len(ib)} inputs, non-ftz differs at {int((full['variant'] != full['out']).sum())}")
    return full


def sample_arrays(full: dict, n: int, sm: dict) -> dict[str, np.ndarray]:
    """The first n samples as stored: raw bits of inputs and ftz outputs, the non-ftz outputs as ulp
    distances from the ftz ones."""
    ib, out, vo = full["in"][:n], full["out"][:n], full["variant"][:n]
    sm.update({"n": int(n), "out_sha256": sha(out)})
    sm["variants"][sm["op"]]["differs"] = int((vo != out).sum())
    return {"in": ib, "out": out, **{f"{sm['op']}/{k}": v for k, v in encode_ulps(vo, out).items()}}


def environment(dry: bool) -> dict:
    import torch

    env = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "triton": getattr(triton, "__version__", None)}
    if not dry:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as exc:
            env["driver"] = f"unknown ({type(exc).__name__})"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for mufu.json and the .npz files")
    ap.add_argument("--dry", action="store_true", help="CPU stand-in without Triton, reduced sizes")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    if not args.dry:
        if triton is None or not torch.cuda.is_available():
            print("error: needs CUDA and Triton (use --dry on a CPU)", file=sys.stderr)
            return 2
    sizes = DRY if args.dry else FULL
    from fa3_numerics.files import atomic_write

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"dry": args.dry, "grid_bits": sizes["grid_bits"], "sizes": sizes, "seeds": SEEDS,
            "reference": REF_METHOD, "device": environment(args.dry), "grids": {}, "samples": {},
            "timings_s": {}}
    run = Runner(args.dry)
    records = {}
    for name in GRIDS:
        t = time.perf_counter()
        records[name] = grid_record(run, name, sizes["grid_bits"], args.dry, meta)
        meta["timings_s"][f"grid {name}"] = round(time.perf_counter() - t, 3)
    samples = {}
    for fam in ("ex2", "lg2", "rcp"):
        t = time.perf_counter()
        samples[fam] = sample_record(run, fam, sizes[fam], meta)
        records[f"samples_{fam}"] = sample_arrays(samples[fam], len(samples[fam]["in"]), meta["samples"][fam])
        meta["timings_s"][f"samples {fam}"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    write_files(args.out, records, samples, meta)
    meta["timings_s"]["compress+write"] = round(time.perf_counter() - t, 3)
    meta["evidence"] = run.evidence
    meta["timings_s"]["kernel_calls_incl_compile"] = {k: round(v, 4) for k, v in run.kernel_s.items()}
    meta["timings_s"]["total"] = round(time.perf_counter() - t_start, 3)
    atomic_write(args.out / "mufu.json", json.dumps(meta, indent=1, default=str))
    log(f"done in {meta['timings_s']['total']:.1f}s; {args.out / 'mufu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
