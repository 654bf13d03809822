"""Fit the arithmetic of the field's kernels from the dumps of ``tools/device/dump_field.py`` (CPU).

    python tools/fit_field.py DUMPS cudnn|cudnn-tie|torchao|sdpa|sdpa-gqa|fixture|fixture-sdpa|fixture-sdpa-gqa|fixture-sdpa-rescale|fixture-tie [--rows N] [--models a,b]

``cudnn-tie`` (part cudnn-tie's constructed one-key rows): per run and scale_o, the model's O codes on the
probe rows against the kernel's, and for each row that differs where its O sits from the E4M3 tie.

For each dumped case it prints F = RMSE(model, kernel) / RMSE(kernel, float64) and the share of
bit-identical outputs for each candidate model; for cuDNN also the share of outputs whose float32
value (bracketed by the several scale_o roundings of the same O) contains the model's.
The float64 reference comes from the case's seed (``dump_field.Case.qkv``: the library's CPU draw);
the regenerated inputs must give the dump's FP8 bytes, else the file is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "device"))

E4M3 = torch.float8_e4m3fn


def load(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


def groups(t: dict) -> dict[str, dict]:
    out: dict = {}
    for k, v in t.items():
        tag, name = k.split("/", 1)
        out.setdefault(tag, {})[name] = v
    return out


def f8(x: torch.Tensor) -> torch.Tensor:
    return x.view(E4M3).to(torch.float64)


def fidelity(model: torch.Tensor, kernel: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (model.double() - kernel.double()).pow(2).mean().sqrt().item()
    r = (kernel.double() - ref.double()).pow(2).mean().sqrt().item()
    return {"F": d / r if r else math.nan, "identical": (model.double() == kernel.double()).double().mean().item(),
            "rmse_kernel": r, "rmse_model": (model.double() - ref.double()).pow(2).mean().sqrt().item()}


# ----------------------------------------------------------------------------- E4M3 rounding cells

def _e4m3_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).to(torch.float64)
    return torch.unique(codes[torch.isfinite(codes)])


_VALS = _e4m3_values()


def rounding_cell(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] of the reals that round (nearest) to each E4M3 value in v (float64); the largest
    finite value's cell is open above (the kernel saturates)."""
    i = torch.searchsorted(_VALS, v.contiguous())
    lo = torch.where(i > 0, (_VALS[(i - 1).clamp_min(0)] + v) / 2, torch.full_like(v, -math.inf))
    hi = torch.where(i < len(_VALS) - 1, (_VALS[(i + 1).clamp_max(len(_VALS) - 1)] + v) / 2,
                     torch.full_like(v, math.inf))
    return lo, hi


def bracket(o8s: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The interval of O that every (code, scale_o) pair allows: O * scale_o rounds to the code."""
    lo_all, hi_all = None, None
    for j in range(o8s.shape[0]):
        lo, hi = rounding_cell(f8(o8s[j]))
        s = float(scales[j])
        lo, hi = lo / s, hi / s
        lo_all = lo if lo_all is None else torch.maximum(lo_all, lo)
        hi_all = hi if hi_all is None else torch.minimum(hi_all, hi)
    return lo_all, hi_all


# ----------------------------------------------------------------------------- cuDNN

def cudnn_cases(dumps: Path):
    """The cuDNN forward cases of a dump folder: part ``cudnn`` (one file), parts ``cudnn-more`` and
    ``cudnn-gqa`` (one file per case), whichever the folder holds."""
    from dump_field import CUDNN_CASES, CUDNN_GQA, CUDNN_MORE

    meta = json.loads((dumps / "dump_field.json").read_text())
    if "cudnn" in meta:
        t, _ = load(dumps / "cudnn_fwd.safetensors")
        info, g = meta["cudnn"]["cases"], groups(t)
        for c in CUDNN_CASES:
            yield c, g[c.name], info[c.name]
    if "cudnn-more" in meta:
        info = meta["cudnn-more"]["cases"]
        for c in CUDNN_MORE:
            t, _ = load(dumps / f"cudnn_{c.name}.safetensors")
            yield c, groups(t)[c.name], info[c.name]
    if "cudnn-gqa" in meta:
        info = meta["cudnn-gqa"]["cases"]
        for c, _, _ in CUDNN_GQA:
            if c.name in info:
                t, _ = load(dumps / f"cudnn_{c.name}.safetensors")
                yield c, groups(t)[c.name], info[c.name]
    if not {"cudnn", "cudnn-more", "cudnn-gqa"} & set(meta):
        raise SystemExit(f"error: {dumps} holds no cuDNN forward dump (parts cudnn, cudnn-more or cudnn-gqa of "
                         "dump_field.py)")


def cudnn_ref_inputs(c, case: dict):
    """float64 Q, K, V of the case, checked against the dump's FP8 bytes (the backend's prepare)."""
    from dump_field import cudnn_inputs

    q, k, v = c.qkv()
    _, ins = cudnn_inputs(q, k, v, c.causal, torch.device("cpu"))
    for name in "qkv":
        if not torch.equal(ins[name].view(torch.uint8), case[f"{name}8"]):
            raise SystemExit(f"error: case {c.name}: the regenerated inputs do not give the dump's {name}8 bytes")
    return q, k, v


def _scores(case: dict, info: dict, causal: bool) -> torch.Tensor:
    """S as the graph defines it: (Q8 K8^T) in float32, times attn_scale, descale_q, descale_k (one
    float32 multiply each, in the graph's order), -inf above the diagonal when causal."""
    q8, k8 = f8(case["q8"]).float(), f8(case["k8"]).float()
    s = torch.matmul(q8, k8.transpose(-1, -2))
    for name in ("attn_scale", "descale_q", "descale_k"):
        s = s * torch.tensor(info[name], dtype=torch.float32)
    if causal:
        n, nk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, nk, dtype=torch.bool).tril(), -math.inf)
    return s


def _pv(p8: torch.Tensor, v8: torch.Tensor, acc: str) -> torch.Tensor:
    if acc == "fp32":
        return torch.matmul(p8, v8)
    from fa3_numerics.numerics.formats import get_format
    from fa3_numerics.numerics.mma import hopper_mma

    e4 = get_format("e4m3")
    return hopper_mma(p8.contiguous(), v8.contiguous(), a_fmt=e4, b_fmt=e4)


def two_pass(case: dict, info: dict, causal: bool, *, acc: str = "fp32", div: str = "div") -> torch.Tensor:
    """The graph taken literally: P = softmax(S) normalised in float32, P8 = e4m3(P scale_s),
    O = (P8 V8) descale_s descale_v: float32 O before its E4M3 cast."""
    s = _scores(case, info, causal)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    p = e / l if div == "div" else e * (1.0 / l)
    p8 = (p * torch.tensor(info["scale_s"], dtype=torch.float32)).clamp(-448, 448).to(E4M3).float()
    o = _pv(p8, f8(case["v8"]).float(), acc)
    return o * torch.tensor(info["descale_s"], dtype=torch.float32) * torch.tensor(info["descale_v"],
                                                                                  dtype=torch.float32)


def one_pass(case: dict, info: dict, causal: bool, *, acc: str = "fp32", l_from: str = "p") -> torch.Tensor:
    """P~ = exp(S - rowmax) (the row's final max, as a flash loop whose max never moves), P8 =
    e4m3(P~ scale_s), O = (P8 V8) descale_s descale_v / l, l the sum of P~ (``l_from="p"``) or of
    the cast P8 / scale_s (``"p8"``)."""
    s = _scores(case, info, causal)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    p8 = (e * torch.tensor(info["scale_s"], dtype=torch.float32)).clamp(-448, 448).to(E4M3).float()
    l = e.sum(-1, keepdim=True) if l_from == "p" else p8.sum(-1, keepdim=True) * torch.tensor(
        info["descale_s"], dtype=torch.float32)
    o = _pv(p8, f8(case["v8"]).float(), acc)
    return o * torch.tensor(info["descale_s"], dtype=torch.float32) * torch.tensor(info["descale_v"],
                                                                                  dtype=torch.float32) / l


CANDIDATES = {
    "one-pass": lambda case, info, c: one_pass(case, info, c),
    "one-pass-l8": lambda case, info, c: one_pass(case, info, c, l_from="p8"),
    "two-pass": lambda case, info, c: two_pass(case, info, c),
    "two-pass-rcp": lambda case, info, c: two_pass(case, info, c, div="rcp"),
    "two-pass-fp22": lambda case, info, c: two_pass(case, info, c, acc="fp22"),
}


def _emulated_o32(recipe_text: str, q, k, v, causal):
    """The emulator's float32 O before the output cast (the recipe with out=fp32, oscale=none)."""
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe, get_recipe

    import dataclasses

    r = get_recipe("cudnn-fp8-fwd").recipe if recipe_text == "preset" else Recipe.from_str(recipe_text)
    r = dataclasses.replace(r, out="fp32", oscale="none")
    return emulate(r, q, k, v, causal=causal).float()


def _codes_at(recipe_text: str, q, k, v, causal, scale_o: float) -> torch.Tensor:
    """The model's O codes at the kernel's scale_o: with smath=cudnn the scale folded into each row's
    factor as cuDNN does (keys/smath.py), else the float32 O times scale_o."""
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe, get_recipe

    import dataclasses

    r = get_recipe("cudnn-fp8-fwd").recipe if recipe_text == "preset" else Recipe.from_str(recipe_text)
    if r.smath == "cudnn":
        y = emulate(dataclasses.replace(r, out="fp32", oscale="none"), q, k, v, causal=causal, scale_o=scale_o)
    else:
        y = _emulated_o32(recipe_text, q, k, v, causal) * scale_o
    return y.float().clamp(-448, 448).to(E4M3).view(torch.uint8)


def score_o32(o32: torch.Tensor, case: dict, info: dict, lo, hi, ref) -> dict:
    """A model's float32 O against the kernel: inside the bracket, codes at the backend's scale_o."""
    so = float(case["scale_o"][0])
    codes = (o32 * so).clamp(-448, 448).to(E4M3)
    kernel = f8(case["o8"][0]) * info["descale_o"]
    model = codes.to(torch.float64) * info["descale_o"]
    fid = fidelity(model, kernel, ref)
    o = o32.double()
    fid["inside"] = ((o >= lo) & (o <= hi)).double().mean().item()
    fid["codes"] = (codes.view(torch.uint8) == case["o8"][0]).double().mean().item()
    fid["rel_to_mid"] = (((o - (lo + hi) / 2).abs()) / (hi - lo).clamp_min(1e-30)).median().item()
    return fid


OLD_CUDNN = "gran=tensor,poff=8.80735,acc=fp22,out=e4m3,oscale=amax"  # the preset before the fit


def cudnn_table(dumps: Path, specs: dict[str, str]) -> list[dict]:
    """Per case and spec: F as ``validate`` computes it (the emulator's own O, its own amax scale,
    against the kernel's O8 times the kernel's descale_o) and the share of O's E4M3 codes equal to
    the kernel's at the kernel's scale_o."""
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe
    from fa3_numerics.numerics.reference import reference_attention

    rows = []
    for c, case, info in cudnn_cases(dumps):
        q, k, v = cudnn_ref_inputs(c, case)
        ref = reference_attention(q, k, v, causal=c.causal)
        kernel = f8(case["o8"][0]) * info["descale_o"]
        row = {"case": c.name, "seed": c.seed, "rmse_kernel": None}
        for label, spec in specs.items():
            o = emulate(Recipe.from_str(spec), q, k, v, causal=c.causal)
            fid = fidelity(o, kernel, ref)
            codes = _codes_at(spec, q, k, v, c.causal, float(case["scale_o"][0]))
            diff = int((codes != case["o8"][0]).sum())
            row.update({f"F_{label}": fid["F"], f"codes_differing_{label}": diff, "codes": codes.numel(),
                        "rmse_kernel": fid["rmse_kernel"]})
        rows.append(row)
        print(row, flush=True)
    return rows


def run_cudnn(a) -> int:
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe, get_recipe
    from fa3_numerics.numerics.reference import reference_attention

    if a.table:
        from fa3_numerics.numerics.recipe import get_recipe

        cudnn_table(a.dumps, {"before": OLD_CUDNN, "after": get_recipe("cudnn-fp8-fwd").recipe.short_str()})
        return 0
    models = a.models.split(";") if a.models else ["preset"]
    for c, case, info in cudnn_cases(a.dumps):
        if a.cases and c.name not in a.cases.split(","):
            continue
        q, k, v = cudnn_ref_inputs(c, case)
        ref = reference_attention(q, k, v, causal=c.causal)
        o8s, scales = case["o8"], case["scale_o"]
        kernel = f8(o8s[0]) * info["descale_o"]
        lo, hi = bracket(o8s, scales)
        print(f"{c.name} (seed {c.seed}): amax_s {info['amax_s_first']:.6g} amax_o {info['amax_o_first']:.6g}; "
              f"bracket width / |O| median {((hi - lo) / kernel.abs().clamp_min(1e-30)).median():.3g}")
        info = dict(info, attn_scale=info["attn_scale"])
        for m in models:
            if m in CANDIDATES:
                o32 = CANDIDATES[m](case, info, c.causal)
            else:
                o32 = _emulated_o32(m, q, k, v, c.causal)
            fid = score_o32(o32, case, info, lo, hi, ref)
            print(f"  {m:40s} F {fid['F']:.4f} codes {fid['codes']:.1%} inside {fid['inside']:.1%} "
                  f"|o-mid|/width {fid['rel_to_mid']:.2f} rmse kernel {fid['rmse_kernel']:.3e} model {fid['rmse_model']:.3e}")
    return 0


# ----------------------------------------------------------------------------- cuDNN tie probes

def _e4m3_midpoints() -> torch.Tensor:
    return (_VALS[1:] + _VALS[:-1]) / 2


def tie_distance(x: torch.Tensor) -> torch.Tensor:
    """|x| minus the nearest E4M3 midpoint (a tie of round-to-nearest), in float32 ulps of x: 0 on a
    tie, +-1 one ulp above or below it."""
    mids = _e4m3_midpoints()
    ax = x.abs().double()
    i = torch.searchsorted(mids, ax.contiguous()).clamp(1, len(mids) - 1)
    lo, hi = mids[i - 1], mids[i]
    near = torch.where((ax - lo).abs() <= (hi - ax).abs(), lo, hi)
    ulp = (torch.nextafter(x.abs().float(), torch.tensor(math.inf)) - x.abs().float()).double()
    return (ax - near) / ulp.clamp_min(1e-45)


def tie_runs(dumps: Path):
    """(tag, tensors, info) of each run of part cudnn-tie that the folder holds."""
    meta = json.loads((dumps / "dump_field.json").read_text())
    if "cudnn-tie" not in meta:
        raise SystemExit(f"error: {dumps} holds no cudnn-tie dump (part cudnn-tie of dump_field.py)")
    cache: dict = {}
    for tag, info in meta["cudnn-tie"]["cases"].items():
        if "error" in info:
            print(f"{tag}: not run on the device: {info['error']}")
            continue
        f = info["file"]
        if f not in cache:
            cache[f] = groups(load(dumps / f)[0])
        yield tag, cache[f][tag], info


def run_cudnn_tie(a) -> int:
    """Per tie run: the regenerated inputs checked against the dump's bytes, the model's float32 O
    (the preset, or --models) on the 128 probe rows, its codes at every dumped scale_o against the
    kernel's; per row that differs anywhere: its margin, level, spread, the dominant key's position, how
    far the model's O scale_o sits from the tie (float32 ulps) and both codes. Stats: the kernel's LSE
    against the model's."""
    from dump_field import TIE_ROWS, tie_inputs
    from fa3_numerics.numerics.emulator import emulate
    from fa3_numerics.numerics.recipe import Recipe, get_recipe

    import dataclasses

    models = a.models.split(";") if a.models else ["preset"]
    total: dict = {}
    for tag, t, info in tie_runs(a.dumps):
        if a.cases and tag not in a.cases.split(","):
            continue
        q, k, v, intended, rows = tie_inputs(info["nk"], info["positions"], info["attn_scale"],
                                             info["descale_v_requested"], info["seed"])
        for name, ref in (("q8", intended["q8"][:, :, :TIE_ROWS]), ("k8", intended["k8"]), ("v8", intended["v8"])):
            if not torch.equal(f8(t[name]), ref):
                raise SystemExit(f"error: {tag}: the regenerated inputs do not give the dump's {name} bytes")
        idx = torch.arange(TIE_ROWS)
        kernel = t["o8"]  # [scales, B, H, rows, D] uint8
        print(f"{tag}: nk {info['nk']} positions {info['positions']} attn_scale {info['attn_scale']:.9g} "
              f"descale_v {info['descale_v']:.9g} amax_s(kernel) {info['amax_s_first']:.9g} "
              f"amax_o {info['amax_o_first']:.9g}; repeats equal {all(info['repeat_rows_equal'])}, "
              f"train O = inference O {info.get('train_o_equals_inference_o')}")
        for m in models:
            r = get_recipe("cudnn-fp8-fwd").recipe if m == "preset" else Recipe.from_str(m)
            r = dataclasses.replace(r, out="fp32", oscale="none")
            st: dict = {}
            o32 = emulate(r, q, k, v, softmax_scale=info["attn_scale"], q_index=idx, stats=st).float()
            diff_rows: dict = {}
            line = []
            for j, (so, label) in enumerate(zip(info["scale_o"], info["scale_o_labels"])):
                if r.smath == "cudnn":  # cuDNN folds scale_o into each row's factor: O * scale_o as it forms it
                    x = emulate(r, q, k, v, softmax_scale=info["attn_scale"], q_index=idx, scale_o=so).float()
                else:
                    x = o32 * torch.tensor(so, dtype=torch.float32)
                codes = x.clamp(-448, 448).to(E4M3).view(torch.uint8)
                d = codes != kernel[j]
                near = tie_distance(x).abs() <= 2  # the cells l's last bits decide
                line.append(f"{label} {int(d.sum())} (near a tie {int(near.sum())}, of them differing "
                            f"{int((d & near).sum())})")
                total[(m, label)] = total.get((m, label), 0) + int(d.sum())
                for bi, h, i, c in d.nonzero().tolist():
                    diff_rows.setdefault((h, i), []).append(
                        (label, c, float(x[bi, h, i, c]), float(tie_distance(x[bi, h, i, c:c + 1])[0]),
                         float(f8(codes[bi, h, i, c])), float(f8(kernel[j, bi, h, i, c]))))
            print(f"  {m}: codes differing per scale_o: " + ", ".join(line))
            if "stats" in t and "lse" in st:
                dl = (st["lse"].double() - t["stats"][:, :, :TIE_ROWS].double())
                print(f"  {m}: LSE model - kernel: max |d| {dl.abs().max():.3e}, rows equal "
                      f"{(dl == 0).double().mean():.1%}")
            # rows whose differing codes sit nearest a tie first: those are what phase 2 fits
            order = sorted(diff_rows.items(), key=lambda kv: min(abs(it[3]) for it in kv[1]))
            for (h, i), items in order[: a.rows or 40]:
                rw = rows[i]
                lab, c, x, dist, mc, kc = min(items, key=lambda it: abs(it[3]))
                print(f"    head {h} (dominant key {info['positions'][h]}) row {i}: margin {rw['margin_log2']:.4g} "
                      f"level {rw['level_log2']:.4g} spread {rw['spread']}; {len(items)} codes differ, nearest a tie "
                      f"{lab} col {c}: model O*scale_o {x:.9g} ({dist:+.2f} ulp from a tie) -> {mc:g}, kernel {kc:g}")
    if total:
        print("codes differing over all runs: " + ", ".join(f"{m} {lab} {n}" for (m, lab), n in total.items()))
    return 0


# ----------------------------------------------------------------------------- torchao

def _from_codes(codes: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """float64 inputs that the emulator's per-(batch, kv-head) quantizer turns back into exactly
    ``codes`` ([B, H, S, D] uint8) and ``descale`` ([B, Hkv])."""
    x = f8(codes)
    g = x.shape[1] // descale.shape[1]
    return x * descale.double().repeat_interleave(g, dim=1)[:, :, None, None]


def run_torchao(a) -> int:
    import dataclasses

    from dump_field import TORCHAO_CASES
    from fa3_numerics.kernels.torchao import kernel_inputs
    from fa3_numerics.numerics.emulator import emulate, prepare
    from fa3_numerics.numerics.recipe import Recipe, get_recipe
    from fa3_numerics.numerics.reference import reference_attention

    meta = json.loads((a.dumps / "dump_field.json").read_text())["torchao"]["cases"]
    tensors = {}
    for name in ("torchao_n1000.safetensors", "torchao_d64.safetensors"):
        tensors.update(groups(load(a.dumps / name)[0]))
    preset = get_recipe("torchao-fp8").recipe
    models = a.models.split(";") if a.models else ["fa3-fp8-kernel,acc=fp22"]
    for c in TORCHAO_CASES:
        t, info = tensors[c.name], meta[c.name]
        q, k, v = c.qkv()
        qb, kb, vb = (x.double() for x in kernel_inputs(preset, q, k, v))
        n = q.shape[2]
        rows = torch.arange(n) if not a.rows else torch.randperm(n, generator=torch.Generator().manual_seed(c.seed))[
            :a.rows].sort().values
        ref = reference_attention(q, k, v, causal=c.causal, q_index=rows)
        o_views = t["o_views"].double()[:, :, rows]
        o_contig = t["o_contig"].double()[:, :, rows]
        pre = prepare(preset, q, k, v, q_index=torch.arange(n), causal=c.causal, cache={})
        print(f"{c.name} (seed {c.seed}): views == contiguous {info['views_equal_contiguous']}, "
              f"views == num_splits 1 {info['views_equal_num_splits_1']}, num_chunks=1 {info['num_chunks_1']}")
        for nm, codes, ds in (("q", t["q8"], t["q_descale"]), ("k", t["k8"], t["k_descale"]),
                              ("v", t["v8"], t["v_descale"])):
            emu = getattr(pre, nm)
            emu_codes = emu.values.to(E4M3).view(torch.uint8)
            g = emu.values.shape[1] // ds.shape[1]
            emu_ds = emu.descale.reshape(emu.descale.shape[0], -1)[:, ::g] if emu.descale.numel() > 1 else emu.descale
            diff = (emu_codes != codes)
            where = diff.nonzero()
            print(f"  {nm}: codes differing {int(diff.sum())} of {diff.numel()}"
                  + (f" (first at {where[0].tolist()}: emulator {f8(emu_codes[tuple(where[0])]).item()} "
                     f"torchao {f8(codes[tuple(where[0])]).item()})" if len(where) else "")
                  + f"; descales equal {torch.equal(emu_ds.float().reshape(-1), ds.float().reshape(-1))}"
                  + f" (torchao {ds.reshape(-1)[:2].tolist()} emulator {emu_ds.reshape(-1)[:2].tolist()})")
        # the FA3 model fed torchao's own bytes, against the kernel on them
        q8, k8, v8 = (_from_codes(t[f"{nm}8"], t[f"{nm}_descale"]) for nm in "qkv")
        for m in models:
            r = Recipe.from_str(m)
            o = emulate(r, q8, k8, v8, causal=c.causal, q_index=rows)
            for label, ker in (("views", o_views), ("contig", o_contig)):
                fid = fidelity(o, ker, ref)
                print(f"  {m} on torchao's bytes vs kernel {label}: F {fid['F']:.4f} identical {fid['identical']:.1%}")
        o = emulate(preset, q, k, v, causal=c.causal, q_index=rows)
        fid = fidelity(o, o_views, ref)
        print(f"  torchao-fp8 preset on the inputs vs kernel views: F {fid['F']:.4f} identical {fid['identical']:.1%}")
    return 0


# ----------------------------------------------------------------------------- SDPA backward

OLD_SDPA = "fa3-bf16-bwd-bf16,bm=128,bn=64,order=forward,bwd.bm=64,bwd.bn=128"  # reports/h200/backward's check


def sdpa_end_to_end(t: dict, c, spec: str, bwd_spec: str | None = None) -> dict:
    """F of O, dQ, dK, dV of the recipe's own forward and backward (as backward_h200.py's check) against
    the kernel's: {name: fidelity dict}. ``bwd_spec``: the backward's recipe where it differs."""
    from fa3_numerics.numerics.backward import backward_from, run_forward
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from fa3_numerics.numerics.recipe import Recipe

    q, k, v, do = (t[x].double() for x in ("q", "k", "v", "do"))
    ref = dict(zip(("o", "dq", "dk", "dv"), reference_gradients(q, k, v, do, causal=c.causal)))
    fwd = run_forward(Recipe.from_str(spec), q, k, v, causal=c.causal)
    gr = backward_from(Recipe.from_str(bwd_spec or spec), q, k, v, fwd, do, causal=c.causal)
    got = {"o": gr.forward.o, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
    out = {nm: fidelity(got[nm], t[nm], ref[nm]) for nm in got}
    for nm in ("dq", "dk", "dv"):
        out[nm]["worst_row"] = worst_row(got[nm], t[nm], ref[nm])
    return out


def worst_row(model: torch.Tensor, kernel: torch.Tensor, ref: torch.Tensor) -> dict:
    """The row (over heads and positions) that holds the most of RMSE(model, kernel), and F without it:
    one BF16 flip of a large dS moves a whole dQ row (and a dK row), so F over a few hundred thousand
    values can be one row's"""
    e = (model.double() - kernel.double()).pow(2).sum(-1).flatten()
    top = int(e.argmax())
    d = model.shape[-1]
    rest = ((e.sum() - e[top]) / (model.numel() - d)).sqrt().item()
    r = (kernel.double() - ref.double()).pow(2).mean().sqrt().item()
    return {"row": top, "share": (e[top] / e.sum()).item() if e.sum() else 0.0,
            "F_without": rest / r if r else math.nan,
            "differing": int((model.double() != kernel.double()).sum())}


def sdpa_meta(folder: Path) -> dict:
    """Each SDPA case's metadata from the folder's dump_field*.json (parts sdpa and sdpa-more)."""
    out: dict = {}
    for f in sorted(folder.glob("dump_field*.json")):
        m = json.loads(f.read_text())
        for part in ("sdpa", "sdpa-more"):
            out.update(m.get(part, {}).get("cases", {}))
    return out


def run_sdpa(a) -> int:
    from dump_field import SDPA_FIT, SDPA_GQA, SDPA_HOLDOUT, SDPA_MORE
    from fa3_numerics.numerics.backward import Forward, backward_from, run_forward
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from fa3_numerics.numerics.recipe import Recipe

    meta = sdpa_meta(a.dumps)
    models = a.models.split(";") if a.models else [
        "fa3-bf16-bwd-bf16,bm=128,bn=64,order=forward,bwd.bm=64,bwd.bn=128"]
    sets = tuple((f, cs) for f, cs in (("sdpa_bwd_fit.safetensors", SDPA_FIT),
                                       ("sdpa_bwd_holdout.safetensors", SDPA_HOLDOUT + [SDPA_GQA]),
                                       ("sdpa_bwd_more.safetensors", SDPA_MORE))
                 if (a.dumps / f).exists() or f != "sdpa_bwd_more.safetensors")
    if a.cases:
        sets = tuple((f, [c for c in cs if c.name in a.cases.split(",")]) for f, cs in sets)
    if a.table:
        from fa3_numerics.numerics.recipe import get_recipe

        specs = {"before": (OLD_SDPA, None), "after": (get_recipe("sdpa-flash-bf16").recipe.short_str(), None)}
        if a.fa2math:
            # fa2math in the forward and in the backward separately (the preset's choice of both)
            base = "sdpa-flash-bf16,fa2math="
            specs = {f"fwd_{f}_bwd_{b}": (base + f, base + b) for f in ("torch", "fa3") for b in ("torch", "fa3")}
        rows = []
        for fname, cases in sets:
            g = groups(load(a.dumps / fname)[0])
            for c in cases:
                row = {"case": c.name, "seed": c.seed, "file": fname}
                for label, (spec, bwd_spec) in specs.items():
                    for nm, fid in sdpa_end_to_end(g[c.name], c, spec, bwd_spec).items():
                        if nm != "o":
                            w = fid.pop("worst_row")
                            row[f"F_{nm}_{label}_without_worst_row"] = w["F_without"]
                            row[f"differing_{nm}_{label}"] = w["differing"]
                        row[f"F_{nm}_{label}"] = fid["F"]
                        row[f"identical_{nm}_{label}"] = fid["identical"]
                        row[f"rmse_{nm}_kernel"] = fid["rmse_kernel"]
                        row[f"rmse_{nm}_{label}"] = fid["rmse_model"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        return 0
    for fname, cases in sets:
        g = groups(load(a.dumps / fname)[0])
        for c in cases:
            t, info = g[c.name], meta.get(c.name, {})
            q, k, v, do = (t[x].double() for x in ("q", "k", "v", "do"))
            o_ref, dq_ref, dk_ref, dv_ref = reference_gradients(q, k, v, do, causal=c.causal)
            ref = {"o": o_ref, "dq": dq_ref, "dk": dk_ref, "dv": dv_ref}
            print(f"{c.name} (seed {c.seed}, {fname}): repeat {info.get('repeat')}")
            for m in models:
                r = Recipe.from_str(m)
                fwd = run_forward(r, q, k, v, causal=c.causal)
                f_o = fidelity(fwd.o, t["o"], o_ref)
                f_lse = (fwd.lse.double() - t["lse"].double()).abs().max().item()
                # the backward from the kernel's own O and LSE: the backward alone
                kf = Forward(t["o"].double(), t["lse"].float())
                gr = backward_from(r, q, k, v, kf, do, causal=c.causal)
                parts = [f"O F {f_o['F']:.4f} ident {f_o['identical']:.1%} (max |dLSE| {f_lse:.2e})"]
                for nm, x in (("dq", gr.dq), ("dk", gr.dk), ("dv", gr.dv)):
                    fid = fidelity(x, t[nm], ref[nm])
                    parts.append(f"{nm} F {fid['F']:.4f} ident {fid['identical']:.1%} "
                                 f"(err kernel {fid['rmse_kernel']:.3e} model {fid['rmse_model']:.3e})")
                print(f"  {m}:\n    " + "\n    ".join(parts))
    return 0


def sdpa_gqa_cases(folder: Path) -> list[tuple[dict, dict]]:
    """[(metadata, {name: tensor})] of part sdpa-gqa's cases in the folder (each case's _fwd and _grad
    files merged: inputs, O, LSE, dQ, dK, dV and the per-query-head dK/dV)."""
    from fa3_numerics.data.dumps import read_grouped

    out = []
    for f in sorted(folder.glob("dump_field*.json")):
        for name, meta in json.loads(f.read_text()).get("sdpa-gqa", {}).get("cases", {}).items():
            t: dict = {}
            for part in ("fwd", "grad"):
                t.update(read_grouped(folder / f"sdpa_gqa_{name}_{part}.safetensors")[0][name])
            out.append((meta, t))
    return out


def run_sdpa_gqa(a) -> int:
    """Part sdpa-gqa's cases end to end (the recipe's own forward, then its backward from that forward's
    O and LSE) for each of --models (default the sdpa-flash-bf16 preset): per output F, identical share
    and the count of values differing; the LSE's identical share and count."""
    from types import SimpleNamespace

    from fa3_numerics.numerics.backward import backward_from, run_forward
    from fa3_numerics.numerics.backward_reference import reference_gradients
    from fa3_numerics.numerics.recipe import Recipe

    models = a.models.split(";") if a.models else ["sdpa-flash-bf16"]
    for meta, t in sdpa_gqa_cases(a.dumps):
        c = SimpleNamespace(**meta["case"])
        if a.cases and c.name not in a.cases.split(","):
            continue
        q, k, v, do = (t[x].double() for x in ("q", "k", "v", "do"))
        ref = dict(zip(("o", "dq", "dk", "dv"), reference_gradients(q, k, v, do, causal=c.causal)))
        for spec in models:
            fwd = run_forward(Recipe.from_str(spec), q, k, v, causal=c.causal)
            gr = backward_from(Recipe.from_str(spec), q, k, v, fwd, do, causal=c.causal)
            row = {"case": c.name, "model": spec,
                   "lse_identical": (fwd.lse.float() == t["lse"]).double().mean().item(),
                   "lse_differing": int((fwd.lse.float() != t["lse"]).sum())}
            for nm, x in (("o", gr.forward.o), ("dq", gr.dq), ("dk", gr.dk), ("dv", gr.dv)):
                fid = fidelity(x, t[nm], ref[nm])
                row[f"F_{nm}"] = fid["F"]
                row[f"differing_{nm}"] = int((x.double() != t[nm].double()).sum())
            print(json.dumps(row), flush=True)
    return 0


# ----------------------------------------------------------------------------- test fixture

FIXTURE_CUDNN = ("c_n1024_d64", "c_n256_d64_causal_gauss")
FIXTURE_SDPA = ("b_n512_d64_causal", 2)  # the case and the heads kept (the backward is per head)


def write_fixture(a) -> int:
    """tests/fixtures/field_h200.safetensors: the cuDNN cases' FP8 bytes, descales and O codes at the
    backend's scale_o, and two heads of one SDPA backward case (inputs, the kernel's O and LSE, its
    gradients), with each case's metadata (seeds, shapes) in the header."""
    from safetensors.torch import save_file

    meta = json.loads((a.dumps / "dump_field.json").read_text())
    t_c = groups(load(a.dumps / "cudnn_fwd.safetensors")[0])
    out, info = {}, {"source": "tools/device/dump_field.py on an H200 (reports/h200/field/README.md)",
                     "machine": meta["machine"]}
    for name in FIXTURE_CUDNN:
        c, m = t_c[name], meta["cudnn"]["cases"][name]
        for k in ("q8", "k8", "v8"):
            out[f"{name}/{k}"] = c[k]
        out[f"{name}/o8"] = c["o8"][0].contiguous()
        info[name] = {k: m[k] for k in ("case", "descale_q", "descale_k", "descale_v", "scale_s", "descale_s",
                                          "descale_o", "attn_scale", "causal")}
        info[name]["scale_o"] = float(c["scale_o"][0])
    name, heads = FIXTURE_SDPA
    t_s = groups(load(a.dumps / "sdpa_bwd_fit.safetensors")[0])[name]
    for k in ("q", "k", "v", "do", "o", "lse", "dq", "dk", "dv"):
        out[f"{name}/{k}"] = t_s[k][:, :heads].contiguous()
    info[name] = {"case": meta["sdpa"]["cases"][name]["case"], "heads_kept": heads}
    save_file(out, str(a.out), metadata={"info": json.dumps(info)})
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**20:.2f} MiB)")
    return 0


# heads 0 (it holds the row whose one dS flip is most of dQ's and dK's F end to end) and 2 (fa2math=fa3
# is far off there)
FIXTURE_SDPA_MORE = ("b_n768_d64_causal_s3", (0, 2))


def write_fixture_sdpa(a) -> int:
    """tests/fixtures/field_h200_sdpa_n768.safetensors: two heads of SDPA's flash forward and backward
    on n 768 causal d 64 (sdpa_bwd_more: three splits in the forward), inputs, the kernel's O, LSE and
    gradients, with the case's metadata in the header. The forward's split count is the same for two
    heads as for the four dumped (fa2_loop.fa2_num_splits), so the emulator's forward on it is the
    dumped case's."""
    from safetensors.torch import save_file

    from fa3_numerics.numerics.fa2_loop import fa2_num_splits

    name, heads = FIXTURE_SDPA_MORE
    meta = sdpa_meta(a.dumps)[name]
    c = meta["case"]
    shape = dict(seqlen_q=c["seqlen"], seqlen_k=c["seqlen"], head_dim=c["head_dim"])
    if fa2_num_splits(batch=c["batch"], heads=len(heads), **shape) != fa2_num_splits(batch=c["batch"],
                                                                                     heads=c["heads"], **shape):
        raise SystemExit(f"{heads} head(s) of {name} would split the forward differently from the dump's")
    t = groups(load(a.dumps / "sdpa_bwd_more.safetensors")[0])[name]
    out = {f"{name}/{k}": t[k][:, list(heads)].contiguous()
           for k in ("q", "k", "v", "do", "o", "lse", "dq", "dk", "dv")}
    info = {"source": "tools/device/dump_field.py --parts sdpa-more on an H200 (reports/h200/backward/README.md)",
            name: {**meta, "heads_kept": list(heads)}}
    out_path = a.out if a.out != DEFAULT_FIXTURE else Path("tests/fixtures/field_h200_sdpa_n768.safetensors")
    save_file(out, str(out_path), metadata={"info": json.dumps(info)})
    print(f"wrote {out_path} ({out_path.stat().st_size / 2**20:.2f} MiB)")
    return 0


# part sdpa-gqa's causal n 1536 case cut to query heads 6-7 (KV head 1), rows 768-1023 and keys 0-1023: under
# bottom-right causal alignment those rows see the same keys in the same 256-key split tiles as in the dump
# (4 splits here, 6 there of which the last 2 are empty for these rows), so the kernel's LSE and O rows are
# the emulator's forward of the cut. It holds 20 LSE rows and 5 O values that the correctly rounded combine
# missed (libdevice's expf/logf: none).
FIXTURE_SDPA_GQA = ("b_n1536_d64_causal_gqa8x2_s5", (6, 8), (768, 1024))


def write_fixture_sdpa_gqa(a) -> int:
    """tests/fixtures/field_h200_sdpa_gqa_n1536.safetensors: FIXTURE_SDPA_GQA's Q, K, V, O and LSE, with the
    case's metadata and the cut in the header."""
    from safetensors.torch import save_file

    from fa3_numerics.numerics.fa2_loop import fa2_num_splits

    name, (h0, h1), (r0, r1) = FIXTURE_SDPA_GQA
    meta, t = next((m, t) for m, t in sdpa_gqa_cases(a.dumps) if m["case"]["name"] == name)
    c = meta["case"]
    rep = c["heads"] // c["kv_heads"]
    if h0 // rep != (h1 - 1) // rep or not c["causal"]:
        raise SystemExit("the cut must keep query heads of one KV head of a causal case")
    full = fa2_num_splits(batch=c["batch"], heads=c["heads"], seqlen_q=c["seqlen"], seqlen_k=c["seqlen"],
                          head_dim=c["head_dim"])
    cut = fa2_num_splits(batch=c["batch"], heads=h1 - h0, seqlen_q=r1 - r0, seqlen_k=r1, head_dim=c["head_dim"])
    from fa3_numerics.numerics.fa2_loop import split_block_n
    if -(-c["seqlen"] // split_block_n(c["head_dim"])) != full or -(-r1 // split_block_n(c["head_dim"])) != cut:
        raise SystemExit(f"the cut's splits ({cut}) are not the dump's tiles one per split ({full})")
    kh = h0 // rep
    out = {f"{name}/q": t["q"][:, h0:h1, r0:r1], f"{name}/o": t["o"][:, h0:h1, r0:r1],
           f"{name}/lse": t["lse"][:, h0:h1, r0:r1], f"{name}/k": t["k"][:, kh:kh + 1, :r1],
           f"{name}/v": t["v"][:, kh:kh + 1, :r1]}
    out = {k: x.contiguous() for k, x in out.items()}
    info = {"source": "tools/device/dump_field.py --parts sdpa-gqa on an H200 (reports/h200/backward/README.md)",
            name: {**meta, "query_heads_kept": [h0, h1], "kv_head_kept": kh, "rows_kept": [r0, r1],
                   "keys_kept": [0, r1], "splits_in_dump": full, "splits_in_cut": cut}}
    out_path = a.out if a.out != DEFAULT_FIXTURE else Path("tests/fixtures/field_h200_sdpa_gqa_n1536.safetensors")
    save_file(out, str(out_path), metadata={"info": json.dumps(info)})
    print(f"wrote {out_path} ({out_path.stat().st_size / 2**10:.0f} KiB)")
    return 0


# part sdpa-gqa's non-causal n 1024 d 128 case (2 splits of 4 KV tiles: the rescale path): KV head 1, and of its
# query heads 4-7 the rows where the row sum's rescale as a separate multiply (not nvcc's FFMA) misses the
# kernel's LSE or O, plus as many rows that both models get right; non-causal rows are independent, so the
# rows stack as one head against the whole K, V (the test keeps the dump's split count)
FIXTURE_SDPA_RESCALE = ("b_n1024_d128_gqa8x2_s2", 1)


def write_fixture_sdpa_rescale(a) -> int:
    """tests/fixtures/field_h200_sdpa_gqa_n1024_rows.safetensors (FIXTURE_SDPA_RESCALE): the rows' Q, O and LSE
    as one head [1, 1, R, D], the KV head's K and V, the rows' (query head, row) and the case in the header."""
    import contextlib
    from unittest import mock

    from safetensors.torch import save_file

    from fa3_numerics.numerics import fa2_loop
    from fa3_numerics.numerics.backward import run_forward
    from fa3_numerics.numerics.emulator import _quad_row_sum
    from fa3_numerics.numerics.recipe import Recipe

    name, kh = FIXTURE_SDPA_RESCALE
    meta, t = next((m, t) for m, t in sdpa_gqa_cases(a.dumps) if m["case"]["name"] == name)
    c = meta["case"]
    rep = c["heads"] // c["kv_heads"]
    hs = list(range(kh * rep, (kh + 1) * rep))
    splits = fa2_loop.fa2_num_splits(batch=c["batch"], heads=c["heads"], seqlen_q=c["seqlen"], seqlen_k=c["seqlen"],
                                     head_dim=c["head_dim"])
    q, k, v = (t[x].double() for x in "qkv")
    r = Recipe.from_str("sdpa-flash-bf16")
    miss = []
    with mock.patch.object(fa2_loop, "fa2_num_splits", lambda **kw: splits):
        for sep in (False, True):
            ctx = (mock.patch.object(fa2_loop, "_rescaled_row_sum", lambda rs4, al, p: _quad_row_sum(rs4 * al, p))
                   if sep else contextlib.nullcontext())
            with ctx:
                fw = run_forward(r, q[:, hs], k[:, kh:kh + 1], v[:, kh:kh + 1], causal=False)
            miss.append(((fw.lse.float() != t["lse"][:, hs]) | (fw.o.double() != t["o"][:, hs].double()).any(-1))[0])
    bad = miss[1] & ~miss[0]
    good = ~miss[0] & ~miss[1]
    n_bad = int(bad.sum())
    keep = bad.clone()
    keep.view(-1)[good.view(-1).nonzero().view(-1)[:n_bad]] = True  # as many rows both models match
    hr = keep.nonzero().tolist()  # (query head index within hs, row)
    hi = torch.tensor([hs[i] for i, _ in hr])
    ri = torch.tensor([j for _, j in hr])
    out = {f"{name}/q": t["q"][0, hi, ri][None, None], f"{name}/o": t["o"][0, hi, ri][None, None],
           f"{name}/lse": t["lse"][0, hi, ri][None, None], f"{name}/k": t["k"][:, kh:kh + 1],
           f"{name}/v": t["v"][:, kh:kh + 1]}
    out = {key: x.contiguous() for key, x in out.items()}
    info = {"source": "tools/device/dump_field.py --parts sdpa-gqa on an H200 (reports/h200/backward/README.md)",
            name: {**meta, "kv_head_kept": kh, "rows_kept": [[hs[i], j] for i, j in hr], "splits_in_dump": splits,
                   "rows_the_separate_multiply_misses": n_bad, "rows_the_ffma_misses": int(miss[0].sum())}}
    out_path = a.out if a.out != DEFAULT_FIXTURE else Path("tests/fixtures/field_h200_sdpa_gqa_n1024_rows.safetensors")
    save_file(out, str(out_path), metadata={"info": json.dumps(info)})
    print(f"wrote {out_path} ({out_path.stat().st_size / 2**10:.0f} KiB): {len(hr)} rows, {n_bad} missed by the "
          f"separate multiply, {int(miss[0].sum())} by the FFMA")
    return 0


# (run, head) of part cudnn-tie kept as a test fixture, and its rows: margins of 32 log2 units and more
# (the distractors' P~ below l's last bit), every level and spread. ln2: the offset lg2.approx(scale_s)
# decides levels 0 and 3 from 26 and 52; rsqrtd: the unfused S' - (m' - L) and scale_o folded into
# the row's factor decide level 26.5 from 53.
FIXTURE_TIE = (("tie_ln2_n256", 2), ("tie_rsqrtd_n256", 2))
FIXTURE_TIE_MIN_MARGIN = 32.0
# part fixture-tie-sum: a multi-tile run (4 KV tiles, the dominant key in the third) and its rows of margin
# 26-32, where the other keys' P~ add up to l's last bits: the row sum's form (per-tile sums, then
# fma(tile_sum, descale_s, rs rescale)) decides them
FIXTURE_TIE_SUM = (("tie_rsqrtd_n1024", 4),)
FIXTURE_TIE_SUM_MARGINS = (26.0, 33.0)


def write_fixture_tie(a, keep_runs=FIXTURE_TIE, margins=(FIXTURE_TIE_MIN_MARGIN, math.inf)) -> int:
    """tests/fixtures/cudnn_tie_h200.safetensors (or _sum_: FIXTURE_TIE_SUM): the runs' FP8 bytes (Q only
    the kept rows, K and V the head's), the kernel's O codes of those rows at every dumped scale_o, and
    the metadata."""
    from safetensors.torch import save_file

    out, info = {}, {"source": "tools/device/dump_field.py part cudnn-tie on an H200 (dump_field.json 'cudnn-tie')"}
    for (tag, t, m) in tie_runs(a.dumps):
        keep = dict(keep_runs)
        if tag not in keep:
            continue
        h = keep[tag]
        # the rows of infinite target margin (Q's code 448) come along: they keep Q's amax, so the preset's
        # per-tensor quantization of the kept rows gives the dump's codes
        rows = [i for i, rw in enumerate(m["rows"])
                if margins[0] <= rw["margin_log2"] < margins[1] or math.isinf(rw["margin_target"])]
        idx = torch.tensor(rows)
        out[f"{tag}/q8"] = t["q8"][:, h:h + 1].index_select(2, idx).contiguous()
        out[f"{tag}/k8"] = t["k8"][:, h:h + 1].contiguous()
        out[f"{tag}/v8"] = t["v8"][:, h:h + 1].contiguous()
        out[f"{tag}/o8"] = t["o8"][:, :, h:h + 1].index_select(3, idx).contiguous()
        out[f"{tag}/scale_o"] = t["scale_o"].contiguous()
        info[tag] = {k: m[k] for k in ("attn_scale", "descale_q", "descale_k", "descale_v", "scale_s", "descale_s",
                                        "scale_o_labels", "nk")}
        info[tag].update(head=h, dominant_key=m["positions"][h], rows=rows,
                         row_info=[m["rows"][i] for i in rows])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(f".{a.out.name}.tmp")
    save_file(out, str(tmp), metadata={"info": json.dumps(info)})
    tmp.replace(a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**10:.0f} KiB)")
    return 0


DEFAULT_FIXTURE = Path("tests/fixtures/field_h200.safetensors")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dumps", type=Path)
    ap.add_argument("part", choices=("cudnn", "cudnn-tie", "torchao", "sdpa", "sdpa-gqa", "fixture", "fixture-sdpa",
                                     "fixture-sdpa-gqa", "fixture-sdpa-rescale", "fixture-tie", "fixture-tie-sum"))
    ap.add_argument("--out", type=Path, default=DEFAULT_FIXTURE)
    ap.add_argument("--models", default="")
    ap.add_argument("--rows", type=int, default=0)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--table", action="store_true", help="F before/after the fit per case (the README's table)")
    ap.add_argument("--fa2math", action="store_true",
                    help="with --table: the preset with fa2math=torch/fa3 in the forward and the backward separately")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"cudnn": run_cudnn, "cudnn-tie": run_cudnn_tie, "torchao": run_torchao, "sdpa": run_sdpa,
            "sdpa-gqa": run_sdpa_gqa, "fixture": write_fixture, "fixture-sdpa": write_fixture_sdpa,
            "fixture-sdpa-gqa": write_fixture_sdpa_gqa, "fixture-sdpa-rescale": write_fixture_sdpa_rescale,
            "fixture-tie": write_fixture_tie,
            "fixture-tie-sum": lambda a: write_fixture_tie(a, FIXTURE_TIE_SUM, FIXTURE_TIE_SUM_MARGINS)}[a.part](a)


if __name__ == "__main__":
    sys.exit(main())
