"""Capture FA3 kernel outputs on the data the toolkit exists for (heavy outliers, every head
dim, MQA, long BF16 rows) and BF16 probes, for offline fidelity work on the CPU.

Companion of ``dump_fa3.py`` (whose data layout and helpers it reuses): it adds

- FP8 stress configurations: p up to 0.05, sigma up to 300, head dims 96 and 192, one KV head
  (MQA), causal ragged lengths. Inputs are the e4m3 bytes and descales (stored) so the
  emulator sees exactly the kernel's inputs; the kernel's outputs must be finite.
- BF16 configurations up to seqlen 8192: the kernel on the BF16 casts of the float64 inputs,
  which are regenerated on the CPU from the stored config and seed (not stored).
- BF16 probes that isolate the two GEMMs of the BF16 path:
  ``b16_q0``: Q = 0, so every P~ is exactly 1 and O = bf16(sum_k V_kj / Sk) with Sk = 4096:
  the P.V accumulation of the BF16 tensor core (V columns of several magnitudes and signs);
  ``b16_sk1``: Sk = 1 and softmax scale 1, so the log-sum-exp output is S = q . k in float32:
  the Q.K^T accumulation.

At most 8 files of at most 16 MiB come back from the device tool; configurations are
grouped into few files. Run on the device machine (carry .whl with the fa3-fwd wheel)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 tools/device/dump_stress.py --out $OUT

``--mock`` runs the float32 stand-in on the CPU to check the script (files marked mock).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dump_fa3 import (INPUTS, Config, call_kernel, load_kernel, make_qkv, mock_attn, run_config, sync,  # noqa: E402
                      to_kernel_layout, u8)

FP8_CONFIGS = [
    Config("st_s2048_h4_d128_p05_s100", heads=4, p=0.05, sigma=100.0),
    Config("st_s2048_h4_d64_p01_s300_causal", heads=4, dim=64, p=0.01, sigma=300.0, causal=True),
    Config("st_s1000_h4_kv1_d96_p01_s30", seqlen=1000, heads=4, kv_heads=1, dim=96, p=0.01, sigma=30.0),
    Config("st_s777_h2_d192_p002_s15_causal", seqlen=777, heads=2, dim=192, p=0.002, sigma=15.0, causal=True),
    Config("st_s2048_h2_d256_p05_s300", heads=2, dim=256, p=0.05, sigma=300.0),
    Config("st_s4096_h2_kv1_d128_p01_s30", seqlen=4096, heads=2, kv_heads=1, p=0.01, sigma=30.0),
]
BF16_CONFIGS = [
    Config("b16_s8192_h2_d128", seqlen=8192, heads=2),
    Config("b16_s2048_h4_d128", heads=4),
    Config("b16_s4096_h2_d64_causal", seqlen=4096, heads=2, dim=64, causal=True),
]


def run_bf16(cfg: Config, fn, dev):
    t0 = time.perf_counter()
    q, k, v = make_qkv(cfg)
    qb, kb, vb = (to_kernel_layout(x.to(torch.bfloat16)).to(dev) for x in (q, k, v))
    sync(dev)
    t1 = time.perf_counter()
    o, lse = call_kernel(fn, qb, kb, vb, 1.0 / math.sqrt(cfg.dim), cfg.causal)
    sync(dev)
    again, _ = call_kernel(fn, qb, kb, vb, 1.0 / math.sqrt(cfg.dim), cfg.causal)
    out = {f"{cfg.name}/o": o.cpu().contiguous()}
    if lse is not None:
        out[f"{cfg.name}/lse"] = lse.float().cpu().contiguous()
    return out, {"kernel_s": time.perf_counter() - t1, "total_s": time.perf_counter() - t0,
                 "repeat_identical": bool(torch.equal(o, again))}


def bf16_probes(fn, dev, seed=7):
    """b16_q0 and b16_sk1 (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, t = {}, {}
    # q0: 1 x 128 queries x 8 heads, Sk = 4096, d = 128. Column scales spread over 2^-8..2^8 and
    # mixtures of signs; half the heads one sign only (the accumulator only grows).
    b, sq, h, sk, d = 1, 128, 8, 4096, 128
    scale_col = torch.exp2(torch.linspace(-8, 8, d, dtype=torch.float64))
    v = torch.randn(b, sk, h, d, generator=gen, dtype=torch.float64) * scale_col
    v[:, :, h // 2:] = v[:, :, h // 2:].abs()
    # a few columns with one large key among small ones, at different positions
    for j in range(0, d, 16):
        v[:, (j * 37) % sk, :, j] *= 512.0
    vb = v.to(torch.bfloat16)
    qb = torch.zeros(b, sq, h, d, dtype=torch.bfloat16)
    kb = torch.ones(b, sk, h, d, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    o, _ = call_kernel(fn, qb.to(dev), kb.to(dev), vb.to(dev), 1.0 / math.sqrt(d), False)
    sync(dev)
    t["b16_q0_s"] = time.perf_counter() - t0
    tensors["b16_q0/v"] = vb.contiguous()
    tensors["b16_q0/o"] = o[:, :1].cpu().contiguous()  # every query row is the same
    # sk1: 1 x 2048 queries x 4 heads, Sk = 1, d = 128, scale 1: lse = S (fp32).
    b, sq, h, sk, d = 1, 2048, 4, 1, 128
    spread = torch.exp2(torch.randint(-6, 7, (b, sq, h, d), generator=gen).to(torch.float64))
    qb = (torch.randn(b, sq, h, d, generator=gen, dtype=torch.float64) * spread).to(torch.bfloat16)
    kb = (torch.randn(b, sk, h, d, generator=gen, dtype=torch.float64) * 4.0).to(torch.bfloat16)
    vb = torch.randn(b, sk, h, d, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    t0 = time.perf_counter()
    o, lse = call_kernel(fn, qb.to(dev), kb.to(dev), vb.to(dev), 1.0, False)
    sync(dev)
    t["b16_sk1_s"] = time.perf_counter() - t0
    tensors.update({"b16_sk1/q": qb.contiguous(), "b16_sk1/k": kb.contiguous()})
    if lse is not None:
        tensors["b16_sk1/lse"] = lse.float().cpu().contiguous()
    return tensors, t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "fa3_stress_dumps"))
    ap.add_argument("--mock", action="store_true")
    args = ap.parse_args(argv)
    from safetensors.torch import save_file

    os.makedirs(args.out, exist_ok=True)
    fn, modname = load_kernel(args.mock)
    dev = torch.device("cuda" if modname != "mock" else "cpu")
    fn = fn or mock_attn
    meta = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version(),
            "kernel_module": modname, "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    print("versions", json.dumps(meta), flush=True)
    groups: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    timings: dict[str, dict] = {}
    for i, cfg in enumerate(FP8_CONFIGS):
        try:
            tensors, m, t = run_config(cfg, fn, dev)
        except Exception as exc:  # noqa: BLE001 - keep the others going
            print(f"{cfg.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        # the BF16 run on the same inputs belongs to another study; keep the FP8 part
        keep = {f"{cfg.name}/{k}": v for k, v in tensors.items() if "bf16" not in k}
        groups.setdefault(f"fp8_{i // 2}", {}).update(keep)
        configs[cfg.name] = asdict(cfg)
        timings[cfg.name] = t
        o = tensors["o_fp8"].float()
        print(f"{cfg.name}: fp8 {t['fp8_s'] * 1e3:.1f} ms, non-finite outputs {int((~torch.isfinite(o)).sum())}, "
              f"repeat identical {t['repeat_identical']}", flush=True)
    for cfg in BF16_CONFIGS:
        try:
            tensors, t = run_bf16(cfg, fn, dev)
        except Exception as exc:  # noqa: BLE001
            print(f"{cfg.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        groups.setdefault("bf16", {}).update(tensors)
        configs[cfg.name] = asdict(cfg)
        timings[cfg.name] = t
        print(f"{cfg.name}: bf16 {t['kernel_s'] * 1e3:.1f} ms, repeat identical {t['repeat_identical']}", flush=True)
    try:
        tensors, t = bf16_probes(fn, dev)
        groups["probes_bf16"] = tensors
        timings["probes_bf16"] = t
        print(f"bf16 probes: {json.dumps(t)}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"bf16 probes: FAILED {type(exc).__name__}: {exc}", flush=True)
    total = 0
    for name, tensors in groups.items():
        path = os.path.join(args.out, f"stress_{name}.safetensors")
        md = dict(meta, configs=json.dumps(configs), timings=json.dumps(timings),
                  fp8_storage="q8/k8/v8: uint8 view of float8_e4m3fn bytes, (b, s, h, d)", inputs=INPUTS)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=md)
        total += os.path.getsize(path)
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.2f} MiB)", flush=True)
    print(f"total {total / 2**20:.2f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
