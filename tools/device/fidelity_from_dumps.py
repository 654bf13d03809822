"""Emulator fidelity against real FA3 kernel outputs captured by ``dump_fa3.py``.

For every dump file and every accumulator model it feeds the kernel's own FP8 inputs to the
emulator (recipe ``fa3-fp8-kernel,acc=MODEL``) and reports, over a seeded sample of query rows:

- F = RMSE(emulator, kernel) / RMSE(kernel, float64 reference) (``numerics.metrics.fidelity``).
  The reference is recomputed from the paper-distribution inputs the dump was made from (its
  config and seed, drawn by the library as dump_fa3.py draws them); those inputs must quantize
  to the dump's own FP8 bytes, else the dump was drawn another way (before dump_fa3.py used the
  library's distribution) and is refused.
- The share of BF16 outputs that are bit-identical to the kernel's.

Runs on the CPU (or ``--device cuda``) with no kernel needed, so the H200 is used only to
capture outputs::

    python tools/device/fidelity_from_dumps.py DUMP_DIR [--rows 64] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _paper_inputs(cfg: dict, t: dict, path: Path):
    """The float64 Q, K, V dump_fa3.py drew for ``cfg`` (``dump_fa3.make_qkv``), checked against the
    dump: quantized with the dump's descales they give its FP8 bytes, or the dump is refused."""
    from dump_fa3 import Config, make_qkv, quantize, to_kernel_layout, u8

    qkv = make_qkv(Config(**cfg))
    for name, x in zip("qkv", qkv):
        got = u8(to_kernel_layout(quantize(x, t[f"{name}_descale"])))
        if not torch.equal(got, t[f"{name}8"]):
            raise SystemExit(f"error: {path}: the inputs regenerated from its config do not quantize to its {name}8 "
                             "bytes; it was drawn another way (dump_fa3.py before it used the library's distribution); "
                             "capture it again with tools/device/dump_fa3.py")
    return qkv


def _dequantized(t: dict, name: str) -> torch.Tensor:
    x = t[name + "8"].view(torch.float8_e4m3fn).double().transpose(1, 2)
    d = t[name + "_descale"].double()
    return x * d.repeat_interleave(x.shape[1] // d.shape[1], dim=1)[:, :, None, None]


def evaluate(path: Path, models: list[str], rows: int, device: str) -> list[dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from fa3_numerics.data.sampling import query_rows
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.recipe import Recipe
    from fa3_numerics.numerics.reference import reference_attention

    t = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    cfg = json.loads(meta["config"])
    if meta.get("kernel_module") == "mock":
        raise SystemExit(f"error: {path} was written with a mock kernel; capture real outputs first")
    # Dequantized kernel inputs re-quantize to exactly the kernel's FP8 bytes and descales.
    q, k, v = (_dequantized(t, n).to(device) for n in ("q", "k", "v"))
    n = q.shape[2]
    idx = query_rows(n, rows, cfg["seed"], device=device)  # the studies' seeded sample (every row for 0)
    o_kernel = t["o_fp8"].transpose(1, 2).double().to(device)[:, :, idx]
    q64, k64, v64 = (x.to(device) for x in _paper_inputs(cfg, t, path))
    ref = reference_attention(q64, k64, v64, causal=cfg["causal"], q_index=idx)
    err_kernel = ((o_kernel - ref) ** 2).mean().sqrt().item()
    out = []
    for model in models:
        t0 = time.perf_counter()
        o = emulate(Recipe.from_str(f"fa3-fp8-kernel,acc={model}"), q, k, v, causal=cfg["causal"], q_index=idx)
        fid = fidelity(o, o_kernel, ref)
        f = fid["F"]
        out.append({"config": cfg["name"], "acc": model, "F": f, "bit_identical": fid["identical"],
                    "rmse_kernel": err_kernel, "outputs": o.numel(), "seconds": time.perf_counter() - t0})
        print(f"{cfg['name']:22s} acc={model:10s} F={f:.2e} bit-identical={out[-1]['bit_identical'] * 100:.3f}% "
              f"RMSE(kernel, fp64)={err_kernel:.3e} [{out[-1]['seconds']:.0f} s]", flush=True)
    return out, meta


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dumps", type=Path)
    ap.add_argument("--rows", type=int, default=64, help="query rows per head, seeded sample (0 = all)")
    ap.add_argument("--models", default="fp32,fp22,two-level")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    files = sorted(p for p in a.dumps.glob("fa3_s*.safetensors"))
    if not files:
        print(f"error: no fa3_s*.safetensors dumps in {a.dumps}; make them with tools/device/dump_fa3.py", file=sys.stderr)
        return 2
    rows, meta = [], {}
    for p in files:
        r, meta = evaluate(p, a.models.split(","), a.rows, a.device)
        rows += r
    if a.out:
        lines = [f"# Emulator fidelity against the FA3 FP8 kernel ({meta.get('device_name')}, {meta.get('kernel_dist')}, "
                 f"torch {meta.get('torch')})", "",
                 f"Kernel outputs captured with `tools/device/dump_fa3.py` on the GPU machine; compared here with "
                 f"`python tools/device/fidelity_from_dumps.py DUMPS --rows {a.rows}` (emulator on {a.device}, "
                 f"{a.rows or 'all'} seeded query rows per head, every head). F = RMSE(emulator, kernel) / "
                 f"RMSE(kernel, float64 reference on the unquantized inputs).", "",
                 "| config | accumulator model | F | bit-identical BF16 outputs | RMSE(kernel, fp64) | outputs compared |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['config']} | `{r['acc']}` | {r['F']:.2e} | {r['bit_identical'] * 100:.3f}% | "
                         f"{r['rmse_kernel']:.3e} | {r['outputs']} |")
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
