"""Mutation testing of the numerics core: does the fast test subset catch small wrong answers?

Each mutation is a one-line change of the numerics (Python, the compiled C paths, or both), of
the kind a refactoring could introduce: the MMA k-step, the P offset, the KV order, the output
format, the Hadamard signs, the causal alignment, the pow2 rounding direction, the e4m3
rounding mode, saturation, the flush to zero, the FP22 truncation bits, the quad row-sum
order, and the reverted fixes of the engine's defects. For each, the repository is copied to a
temporary folder, the change applied there (the working tree is never edited), and the fast
tests (``pytest -m "not slow" -x``) run against the copy with ``PYTHONPATH`` pointing at it and
the compiled library cached apart (``FA3N_CACHE``), so that a C mutation is compiled. A
mutation is caught when a test fails; the table names the first failing test.

Mutations of a Python path that the compiled one shadows (the softmax step, casts, MMA model,
butterflies) are caught because the fast subset runs those paths too: the ``paths`` fixture and
``torch_paths()`` run tests with ``FA3N_NATIVE=0``, and test_native.py compares both paths.

    python benchmarks/mutations.py                 # every mutation, with a baseline run first
    python benchmarks/mutations.py --list          # the mutations, one line each
    python benchmarks/mutations.py kstep16-c poff-py   # some of them
    python benchmarks/mutations.py --timeout 300 --keep   # keep the copies under /tmp

Exit code 0 when the baseline passes and every mutation is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a test run of the copy needs; reports/ is linked (read-only data some tests read).
COPY = ("fa3_numerics", "tests", "kernels", "experiments", "pyproject.toml", "README.md")
LINK = ("reports",)
PKG = "fa3_numerics/numerics/"
# The numerics tests first, so that with -x a caught mutation stops early; every other test
# module follows in name order (the rest of the fast subset).
FIRST = ("test_mma.py", "test_formats.py", "test_native.py", "test_emulator.py", "test_quant.py",
         "test_rotation.py", "test_reference.py", "test_recipe.py", "test_engine_units.py")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple  # (path, old, new): ``old`` must occur exactly once in ``path``


def M(name, what, *edits):
    return Mutation(name, what, tuple(edits))


MUTATIONS = [
    # -- the Hopper MMA model ------------------------------------------------------------------
    M("kstep16-py", "MMA k-step 32 -> 16 (PyTorch reference)", (PKG + "mma.py", "K_STEP = 32", "K_STEP = 16")),
    M("kstep64-py", "MMA k-step 32 -> 64 (PyTorch reference)", (PKG + "mma.py", "K_STEP = 32", "K_STEP = 64")),
    M("kstep16-c", "MMA k-step 32 -> 16 (C)", (PKG + "_native.c", "#define K_STEP 32", "#define K_STEP 16")),
    M("kstep64-c", "MMA k-step 32 -> 64 (C)", (PKG + "_native.c", "#define K_STEP 32", "#define K_STEP 64")),
    M("fp22-bits12-py", "MMA keeps 12 bits, not 13 (PyTorch)", (PKG + "mma.py", "MANTISSA_BITS = 13", "MANTISSA_BITS = 12")),
    M("fp22-bits14-py", "MMA keeps 14 bits, not 13 (PyTorch)", (PKG + "mma.py", "MANTISSA_BITS = 13", "MANTISSA_BITS = 14")),
    M("fp22-final-bits-c", "MMA step sum cut to 15 significant bits, not 14 (C, portable step)",
      (PKG + "_native.c", "tb &= ~0x3ffu; /* 14 significant bits", "tb &= ~0x1ffu; /* 14 significant bits")),
    M("fp22-final-bits-c-avx2", "MMA step sum cut to 15 significant bits, not 14 (C, AVX2)",
      (PKG + "_native.c", "_mm256_set1_epi32(-1024)", "_mm256_set1_epi32(-512)")),
    M("fp22-term-ulp-c", "MMA terms aligned one bit finer (C, both paths)",
      (PKG + "_native.c", "const float s = pow2f(13 - emax);", "const float s = pow2f(14 - emax);"),
      (PKG + "_native.c", "_mm256_set1_epi32(140 + 127)", "_mm256_set1_epi32(141 + 127)")),
    M("mma-tiny-c-c", "MMA: a step without products keeps 0 instead of C below 2^-100 (C, AVX2)",
      (PKG + "_native.c", "if ((tiny[v] >> u) & 1) acc[8 * v + u] =", "if (0) acc[8 * v + u] =")),
    M("mma-zero-code-c", "MMA: a zero operand's exponent code inside the real range (zeros set emax; C)",
      (PKG + "_native.c", "#define ZU 125", "#define ZU 60")),
    M("mma-domain-c", "MMA: operands of more than 12 significant bits taken by the float form (C, plain split)",
      (PKG + "_native.c", "((bits & 0xfffu) != 0) | ", "")),
    M("mma-domain-c-avx2", "MMA: operands of more than 12 significant bits taken by the float form (C, AVX2 split)",
      (PKG + "_native.c", "_mm256_set1_epi32(0xfff)", "_mm256_set1_epi32(0)")),
    M("mma-true-exponent-py", "MMA aligns to the product's true exponent, not E(a) + E(b) (PyTorch)",
      (PKG + "mma.py", "            e = torch.where(prod != 0, e, torch.full_like(e, float(ZERO_EXP)))",
       "            e = torch.where(prod != 0, _exponent(prod), torch.full_like(e, float(ZERO_EXP)))")),
    M("mma-round-py", "MMA rounds the aligned terms to nearest instead of truncating (PyTorch)",
      (PKG + "mma.py", "total = torch.trunc(prod * inv_ulp.unsqueeze(-1)).sum(dim=-1)",
       "total = torch.round(prod * inv_ulp.unsqueeze(-1)).sum(dim=-1)")),
    M("mma-nan-fix-reverted", "MMA reference aligns in float32 again (NaN for a tiny accumulator)",
      (PKG + "mma.py", "inv_ulp = torch.exp2(model.bits - emax)", "inv_ulp = torch.exp2(model.bits - emax).float()")),
    # -- the flash algorithm ---------------------------------------------------------------------
    M("poff-py", "P offset 8 -> 7 in the flash loop (both paths read it)",
      (PKG + "emulator.py", "offset = float(recipe.p_offset)", "offset = float(recipe.p_offset) - 1.0")),
    M("poff-c", "P offset 8 -> 7 in the compiled softmax step",
      (PKG + "_native.c", "(float)((double)mc * (double)a - offset)", "(float)((double)mc * (double)a - (offset - 1.0))")),
    M("poff-default", "default P offset 8 -> 4", (PKG + "keys/core.py", '_core("poff", 8.0,', '_core("poff", 4.0,')),
    M("kv-order", "KV tiles first to last where the recipe says last to first",
      (PKG + "emulator.py", 'if recipe.order == "reverse" else range(n_tiles)',
       'if recipe.order != "reverse" else range(n_tiles)')),
    M("out-fp32", "flash output left in float32 instead of the recipe's format",
      (PKG + "emulator.py", "    o = acc * (inv * v_end).to(torch.float32) if v_end is not None else acc * inv\n"
                            "    return quantize_dequantize(o, recipe.out, torch.float64)",
       "    o = acc * (inv * v_end).to(torch.float32) if v_end is not None else acc * inv\n"
       "    return o.to(torch.float64)")),
    M("out-default-fp32", "default output format bf16 -> fp32",
      (PKG + "keys/core.py", '_core("out", "bf16",', '_core("out", "fp32",')),
    M("causal-top-left-ref", "causal mask aligned top-left (reference and PyTorch paths)",
      (PKG + "reference.py", "return k_pos[None, :] <= (q_pos[:, None] + (seqlen_k - seqlen_q))",
       "return k_pos[None, :] <= q_pos[:, None]")),
    M("causal-top-left-c", "causal limit aligned top-left in the compiled softmax step",
      (PKG + "emulator.py", "lim = (q_index + (nk - pre.seqlen_q) - s0) if causal else None",
       "lim = (q_index - s0) if causal else None")),
    M("ftz-off-py", "no flush to zero in the PyTorch softmax arithmetic",
      (PKG + "emulator.py", "    return torch.where(x.abs() < FLT_MIN_NORMAL, x * 0.0, x)", "    return x")),
    M("ftz-off-c", "no flush to zero in the compiled softmax step and rescale",
      (PKG + "_native.c", "return (ftz & (__builtin_fabsf(x) < 0x1p-126f)) ? 0.0f * x : x;", "return x;")),
    M("ftz-default-off", "default ftz 1 -> 0", (PKG + "keys/ftz.py", '"ftz", True,', '"ftz", False,')),
    M("quad-total-py", "final quad reduction (s0 + s1) + (s2 + s3) instead of (s0 + s2) + (s1 + s3)",
      (PKG + "emulator.py", "return ((rs4[..., 0] + rs4[..., 2]) + (rs4[..., 1] + rs4[..., 3])).unsqueeze(-1)",
       "return ((rs4[..., 0] + rs4[..., 1]) + (rs4[..., 2] + rs4[..., 3])).unsqueeze(-1)")),
    M("quad-rowsum-py", "each thread adds its column pair in the other order (PyTorch)",
      (PKG + "emulator.py", "        rs4 = rs4 + p[..., j, :, 0]\n        rs4 = rs4 + p[..., j, :, 1]",
       "        rs4 = rs4 + p[..., j, :, 1]\n        rs4 = rs4 + p[..., j, :, 0]")),
    M("quad-rowsum-c", "each thread adds its column pair in the other order (C, the four parallel chains)",
      (PKG + "_native.c", "a0 = a0 + p8[0];\n                a1 = a1 + p8[2];\n                a2 = a2 + p8[4];\n"
       "                a3 = a3 + p8[6];\n                a0 = a0 + p8[1];\n                a1 = a1 + p8[3];\n"
       "                a2 = a2 + p8[5];\n                a3 = a3 + p8[7];",
       "a0 = a0 + p8[1];\n                a1 = a1 + p8[3];\n                a2 = a2 + p8[5];\n"
       "                a3 = a3 + p8[7];\n                a0 = a0 + p8[0];\n                a1 = a1 + p8[2];\n"
       "                a2 = a2 + p8[4];\n                a3 = a3 + p8[6];")),
    M("rescale-rn-c", "tile rescale exp2 rounded to nearest instead of toward zero (C)",
      (PKG + "_native.c", "    if ((double)__builtin_fabsf(y) > __builtin_fabs(r)) y = __builtin_nextafterf(y, 0.0f);\n",
       "")),
    M("standard-mqa-fix-reverted", "standard algorithm takes the head count from K (MQA crash)",
      (PKG + "emulator.py", "    b, h = pre.q.values.shape[:2]\n    nk, dv = pre.seqlen_k, pre.v.values.shape[-1]",
       "    b, h = pre.k.values.shape[:2]\n    nk, dv = pre.seqlen_k, pre.v.values.shape[-1]")),
    M("p-kept-in-bf16", "baseline-fp8's softmax rows kept between its two passes in BF16, not their FP16",
      (PKG + "emulator.py", "kept[blk] = p_rows.to(keep_dtype)", "kept[blk] = p_rows.to(torch.bfloat16)")),
    M("outlier-rate-halved", "the paper distribution's outlier positions drawn at p / 2",
      ("fa3_numerics/data/distributions/paper.py", ".geometric_(p, generator=g)", ".geometric_(p / 2, generator=g)")),
    M("standard-masked-rows-fix-reverted", "standard attention's rows that see no key give NaN again",
      (PKG + "emulator.py", "dim=-1).masked_fill(~vis.any(dim=-1, keepdim=True), 0.0)", "dim=-1)")),
    M("p-exp2-rz-c", "P~ = exp2(.) rounded toward zero instead of to nearest (C)",
      (PKG + "_native.c", "row[c] = flush32((float)exp2_d((double)x), ftz);",
       "row[c] = flush32(exp2_rz32(x), ftz);")),
    M("scale-log2-unrounded", "softmax_scale not rounded to float32 before the log2(e) factor (the host's rounding)",
      (PKG + "emulator.py", "base = torch.tensor(float(torch.tensor(scale, dtype=torch.float32)) * LOG2E,",
       "base = torch.tensor(scale * LOG2E,")),
    M("q-descale-per-query-head", "GQA: one Q descale per query head instead of per (batch, kv-head)",
      (PKG + "emulator.py", "group = h // hkv if isinstance(g, PerHead) else 1", "group = 1")),
    M("gqa-mapping-ref", "reference pairs query head h with KV head h % kv_heads instead of h // group",
      (PKG + "reference.py", "            kt = k[bi, hi // g].to(torch.float64).transpose(0, 1)\n"
                             "            vh = v[bi, hi // g].to(torch.float64)",
       "            kt = k[bi, hi % hkv].to(torch.float64).transpose(0, 1)\n"
       "            vh = v[bi, hi % hkv].to(torch.float64)")),
    # -- formats, quantization, rotation -----------------------------------------------------------
    M("e4m3-trunc-py", "casts truncate instead of rounding to nearest even (PyTorch reference)",
      (PKG + "formats.py", "y = torch.ldexp(torch.round(torch.ldexp(x, -q_exp)), q_exp.to(x.dtype))",
       "y = torch.ldexp(torch.trunc(torch.ldexp(x, -q_exp)), q_exp.to(x.dtype))")),
    M("e4m3-trunc-c", "casts truncate instead of rounding to nearest even (C)",
      (PKG + "_native.c", "double y = __builtin_rint(x * pow2d(-qe)) * pow2d(qe);",
       "double y = __builtin_trunc(x * pow2d(-qe)) * pow2d(qe);")),
    M("saturation-off-py", "saturating formats neither clamp nor overflow (PyTorch reference)",
      (PKG + "formats.py", "        y = torch.clamp(y, -f.max, f.max)\n", "        pass\n")),
    M("saturation-off-c", "saturating formats not clamped (C)",
      (PKG + "_native.c", "double lim = sat ? fmax : INFINITY;", "double lim = INFINITY;")),
    M("saturation-off-cast", "cast() no longer clamps before torch's FP8 conversion",
      (PKG + "formats.py", "    if f.saturate:\n        x = torch.clamp(x, -f.max, f.max)\n    return x.to(f.dtype)",
       "    return x.to(f.dtype)")),
    M("pow2-floor", "pow2 descales rounded down instead of up",
      (PKG + "quant.py", "s = torch.exp2(torch.ceil(torch.log2(s)))", "s = torch.exp2(torch.floor(torch.log2(s)))")),
    M("hadamard-signs-after-py", "random signs applied after H instead of before (PyTorch butterflies)",
      (PKG + "rotation.py", "return fast if fast is not None else fwht(x * s)",
       "return fast if fast is not None else fwht(x) * s")),
    M("hadamard-signs-dropped-c", "random signs not applied (C butterflies)",
      (PKG + "_native.c", "for (int64_t i = 0; i < d; i++) buf[i] = xr[i] * signs[i];",
       "for (int64_t i = 0; i < d; i++) buf[i] = xr[i];")),
    M("hadamard-signs-constant", "random signs all +1 (no randomisation, matrix and butterflies alike)",
      (PKG + "rotation.py", ".to(torch.float64) * 2 - 1", ".to(torch.float64) * 0 + 1")),
    # -- the engine's defences ------------------------------------------------------------------
    M("badzip-fix-reverted", "a truncated cache file raises BadZipFile again",
      ("fa3_numerics/engine/cache.py", "except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:",
       "except (OSError, ValueError, EOFError) as exc:")),
    M("nonfinite-fix-reverted", "the engine no longer refuses non-finite inputs",
      ("fa3_numerics/engine/runner.py", "    check_inputs(q, k, v, scale=scale, where=where)\n", "")),
]


def _copy(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    for name in LINK:
        if (ROOT / name).exists():
            (dest / name).symlink_to(ROOT / name)


def _apply(dest: Path, m: Mutation) -> None:
    for path, old, new in m.edits:
        f = dest / path
        text = f.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutation {m.name}: {path} holds {text.count(old)} copies of the text to change "
                             f"(the source moved on: update the mutation)\n{old}")
        f.write_text(text.replace(old, new))


_LAST: dict = {}  # the last run's output (printed when the unmutated run fails)


def _run(dest: Path, cache: Path, timeout: float, extra: list[str]) -> tuple[str, str, float]:
    """(outcome, first failing test or '', seconds): outcome passed / caught / timeout / error."""
    env = dict(os.environ, PYTHONPATH=str(dest), FA3N_CACHE=str(cache), PYTHONDONTWRITEBYTECODE="1")
    # files, not the folder: given the folder too, pytest would run everything in name order
    files = sorted(p.name for p in (dest / "tests").glob("test_*.py"))
    order = [f"tests/{n}" for n in FIRST if n in files] + [f"tests/{n}" for n in files if n not in FIRST]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", "--no-header",
           "-o", "addopts=", *extra, *order]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    out = res.stdout + res.stderr
    _LAST["output"] = out
    if res.returncode == 0:
        return "passed", "", dt
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    if not failed:  # -x stops after the first failure; its id is in the summary line, or the run broke
        m = re.search(r"^(tests/\S+::\S+) (?:FAILED|ERROR)", out, flags=re.M)
        failed = [m.group(1)] if m else []
    if res.returncode in (1, 2) and failed:
        return "caught", failed[0], dt
    tail = " | ".join(out.strip().splitlines()[-3:])
    return ("caught" if res.returncode in (1, 2) else "error"), f"(run failed: {tail[:150]})", dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per test run (default 240)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28s} {m.what}")
        return 0
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutation(s): {', '.join(sorted(unknown))}; see --list", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the copies (finally)
    work = Path(tempfile.mkdtemp(prefix="fa3n-mutations-"))
    cache = work / "native-cache"  # compiled libraries, keyed by their source: one per C mutation
    t_all = time.perf_counter()
    rows, ok = [], True
    try:
        if not args.no_baseline:
            base = work / "baseline"
            _copy(base)
            outcome, test, dt = _run(base, cache, args.timeout, [])
            rows.append(("(none: baseline)", outcome, test, dt))
            print(f"baseline: {outcome} in {dt:.1f} s (the fast subset: pytest -m 'not slow', "
                  f"including the first compile of the C paths into an empty cache)", flush=True)
            if outcome != "passed":
                ok = False
                print(f"  the unmutated fast subset does not pass: {test}", flush=True)
                print("\n".join("  | " + ln for ln in _LAST.get("output", "").strip().splitlines()[-40:]), flush=True)
            else:  # again, with the library compiled: the fast subset's own time
                _, _, dt2 = _run(base, cache, args.timeout, [])
                rows.append(("(none: baseline, warm)", "passed", "", dt2))
                print(f"baseline again (compiled library cached): {dt2:.1f} s", flush=True)
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
        for m in chosen:
            dest = work / m.name
            _copy(dest)
            _apply(dest, m)
            outcome, test, dt = _run(dest, cache, args.timeout, [])
            status = {"caught": "caught", "passed": "MISSED", "timeout": "TIMEOUT", "error": "ERROR"}[outcome]
            ok &= outcome == "caught"
            rows.append((m.name, status, test, dt))
            print(f"{m.name:28s} {status:8s} {dt:6.1f} s  {test}", flush=True)
            if not args.keep:
                shutil.rmtree(dest, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t_all
    print()
    print("| mutation | result | first failing test | seconds |")
    print("|---|---|---|---:|")
    for name, status, test, dt in rows:
        print(f"| {name} | {status} | {test.replace('|', '/')} | {dt:.1f} |")
    n_mut = sum(1 for r in rows if not r[0].startswith("("))
    n_caught = sum(1 for r in rows if r[1] == "caught")
    print(f"\n{n_caught} of {n_mut} mutations caught; wall time {total:.0f} s"
          + (f" (work folder kept: {work})" if args.keep else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
