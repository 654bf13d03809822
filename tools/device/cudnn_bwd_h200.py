"""cuDNN's FP8 attention backward (cudnn-frontend ``sdpa_fp8_backward``) against the emulated ``cudnn-fp8``
preset on an H200, and the kernel's inputs and outputs saved for fitting offline.

For each case (the FA3 paper's outliers and the k-bias family, seqlens 1024 / 2048, head dims 128 and 64,
causal and not, one GQA case) and each FP8 format arm of the backward (``--arms``: dO format : gradient
format; ``e4m3:e4m3`` is cuDNN's own benchmark, ``e5m2:e5m2`` TransformerEngine's HYBRID format,
``e4m3:bf16`` gradients unquantized where cuDNN takes them):

1. Q, K, V float64 from the library's family on the CPU (``torch.Generator().manual_seed(seed)``), dO
   N(0, 1) from ``seed * 1000003 + 29`` (as ``run backward`` draws it), all moved to the GPU;
2. per-tensor FP8 inputs as a user (and TransformerEngine's current scaling) makes them: descale =
   amax / max in float64 rounded to float32 (``quant.amax_to_scale``), codes = saturating cast of x /
   descale; E4M3 Q, K, V; dO in the arm's format;
3. the kernel: ``sdpa_fp8`` training forward (Stats written) twice, the second with scale_o = 1 /
   descale_o from the first's Amax_O; ``sdpa_fp8_backward`` three times: scale_dP = 1 to read Amax_dP,
   then scale_dP = max / Amax_dP (the dO format's max) to read Amax_dQ/dK/dV, then scale_dQ/dK/dV =
   max / Amax (FP8 gradients; one call less for BF16 ones);
4. the emulator on the very same FP8 values (dequantized, float64), ``cudnn-fp8-kernel`` in the arm's
   formats (``arm_recipe``): the preset's backward from the
   kernel's own O and Stats (``kfwd``: the backward alone) at ``bwd.acc`` fp32 and fp22, and forward +
   backward from the emulator's own forward (``own``);
5. F = RMSE(emulator, kernel) / RMSE(kernel, fp64) per output (O, dQ, dK, dV; ``metrics.fidelity``),
   fp64 = float64 autograd of exact attention (``backward_reference``) on the original inputs
   (``F``) and on the FP8 inputs (``F_q``, the emulator's own reference point).

Written to ``--out`` after every case: ``cudnn_bwd_h200.json`` (every number, scale and amax),
``report.md`` (the F table), and ``cudnn_bwd_cases.npz`` (the first ``--save`` cases' FP8 inputs, their
descales, the kernel's O / Stats / dQ / dK / dV bytes and scales, per arm; <= 12 MB, checked) so the
preset can be fitted offline. A cuDNN refusal of an arm or case is recorded, not fatal.

``--only NAME,...`` runs chosen cases, ``--seeds 0,1`` each at several seeds (seed s > 0 adds ``-s<s>`` to
the name), and ``--save-cases NAME[@ARM+ARM],...`` (or ``all``) saves exactly those case-arms, one file per
case (``cudnn_bwd_<case>.npz``, '/' written '-'; one file per arm where a case's arms together pass the
limit) instead of ``--save``'s one file. E.g. the bytes of the re-run's misses, at its seed and a new one::

    python3 tools/device/cudnn_bwd_h200.py --out "$OUT" --only k-bias-n1024-d128-full,outliers-n2048-d128-full \
        --seeds 0,1 --arms e4m3:e4m3,e5m2:e5m2 --save-cases all

Device call (from the checkout's root, .whl/ carried; ~1-2 minutes after the wheels install)::

    source tools/device/setup_device.sh && python3 tools/device/cudnn_bwd_h200.py --out "$OUT"

``--dry`` runs the whole plumbing on the CPU at small sizes with a stand-in kernel built from the
emulator itself (the ``kfwd`` fp32 variant must then give F < 0.01: a check of the decoding, scales and
files), and exits non-zero if it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import Out, log  # noqa: E402

NPZ_LIMIT = 12 << 20
ARM_FORMATS = (("e4m3", "e5m2"), ("e4m3", "e5m2", "bf16"))


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    seqlen: int
    head_dim: int
    causal: bool
    heads: int = 4
    kv_heads: int = 4
    seed: int = 0

    @property
    def base(self) -> str:
        return f"{self.family}-n{self.seqlen}-d{self.head_dim}-{'causal' if self.causal else 'full'}"

    @property
    def name(self) -> str:
        # seed 0 keeps the name the first runs' files carry
        return f"{self.base}-h{self.heads}/{self.kv_heads}" + (f"-s{self.seed}" if self.seed else "")

    def matches(self, spec: str) -> bool:
        """``spec`` names this case: its base (``k-bias-n1024-d128-full``, every seed), with the heads, or whole."""
        return spec in (self.base, f"{self.base}-h{self.heads}/{self.kv_heads}", self.name)


# the first three (two heads, n = 1024) are the ones saved to the .npz
CASES = (
    Case("outliers", 1024, 128, False, heads=2, kv_heads=2),
    Case("outliers", 1024, 128, True, heads=2, kv_heads=2),
    # non-causal k-bias: rows whose largest P is ~0.1, where P's scale in the backward shows
    Case("k-bias", 1024, 128, False, heads=2, kv_heads=2),
    # cuDNN 9.19 declines head dim 64 on Hopper (kept: the refusal is recorded)
    Case("outliers", 2048, 64, True),
    Case("k-bias", 2048, 128, True),
    Case("sink-tokens", 1024, 128, False),
    Case("outliers", 2048, 128, False),
    Case("outliers", 1024, 128, True, heads=8, kv_heads=2),
)


@dataclasses.dataclass(frozen=True)
class Arm:
    do: str
    grad: str

    @property
    def name(self) -> str:
        return f"{self.do}:{self.grad}"


def parse_arms(text: str) -> list[Arm]:
    arms = []
    for part in text.split(","):
        do, _, grad = part.strip().partition(":")
        if do not in ARM_FORMATS[0] or grad not in ARM_FORMATS[1]:
            raise SystemExit(f"error: arm {part!r}: dO format e4m3|e5m2 : gradient format e4m3|e5m2|bf16")
        arms.append(Arm(do, grad))
    return arms


def arm_recipe(arm: Arm, acc: str, preset: str = "cudnn-fp8-kernel"):
    """``preset`` (its forward: cuDNN's Hopper forward, E4M3 O scaled from Amax_O, fp22) with the
    backward formats of ``kernels.cudnn.bwd_formats`` for the arm, at ``bwd.acc`` ``acc``."""
    from fa3_numerics.kernels.cudnn import bwd_formats
    from fa3_numerics.numerics.recipe import get_recipe

    return dataclasses.replace(get_recipe(preset).recipe, **bwd_formats(arm.do, arm.grad), bwd_acc=acc)


def select_cases(only: str, seeds: str, save_cases: str, n_cases: int, arms: list[Arm]):
    """The cases to run (``--only`` or the first ``n_cases``, each at every seed) and, for ``--save-cases``,
    {case name: arms to save, [] = every arm}. Names that match nothing are an error, not a silent skip."""
    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --seeds {seeds!r}: integers, comma-separated") from None
    if not seed_list or any(x < 0 for x in seed_list):
        raise SystemExit(f"error: --seeds {seeds!r}: one or more integers >= 0")
    if only:
        base = []
        for spec in (x.strip() for x in only.split(",") if x.strip()):
            hit = [c for c in CASES if c.matches(spec)]
            if not hit:
                raise SystemExit(f"error: --only {spec!r} names no case; cases: {', '.join(c.name for c in CASES)}")
            base += [c for c in hit if c not in base]
    else:
        base = list(CASES[:n_cases])
    cases = [dataclasses.replace(c, seed=sd) for c in base for sd in seed_list]
    save: dict[str, list[str]] = {}
    if save_cases == "all":
        save = {c.name: [] for c in cases}
    elif save_cases:
        run_arms = {x.name for x in arms}
        for spec in (x.strip() for x in save_cases.split(",") if x.strip()):
            name, _, arm_text = spec.partition("@")
            chosen = [x for x in arm_text.split("+") if x]
            bad = [x for x in chosen if x not in run_arms]
            if bad:
                raise SystemExit(f"error: --save-cases {spec!r}: arms {bad} are not among --arms {sorted(run_arms)}")
            hit = [c for c in cases if c.matches(name)]
            if not hit:
                raise SystemExit(f"error: --save-cases {spec!r} names no case that runs; running: "
                                 f"{', '.join(c.name for c in cases)}")
            for c in hit:
                every = not chosen or save.get(c.name, None) == []
                save[c.name] = [] if every else sorted(set(save.get(c.name, [])) | set(chosen))
    return cases, save


# -- inputs ---------------------------------------------------------------------------------------


def case_inputs(case: Case):
    from fa3_numerics.data import distributions

    shape = distributions.AttnShape(1, case.heads, case.seqlen, case.head_dim, kv_heads=case.kv_heads)
    q, k, v = distributions.generate(case.family, shape, case.seed, device="cpu")
    g = torch.Generator().manual_seed(case.seed * 1000003 + 29)
    do = torch.randn(q.shape, generator=g, dtype=torch.float64)
    return q, k, v, do


def per_tensor(x: torch.Tensor, fmt: str):
    """(codes, descale, dequantized float64): ``kernels.cudnn.per_tensor_fp8`` (the library's rule)."""
    from fa3_numerics.kernels.cudnn import per_tensor_fp8

    codes, descale = per_tensor_fp8(x, fmt)
    return codes, descale, codes.to(torch.float64) * descale


def cudnn_kernel(ins: dict, case: Case, arm: Arm, scale: float) -> dict:
    """cuDNN's training forward and sdpa_fp8_backward (``kernels.cudnn.fp8_fwd_bwd``)."""
    from fa3_numerics.kernels import cudnn as kc

    return {**kc.fp8_fwd_bwd(ins, case.causal, scale, arm.do, arm.grad), "engine": "cuDNN library"}


def standin_kernel(ins: dict, case: Case, arm: Arm, scale: float) -> dict:
    """The dry run's kernel: the same call sequence on ``kernels.cudnn.EmulatedGraphs``."""
    from fa3_numerics.kernels import cudnn as kc

    res = kc.fp8_fwd_bwd(ins, case.causal, scale, arm.do, arm.grad, graphs=kc.EmulatedGraphs)
    return {**res, "engine": kc.EmulatedGraphs.ENGINE}


# -- one case --------------------------------------------------------------------------------------


def run_case(case: Case, arms: list[Arm], dev: str, kernel, variants, deadline: float) -> tuple[dict, dict]:
    from fa3_numerics.kernels.cudnn import decode, p_scales
    from fa3_numerics.numerics.backward import Forward, backward_from, emulate_backward
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.recipe import get_recipe

    q, k, v, do = case_inputs(case)
    scale = 1.0 / math.sqrt(case.head_dim)
    qkv = {x: per_tensor(t, "e4m3") for x, t in (("q", q), ("k", k), ("v", v))}
    ref = dict(zip(("o", "dq", "dk", "dv"), (t.to(dev) for t in reference_gradients(
        q.to(dev), k.to(dev), v.to(dev), do.to(dev), causal=case.causal))))
    scale_s, descale_s = p_scales(get_recipe("cudnn-fp8-fwd").recipe)
    row = {"case": case.name, **dataclasses.asdict(case), "softmax_scale": scale, "arms": {}}
    saved = {"q": qkv["q"][0], "k": qkv["k"][0], "v": qkv["v"][0],
             "descales_qkv": np.array([qkv[x][1] for x in "qkv"], dtype=np.float32)}
    for arm in arms:
        t0 = time.perf_counter()
        do8, descale_do, do_val = per_tensor(do, arm.do)
        ins = {x: qkv[x][0].to(dev) for x in "qkv"}
        ins.update({f"descale_{x}": qkv[x][1] for x in "qkv"})
        ins.update({f"{x}_val": qkv[x][2].to(dev) for x in "qkv"})
        ins.update({"dO": do8.to(dev), "descale_dO": descale_do, "dO_val": do_val.to(dev), "scale_s": scale_s,
                    "descale_s": descale_s})
        entry = {"seconds": {}}
        row["arms"][arm.name] = entry
        try:
            res = kernel(ins, case, arm, scale)
        except Exception as exc:  # noqa: BLE001 - cuDNN's refusals are its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            entry["kernel_error"] = f"{type(exc).__name__}: {first}"
            log(f"{case.name} {arm.name}: kernel refused: {entry['kernel_error']}")
            continue
        entry["seconds"]["kernel"] = round(time.perf_counter() - t0, 2)
        sc = res["scalars"]
        ker = {"o": decode(res["o_raw"], sc["scale_o"]), "dq": decode(res["dq_raw"], sc["scale_dQ"]),
               "dk": decode(res["dk_raw"], sc["scale_dK"]), "dv": decode(res["dv_raw"], sc["scale_dV"])}
        bad = {name: int((~torch.isfinite(x)).sum()) for name, x in ker.items()}
        entry.update({"scalars": sc, "amax": res["amax"], "engine": res["engine"], "descale_dO": descale_do,
                      "nonfinite_kernel": bad})
        if any(bad.values()):
            log(f"NON-FINITE kernel output {case.name} {arm.name}: {bad}")
        saved[f"{arm.name}/do"] = do8
        for name in ("o_raw", "stats", "dq_raw", "dk_raw", "dv_raw"):
            saved[f"{arm.name}/{name}"] = res[name]
        saved[f"{arm.name}/scalars"] = json.dumps(sc)
        qv, kv_, vv, dov = ins["q_val"], ins["k_val"], ins["v_val"], ins["dO_val"]
        ref_q = dict(zip(("o", "dq", "dk", "dv"), reference_gradients(qv, kv_, vv, dov, causal=case.causal)))
        entry["kernel_vs_fp64"] = {g: float((ker[g] - ref[g]).pow(2).mean().sqrt()) for g in ker}
        entry["variants"] = {}
        for fwd_kind, acc in variants:
            vname = f"{fwd_kind}/{acc}"
            if time.perf_counter() > deadline:
                entry["variants"][vname] = {"skipped": "time budget"}
                continue
            t1 = time.perf_counter()
            r = arm_recipe(arm, acc)
            try:
                if fwd_kind == "kfwd":
                    lse = res["stats"].reshape(ker["o"].shape[:3]).to(torch.float32)
                    gr = backward_from(r, qv, kv_, vv, Forward(ker["o"], lse), dov, causal=case.causal,
                                       softmax_scale=scale)
                    emu = {"o": ker["o"], "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
                else:
                    gr = emulate_backward(r, qv, kv_, vv, dov, causal=case.causal, softmax_scale=scale)
                    emu = {"o": gr.forward.o, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
            except Exception as exc:  # noqa: BLE001 - one variant failing keeps the others
                entry["variants"][vname] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                log(f"{case.name} {arm.name} {vname}: emulator failed: {exc}")
                continue
            fid = {}
            for g in ("o", "dq", "dk", "dv"):
                f = fidelity(emu[g], ker[g], ref[g])
                fq = fidelity(emu[g], ker[g], ref_q[g])
                fid[g] = {"F": f["F"], "F_q": fq["F"], "identical": f["identical"], "rmse_diff": f["rmse_diff"],
                          "rmse_kernel": f["rmse_kernel"], "rmse_kernel_q": fq["rmse_kernel"],
                          "rmse_emulator": float((emu[g] - ref[g]).pow(2).mean().sqrt())}
            entry["variants"][vname] = {"recipe": r.short_str(), "fidelity": fid,
                                        "seconds": round(time.perf_counter() - t1, 2)}
            log(f"{case.name} {arm.name} {vname}: F dq {fid['dq']['F']:.4f} dk {fid['dk']['F']:.4f} "
                f"dv {fid['dv']['F']:.4f} o {fid['o']['F']:.4f}")
    return row, saved


# -- files -----------------------------------------------------------------------------------------


def _np(x):
    if isinstance(x, str):
        return np.array(x)
    if isinstance(x, np.ndarray):
        return x
    x = x.detach().cpu()
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.view(torch.uint8).numpy()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy()
    return x.numpy()


NPZ_LAYOUT = ("[B, H, N, D] contiguous; FP8 as uint8 (float8_e4m3fn / float8_e5m2 bytes: dO and the "
              "gradients in the arm's format, key '<arm>/...'), BF16 as int16 bits; stats float32 "
              "[B, H, N, 1] natural-log LSE; true value = code * descale (inputs) or code / scale "
              "(kernel outputs, scales in '<arm>/scalars')")


def _npz_bytes(items: list[tuple[Case, dict]], rows: list[dict]) -> bytes:
    meta = {"cases": [dataclasses.asdict(c) | {"name": c.name} for c, _ in items], "layout": NPZ_LAYOUT,
            "rows": rows}
    arrays = {"meta": np.array(json.dumps(meta, default=str))}
    for c, d in items:
        arrays.update({f"{c.name}/{k}": _np(v) for k, v in d.items()})
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _arms_of(d: dict) -> list[str]:
    return sorted({k.split("/")[0] for k in d if ":" in k.split("/")[0]})


def file_slug(text: str) -> str:
    # the device tool brings back only names of letters, digits, '.', '_' and '-'
    return "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in text)


def write_case_npz(folder: Path, case: Case, d: dict, row: dict) -> list[tuple[str, int]]:
    """One saved case as ``cudnn_bwd_<case>.npz`` (the layout of ``write_npz``, one case), written whole;
    past NPZ_LIMIT one file per arm instead (``..._<arm>.npz``, the inputs in each), so that no arm is
    dropped to fit. Returns (file name, bytes) of what was written."""
    from fa3_numerics.files import atomic_write

    whole = _npz_bytes([(case, d)], [row])
    arms = _arms_of(d)
    if len(whole) <= NPZ_LIMIT or len(arms) < 2:
        parts = [(f"cudnn_bwd_{file_slug(case.name)}.npz", whole)]
    else:
        inputs = {k: v for k, v in d.items() if ":" not in k.split("/")[0]}
        parts = [(f"cudnn_bwd_{file_slug(case.name)}_{file_slug(arm)}.npz",
                  _npz_bytes([(case, inputs | {k: v for k, v in d.items() if k.startswith(arm + "/")})], [row]))
                 for arm in arms]
    written = []
    for fname, data in parts:
        if len(data) > NPZ_LIMIT:
            log(f"NOT SAVED: {fname} is {len(data)} bytes, over the {NPZ_LIMIT}-byte limit")
            continue
        atomic_write(folder / fname, data)
        written.append((fname, len(data)))
    return written


def write_npz(path: Path, saved: list[tuple[Case, dict]], rows: list[dict]) -> int:
    """The saved cases as one compressed .npz (keys ``<case>/<name>``; FP8 as uint8 bytes, BF16 as int16
    bits), written whole; arms are dropped from the last case backwards past NPZ_LIMIT. Returns bytes."""
    from fa3_numerics.files import atomic_write

    items = [(c, dict(d)) for c, d in saved]
    while True:
        data = _npz_bytes(items, rows)
        if len(data) <= NPZ_LIMIT or not items:
            break
        c, d = items[-1]
        arm_keys = _arms_of(d)
        if len(arm_keys) > 1:
            drop = arm_keys[-1]
            items[-1] = (c, {k: v for k, v in d.items() if not k.startswith(drop + "/")})
        else:
            items.pop()
    atomic_write(path, data)
    return len(data)


def report_table(rows: list[dict]) -> str:
    lines = ["## F = RMSE(emulator, kernel) / RMSE(kernel, fp64) (fp64 on the original inputs; F_q on the FP8 "
             "inputs in the JSON)", "",
             "| case | arm | emulator | F O | F dQ | F dK | F dV | bit-identical dQ |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for arm, e in row["arms"].items():
            if "kernel_error" in e:
                lines.append(f"| {row['case']} | {arm} | kernel refused: `{e['kernel_error'][:120]}` | | | | | |")
                continue
            for vname, var in e.get("variants", {}).items():
                if "fidelity" not in var:
                    lines.append(f"| {row['case']} | {arm} | {vname}: {var.get('skipped') or var.get('error')} "
                                 "| | | | | |")
                    continue
                f = var["fidelity"]
                lines.append(f"| {row['case']} | {arm} | {vname} | {f['o']['F']:.4f} | {f['dq']['F']:.4f} | "
                             f"{f['dk']['F']:.4f} | {f['dv']['F']:.4f} | {100 * f['dq']['identical']:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--arms", default="e4m3:e4m3,e5m2:e5m2,e4m3:bf16",
                    help="dO format : gradient format, comma-separated")
    ap.add_argument("--variants", default="kfwd/fp32,kfwd/fp22,own/fp22",
                    help="emulator variants: kfwd (from the kernel's O and Stats) or own (its own forward) / bwd.acc")
    ap.add_argument("--cases", type=int, default=len(CASES), help="how many of the cases, in order")
    ap.add_argument("--save", type=int, default=3, help="how many of the first cases go to the .npz")
    ap.add_argument("--only", default="", help="run only these cases, comma-separated, in the table's order: a "
                    "name without heads and seed (k-bias-n1024-d128-full), with heads (...-h2/2) or whole")
    ap.add_argument("--seeds", default="0", help="each chosen case at each of these seeds, comma-separated")
    ap.add_argument("--save-cases", default="", help="save exactly these case-arms, each to its own .npz "
                    "(cudnn_bwd_<case>.npz, per arm past the size limit) instead of --save's one file: "
                    "NAME (every arm run) or NAME@ARM[+ARM], comma-separated, NAME as for --only, or 'all'")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds; no emulator variant starts after it")
    ap.add_argument("--dry", action="store_true", help="CPU plumbing check with a stand-in kernel, small sizes")
    a = ap.parse_args(argv)
    try:
        arms = parse_arms(a.arms)
        variants = [tuple(v.split("/")) for v in a.variants.split(",")]
        if any(len(v) != 2 or v[0] not in ("kfwd", "own") or v[1] not in ("fp32", "fp22") for v in variants):
            raise SystemExit(f"error: --variants {a.variants!r}: kfwd|own / fp32|fp22, comma-separated")
        cases, save_arms = select_cases(a.only, a.seeds, a.save_cases, a.cases, arms)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    out = Out(Path(a.out), ["head", "table", "errors"], numbers="cudnn_bwd_h200.json")
    if a.dry:
        dev, kernel = "cpu", standin_kernel
        small = [dataclasses.replace(c, seqlen=256, heads=min(c.heads, 2), kv_heads=min(c.kv_heads, 2))
                 for c in (cases if a.only else cases[:3])]
        save_arms = {s.name: save_arms[c.name] for c, s in zip(cases, small) if c.name in save_arms}
        cases = small
        device = "cpu (dry run, stand-in kernel)"
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device; run this on the H200 with the device tool, or pass --dry", file=sys.stderr)
            return 2
        from fa3_numerics.kernels.cudnn import kernel_problem, load_kernel

        why = kernel_problem("cuda")
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
        dev, kernel = "cuda", cudnn_kernel
        device = f"{torch.cuda.get_device_name()}, {load_kernel()[1]}"
    out.timings = {"device": device, "torch": torch.__version__, "arms": [x.name for x in arms],
                   "variants": ["/".join(v) for v in variants], "rows": []}
    out.section("head", f"# cuDNN FP8 backward against the cudnn-fp8 preset\n\nDevice: {device}; torch "
                        f"{torch.__version__}; arms (dO:gradients) {', '.join(x.name for x in arms)}.")
    deadline = time.perf_counter() + a.budget
    saved = []
    nonfinite = 0
    for i, case in enumerate(cases):
        log(f"case {case.name}")
        try:
            row, keep = run_case(case, arms, dev, kernel, variants, deadline)
        except Exception as exc:  # noqa: BLE001 - the next case still runs
            out.error(case.name, exc)
            continue
        out.timings["rows"].append(row)
        nonfinite += sum(sum(e.get("nonfinite_kernel", {}).values()) for e in row["arms"].values())
        if a.save_cases:
            if case.name in save_arms:
                chosen = save_arms[case.name] or [x.name for x in arms]
                d = {k: v for k, v in keep.items() if ":" not in k.split("/")[0] or k.split("/")[0] in chosen}
                missing = [x for x in chosen if x not in _arms_of(d)]
                if missing:
                    log(f"{case.name}: arms {missing} not saved (the kernel refused them)")
                for fname, size in write_case_npz(Path(a.out), case, d, row):
                    out.timings.setdefault("npz_files", {})[fname] = size
                    log(f"saved {fname}: {size} bytes")
        elif i < a.save:
            saved.append((case, keep))
            size = write_npz(Path(a.out) / "cudnn_bwd_cases.npz", saved, out.timings["rows"])
            out.timings["npz_bytes"] = size
        out.save_timings()
        out.section("table", report_table(out.timings["rows"]))
    if nonfinite:
        log(f"NON-FINITE: {nonfinite} kernel output values are NaN/Inf (see nonfinite_kernel in the JSON)")
        return 3
    if a.dry:
        worst = [var["fidelity"][g]["F"] for row in out.timings["rows"] for e in row["arms"].values()
                 for vn, var in e.get("variants", {}).items() if vn == "kfwd/fp32" and "fidelity" in var
                 for g in ("dq", "dk", "dv")]
        sizes = list(out.timings.get("npz_files", {}).values()) or [out.timings.get("npz_bytes", NPZ_LIMIT + 1)]
        ok = bool(worst) and max(worst) < 0.01 and max(sizes) <= NPZ_LIMIT
        log(f"dry run: kfwd/fp32 against its own stand-in: max F {max(worst) if worst else 'none'} "
            f"(must be < 0.01: codes written x * scale_dX by the stand-in and x / descale by the emulator differ by one code in a few positions), npz {sizes} bytes: {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
