"""One device call for the Triton kernels: self-checks, fused-quantizer fidelity and
bandwidth, validation of the emulator against the Triton FP8 kernel, Table 3 on hardware with
block quantization, throughput beside FA3, and the accuracy-against-speed figure.

Run on the H200 (carry .whl: fa3-fwd for the FA3 rows, h5netcdf for the .nc files)::

    bash tools/device/triton_h200.sh            # writes into $OUT

Files written into ``--out`` (at most 8), each as soon as its part finishes:

- ``report.md``        every table, with where and how it was measured
- ``results.json``     environment, every number, wall times
- ``quant.csv``        fused quantizer bandwidth per granularity and mode (device time from CUDA-graph
                       replays, and per call with the host's launch)
- ``quant_sweep.csv``  (part ``quantsweep``) launch configurations of the tiled and persistent kernels;
                       with every other part in one call that makes 9 files: leave one part out
- ``validation.nc``    F and bit-identical share per case, accumulator model and kernel variant
- ``table3_hardware.nc`` Table 3 rows on the Triton kernel (and fused / two-level variants)
- ``throughput.csv``   ms and TFLOP/s per variant and repeat statistics, RMSE against float64
- ``accuracy_speed.png`` RMSE against TFLOP/s (median, 10-90% range over repeats)
- ``log.txt``          (written by the shell wrapper)

Functions for ``tools/device/h200.py`` (each takes an ``Out`` with ``section``, ``timings``,
``save_timings``, ``dir`` and ``error``, plus ``args`` and ``Sizes``; their report sections are
keyed ``triton_*``): ``triton_tests``, ``triton_checks``, ``triton_quantizer``,
``triton_quant_sweep``, ``triton_validation``, ``triton_block_validation``, ``triton_table3``,
``triton_throughput`` (returns rows in h200's throughput format plus spread columns; ``backend``
is ``triton`` or ``fa3``, ``fused`` in the variant name for rows with the fused preprocessing),
``throughput_figure``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from common import (REPO, T0, Out, Sizes, ensure_package, event_times, graph_times, log, paper_qkv, quantile,
                    to_bshd, write_csv)

HBM_SPEC_TBS = 4.8
REPORT_ORDER = ["head", "env", "triton_tests", "triton_checks", "triton_quant", "triton_quant_sweep",
                "triton_validation", "triton_block_validation", "triton_table3", "triton_throughput", "errors"]
# The validation grid of this call (one; ``--grid``): the first of ``Sizes.grids``.
TRITON_SIZES = dataclasses.replace(Sizes(), tp_reps=30, grids=("small",))


# ----------------------------------------------------------------------------- parts


def environment(out: Out, args) -> dict:
    import torch
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
           "triton": triton.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        from fa3_numerics.engine.provenance import git_commit

        env["git_commit"] = git_commit()
    except Exception:  # noqa: BLE001 - provenance only
        pass
    try:
        from fa3_numerics.kernels.fa3 import kernel_problem, load_kernel

        why = kernel_problem("cuda")
        env["fa3"] = "ok " + " ".join(load_kernel()[1:]) if why is None else why
    except Exception as exc:  # noqa: BLE001
        env["fa3"] = f"{type(exc).__name__}: {exc}"
    # The ceiling the quantizer's bandwidth is judged against: a device-to-device copy.
    n = 1 << 30
    bufs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ts = event_times(lambda: bufs[1].copy_(bufs[0]), 20)
    env["copy_tbs"] = 2 * n / quantile(ts, 0.5) / 1e12
    env["copy_tbs_graph"] = 2 * n / quantile(graph_times(lambda: bufs[1].copy_(bufs[0]), 5, 5), 0.5) / 1e12
    # A copy moving as many bytes as the quantizer of a 4x8192x16x128 BF16 tensor (201 MB), graph-timed.
    m = 4 * 8192 * 16 * 128 * 3 // 2
    ts = graph_times(lambda: bufs[1][:m].copy_(bufs[0][:m]), 10, 10)
    env["copy_tbs_201MB_graph"] = 2 * m / quantile(ts, 0.5) / 1e12
    bufs.clear()
    out.timings["env"] = env
    out.save_timings()
    out.section("env", "## Environment\n\n" + "\n".join(f"- {k}: {v}" for k, v in env.items()))
    log(f"env {env}")
    return env


def triton_checks(out: Out, args=None, sz: Sizes | None = None) -> None:
    """The kernels' correctness checks on the device (the same functions the CPU tests run in the
    interpreter), plus pytest of tests/kernels/test_kernels_triton.py."""
    import torch

    from fa3_numerics.kernels.triton_ import selfcheck

    t = time.perf_counter()
    res = {"cast": selfcheck.cast_checks("cuda"), "gqa": selfcheck.gqa_check("cuda")}
    log(f"checks cast/gqa {res}")
    res["attention"] = selfcheck.attention_checks("cuda", accs=("fp32", "fp22", "two-level"))
    for r in res["attention"]:
        log(f"  check {r}")
    res["quant"] = selfcheck.quantizer_checks("cuda", shape=(2, 16, 2048, 128), impls=("butterfly", "dot"))
    res["seconds"] = round(time.perf_counter() - t, 2)
    out.timings["checks"] = res
    out.save_timings()
    code = None
    try:
        import pytest

        code = int(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", str(REPO / "tests" / "test_kernels_triton.py")]))
    except Exception as exc:  # noqa: BLE001
        out.error("pytest", exc)
    out.timings["checks"]["pytest_exit_code"] = code
    out.save_timings()
    lines = ["## Correctness checks on the device (kernels/triton_/selfcheck.py)", "",
             "- hardware casts (cvt.rn.satfinite FP8, cvt.rn BF16) equal the float32 soft rounding: "
             + ", ".join(f"{k} {v}" for k, v in res["cast"].items()),
             f"- GQA equals K/V repeated per Q head bit for bit: {res['gqa']['gqa_identical']}; fully masked rows are 0: "
             f"{res['gqa']['masked_rows_zero']}",
             f"- tests/kernels/test_kernels_triton.py on this machine: pytest exit code {code}", "",
             "Kernel against the emulator per accumulator model (outliers p 0.01 sigma 10, every row):", "",
             "| recipe | backend | n | h/kv | d | causal | RMSE(kernel) | F fp32 | F fp22 | F two-level | identical fp22 | identical two-level |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["attention"]:
        lines.append(f"| `{r['recipe']}` | {r['backend']} | {r['seqlen']} | {r['heads']}/{r['kv_heads']} | {r['head_dim']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['rmse_kernel']:.3e} | {r['F_fp32']:.4f} | {r['F_fp22']:.4f} | "
                     f"{r['F_two-level']:.4f} | {r['identical_fp22']:.2%} | {r['identical_two-level']:.2%} |")
    lines += ["", "Fused quantizer against the emulator's rotation + quantize (batch 2, 16 heads, seqlen 2048, dim 128, "
              "paper outliers p 0.01):", "", "| granularity | group | pow2 | rot | mode | bytes identical | values equal | "
              "descales identical | differing / elements |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["quant"]:
        lines.append(f"| {r['gran']} | {r['group']} | {r['pow2']} | {r['rot']} | {r['mode']} | {r['values_identical']:.6%} | "
                     f"{r['values_equal']:.6%} | {r['descales_identical']:.4%} | {r['values_differing']} / {r['elements']} |")
    out.section("triton_checks", "\n".join(lines))
    del torch


def triton_tests(out: Out, args=None, sz: Sizes | None = None) -> None:
    """tests/kernels/test_kernels_triton.py on the device, and the cast comparison in detail."""
    import pytest

    from fa3_numerics.kernels.triton_ import selfcheck

    cast = selfcheck.cast_checks("cuda")
    log(f"casts {cast}")
    t = time.perf_counter()
    code = int(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", str(REPO / "tests" / "test_kernels_triton.py")]))
    out.timings["tests"] = {"pytest_exit_code": code, "seconds": round(time.perf_counter() - t, 1), "cast": cast}
    out.save_timings()
    out.section("triton_tests", f"## tests/kernels/test_kernels_triton.py on the device\n\npytest exit code {code} "
                                f"({'all passed' if code == 0 else 'failures: see log.txt'}); hardware vs soft casts: {cast}")


def _k_tile_fidelity() -> list[dict]:
    """K tiles (blocks of 224 and 96 rows, rows written (b, h, s, d)) through the shared-memory
    kernel (split rotation) and the tl kernel, each against prepare() on the paper's outliers."""
    from fa3_numerics.kernels.triton_ import selfcheck

    cases = [("block", 224, 1, True, "hadamard"), ("block", 224, 1, False, "hadamard"), ("block", 96, 1, False, "hadamard")]
    fid = []
    for extra, lab in (({"reread": True}, "tl"), ({"reread": "smem"}, "smem"),
                       ({"reread": "smem", "keep_last": True}, "smem last kept")):
        fid += selfcheck.quantizer_checks("cuda", shape=(2, 16, 2048, 128), exact_modes=(False,), impls=("dot",),
                                          cases=cases, out_layout="bhsd", extra=extra, label=lab)
    return fid


def triton_quantizer(out: Out, args=None, sz: Sizes | None = None) -> list[dict]:
    """Fidelity against prepare() and bandwidth of the fused rotate-and-quantize kernel on a
    Q-shaped BF16 tensor (b, s, h, d), with the committed default launch (the sweep measures the
    alternatives); the float64 path and the butterfly rotation once, per head."""
    import torch

    from fa3_numerics.kernels.triton_ import selfcheck
    from fa3_numerics.kernels.triton_.rotate_quant import min_bytes, rotate_quantize
    from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken

    sz = sz or TRITON_SIZES
    t0 = time.perf_counter()
    fid = selfcheck.quantizer_checks("cuda", shape=(2, 16, 2048, 128), impls=("butterfly", "dot"))
    fid += _k_tile_fidelity()
    for r in fid:
        log(f"quant fidelity {r}")
    out.timings["quant_fidelity"] = {"rows": fid, "seconds": round(time.perf_counter() - t0, 1)}
    out.save_timings()
    b, n, h, d = sz.tp_batch, sz.tp_seqlen, sz.tp_heads, 128
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(b, n, h, d, generator=g, device="cuda").to(torch.bfloat16)
    copy = out.timings.get("env", {}).get("copy_tbs", float("nan"))
    rows = []
    configs = [("head", PerHead(), 1), ("block128", PerBlock(128), 1), ("block224", PerBlock(224), 1),
               ("token", PerToken(), 1), ("tensor", PerTensor(), 1)]
    modes = [("fast-dot", False, "dot"), ("fast-butterfly", False, "butterfly"), ("exact-f64", True, "butterfly")]
    for gname, gran, passes in configs:
        for mname, exact, impl in modes:
            if mname != "fast-dot" and gname != "head":
                continue
            for rot in ("hadamard",):
                label = f"{gname} {mname}"
                try:
                    kw = {}
                    call = lambda: rotate_quantize(x, layout="bshd", gran=gran, rot=rot, seed=0, exact=exact,  # noqa: E731,B023
                                                   impl=impl, out_layout="bhsd", **kw)  # noqa: B023
                    o = call()
                    ts = event_times(call, 20)
                    tg = graph_times(call, 10, 10) if not exact else ts
                    t, t_e = quantile(tg, 0.5), quantile(ts, 0.5)
                    reads = 2 if gname in ("head", "tensor") else 1
                    mb = min_bytes(x, o)
                    actual = mb + (reads - 1) * x.numel() * x.element_size()
                    r = {"granularity": gname, "mode": mname, "rot": rot, "shape": f"{b}x{n}x{h}x{d} bf16",
                         "kernel": o.launch,
                         "ms": t * 1e3, "ms_p10": quantile(tg, 0.1) * 1e3, "ms_p90": quantile(tg, 0.9) * 1e3, "ms_per_call": t_e * 1e3,
                         "timing": "cuda graph, 10 calls" if not exact else "per call",
                         "min_bytes": mb, "bytes_moved": actual, "passes_over_input": reads, "traffic_over_min": actual / mb,
                         "tbs_min_bytes": mb / t / 1e12, "tbs_moved": actual / t / 1e12,
                         "pct_copy_moved": 100 * actual / t / 1e12 / copy, "pct_spec_moved": 100 * actual / t / 1e12 / HBM_SPEC_TBS,
                         "pct_copy_per_call": 100 * actual / t_e / 1e12 / copy}
                    rows.append(r)
                    log(f"quant {label}: {t * 1e3:.4f} ms, {r['tbs_moved']:.2f} TB/s moved ({r['pct_copy_moved']:.0f}% of copy); "
                        f"per call {t_e * 1e3:.4f} ms")
                except Exception as exc:  # noqa: BLE001
                    out.error(f"quantizer {label}", exc)
    out.timings["quantizer"] = rows
    out.save_timings()
    write_csv(out.dir / "quant.csv", rows)
    lines = ["## Fused rotate-and-quantize: fidelity against prepare() (batch 2, 16 heads, seqlen 2048, dim 128, "
             "outliers p 0.01)", "", "| granularity | group | pow2 | rot | mode | bytes identical | values equal | "
             "descales identical | differing / elements |", "|---|---|---|---|---|---|---|---|---|"]
    for r in fid:
        lines.append(f"| {r['gran']} | {r['group']} | {r['pow2']} | {r['rot']} | {r['mode']} | {r['values_identical']:.6%} | "
                     f"{r['values_equal']:.6%} | {r['descales_identical']:.4%} | {r['values_differing']} / {r['elements']} |")
    lines += ["", f"## Fused rotate-and-quantize: bandwidth (BF16 {b}x{n}x{h}x{d} in (batch, seq, head, dim), FP8 out "
              f"(batch, head, seq, dim); random Hadamard; device time from CUDA-graph replays (float64 path: per call))", "",
              f"Device-to-device copy on this GPU: {copy:.2f} TB/s (read + write); spec {HBM_SPEC_TBS} TB/s.", "",
              "| granularity | mode | kernel | ms (p10-p90) | passes over input | TB/s (bytes moved) | % of copy | % of spec | "
              "traffic / minimal | TB/s (minimal bytes) | ms per call | % of copy per call |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['granularity']} | {r['mode']} | {r['kernel']} | {r['ms']:.4f} ({r['ms_p10']:.4f}-{r['ms_p90']:.4f}) | "
                     f"{r['passes_over_input']} | {r['tbs_moved']:.2f} | {r['pct_copy_moved']:.0f}% | {r['pct_spec_moved']:.0f}% | "
                     f"{r['traffic_over_min']:.2f} | {r['tbs_min_bytes']:.2f} | {r['ms_per_call']:.4f} | {r['pct_copy_per_call']:.0f}% |")
    lines += ["", "Per head and per tensor need a second read: every element's scale depends on the amax of the whole "
              "head. Minimal bytes = BF16 read once + FP8 and descales written once."]
    out.section("triton_quant", "\n".join(lines))
    return rows


def validation_cases(grid_name: str):
    import dataclasses as dc

    from fa3_numerics.studies.validate import Case, grid

    cases = [c for c in grid(grid_name) if c.dtype == "fp8"]
    extra = []
    if grid_name != "stress":
        try:
            extra = [c for c in grid("stress") if c.dtype == "fp8"]
        except Exception:  # noqa: BLE001 - the stress grid may not exist yet
            extra = []
    b = Case()
    # Heavy outliers and the per-block recipes no public kernel can run.
    # Heavy outliers (validate.py's cases take per-head or per-tensor descales; the per-block
    # recipes are validated by ``triton_block_validation``).
    extra += [b.with_data(p=0.01, sigma=30.0), b.with_data(p=0.001, sigma=100.0),
              dc.replace(b.with_data(p=0.01, sigma=30.0), rot="hadamard", causal=True, kv_heads=2, seqlen=1000)]
    from fa3_numerics.engine.backends import refusal
    from fa3_numerics.kernels.triton_.backend import TritonBackend, shape_problem
    from fa3_numerics.studies.validate import case_recipe

    seen, out = set(), []
    kern = TritonBackend()
    for c in cases + extra:
        # Head dims 96/192 (no power-of-two Triton tile) and anything else the kernel refuses.
        r = case_recipe(c)
        if refusal(kern, r) or shape_problem(r, c.head_dim, c.causal):
            continue
        if c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out


def triton_validation(out: Out, args=None, sz: Sizes | None = None, deadline: float | None = None) -> None:
    from fa3_numerics.kernels.triton_.backend import TritonBackend, TritonTwoLevelBackend
    from fa3_numerics.report.validation import markdown_validation
    from fa3_numerics.studies.validate import accumulator_ranking, run_validation

    sz = sz or TRITON_SIZES
    cases = validation_cases(sz.grids[0])
    res, dss = {}, []
    for i, kern in enumerate((TritonBackend(), TritonTwoLevelBackend())):
        t = time.perf_counter()
        # The chained kernel (the default) gets 60% of the time left; the two-level one the rest.
        dl = None if deadline is None else (t + 0.6 * (deadline - t) if i == 0 else deadline)
        try:
            ds = run_validation(cases, device="cuda", kernel=kern, accs=["fp32", "fp22", "two-level"],
                                progress=lambda m: log("  " + m), deadline=dl)
        except Exception as exc:  # noqa: BLE001 - keep the other kernel's results
            out.error(f"validation {kern.name}", exc)
            continue
        rank = accumulator_ranking(ds)
        res[kern.name] = {"seconds": round(time.perf_counter() - t, 1), "ranking": rank,
                          "F": {str(c): {str(a): float(ds["fidelity"].sel(case=c, acc=a)) for a in ds["acc"].values}
                                for c in ds["case"].values},
                          "identical": {str(c): {str(a): float(ds["identical"].sel(case=c, acc=a))
                                                 for a in ds["acc"].values} for c in ds["case"].values}}
        out.timings["validation"] = res
        out.save_timings()
        dss.append((kern.name, ds))
        log(f"validation {kern.name}: {rank}")
        _write_validation(out, dss)
    parts = [f"## Validation: the emulator against the Triton FP8 kernel (grid `{sz.grids[0]}` FP8 cases + stress + "
             f"heavy outliers), F = RMSE(emulator, kernel) / RMSE(kernel, float64)"]
    for name, ds in dss:
        rank = res[name]["ranking"]
        best = rank[0] if rank else None
        parts += [f"### Kernel `{name}`" + (f": best model `{best['acc']}`, max F {best['max_F']:.4f}" if best else ""),
                  "", markdown_validation(ds)]
    out.section("triton_validation", "\n".join(parts))


def _write_validation(out: Out, dss) -> None:
    import xarray as xr

    from fa3_numerics.engine.dataset import write

    try:
        both = xr.concat([d.expand_dims(kernel=[n]) for n, d in dss], dim="kernel", data_vars="all",
                         combine_attrs="drop_conflicts")
        write(both, out.dir / "validation.nc")
    except Exception as exc:  # noqa: BLE001
        out.error("validation.nc", exc)


BLOCK_CASES = [  # (recipe, seqlen, heads, kv_heads, head_dim, causal, backend)
    ("fa3-fp8", 2048, 8, 8, 128, False, "triton"), ("fa3-fp8-no-incoherent", 2048, 8, 8, 128, False, "triton"),
    ("fa3-fp8", 1000, 8, 2, 128, True, "triton"), ("fa3-fp8", 2048, 8, 8, 64, False, "triton"),
    ("fa3-fp8", 2048, 8, 8, 256, True, "triton"), ("fa3-fp8", 2048, 8, 8, 128, False, "triton-two-level"),
    ("fa3-fp8,pow2=0", 2048, 8, 8, 128, False, "triton"),
]


def triton_block_validation(out: Out, args=None, sz: Sizes | None = None) -> None:
    """Per-block recipes (which validate.py's grid, built for the public FA3 kernel, does not take):
    emulator against the Triton kernel per accumulator model, paper outliers and heavy ones."""
    from fa3_numerics.kernels.triton_ import selfcheck

    rows = []
    for p, sigma in ((0.001, 10.0), (0.01, 30.0)):
        for r in selfcheck.attention_checks("cuda", cases=BLOCK_CASES, accs=("fp32", "fp22", "two-level"), p=p,
                                            sigma=sigma):
            rows.append({**r, "p": p, "sigma": sigma})
            log(f"  block {r['recipe']} {r['backend']} p{p} s{sigma}: F fp22 {r['F_fp22']:.4f} two-level "
                f"{r['F_two-level']:.4f}")
    out.timings["block_validation"] = rows
    out.save_timings()
    lines = ["## Validation of the per-block recipes (emulator vs Triton kernel, every query row, seed 0)", "",
             "| recipe | backend | n | h/kv | d | causal | p | sigma | RMSE(kernel) | F fp32 | F fp22 | F two-level | "
             "identical fp22 | identical two-level |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['recipe']}` | {r['backend']} | {r['seqlen']} | {r['heads']}/{r['kv_heads']} | {r['head_dim']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['p']:g} | {r['sigma']:g} | {r['rmse_kernel']:.3e} | "
                     f"{r['F_fp32']:.4f} | {r['F_fp22']:.4f} | {r['F_two-level']:.4f} | {r['identical_fp22']:.2%} | "
                     f"{r['identical_two-level']:.2%} |")
    out.section("triton_block_validation", "\n".join(lines))


# Launch configurations of the quantizer sweep: (name, granularity, rot, out layout, kwargs).
# {} = the committed default launch (its configuration is read back from QuantOut.launch).
# "old": the one-program-per-tile kernel (persistent=False, IEEE division): the bytes every other
# row is compared with. Blocks in the persistent kernel: in one tile, in 64-row sub-tiles kept in registers ("kept") or read again from L2 ("reread": as more
# pipelined steps; "reread-sync": at the block's last step).
def _sweep_configs(which: str = "full"):
    from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken

    old = dict(persistent=False)
    B128, B224 = ("block128", PerBlock(128), "hadamard", "bhsd"), ("block224", PerBlock(224), "hadamard", "bhsd")
    V128, V224 = ("vblock128", PerBlock(128), "none", "bhds"), ("vblock224", PerBlock(224), "none", "bhds")
    if which == "probe":
        # Where a 224-row block's time goes: the defaults for FA3's 224-row K and V tiles (the
        # shared-memory kernels: K's short last sub-tile rotated twice, V in vquant_smem),
        # power-of-two and amax descales, beside the tl kernel's launches.
        p2 = dict(pow2=True)
        K2, V2 = ("block224-pow2", PerBlock(224), "hadamard", "bhsd"), ("vblock224-pow2", PerBlock(224), "none", "bhds")
        return [
            (*K2, dict(old, num_warps=8, **p2)), (*V2, dict(old, num_warps=8, **p2)), (*V224, dict(old, num_warps=8)),
            (*B224, dict(old, num_warps=8)), (*V128, dict(old, num_warps=8)),
            (*K2, p2), (*B224, {}), (*V2, p2), (*V224, {}),
            (*K2, dict(reread=True, **p2)), (*V2, dict(reread="skewed", sub_tile=32, stages=6, **p2)),
            (*V224, dict(reread="skewed", sub_tile=32, stages=6)),
            (*V2, dict(reread="smem", progs_per_sm=2, **p2)), (*V224, dict(reread="smem", head_fast=False)),
            (*V128, {}), (*V128, dict(reread="smem")),
            (*K2, p2), (*V2, p2), (*B224, {}), (*V224, {}),  # again: the spread
        ]
    return [
        ("token", PerToken(), "hadamard", "bhsd", dict(old, tile=64, num_warps=4)),
        (*B128, dict(old, num_warps=8)),
        (*B224, dict(old, num_warps=8)),
        (*V128, dict(old, num_warps=8)),  # the tl kernel's V blocks of 128 rows (b, h, d, s), before the skewed reread
        (*V224, dict(old, num_warps=8)),
        # committed defaults
        ("token", PerToken(), "hadamard", "bhsd", {}),
        ("head", PerHead(), "hadamard", "bhsd", {}),
        ("tensor", PerTensor(), "hadamard", "bhsd", {}),
        ("vhead", PerHead(), "none", "bhds", {}),
        (*B128, {}),
        (*B224, {}),
        (*V128, {}),
        (*V224, {}),
        # alternatives: blocks read again one block behind, in the first pass's steps
        # (reread="skewed"), or with their inputs kept in registers and rotated again
        # (reread="inputs"); register caps (max_regs) that let 3 (168 registers) or 4 (128)
        # programs share an SM; warps, stages and item order
        (*B224, dict(reread=True, stages=4)),  # the reread default before the register cap
        (*B224, dict(reread="skewed")),
        (*B224, dict(reread="inputs")),
        (*B224, dict(reread=True, num_warps=8, stages=2, max_regs=128)),
        (*B224, dict(reread=True, max_regs=168, stages=2, head_fast=False)),
        (*V224, dict(reread=True)),  # V's reread before the skewed mode
        (*V224, dict(reread="skewed", max_regs=168)),
        (*V224, dict(reread="skewed", stages=5)),
        (*V224, dict(reread="skewed", num_warps=8, stages=4)),
        (*V224, dict(reread="inputs", num_warps=8)),
        (*V128, dict(reread="skewed", stages=3)),
        (*V128, dict(reread="skewed", stages=4)),
        (*V128, dict(reread="inputs", max_regs=168, stages=3)),
        (*B128, dict(reread="skewed")),
        (*B128, dict(reread="inputs")),
        # the shared-memory kernels (rotate_quant_smem for K, vquant_smem for V: the defaults for
        # these tiles) against the tl kernel's launches, and their variants
        (*B224, dict(reread=True)), (*B224, dict(reread="smem", keep_last=True)),
        (*B224, dict(reread="smem", parts=4)), (*B128, dict(reread="smem")),
        (*V224, dict(reread="skewed", sub_tile=32, stages=6)), (*V128, dict(reread="skewed", stages=3, max_regs=168)),
        (*V224, dict(reread="smem", progs_per_sm=2)),
        (*B224, {}),  # the defaults again: the spread within the run
        (*V128, {}),
        (*V224, {}),
        ("token", PerToken(), "hadamard", "bhsd", {}),
    ]


def _cfg_label(kw: dict, launch: str = "") -> str:
    if not kw:
        return f"default: {launch}"
    if not kw.get("persistent", True):
        return f"old {launch or ''}".strip()
    return launch or ", ".join(f"{k}={v}" for k, v in kw.items())


def triton_quant_sweep(out: Out, args=None, sz: Sizes | None = None) -> None:
    """Launch configurations of the fast quantizer (the tiled kernel, the persistent
    kernel's committed defaults and alternatives): device time from CUDA-graph replays and
    per-call time with the host's launch, bytes identical to the IEEE-division tiled kernel; the
    fastest per granularity (identical bytes only) is recorded. The quant and end-to-end parts
    run the defaults."""
    import torch

    from fa3_numerics.kernels.triton_.rotate_quant import min_bytes, rotate_quantize

    sz = sz or TRITON_SIZES
    b, n, h, d = sz.tp_batch, sz.tp_seqlen, sz.tp_heads, 128
    x = torch.randn(b, n, h, d, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda").to(torch.bfloat16)
    env = out.timings.get("env", {})
    copy = env.get("copy_tbs", float("nan"))
    rows, best, refs = [], {}, {}
    which = getattr(args, "sweep", "full")
    if which == "probe":
        # The split rotation's values against prepare() (float64), beside the one-product kernel's:
        # the paper's outliers, rows written (b, h, s, d), blocks of the FA3 tiles.
        fid = []
        try:
            fid = _k_tile_fidelity()
        except Exception as exc:  # noqa: BLE001
            out.error("probe fidelity", exc)
        for r in fid:
            log(f"probe fidelity {r}")
        out.timings["probe_fidelity"] = fid
    for gname, gran, rot, olay, kw in _sweep_configs(which):
        label = f"{gname} {_cfg_label(kw)}"
        try:
            kw = dict(kw)
            lay = kw.pop("layout", "bshd")  # a (b, h, s, d) input: each head's rows contiguous
            xin = x if lay == "bshd" else x.transpose(1, 2).contiguous()
            call = lambda: rotate_quantize(xin, layout=lay, gran=gran, rot=rot, seed=0, impl="dot" if rot != "none" else "auto",  # noqa: E731,B023
                                           out_layout=olay, **kw)  # noqa: B023
            o = call()
            torch.cuda.synchronize()
            label = f"{gname} {_cfg_label(kw, o.launch)}" + (f" in {lay}" if lay != "bshd" else "")
            if not kw.get("persistent", True) and not kw.get("recip"):
                refs[gname] = o
            ref = refs.get(gname)
            same = float((o.values.view(torch.uint8) == ref.values.view(torch.uint8)).double().mean()) if ref is not None else float("nan")
            dsame = bool(torch.equal(o.descale, ref.descale)) if ref is not None else None
            te = event_times(call, 20)
            tg = graph_times(call, 10, 10)
            passes = 2 if gname in ("head", "tensor", "vhead") else 1
            mb = min_bytes(x, o)
            persistent = o.launch.startswith("persistent")
            moved = mb + (passes - 1) * x.numel() * 2
            t, t_e = quantile(tg, 0.5), quantile(te, 0.5)
            r = {"granularity": gname, "rot": rot, "in_layout": lay, "out_layout": olay, "config": _cfg_label(kw, o.launch),
                 "kernel": "persistent" if persistent else "tiled", "default": int(not kw), "launch": o.launch,
                 "kwargs": json.dumps(kw),
                 "order": "seq-first" if "seq-first" in o.launch else "heads-first",
                 "scale": "x * (1/descale)" if kw.get("recip") else "x / descale",
                 "passes_over_input": passes, "min_bytes": mb, "bytes_moved": moved,
                 "ms": t * 1e3, "ms_p10": quantile(tg, 0.1) * 1e3, "ms_p90": quantile(tg, 0.9) * 1e3, "ms_per_call": t_e * 1e3,
                 "tbs_moved": moved / t / 1e12, "pct_copy": 100 * moved / t / 1e12 / copy,
                 "pct_spec": 100 * moved / t / 1e12 / HBM_SPEC_TBS, "tbs_min_bytes": mb / t / 1e12,
                 "traffic_over_min": moved / mb, "pct_copy_per_call": 100 * moved / t_e / 1e12 / copy,
                 "bytes_identical_to_div_kernel": same, "descales_identical_to_div_kernel": dsame}
            rows.append(r)
            log(f"quant sweep {label}: graph {t * 1e3:.3f} ms {r['tbs_moved']:.2f} TB/s ({r['pct_copy']:.0f}% of copy); "
                f"per call {t_e * 1e3:.3f} ms ({r['pct_copy_per_call']:.0f}%); identical {same:.6%} desc {dsame}")
            ok = persistent and not kw.get("recip") and same == 1.0 and dsame
            if ok and (gname not in best or t < best[gname]["ms"] / 1e3):
                best[gname] = {**r, "kw": dict(kw)}
            del o
        except Exception as exc:  # noqa: BLE001
            out.error(f"quant sweep {label}", exc)
    out.timings["quant_sweep"] = {"rows": rows, "best": best}
    out.save_timings()
    write_csv(out.dir / "quant_sweep.csv", rows)
    lines = [f"## Fused quantizer: launch configurations (BF16 {b}x{n}x{h}x{d} in (b, s, h, d); Hadamard except v*; "
             "v* = V: no rotation, FP8 out (b, h, d, s); device time = median of 10 replays of a CUDA graph of 10 calls; "
             "per call = median of 20 single calls with the host's launch)", "",
             f"Copy: {copy:.2f} TB/s (1 GiB, per call), {env.get('copy_tbs_graph', float('nan')):.2f} TB/s (1 GiB, graph), "
             f"{env.get('copy_tbs_201MB_graph', float('nan')):.2f} TB/s (201 MB, graph); spec {HBM_SPEC_TBS} TB/s.", "",
             "| granularity | kernel / configuration | scale by | ms (device) | TB/s moved | % of copy | % of spec | traffic / minimal | "
             "ms per call | % of copy per call | bytes identical to the division kernel |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['granularity']} | {r['config']} | {r['scale']} | {r['ms']:.4f} | {r['tbs_moved']:.2f} | {r['pct_copy']:.0f}% | "
                     f"{r['pct_spec']:.0f}% | {r['traffic_over_min']:.2f} | {r['ms_per_call']:.4f} | {r['pct_copy_per_call']:.0f}% | "
                     f"{r['bytes_identical_to_div_kernel']:.6%} |")
    lines += ["", "Fastest per granularity (identical bytes): " + "; ".join(
        f"{k}: {v['config']} {v['ms']:.4f} ms ({v['pct_copy']:.0f}% of copy)" for k, v in best.items())]
    out.section("triton_quant_sweep", "\n".join(lines))


def _experiment(variants, backend, sz: Sizes, rows=None):
    from fa3_numerics.studies.outliers import Experiment

    return Experiment(name="outliers", description="FA3 paper Table 3 on the Triton FP8 kernel (device run)",
                      dist="outliers", variants=list(variants), params={}, seqlen=[sz.t3_seqlen], head_dim=[128],
                      causal=[False], batch=sz.t3_batch, heads=sz.t3_heads, kv_heads=0,
                      rows=sz.t3_rows if rows is None else rows, seeds=[0], backend=backend, device="cuda")


T3_ROWS = ["fa3-fp8", "fa3-fp8-no-block-quant", "fa3-fp8-no-incoherent", "fa3-fp8-kernel", "fa3-fp8-kernel-hadamard"]


def triton_table3(out: Out, args=None, sz: Sizes | None = None) -> None:
    import xarray as xr

    from fa3_numerics.engine.dataset import summary_table, write
    from fa3_numerics.studies.outliers import run_experiment

    sz = sz or TRITON_SIZES
    plan = [("emulate", T3_ROWS), ("emulate", [f"{v},acc=fp22" for v in T3_ROWS[:3]]), ("triton", T3_ROWS),
            ("triton-two-level", T3_ROWS[:3]), ("triton-fused", T3_ROWS[:3])]
    rows, dss = [], []
    for backend, variants in plan:
        try:
            t = time.perf_counter()
            ds = run_experiment(_experiment(variants, backend, sz), cache_dir=None, progress=lambda m: None)
            secs = time.perf_counter() - t
        except Exception as exc:  # noqa: BLE001
            out.error(f"table3 on {backend}", exc)
            continue
        ds = ds.assign_coords(variant=[f"{backend}:{v}" for v in ds["variant"].values],
                              backend=("variant", [backend] * ds.sizes["variant"]))
        dss.append(ds)
        for r in summary_table(ds):
            rows.append({**r, "backend": backend, "variant": r["variant"].split(":", 1)[1], "seconds": secs})
        log(f"table3 {backend}: {[(r['variant'], round(r['value'], 6)) for r in rows if r['backend'] == backend]}")
    out.timings["table3"] = [{k: r[k] for k in ("backend", "variant", "value", "lo", "hi", "paper")} for r in rows]
    out.save_timings()
    if dss:
        try:
            write(xr.concat(dss, dim="variant", data_vars="all", combine_attrs="drop_conflicts"),
                  out.dir / "table3_hardware.nc")
        except Exception as exc:  # noqa: BLE001
            out.error("table3_hardware.nc", exc)
    emu = {r["variant"]: r for r in rows if r["backend"] == "emulate"}
    e = lambda x: "-" if x is None or not math.isfinite(x) else f"{x:.3e}"  # noqa: E731
    lines = [f"## Table 3 on the Triton FP8 kernel (batch {sz.t3_batch}, {sz.t3_heads} heads, seqlen {sz.t3_seqlen}, "
             f"dim 128, non-causal, p 0.001, sigma 10, seed 0, {sz.t3_rows} query rows per head; 95% bootstrap "
             f"intervals over (batch, head))", "",
             "| row | paper | backend | RMSE [95% CI] | / paper | emulator acc=fp32 | emulator acc=fp22 | kernel / emulator fp22 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["backend"] == "emulate":
            continue
        v = r["variant"]
        ef = emu.get(v, {}).get("value")
        e22 = emu.get(f"{v},acc=fp22", {}).get("value")
        paper = emu.get(v, {}).get("paper", float("nan"))
        ratio = f"{r['value'] / paper:.2f}" if paper and math.isfinite(paper) else "-"
        lines.append(f"| `{v}` | {e(paper)} | {r['backend']} | {e(r['value'])} [{e(r['lo'])}, {e(r['hi'])}] | {ratio} | "
                     f"{e(ef)} | {e(e22)} | {(r['value'] / e22) if e22 else float('nan'):.4f} |")
    lines += ["", "`triton`: inputs rotated and quantized by the emulator's prepare() (same FP8 bytes); "
              "`triton-fused`: by the fused Triton kernel (float32 path); `triton-two-level`: two-level P.V "
              "accumulation. The paper's FA3 FP8 rows use block scales (power of two) at the FA3 tiles (128 x 224) "
              "and run here as written."]
    out.section("triton_table3", "\n".join(lines))


def triton_throughput(out: Out, args=None, sz: Sizes | None = None, subset: bool = False) -> list[dict]:
    """TFLOP/s at batch 4, seqlen 8192, 16 heads, dim 128 (non-causal and causal), with FA3 beside.
    ``subset``: only the rows with the fused preprocessing (after ``triton_quant_sweep`` picked its
    fastest configuration)."""
    import torch

    from fa3_numerics.data.sampling import query_rows
    from fa3_numerics.kernels.triton_.attention import attention_fp8, plan_tiles
    from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
    from fa3_numerics.numerics.granularity import PerBlock, PerHead
    from fa3_numerics.numerics.reference import reference_attention

    sz = sz or TRITON_SIZES
    b, h, n, d = sz.tp_batch, sz.tp_heads, sz.tp_seqlen, 128
    # The paper's distribution (seed 1), float64 on the GPU; the kernels read its BF16 cast in
    # (b, s, h, d), the reference the float64 draws.
    q64, k64, v64 = paper_qkv(b, h, n, d, 1, device="cuda")
    rows_idx = query_rows(n, sz.tp_rows, 1, device="cuda")
    refs = {c: reference_attention(q64, k64, v64, q_index=rows_idx, causal=c) for c in (False, True)}
    qb, kb, vb = (to_bshd(x, torch.bfloat16) for x in (q64, k64, v64))
    del q64, k64, v64

    def rmse(o, causal, layout):
        o = (o.transpose(1, 2) if layout == "bshd" else o).index_select(2, rows_idx).to(torch.float64)
        return float(torch.sqrt(torch.mean((o - refs[causal]) ** 2)))

    fa3 = None
    try:
        from fa3_numerics.kernels.fa3 import flash_attn, kernel_problem

        if kernel_problem("cuda") is None:
            fa3 = flash_attn
    except Exception:  # noqa: BLE001
        fa3 = None

    def fused(gran, rot, q_layout, v_layout, bm=128, bn=224):
        # The committed default launch of the quantizer (the sweep measures the alternatives).
        def run():
            kw = dict(layout="bshd", seed=0, exact=False)
            gq = PerBlock(bm) if isinstance(gran, PerBlock) else gran
            gk = PerBlock(bn) if isinstance(gran, PerBlock) else gran
            pw = isinstance(gran, PerBlock)  # the paper's recipe: power-of-two block scales
            qo = rotate_quantize(qb, gran=gq, rot=rot, out_layout=q_layout, pow2=pw, **kw)
            ko = rotate_quantize(kb, gran=gk, rot=rot, out_layout=q_layout, pow2=pw, **kw)
            vo = rotate_quantize(vb, gran=gk, rot="none", out_layout=v_layout, pow2=pw, **kw)
            return qo, ko, vo
        return run

    best = {"plan": None}

    def plan_for(bn):
        p = best["plan"] or plan_tiles(d, bn)
        return dataclasses.replace(p, block_n=bn)

    def tri_call(qo, ko, vo, causal, bn, pv="chained", plan=None):
        qd, kd, vd = qo.descale, ko.descale, vo.descale
        if qd.shape[2] == 1 and qd.shape[1] == 1 and h > 1:
            qd, kd, vd = (t.expand(b if t.shape[0] == 1 else t.shape[0], h, 1) for t in (qd, kd, vd))
        return lambda: attention_fp8(qo.values, ko.values, vo.values, qd, kd, vd, q_rows=qo.rows if qo.gran >= 2 else 1 << 30,  # noqa: E731
                                     k_rows=ko.rows if ko.gran >= 2 else 1 << 30, v_rows=vo.rows if vo.gran >= 2 else 1 << 30,
                                     causal=causal, pv=pv, plan=plan or plan_for(bn))

    results = []

    def record(label, backend, causal, call, prep=None, layout="bhsd", recipe="", plan=""):
        try:
            o = call()
            err = rmse(o, causal, layout)
            tk = event_times(call, sz.tp_reps)
            tp = event_times(prep, sz.tp_reps) if prep is not None else [0.0] * len(tk)
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            tot = sorted(a + c for a, c in zip(sorted(tk), sorted(tp)))
            tpg = None
            if prep is not None:
                try:  # the three quantizer launches' device time, host launch cost taken out
                    tpg = quantile(graph_times(prep, 5, 10), 0.5)
                except Exception as exc:  # noqa: BLE001
                    out.error(f"graph prep {label}", exc)
            r = {"variant": label, "backend": backend, "causal": int(causal), "recipe": recipe, "plan": plan, "rmse": err,
                 "kernel_ms": quantile(tk, 0.5) * 1e3, "preprocess_ms": quantile(tp, 0.5) * 1e3,
                 "tflops_kernel": flops / quantile(tk, 0.5) / 1e12,
                 "tflops_kernel_p10": flops / quantile(tk, 0.9) / 1e12, "tflops_kernel_p90": flops / quantile(tk, 0.1) / 1e12,
                 "tflops_with_preprocess": flops / quantile(tot, 0.5) / 1e12,
                 "tflops_with_preprocess_p10": flops / quantile(tot, 0.9) / 1e12,
                 "tflops_with_preprocess_p90": flops / quantile(tot, 0.1) / 1e12, "reps": sz.tp_reps,
                 "preprocess_ms_graph": tpg * 1e3 if tpg is not None else float("nan"),
                 "tflops_with_preprocess_graph": flops / (quantile(tk, 0.5) + (tpg or 0.0)) / 1e12}
            results.append(r)
            log(f"throughput {label} causal={causal}: kernel {r['kernel_ms']:.3f} ms {r['tflops_kernel']:.0f} TFLOP/s, "
                f"with prep {r['tflops_with_preprocess']:.0f} (prep {r['preprocess_ms']:.3f} ms per call; graph-timed prep "
                f"{r['preprocess_ms_graph']:.3f} ms: {r['tflops_with_preprocess_graph']:.0f}); rmse {err:.3e}")
        except Exception as exc:  # noqa: BLE001
            out.error(f"throughput {label} causal={causal}", exc)

    scale = 1.0 / math.sqrt(d)
    for causal in (False, True):
        if fa3 is not None:
            record("FA3 BF16", "fa3", causal, lambda: fa3(qb, kb, vb, softmax_scale=scale, causal=causal), layout="bshd",  # noqa: B023
                   recipe="qk=bf16,v=bf16,p=bf16,out=bf16,poff=0")
            for rot in ("none", "hadamard") if not subset else ("hadamard",):
                prep = fused(PerHead(), rot, "bshd", "bshd")
                qo, ko, vo = prep()
                ds = tuple(t.descale[..., 0].contiguous() for t in (qo, ko, vo))
                name = "FA3 FP8 per-head" + (" + Hadamard" if rot != "none" else "") + " (fused prep)"
                record(name, "fa3", causal,
                       lambda qo=qo, ko=ko, vo=vo, ds=ds: fa3(qo.values, ko.values, vo.values, softmax_scale=scale,
                                                              causal=causal, descales=ds),  # noqa: B023
                       prep=prep, layout="bshd", recipe="fa3-fp8-kernel" + ("-hadamard" if rot != "none" else ""))
        if not causal and not subset:
            # Launch configurations of the per-head kernel; the fastest is used for every Triton row.
            qo, ko, vo = fused(PerHead(), "none", "bhsd", "bhds")()
            from fa3_numerics.kernels.triton_.attention import Plan

            sweep = []
            for pl in (Plan(128, 128, 8, 2), Plan(128, 128, 8, 3), Plan(128, 64, 4, 3), Plan(64, 128, 4, 3),
                       Plan(128, 128, 4, 2)):
                try:
                    call = tri_call(qo, ko, vo, False, pl.block_n, plan=pl)
                    call()
                    sweep.append((quantile(event_times(call, 10), 0.5), pl))
                    log(f"plan {pl}: {sweep[-1][0] * 1e3:.3f} ms")
                except Exception as exc:  # noqa: BLE001
                    out.error(f"plan {pl}", exc)
            if sweep:
                best["plan"] = min(sweep, key=lambda x: x[0])[1]
                out.timings["plan_sweep"] = [{"plan": str(p), "ms": t * 1e3} for t, p in sweep]
        for label, gran, rot, bn, pv, recipe in [
                ("triton FP8 per-head", PerHead(), "none", 128, "chained", "fa3-fp8-kernel,bn=128"),
                ("triton FP8 per-head, FA3 tiles", PerHead(), "none", 224, "chained", "fa3-fp8-kernel"),
                ("triton FP8 per-head + Hadamard (fused)", PerHead(), "hadamard", 128, "chained", "fa3-fp8-kernel-hadamard,bn=128"),
                ("triton FP8 block + Hadamard [fa3-fp8] (fused)", PerBlock(), "hadamard", 128, "chained", "fa3-fp8,bn=128"),
                ("triton FP8 block + Hadamard [fa3-fp8], FA3 tiles (fused)", PerBlock(), "hadamard", 224, "chained", "fa3-fp8"),
                ("triton FP8 block + Hadamard [fa3-fp8] two-level (fused)", PerBlock(), "hadamard", 128, "two-level",
                 "fa3-fp8,bn=128,acc=two-level")]:
            if subset and ("fused" not in label or bn != 128):
                continue
            prep = fused(gran, rot, "bhsd", "bhds", bm=128, bn=bn)
            qo, ko, vo = prep()
            record(label, "triton", causal, tri_call(qo, ko, vo, causal, bn, pv),
                   prep=prep if "fused" in label else None, recipe=recipe, plan=str(plan_for(bn)))
    out.timings["throughput"] = {"shape": [b, h, n, d], "reps": sz.tp_reps, "results": results,
                                 "flops": "4 b h n^2 d (halved when causal)"}
    out.save_timings()
    write_csv(out.dir / "throughput.csv", results)
    fa3_fp8 = {r["causal"]: r["tflops_kernel"] for r in results if r["variant"].startswith("FA3 FP8 per-head (")}
    lines = [f"## Throughput (batch {b}, seqlen {n}, {h} heads, dim {d}; BF16 inputs in (b, s, h, d); median of "
             f"{sz.tp_reps} CUDA-event timings, 10-90% range in brackets)", "",
             "| variant | causal | backend | kernel ms | TFLOP/s kernel [p10-p90] | x FA3 FP8 | prep ms | TFLOP/s with prep [p10-p90] | "
             "prep ms (graph) | TFLOP/s with graph-timed prep | RMSE vs float64 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rel = r["tflops_kernel"] / fa3_fp8[r["causal"]] if r["causal"] in fa3_fp8 else float("nan")
        lines.append(f"| {r['variant']} | {'yes' if r['causal'] else 'no'} | `{r['backend']}` | {r['kernel_ms']:.3f} | "
                     f"{r['tflops_kernel']:.0f} [{r['tflops_kernel_p10']:.0f}-{r['tflops_kernel_p90']:.0f}] | {rel:.2f} | "
                     f"{r['preprocess_ms']:.3f} | {r['tflops_with_preprocess']:.0f} [{r['tflops_with_preprocess_p10']:.0f}-"
                     f"{r['tflops_with_preprocess_p90']:.0f}] | {r['preprocess_ms_graph']:.3f} | "
                     f"{r['tflops_with_preprocess_graph']:.0f} | {r['rmse']:.3e} |")
    lines += ["", "prep = the fused Triton rotate-and-quantize of Q, K and V from BF16 (float32 path), timed the same "
              "way; `fused` rows add it. RMSE over "
              f"{sz.tp_rows} sampled query rows per head against float64 attention on the float64 draws "
              "(library distribution `outliers`, seed 1) whose BF16 cast the kernels read."]
    try:
        throughput_figure(results, out.dir / "accuracy_speed.png", (b, h, n, d))
        lines += ["", "![accuracy against speed](accuracy_speed.png)"]
    except Exception as exc:  # noqa: BLE001
        out.error("figure", exc)
    out.section("triton_throughput", "\n".join(lines))
    return results


def throughput_figure(results, path: Path, shape) -> None:
    """RMSE against TFLOP/s: one marker per (variant, causal), horizontal bars = 10-90% over repeats;
    filled = kernel only, hollow = with the fused preprocessing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    variants = list(dict.fromkeys(r["variant"] for r in results))
    colors = dict(zip(variants, plt.get_cmap("tab10").colors * 2))
    for ax, causal in zip(axes, (0, 1)):
        for r in (r for r in results if int(r["causal"]) == causal):
            c = colors[r["variant"]]
            x, lo, hi = float(r["tflops_kernel"]), float(r["tflops_kernel_p10"]), float(r["tflops_kernel_p90"])
            ax.errorbar([x], [float(r["rmse"])], xerr=[[x - lo], [hi - x]], fmt="o", color=c, ms=8, capsize=3,
                        label=r["variant"] if causal == 0 else None)
            if float(r["preprocess_ms"]) > 0:
                x2 = float(r["tflops_with_preprocess"])
                ax.errorbar([x2], [float(r["rmse"])], xerr=[[x2 - float(r["tflops_with_preprocess_p10"])],
                                                           [float(r["tflops_with_preprocess_p90"]) - x2]],
                            fmt="o", mfc="none", color=c, ms=9, capsize=3)
                ax.plot([x2, x], [float(r["rmse"])] * 2, color=c, lw=0.8, alpha=0.5)
        ax.set_yscale("log")
        ax.set_xlabel("TFLOP/s (filled: kernel only; hollow: with the fused rotate + quantize)")
        ax.set_title(f"{'causal' if causal else 'non-causal'}", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("RMSE vs float64 (log)")
    b, h, n, d = shape
    fig.suptitle(f"Accuracy vs speed on an NVIDIA H200: batch {b}, {h} heads, seqlen {n}, dim {d} "
                 f"(bars: 10-90% over repeats)", fontsize=11)
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "reports/h200/triton"))
    ap.add_argument("--parts", default="checks,quant,throughput,table3,validation")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; validation stops past its share")
    ap.add_argument("--grid", default="small")
    ap.add_argument("--val-seconds", type=float, default=0.0, help="seconds for the validation part (0: to --budget)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", default="full", choices=("full", "probe"),
                    help="quantsweep: every configuration, or the probe of where a 224-row block's time goes")
    ap.add_argument("--figure-from", default=None, help="only redraw the figure from a throughput.csv")
    args = ap.parse_args(argv)
    if args.figure_from:
        with open(args.figure_from) as f:
            throughput_figure(list(csv.DictReader(f)), Path(args.out) / "accuracy_speed.png", (4, 16, 8192, 128))
        return 0
    ensure_package()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Out(Path(args.out), REPORT_ORDER, numbers="results.json")
    sz = dataclasses.replace(TRITON_SIZES, grids=(args.grid,), tp_reps=args.reps)
    out.section("head", "# Triton FP8 kernels on the H200\n\nWritten by `tools/device/triton_h200.py "
                        f"--parts {args.parts}`; every number below was measured in this run.")
    parts = args.parts.split(",")
    try:
        environment(out, args)
    except Exception as exc:  # noqa: BLE001
        out.error("environment", exc)
    steps = {"checks": lambda: triton_checks(out, args, sz), "quant": lambda: triton_quantizer(out, args, sz),
             "tests": lambda: triton_tests(out, args, sz), "quantsweep": lambda: triton_quant_sweep(out, args, sz),
             "e2e": lambda: triton_throughput(out, args, sz, subset=True),
             "blockval": lambda: triton_block_validation(out, args, sz),
             "validation": lambda: triton_validation(out, args, sz, deadline=(time.perf_counter() + args.val_seconds)
                                                     if args.val_seconds else T0 + args.budget),
             "table3": lambda: triton_table3(out, args, sz), "throughput": lambda: triton_throughput(out, args, sz)}
    for p in parts:
        t = time.perf_counter()
        try:
            steps[p]()
        except Exception as exc:  # noqa: BLE001
            out.error(p, exc)
        out.timings.setdefault("part_seconds", {})[p] = round(time.perf_counter() - t, 1)
        out.save_timings()
        log(f"part {p} done in {time.perf_counter() - t:.1f} s")
    out.timings["total_seconds"] = round(time.perf_counter() - T0, 1)
    out.save_timings()
    log(f"done in {out.timings['total_seconds']} s; files {sorted(os.listdir(out.dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
