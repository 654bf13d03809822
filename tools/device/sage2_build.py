"""Build SageAttention 2's Hopper kernels (the ``_qattn_sm90`` and ``_fused`` extensions, sm_90a only)
from a carried source folder, assemble an importable ``sageattention`` package, smoke-test it against
float64 attention and pack it as a tarball that a later device call carries instead of rebuilding.

Steps (each one a sub-command, so the calling shell script bounds each with ``timeout``):

    python3 tools/device/sage2_build.py ext qattn_sm90 --src .sage2src --work /tmp/sage2
    python3 tools/device/sage2_build.py ext fused      --src .sage2src --work /tmp/sage2
    python3 tools/device/sage2_build.py package --src .sage2src --work /tmp/sage2 --out "$OUT"
    python3 tools/device/sage2_build.py smoke   --pkg /tmp/sage2/pkg --out "$OUT"
    python3 tools/device/sage2_build.py unpack  --tar .sage2build/sage2-sm90.tar.gz --pkg /tmp/sage2/pkg

``--dry`` on ``ext`` prints the compiler invocation without running it (a CPU check of the flags).

Flags: SageAttention's setup.py (v2.2.0) with two changes. ``-g`` is dropped from the host flags (it only
adds host debug info, which would push the .so towards the 16 MiB a returned file may have), and the
only target is ``-gencode arch=compute_90a,code=sm_90a``. By default ("slim") the sm90 kernel file is
compiled with its quantization-granularity dispatch limited to per-thread (3) and its return-LSE
dispatch to off, which are the only template arguments ``sageattn`` on sm90 reaches (core.py:
``qk_quant_gran="per_thread"``, ``return_lse=False``): 16 of the file's 64 kernel instances, the same
machine code for those. ``--full`` builds all 64.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

from common import log

# setup.py's CXX_FLAGS and NVCC_FLAGS (SageAttention 2.2.0), less "-g"; the ABI define is added by
# torch.utils.cpp_extension itself.
CXX_FLAGS = ["-O3", "-fopenmp", "-lgomp", "-std=c++17", "-DENABLE_BF16"]
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "--use_fast_math",
    "--threads=8",
    "-Xptxas=-v",
    "-diag-suppress=174",
    "-gencode",
    "arch=compute_90a,code=sm_90a",
]

EXTENSIONS = {
    "qattn_sm90": {
        "name": "_qattn_sm90",
        "sources": ["csrc/qattn/pybind_sm90.cpp", "csrc/qattn/qk_int_sv_f8_cuda_sm90.cu"],
        "ldflags": ["-lcuda"],
    },
    "fused": {
        "name": "_fused",
        "sources": ["csrc/fused/pybind.cpp", "csrc/fused/fused.cu"],
        "ldflags": [],
    },
}

# The dispatch that "slim" puts after dispatch_utils.h in the sm90 kernel file: per-thread
# granularity and no LSE only; any other value still fails loudly at run time, as an unsupported
# value does in the original.
SLIM_DISPATCH = r"""
// sage2_build.py (slim): only the template arguments sageattn reaches on sm90.
#undef DISPATCH_QK_QUANT_GRAN
#define DISPATCH_QK_QUANT_GRAN(qk_quant_gran, QK_QUANT_GRAN, ...)                         \
  if (qk_quant_gran == 3) {                                                               \
    constexpr int QK_QUANT_GRAN = 3;                                                      \
    __VA_ARGS__                                                                           \
  } else {                                                                                \
    throw std::invalid_argument("slim sage2 build: only qk_quant_gran=3 (per_thread)");  \
  }
#undef DISPATCH_RETURN_LSE
#define DISPATCH_RETURN_LSE(return_lse, RETURN_LSE, ...)                                  \
  if (return_lse == 0) {                                                                  \
    constexpr bool RETURN_LSE = false;                                                    \
    __VA_ARGS__                                                                           \
  } else {                                                                                \
    throw std::invalid_argument("slim sage2 build: return_lse is not built");            \
  }
"""

PACKAGE_FILES = ["__init__.py", "core.py", "quant.py", "sm80_compile.py", "sm89_compile.py",
                 "sm90_compile.py", "fa3_wrapper.py"]
TARBALL = "sage2-sm90.tar.gz"
MAX_RETURN_BYTES = 16 * 1024 * 1024


def stage_sources(src: Path, dst: Path, full: bool) -> Path:
    """A copy of ``src`` at ``dst`` (the build writes nothing into the carried folder; one copy per
    extension, as the two build at once), the sm90 kernel file patched to the slim dispatch unless
    ``full``."""
    if not dst.exists():
        shutil.copytree(src, dst)
    cu = dst / "csrc/qattn/qk_int_sv_f8_cuda_sm90.cu"
    text = cu.read_text()
    anchor = '#include "../dispatch_utils.h"\n'
    if not full and "sage2_build.py (slim)" not in text:
        if anchor not in text:
            sys.exit(f"error: {cu} has no line {anchor.strip()!r}; build with --full")
        cu.write_text(text.replace(anchor, anchor + SLIM_DISPATCH, 1))
    return dst


def cuda_link_dirs(work: Path) -> list[str]:
    """-L flags under which ``-lcuda`` resolves: the toolkit's link stub where it ships one, else a
    folder with a libcuda.so link to the driver's libcuda.so.1 (the driver often installs only the
    versioned name; the extension calls cuTensorMapEncodeTiled from it)."""
    from torch.utils.cpp_extension import CUDA_HOME

    home = Path(CUDA_HOME or "/usr/local/cuda")
    for d in [home / r for r in ("lib64/stubs", "targets/x86_64-linux/lib/stubs", "lib/stubs", "lib64")] + \
             [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/local/nvidia/lib64")]:
        if (d / "libcuda.so").exists():
            return [f"-L{d}"]
    for d in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/local/nvidia/lib64"),
              Path("/usr/lib/wsl/lib")):
        if (d / "libcuda.so.1").exists():
            link = work / "cudalink"
            link.mkdir(parents=True, exist_ok=True)
            if not (link / "libcuda.so").exists():
                (link / "libcuda.so").symlink_to(d / "libcuda.so.1")
            log(f"linking -lcuda against {d / 'libcuda.so.1'}")
            return [f"-L{link}"]
    log("warning: no libcuda.so or libcuda.so.1 found; -lcuda may fail to link")
    return []


def build_ext(key: str, src: Path, work: Path, full: bool, dry: bool) -> None:
    spec = EXTENSIONS[key]
    staged = stage_sources(src, work / f"src-{key}", full)
    sources = [str(staged / s) for s in spec["sources"]]
    bdir = work / f"build-{key}"
    bdir.mkdir(parents=True, exist_ok=True)
    ldflags = spec["ldflags"] + (cuda_link_dirs(work) if spec["ldflags"] else [])
    log(f"{spec['name']}: sources {spec['sources']} cxx {CXX_FLAGS} nvcc {NVCC_FLAGS} ld {ldflags} "
        f"MAX_JOBS={os.environ.get('MAX_JOBS')} slim={not full}")
    if dry:
        return
    from torch.utils import cpp_extension

    t = time.perf_counter()
    cpp_extension.load(name=spec["name"], sources=sources, extra_cflags=CXX_FLAGS,
                       extra_cuda_cflags=NVCC_FLAGS, extra_ldflags=ldflags,
                       build_directory=str(bdir), verbose=True, with_cuda=True)
    so = bdir / f"{spec['name']}.so"
    log(f"{spec['name']}: built {so} ({so.stat().st_size} bytes) in {time.perf_counter() - t:.1f}s")


def package(src: Path, work: Path, out: Path) -> None:
    """``work/pkg/sageattention``: the Python files, the Triton quantizers and the two .so files, then
    the tarball in ``out`` with every file's size; refuses a tarball over the return limit."""
    pkg = work / "pkg" / "sageattention"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    for f in PACKAGE_FILES:
        shutil.copy2(src / "sageattention" / f, pkg / f)
    shutil.copytree(src / "sageattention" / "triton", pkg / "triton")
    for key, spec in EXTENSIONS.items():
        so = work / f"build-{key}" / f"{spec['name']}.so"
        if not so.exists():
            sys.exit(f"error: {so} was not built; run the ext step for {key} first")
        shutil.copy2(so, pkg / so.name)
    if (src / "SOURCE").exists():
        shutil.copy2(src / "SOURCE", pkg / "SOURCE")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (TARBALL + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(pkg, arcname="sageattention")
    os.replace(tmp, out / TARBALL)
    sizes = {str(p.relative_to(pkg)): p.stat().st_size for p in sorted(pkg.rglob("*")) if p.is_file()}
    sizes[TARBALL] = (out / TARBALL).stat().st_size
    for k, v in sizes.items():
        log(f"size {k}: {v} bytes ({v / 2**20:.2f} MiB)")
    (out / "sizes.json").write_text(json.dumps(sizes, indent=1))
    if sizes[TARBALL] > MAX_RETURN_BYTES:
        sys.exit(f"error: {TARBALL} is {sizes[TARBALL]} bytes, over the 16 MiB a returned file may have")


def unpack(tar: Path, pkg_root: Path) -> None:
    if not tar.exists():
        sys.exit(f"error: no {tar}; place the build call's {TARBALL} there (tools/device/sage2_build.sh)")
    pkg_root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar) as t:
        t.extractall(pkg_root, filter="data")
    log(f"unpacked {tar} into {pkg_root}")


def smoke(pkg_root: Path, out: Path | None) -> None:
    """``sageattn`` (which picks the sm90 kernel on an H200) against float64 attention on a few shapes:
    the RMSE and the largest error, and the FP16 SDPA's RMSE beside them as the scale."""
    sys.path.insert(0, str(pkg_root))
    import torch

    import sageattention
    from sageattention import core

    log(f"imported {sageattention.__file__}; SM90_ENABLED={core.SM90_ENABLED} "
        f"SM80_ENABLED={core.SM80_ENABLED} SM89_ENABLED={core.SM89_ENABLED}")
    if not core.SM90_ENABLED:
        sys.exit("error: sageattention.sm90_compile did not import (see the ext step's log)")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    # kv length 1000 is not a multiple of 128: it exercises the padding of V in core.py
    for b, h, n, d, causal, dtype in [(1, 4, 1024, 128, False, torch.float16),
                                      (1, 4, 1000, 128, True, torch.float16),
                                      (2, 2, 512, 64, False, torch.bfloat16)]:
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype).cuda() for _ in range(3))
        o = sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
        torch.cuda.synchronize()
        q64, k64, v64 = (x.double() for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).double()
        err = o.double() - ref
        rms_ref = ref.pow(2).mean().sqrt().item()
        row = {"shape": [b, h, n, d], "causal": causal, "dtype": str(dtype),
               "rmse": err.pow(2).mean().sqrt().item(), "rms_ref": rms_ref, "max_abs": err.abs().max().item(),
               "nonfinite": int((~torch.isfinite(o)).sum().item()),
               "rmse_sdpa_same_dtype": (sdpa - ref).pow(2).mean().sqrt().item()}
        rows.append(row)
        log(f"smoke {row}")
    # a V channel that is zero on every token: per_channel_fp8 scales it by 448 / 0, and 0 * inf is NaN
    q, k, v = (torch.randn(1, 2, 256, 128, generator=gen).half().cuda() for _ in range(3))
    v[..., 3] = 0
    o = sageattention.sageattn(q, k, v, tensor_layout="HND")
    torch.cuda.synchronize()
    bad_ch = sorted({int(c) for c in torch.nonzero(~torch.isfinite(o))[:, 3].tolist()})
    probe = {"probe": "V channel 3 all zero", "nonfinite": int((~torch.isfinite(o)).sum().item()),
             "nonfinite_channels": bad_ch}
    log(f"smoke {probe}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "smoke.json").write_text(json.dumps(rows + [probe], indent=1))
    # INT8 Q/K and FP8 P, V give a few percent of the output's RMS; a wrong layout or scale gives ~100%
    bad = [r for r in rows if r["nonfinite"] or not r["rmse"] < 0.1 * r["rms_ref"]]
    if bad:
        sys.exit(f"error: sageattn smoke failed on {len(bad)} case(s): {bad}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ext")
    e.add_argument("key", choices=sorted(EXTENSIONS))
    e.add_argument("--src", type=Path, default=Path(".sage2src"))
    e.add_argument("--work", type=Path, default=Path("/tmp/sage2"))
    e.add_argument("--full", action="store_true")
    e.add_argument("--dry", action="store_true")
    k = sub.add_parser("package")
    k.add_argument("--src", type=Path, default=Path(".sage2src"))
    k.add_argument("--work", type=Path, default=Path("/tmp/sage2"))
    k.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("smoke")
    s.add_argument("--pkg", type=Path, default=Path("/tmp/sage2/pkg"))
    s.add_argument("--out", type=Path)
    u = sub.add_parser("unpack")
    u.add_argument("--tar", type=Path, default=Path(".sage2build") / TARBALL)
    u.add_argument("--pkg", type=Path, default=Path("/tmp/sage2/pkg"))
    a = p.parse_args(argv)
    if getattr(a, "src", None) is not None and not (a.src / "csrc").is_dir():
        sys.exit(f"error: no SageAttention sources in {a.src}; carry the exported folder (.sage2src)")
    if a.cmd == "ext":
        build_ext(a.key, a.src, a.work, a.full, a.dry)
    elif a.cmd == "package":
        package(a.src, a.work, a.out)
    elif a.cmd == "smoke":
        smoke(a.pkg, a.out)
    else:
        unpack(a.tar, a.pkg)


if __name__ == "__main__":
    main()
