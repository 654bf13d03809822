"""One call on the H200: Table 3 on the FA3 kernel beside the emulator and the paper, the
validation grids (emulator vs kernel, per accumulator model), the command-line Table 3 timing
and the MMA model's speed.

Writes into ``--out`` (the device tool's $OUT), each file as soon as its part finishes, so a
timeout still returns what was done (at most 8 files come back):

- ``report.md``          the results tables (rewritten after every part)
- ``timings.json``       environment, wall times, per-case F
- ``table3_emulator.nc`` the paper-shape Table 3, 7 rows + the kernel's recipes, emulator on the GPU
- ``table3_hardware.nc`` the rows the hardware can run (fa3, sdpa-flash, sdpa-cudnn, sdpa-math)
- ``validation.nc``      F, bit-identical share and non-finite counts per case and accumulator
                          model, for the grids run (coordinate ``grid``: small, stress, captured)
- ``throughput.csv``, ``accuracy_speed.png`` (part ``throughput``, off by default: the numbers
  of the last run are kept in reports/h200/)

Run on the device machine with ``bash tools/device/h200.sh`` (carry .whl: the fa3-fwd and
h5netcdf wheels; the script installs them and the project). ``--mock`` runs every part on the
CPU at toy sizes with a float32 stand-in for the kernel (results labelled as such).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import (MOCK_SIZES, REPO, T0, Out, Sizes, ensure_package, log, median_seconds, paper_qkv, sync,
                    to_bshd, versions, write_csv)

REPORT_ORDER = ["head", "env", "table3", "table3_time", "cli", "table3_fp22", "validation", "mma", "throughput",
                "extra", "devices", "tests", "errors"]

# Recipes of the public kernel, beside the paper's rows.
BF16_SPEC = "qk=bf16,v=bf16,p=bf16,out=bf16,poff=0"
KERNEL_ROWS = ["fa3-fp8-kernel", "fa3-fp8-kernel-hadamard", "fa3-fp8-kernel,gran=tensor", BF16_SPEC]


def environment(out: Out, args, fa3_name: str) -> dict:
    import torch

    from fa3_numerics.engine.backends import available_backends, get_backend

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
           "device": args.device, "mock": args.mock, "host": platform.node()}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    env.update(versions(("xarray", "numpy", "h5netcdf", "seaborn", "fa3-fwd")))
    env["backends"] = available_backends(args.device)
    if not args.mock and env["backends"].get("fa3") is None:
        env.update(get_backend("fa3").provenance())
    env["fa3_backend_used"] = fa3_name
    try:
        from fa3_numerics.numerics.recipe import Recipe

        env["emulator_default_acc"] = Recipe().acc
        from fa3_numerics.engine.provenance import git_commit

        env["git_commit"] = git_commit()
    except Exception:  # noqa: BLE001
        pass
    out.timings["env"] = env
    out.save_timings()
    lines = ["## Environment", "", f"- device: {env.get('gpu', args.device)} (torch {env['torch']}, CUDA {env['cuda']}, "
             f"python {env['python']}); kernel: {env.get('kernel_module', fa3_name)} {env.get('kernel_version', '')}",
             f"- emulator default accumulator: `{env.get('emulator_default_acc')}`; git {env.get('git_commit')}",
             "- backends: " + "; ".join(f"`{k}` {'ok' if v is None else 'missing (' + v + ')'}"
                                        for k, v in env["backends"].items())]
    out.section("env", "\n".join(lines))
    log("env " + json.dumps({k: v for k, v in env.items() if k != "backends"}))
    return env


def experiment(variants, backend, device, sz: Sizes, rows=None):
    from fa3_numerics.studies.outliers import Experiment

    return Experiment(name="outliers", description="FA3 paper Table 3 at the paper's shape (device run)",
                      dist="outliers", variants=list(variants), params={}, seqlen=[sz.t3_seqlen], head_dim=[128],
                      causal=[False], batch=sz.t3_batch, heads=sz.t3_heads, kv_heads=0,
                      rows=sz.t3_rows if rows is None else rows, seeds=[0], backend=backend, device=device)


def run_exp(exp, device):
    from fa3_numerics.studies.outliers import run_experiment

    sync(device)
    t = time.perf_counter()
    ds = run_experiment(exp, cache_dir=None, progress=lambda m: log("  " + m))
    sync(device)
    return ds, time.perf_counter() - t


def table3(out: Out, args, sz: Sizes, fa3_name: str) -> None:
    from fa3_numerics.engine.dataset import summary_table, write
    from fa3_numerics.numerics.recipe import TABLE3
    from fa3_numerics.report.summary import text_table

    dev = args.device
    # Warm-up (CUDA context, cuBLAS handles) on a toy shape, so the timing below is the work.
    warm = dataclasses.replace(sz, t3_seqlen=256, t3_heads=2, t3_batch=1, t3_rows=64)
    run_exp(experiment(TABLE3, "emulate", dev, warm), dev)
    ds7, t7 = run_exp(experiment(TABLE3, "emulate", dev, sz), dev)
    log(f"Table 3, 7 rows + float64 reference, emulator on {dev}: {t7:.2f} s\n{text_table(ds7)}")
    out.timings["table3_seconds"] = {"rows": sz.t3_rows, "seconds": round(t7, 3),
                                     "shape": [sz.t3_batch, sz.t3_heads, sz.t3_seqlen, 128]}
    out.save_timings()
    emu_rows = {r["variant"]: r for r in summary_table(ds7)}
    # The kernel's own recipes, emulated on the same inputs and query rows.
    dsk, tk = run_exp(experiment(KERNEL_ROWS, "emulate", dev, sz), dev)
    emu_rows.update({r["variant"]: r for r in summary_table(dsk)})
    try:
        import xarray as xr

        write(xr.concat([ds7, dsk], dim="variant", data_vars="all", combine_attrs="override"), out.dir / "table3_emulator.nc")
    except Exception as exc:  # noqa: BLE001
        out.error("table3_emulator.nc", exc)
    # Hardware: every row a hardware backend can run.
    plan = [(fa3_name, ["fa3-fp8-no-block-quant"] + KERNEL_ROWS),
            ("sdpa-flash", ["fa2-fp16", "fa3-fp16"]),
            ("sdpa-cudnn", ["fa3-fp16"]),
            ("sdpa-math", ["baseline-fp16"])]
    hw_rows, hw_ds, skipped = [], [], []
    from fa3_numerics.engine.backends import get_backend

    for backend, variants in plan:
        why = get_backend(backend).check(dev)
        if why is not None:
            skipped.append(f"`{backend}`: {why}")
            continue
        try:
            ds, t = run_exp(experiment(variants, backend, dev, sz), dev)
        except Exception as exc:  # noqa: BLE001
            out.error(f"table3 on {backend}", exc)
            continue
        log(f"Table 3 rows on {backend} ({t:.1f} s):\n{text_table(ds)}")
        ds = ds.assign_coords(variant=[f"{backend}:{v}" for v in ds["variant"].values],
                              backend=("variant", [backend] * ds.sizes["variant"]))
        hw_ds.append(ds)
        for r in summary_table(ds):
            hw_rows.append({**r, "backend": backend, "variant": r["variant"].split(":", 1)[1]})
    if hw_ds:
        try:
            import xarray as xr

            write(xr.concat(hw_ds, dim="variant", data_vars="all", combine_attrs="drop_conflicts"), out.dir / "table3_hardware.nc")
        except Exception as exc:  # noqa: BLE001
            out.error("table3_hardware.nc", exc)
    refused = []
    fa3 = get_backend(fa3_name)
    for v in TABLE3:
        from fa3_numerics.numerics.recipe import PRESETS

        why = fa3.supports(PRESETS[v].recipe)
        if why:
            refused.append(f"- `{v}` on fa3: {why}")
    # Markdown.
    e = lambda x: "-" if x is None or not math.isfinite(x) else f"{x:.3e}"  # noqa: E731
    lines = [f"## Table 3 at the paper's shape (batch {sz.t3_batch}, {sz.t3_heads} heads, seqlen {sz.t3_seqlen}, "
             f"dim 128, non-causal, p 0.001, sigma 10, seed 0, {sz.t3_rows or 'all'} query rows per head)", "",
             "| row | paper | emulator | hardware backend | hardware RMSE | hardware / paper | emulator / hardware |",
             "|---|---|---|---|---|---|---|"]
    done_hw = {}
    for r in hw_rows:
        done_hw.setdefault(r["variant"], []).append(r)
    for v in list(TABLE3) + KERNEL_ROWS:
        er = emu_rows.get(v)
        paper = er["paper"] if er else float("nan")
        hws = done_hw.get(v) or [None]
        for h in hws:
            hv = h["value"] if h else float("nan")
            ratio = "-"
            if h and math.isfinite(paper) and paper:
                ratio = f"{hv / paper:.2f} ({'within' if abs(hv / paper - 1) <= 0.10 else 'NOT within'} 10%)"
            emu_hw = f"{er['value'] / hv:.3f}" if h and er and hv and math.isfinite(hv) else "-"
            lines.append(f"| `{v}` | {e(paper)} | {e(er['value'] if er else float('nan'))} | "
                         f"{h['backend'] if h else 'none (refused or skipped)'} | {e(hv)} | {ratio} | {emu_hw} |")
    lines += ["", "Rows the public FA3 kernel cannot run (refused with the reason, emulator only):", ""] + refused
    if skipped:
        lines += ["", "Backends skipped here:", ""] + [f"- {s}" for s in skipped]
    lines += ["", f"Hardware rows use the emulator's own rotation and quantization before the call (same FP8 bytes "
              f"and descales); `fa3-fp8-no-block-quant` = per-tensor descales + Hadamard, the one paper row the "
              f"kernel can run. `sdpa-flash` is PyTorch's FlashAttention-2. `{BF16_SPEC}` is FA3 BF16."]
    out.section("table3", "\n".join(lines))
    out.timings["table3_rows"] = {"emulator": {k: v["value"] for k, v in emu_rows.items()},
                                  "hardware": [{"backend": r["backend"], "variant": r["variant"], "rmse": r["value"],
                                                "paper": r["paper"]} for r in hw_rows]}
    # Where the time goes: drawing the inputs (on the device) and their |x| histogram.
    from fa3_numerics.data import distributions
    from fa3_numerics.engine.inputs import input_histogram

    sync(dev)
    tg = time.perf_counter()
    qkv = distributions.generate("outliers", distributions.AttnShape(sz.t3_batch, sz.t3_heads, sz.t3_seqlen, 128), 0,
                                 device=dev, p=0.001, sigma=10.0)
    sync(dev)
    t_gen = time.perf_counter() - tg
    input_histogram(*qkv)
    sync(dev)
    t_hist = time.perf_counter() - tg - t_gen
    del qkv
    out.timings["table3_seconds"].update({"generate_s": round(t_gen, 3), "histogram_s": round(t_hist, 3),
                                          "rng": distributions.rng_stream("outliers", dev)})
    out.section("table3_time", f"Paper-shape Table 3, all 7 rows + float64 reference, emulator on `{dev}`: "
                               f"**{t7:.2f} s** in process ({sz.t3_rows or 'all'} query rows per head), of which "
                               f"drawing Q, K, V (on `{dev}`, float64) takes {t_gen:.2f} s and their |x| histogram "
                               f"{t_hist:.2f} s (measured separately).")
    out.save_timings()


def table3_fp22(out: Out, args, sz: Sizes) -> None:
    """The FP8 kernel rows of Table 3 once more with the Hopper MMA model (acc=fp22)."""
    from fa3_numerics.engine.dataset import summary_table

    dev = args.device
    fp22_of = {v: f"{v},acc=fp22" for v in ["fa3-fp8-no-block-quant"] + KERNEL_ROWS[:3]}
    ds22, t22 = run_exp(experiment(list(fp22_of.values()), "emulate", dev, sz), dev)
    emu22 = {v: r["value"] for v, r in zip(fp22_of, summary_table(ds22))}
    log(f"emulator acc=fp22 rows ({t22:.1f} s): {emu22}")
    out.timings.setdefault("table3_rows", {})["emulator_fp22"] = emu22
    out.save_timings()
    hw = {r["variant"]: r["rmse"] for r in out.timings.get("table3_rows", {}).get("hardware", [])
          if r["backend"].startswith("fa3")}
    lines = [f"## Table 3 kernel rows with the emulator's Hopper MMA model (acc=fp22), same inputs and rows "
             f"({t22:.1f} s)", "", "| row | emulator acc=fp22 | FA3 kernel | emulator / kernel |", "|---|---|---|---|"]
    for v, x in emu22.items():
        k = hw.get(v)
        lines.append(f"| `{v}` | {x:.4e} | {'-' if k is None else f'{k:.4e}'} | "
                     f"{'-' if not k else f'{x / k:.4f}'} |")
    out.section("table3_fp22", "\n".join(lines))


def validation(out: Out, args, sz: Sizes, fa3_name: str, deadline: float) -> None:
    """The grids in ``sz.grids`` (small with the paper-shape cases, stress, and a capture's layers
    when ``--capture`` names one), each through the kernel and the emulator per accumulator
    model, into one validation.nc (coordinate ``grid``)."""
    import xarray as xr

    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.engine.dataset import write
    from fa3_numerics.report.validation import markdown_validation
    from fa3_numerics.studies.validate import Case, accumulator_ranking, captured_cases, grid, run_validation

    kernel = get_backend(fa3_name)
    why = kernel.check(args.device)
    if why is not None:
        out.section("validation", f"## Validation\n\nnot run: backend `{fa3_name}` cannot run here: {why}")
        return
    plan = []
    for name in sz.grids:
        if name == "captured":
            if args.capture and Path(args.capture).is_file():
                plan.append(("captured", captured_cases(args.capture, rows=args.capture_rows)))
            continue
        cases = grid(name)
        if name == "small" and sz.paper_cases:
            cases += [Case(seqlen=8192, heads=16, kv_heads=16, batch=2, rows=1024),
                      Case(seqlen=8192, heads=16, kv_heads=16, batch=2, gran="tensor", rot="hadamard", rows=1024)]
        plan.append((name, cases))
    sections, datasets = [], []
    out.timings["validation"] = {}
    for name, cases in plan:
        t = time.perf_counter()
        ds = run_validation(cases, device=args.device, kernel=kernel, progress=lambda m: log("  " + m),
                            deadline=deadline)
        rank = accumulator_ranking(ds)
        out.timings["validation"][name] = {
            "seconds": round(time.perf_counter() - t, 2), "ranking": rank,
            "cases": {str(c): {"F": {str(a): float(ds["fidelity"].sel(case=c, acc=a)) for a in ds["acc"].values},
                               "identical": {str(a): float(ds["identical"].sel(case=c, acc=a)) for a in ds["acc"].values},
                               "rmse_kernel": float(ds["rmse_kernel"].sel(case=c))}
                      for c in ds["case"].values}}
        out.save_timings()
        best = f"best accumulator model: `{rank[0]['acc']}` (max F {rank[0]['max_F']:.4f})" if rank else ""
        sections.append(f"## Validation grid `{name}`: emulator vs kernel\n\n{markdown_validation(ds)}\n{best}")
        out.section("validation", "\n\n".join(sections))
        log(f"validation {name} done; " + best)
        datasets.append(ds.assign_coords(grid=("case", [name] * ds.sizes["case"])))
        try:  # rewritten after every grid, so a timeout keeps the grids done
            merged = datasets[0] if len(datasets) == 1 else xr.concat(datasets, dim="case", data_vars="all",
                                                                      combine_attrs="drop_conflicts")
            write(merged, out.dir / "validation.nc")
        except Exception as exc:  # noqa: BLE001
            out.error("validation.nc", exc)


CLI_REPEATS = 5


def cli_table3(out: Out, args) -> None:
    """The paper-shape Table 3 with every query row as a user runs it: one process from the
    command line (interpreter start, imports, CUDA start, inputs drawn on the GPU, the float64
    reference and the seven rows, the dataset, summary and report), timed from outside, first
    run (cold file caches, bytecode compiled) then ``CLI_REPEATS`` more: the median of those is
    the figure. ``FA3N_TIMINGS=1`` makes each run print where its time went."""
    if not args.device.startswith("cuda"):
        return
    import statistics

    cmd = ["fa3-numerics", "run", "outliers", "--p", "0.001", "--device", "cuda", "--rows", "0",
           "--batch", "2", "--heads", "16", "--seqlen", "8192", "--out", "/tmp/t3cli", "--fresh"]
    env = dict(os.environ, FA3N_TIMINGS="1")
    times, phases = [], []
    for _ in range(1 + CLI_REPEATS):
        t = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        times.append(round(time.perf_counter() - t, 2))
        if res.returncode != 0:
            out.error("cli_table3", RuntimeError((res.stderr or res.stdout).strip().splitlines()[-1]))
            return
        phases.append(next((ln for ln in res.stderr.splitlines() if ln.startswith("timings:")), ""))
    warm = statistics.median(times[1:])
    log(f"command-line Table 3 (every row): {times} s\n" + "\n".join(phases) + f"\n{res.stdout}")
    out.timings["cli_table3_seconds"] = times
    out.timings["cli_table3_median_s"] = warm
    out.timings["cli_table3_phases"] = phases
    out.save_timings()
    best = phases[1 + times[1:].index(sorted(times[1:])[len(times[1:]) // 2])]
    out.section("cli", "## Table 3 from the command line, every query row\n\n"
                       f"`{' '.join(cmd)}`: **{warm:.2f} s** wall for the whole process, median of "
                       f"{CLI_REPEATS} runs after a first one ({', '.join(f'{t:.2f}' for t in times[1:])}; "
                       f"first {times[0]:.2f} s; target 5 s). Q, K and V are drawn on the GPU. Where the "
                       f"median run's time went (`FA3N_TIMINGS=1`): {best.removeprefix('timings: ')}."
                       f"\n\n```\n{res.stdout.strip()}\n```")


def mma_speed(out: Out, args) -> None:
    """The Hopper MMA model (acc=fp22) against the float32 emulator on the GPU, same inputs."""
    import torch

    from fa3_numerics.data import distributions
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.mma import device_mma
    from fa3_numerics.numerics.recipe import Recipe

    dev = args.device
    shape = distributions.AttnShape(2, 16, 8192, 128) if dev.startswith("cuda") else distributions.AttnShape(1, 2, 512, 128)
    q, k, v = distributions.generate("outliers", shape, 0, device=dev, p=0.001, sigma=10.0)
    rows = torch.arange(0, shape.seqlen, 8, device=dev)
    # Which implementation of the model runs: the one registered for CUDA (numerics.mma.DEVICE_MMA: the
    # Triton kernel of kernels/triton_/mma_model.py), the compiled C on the CPU, else the PyTorch reference.
    found = device_mma(dev)
    gpu = found is not None
    impl = f"registered device implementation `{found[0]}`" if gpu else (
        "compiled C (numerics/_native.c)" if dev == "cpu" else "PyTorch reference")
    res = {}
    for spec in ("fa3-fp8-kernel,acc=fp32", "fa3-fp8-kernel"):
        r = Recipe.from_str(spec)
        emulate(r, q, k, v, q_index=rows[:64])  # warm-up (on CUDA: compiles the Triton kernels)
        sync(dev)
        t = time.perf_counter()
        emulate(r, q, k, v, q_index=rows)
        sync(dev)
        res[spec] = round(time.perf_counter() - t, 3)
    ratio = res["fa3-fp8-kernel"] / res["fa3-fp8-kernel,acc=fp32"]
    stats = {}
    if gpu and found[0] == "triton":
        from fa3_numerics.kernels.triton_ import mma_model

        stats = dict(mma_model.STATS)
    out.timings["mma_speed"] = {"seconds": res, "ratio": round(ratio, 2), "rows": int(rows.numel()),
                                "shape": [shape.batch, shape.heads, shape.seqlen, shape.head_dim], "impl": impl,
                                "kernel_calls": stats}
    out.save_timings()
    out.section("mma", f"## The Hopper MMA model's cost on `{dev}`\n\n{shape.batch} x {shape.heads} heads, seqlen "
                       f"{shape.seqlen}, {rows.numel()} query rows: `fa3-fp8-kernel` (acc=fp22) "
                       f"{res['fa3-fp8-kernel']:.3f} s, `acc=fp32` {res['fa3-fp8-kernel,acc=fp32']:.3f} s: "
                       f"**{ratio:.2f}x** (target <= 3x). The model ran as the {impl}"
                       + (f" ({stats.get('calls', 0)} calls, {stats.get('fallbacks', 0)} handed to the reference)"
                          if gpu else "") + ".")
    log(f"mma speed {res} ratio {ratio:.2f} impl {impl} {stats}")


def throughput(out: Out, args, sz: Sizes, fa3_name: str) -> None:
    import torch

    from fa3_numerics.data.sampling import query_rows
    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.kernels.fa3 import Fa3Backend, fast_quantize, flash_attn
    from fa3_numerics.numerics.reference import reference_attention

    dev = args.device
    b, h, n, d = sz.tp_batch, sz.tp_heads, sz.tp_seqlen, 128
    flops = 4.0 * b * h * n * n * d
    scale = 1.0 / math.sqrt(d)
    fa3 = get_backend(fa3_name)
    fn = fa3.kernel_fn if isinstance(fa3, Fa3Backend) and fa3.kernel_fn is not None else None
    # The paper's distribution (seed 1), float64 on the device; the kernels read its BF16 cast in
    # (b, s, h, d) as a model hands it over, the reference the float64 draws.
    q64, k64, v64 = paper_qkv(b, h, n, d, 1, device=dev)
    rows = query_rows(n, sz.tp_rows, 1, device=dev)
    ref = reference_attention(q64, k64, v64, q_index=rows)
    qb, kb, vb = (to_bshd(x, torch.bfloat16) for x in (q64, k64, v64))
    del q64, k64, v64

    def rmse(o):
        o = o.transpose(1, 2).index_select(2, rows).to(torch.float64)
        return float(torch.sqrt(torch.mean((o - ref) ** 2)).item())

    results = []

    def prep(gran, rot):
        qq, qd = fast_quantize(qb, kv_heads=h, gran=gran, rot=rot, seed=0)
        kk, kd = fast_quantize(kb, kv_heads=h, gran=gran, rot=rot, seed=0)
        vv, vd = fast_quantize(vb, kv_heads=h, gran=gran, rot="none")
        return qq, kk, vv, (qd, kd, vd)

    fa3_ok = fa3.check(dev) is None
    variants = [("FA3 BF16", None, None), ("FA3 FP8 per-head", "head", "none"),
                ("FA3 FP8 per-head + Hadamard", "head", "hadamard"), ("FA3 FP8 per-tensor", "tensor", "none"),
                ("FA3 FP8 per-tensor + Hadamard", "tensor", "hadamard")]
    for label, gran, rot in variants if fa3_ok else []:
        try:
            if gran is None:
                call = lambda: flash_attn(qb, kb, vb, softmax_scale=scale, causal=False, fn=fn)  # noqa: E731
                t_pre = 0.0
            else:
                qq, kk, vv, ds = prep(gran, rot)
                call = lambda: flash_attn(qq, kk, vv, softmax_scale=scale, causal=False, descales=ds, fn=fn)  # noqa: E731,B023
                t_pre = median_seconds(lambda: prep(gran, rot), sz.tp_reps)  # noqa: B023
            err = rmse(call())
            t_k = median_seconds(call, sz.tp_reps)
            results.append({"variant": label, "backend": fa3_name, "rmse": err, "kernel_ms": t_k * 1e3,
                            "preprocess_ms": t_pre * 1e3, "tflops_kernel": flops / t_k / 1e12,
                            "tflops_with_preprocess": flops / (t_k + t_pre) / 1e12})
            log(f"throughput {results[-1]}")
        except Exception as exc:  # noqa: BLE001
            out.error(f"throughput {label}", exc)
    for backend, label in (("sdpa-cudnn", "SDPA cuDNN BF16"), ("sdpa-flash", "SDPA flash (FA2) BF16")):
        be = get_backend(backend)
        if be.check(dev) is not None:
            continue
        try:
            from torch.nn.attention import sdpa_kernel

            from fa3_numerics.kernels.sdpa import sdp_backend

            qt, kt, vt = (x.transpose(1, 2) for x in (qb, kb, vb))

            def call():
                with sdpa_kernel([sdp_backend(be.kind)]):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale).transpose(1, 2)

            err = rmse(call())
            t_k = median_seconds(call, sz.tp_reps)
            results.append({"variant": label, "backend": backend, "rmse": err, "kernel_ms": t_k * 1e3,
                            "preprocess_ms": 0.0, "tflops_kernel": flops / t_k / 1e12,
                            "tflops_with_preprocess": flops / t_k / 1e12})
            log(f"throughput {results[-1]}")
        except Exception as exc:  # noqa: BLE001
            out.error(f"throughput {label}", exc)
    out.timings["throughput"] = {"shape": [b, h, n, d], "causal": False, "flops": flops, "reps": sz.tp_reps,
                                 "input": "BF16 (b, s, h, d); FP8 variants quantize it (float32 math) first",
                                 "results": results}
    out.save_timings()
    if not results:
        out.section("throughput", "## Throughput\n\nno hardware variant could run here.")
        return
    write_csv(out.dir / "throughput.csv", results)
    lines = [f"## Throughput (batch {b}, seqlen {n}, {h} heads, dim {d}, non-causal; FLOPs = 4 b h n^2 d; "
             f"median of {sz.tp_reps} runs, CUDA events)", "",
             "| variant | backend | kernel ms | TFLOP/s (kernel) | our pre-processing ms | TFLOP/s (with it) | RMSE vs float64 |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['variant']} | `{r['backend']}` | {r['kernel_ms']:.3f} | {r['tflops_kernel']:.4g} | "
                     f"{r['preprocess_ms']:.3f} | {r['tflops_with_preprocess']:.4g} | {r['rmse']:.3e} |")
    lines += ["", "Pre-processing = our rotation (the random Hadamard matrix applied as one float32 matmul, TF32 off) and "
              "quantization (amax, scale, saturating e4m3 cast) of Q, K and V from BF16, timed the same way. "
              f"RMSE over {sz.tp_rows} sampled query rows per head against float64 attention on the float64 draws "
              "(library distribution `outliers`, seed 1) whose BF16 cast the kernels read."]
    try:
        figure(results, out.dir / "accuracy_speed.png", (b, h, n, d), args.mock)
        lines += ["", "![accuracy against speed](accuracy_speed.png)"]
    except Exception as exc:  # noqa: BLE001
        out.error("figure", exc)
    out.section("throughput", "\n".join(lines))


def figure(results, path: Path, shape, mock: bool) -> None:
    """RMSE against TFLOP/s, one colour per hardware variant; filled = kernel only, cross = with our
    rotation + quantization, joined by a line. Rerun from a throughput.csv: ``--figure-from CSV``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = []
    for r in results:
        rows.append({"variant": r["variant"], "TFLOP/s": float(r["tflops_kernel"]), "RMSE": float(r["rmse"]),
                     "timing": "kernel only"})
        if float(r["preprocess_ms"]) > 0:
            rows.append({"variant": r["variant"], "TFLOP/s": float(r["tflops_with_preprocess"]), "RMSE": float(r["rmse"]),
                         "timing": "with our rotation + quantization"})
    df = pd.DataFrame(rows)
    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(9.5, 5))
    palette = dict(zip(df["variant"].unique(), sns.color_palette("tab10", df["variant"].nunique())))
    for v, sub in df.groupby("variant", sort=False):
        if len(sub) > 1:
            ax.plot(sub["TFLOP/s"], sub["RMSE"], color=palette[v], lw=1, alpha=0.5, zorder=1)
    sns.scatterplot(data=df, x="TFLOP/s", y="RMSE", hue="variant", style="timing", palette=palette, s=120,
                    markers={"kernel only": "o", "with our rotation + quantization": "X"}, ax=ax, zorder=2)
    ax.set_yscale("log")
    b, h, n, d = shape
    ax.set_title(f"Accuracy vs speed{' (MOCK, not hardware)' if mock else ' on an NVIDIA H200'}: batch {b}, {h} heads, "
                 f"seqlen {n}, dim {d}, non-causal", fontsize=10)
    ax.set_ylabel("RMSE vs float64 (log)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def extra_all_rows(out: Out, args, sz: Sizes) -> None:
    """The paper-shape Table 3 with every query row (no sampling), timed."""
    from fa3_numerics.numerics.recipe import TABLE3
    from fa3_numerics.report.summary import text_table

    ds, t = run_exp(experiment(TABLE3, "emulate", args.device, sz, rows=0), args.device)
    log(f"Table 3 with every query row: {t:.2f} s\n{text_table(ds)}")
    out.timings["table3_all_rows_seconds"] = round(t, 3)
    out.timings["table3_all_rows"] = {str(v): float(ds["rmse"].sel(variant=v).pipe(lambda a: (a ** 2).mean() ** 0.5))
                                      for v in ds["variant"].values}
    out.save_timings()
    rows = " | ".join(f"`{k}` {v:.3e}" for k, v in out.timings["table3_all_rows"].items())
    out.section("extra", f"## Table 3 with every query row (emulator)\n\n{t:.2f} s for 7 rows + reference. RMSE: {rows}")


def emulator_devices(out: Out, args) -> None:
    """The same emulator code on CUDA and on the CPU, same inputs (TF32 off)."""
    import torch

    from fa3_numerics.data import distributions
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe, get_recipe

    if not args.device.startswith("cuda"):
        return
    shape = distributions.AttnShape(1, 2, 640, 128)
    q, k, v = distributions.generate("outliers", shape, 0, p=0.001, sigma=10.0)
    rows = torch.arange(640)
    res = {}
    for label, r in [("fa3-fp8", get_recipe("fa3-fp8").recipe), ("baseline-fp8", get_recipe("baseline-fp8").recipe),
                     ("fa3-fp8-kernel,acc=fp22", Recipe.from_str("fa3-fp8-kernel,acc=fp22")),
                     ("fa3-fp16", get_recipe("fa3-fp16").recipe)]:
        oc = emulate(r, q, k, v, q_index=rows)
        og = emulate(r, q.cuda(), k.cuda(), v.cuda(), q_index=rows.cuda()).cpu()
        res[label] = {"identical": float((oc == og).double().mean()), "max_abs_diff": float((oc - og).abs().max())}
    out.timings["emulator_cpu_vs_cuda"] = res
    out.save_timings()
    lines = ["## Emulator: the same code on CUDA and on the CPU (TF32 off; batch 1, 2 heads, seqlen 640, dim 128)", "",
             "| recipe | outputs identical | max abs difference |", "|---|---|---|"]
    lines += [f"| `{k}` | {v['identical']:.2%} | {v['max_abs_diff']:.2e} |" for k, v in res.items()]
    out.section("devices", "\n".join(lines))
    log(f"emulator cpu vs cuda: {res}")


def kernel_tests(out: Out, args) -> None:
    """The tests that need this machine, in this process: the FA3 kernel's (tests/kernels/test_kernels_fa3.py)
    and the Triton MMA model's bit-identity with the reference (tests/kernels/test_mma_triton.py)."""
    import pytest

    files = ["test_kernels_fa3.py", "test_mma_triton.py"]
    t = time.perf_counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-rs", *(str(REPO / "tests" / f) for f in files)])
    out.timings["kernel_tests"] = {"files": files, "exit_code": int(code), "seconds": round(time.perf_counter() - t, 2)}
    out.save_timings()
    out.section("tests", f"## tests/{' and tests/'.join(files)} on this machine\n\npytest exit code {int(code)} "
                         f"({'all passed' if int(code) == 0 else 'see log.txt'}).")


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "reports/h200"))
    ap.add_argument("--mock", action="store_true", help="CPU dry run: toy sizes, float32 stand-in for the kernel")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds; optional parts are skipped past it")
    ap.add_argument("--parts", default="table3,cli,validation,mma,table3_fp22,devices,tests",
                    help="comma list of: table3, cli, validation, mma, table3_fp22, throughput, extra, devices, tests")
    ap.add_argument("--grids", default=None, help="validation grids, comma separated (default: small,stress,captured "
                                                  "on the GPU, tiny with --mock)")
    ap.add_argument("--capture", default=".capture/smollm2.safetensors",
                    help="capture file for the `captured` grid (skipped when absent)")
    ap.add_argument("--capture-rows", type=int, default=0, help="query rows per layer of the capture (0 = all)")
    ap.add_argument("--figure-from", default=None, help="only redraw accuracy_speed.png (into --out) from a throughput.csv")
    args = ap.parse_args(argv)
    if args.figure_from:
        import csv

        with open(args.figure_from) as f:
            res = list(csv.DictReader(f))
        meta = json.loads((Path(args.figure_from).parent / "timings.json").read_text()).get("throughput", {})
        figure(res, Path(args.out) / "accuracy_speed.png", tuple(meta.get("shape", (4, 16, 8192, 128))), False)
        return 0
    ensure_package()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args.device = "cpu" if args.mock else "cuda"
    sz = MOCK_SIZES if args.mock else Sizes()
    if args.grids:
        sz = dataclasses.replace(sz, grids=tuple(args.grids.split(",")))
    out = Out(Path(args.out), REPORT_ORDER)
    fa3_name = "fa3-mock" if args.mock else "fa3"
    out.section("head", "# fa3-numerics on real hardware: Table 3, validation, throughput\n\n"
                        f"Written by `tools/device/h200.py`{' --mock (CPU dry run: NOT hardware results)' if args.mock else ''}.")
    deadline = T0 + args.budget
    parts = set(args.parts.split(","))
    try:
        environment(out, args, fa3_name)
    except Exception as exc:  # noqa: BLE001
        out.error("environment", exc)
    steps = [
        ("table3", lambda: table3(out, args, sz, fa3_name), None),
        ("throughput", lambda: throughput(out, args, sz, fa3_name), None),
        ("cli", lambda: cli_table3(out, args), 90),
        ("validation", lambda: validation(out, args, sz, fa3_name, deadline - 90), None),
        ("mma", lambda: mma_speed(out, args), 40),
        ("table3_fp22", lambda: table3_fp22(out, args, sz), 120),
        ("extra", lambda: extra_all_rows(out, args, sz), 60),
        ("devices", lambda: emulator_devices(out, args), 30),
        ("tests", lambda: kernel_tests(out, args), 0),
    ]
    for name, fn, margin in steps:
        if name not in parts:
            continue
        if margin is not None and time.perf_counter() > deadline - margin:
            log(f"skipping {name}: too close to the budget")
            out.timings.setdefault("skipped", []).append(name)
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            out.error(name, exc)
    out.timings["total_seconds"] = round(time.perf_counter() - T0, 2)
    out.save_timings()
    log(f"done in {out.timings['total_seconds']} s; files: {sorted(os.listdir(out.dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
