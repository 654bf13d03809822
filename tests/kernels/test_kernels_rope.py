"""The fused RoPE + rotation + FP8 pre-pass (kernels/triton_/rope_quant.py) against the emulator.

The reference of every case is written here, apart from the kernel: RoPE in float32 in the
model's own form (Llama's ``x * cos + rotate_half(x) * sin`` for the half-split layout, GPT-J's
even/odd pairs for the interleaved one), eager torch on the CPU, so each product rounds to float32
before the sum (no fused multiply-add: the rounding the kernel states), then the emulator's own
``prepare()`` (rotation, smoothing and quantization in float64) on that float32 tensor. The
kernel's FP8 bytes and float32 descales must equal ``prepare()``'s bit for bit (float64 path), or
differ only in rare near-ties by one FP8 step (float32 fast path). Negative controls: the other
RoPE layout and another rotation seed change the bytes.

Three layers, each skipped with its reason where it cannot run: plain Python (refusals, tables);
the kernel under Triton's CPU interpreter (a subprocess, because ``triton.jit`` reads
TRITON_INTERPRET when the module imports; the kernel's soft cast encodes the bytes by hand there,
so even -0 is compared); the compiled kernel on a CUDA GPU (hardware casts).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fa3_numerics.errors import UsageError

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _gpu_reason() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available():
        return "no CUDA GPU (tools/device/rope_h200.py runs this layer there)"
    if torch.cuda.get_device_capability() < (8, 9):
        return "the GPU has no FP8 conversions (sm_89+ needed)"
    return None


GPU_REASON = _gpu_reason()

# (name, rope layout, head_dim, seqlen, heads, kv heads, recipe, which operand, input layout,
#  positions: "arange" | "offset" | "batch", table width: "half" | "full", exact)
CASES = [
    ("q half d64 block pow2", "half", 64, 96, 2, 2, "fa3-fp8,bm=32,bn=64", "q", "bshd", "arange", "half", True),
    ("k interleaved d128 block224 (7 sub-tiles)", "interleaved", 128, 160, 2, 2, "fa3-fp8", "k", "bshd", "offset",
     "full", True),
    ("q half d128 head GQA", "half", 128, 64, 4, 2, "fa3-fp8-kernel-hadamard", "q", "bhsd", "batch", "half", True),
    ("k half d64 smooth=k head", "half", 64, 80, 2, 2, "fa3-fp8-kernel-hadamard,smooth=k", "k", "bshd", "arange",
     "full", True),
    ("q interleaved d64 token", "interleaved", 64, 64, 2, 2, "fa3-fp8,gran=token", "q", "bshd", "offset", "half",
     True),
    ("k half d64 tensor", "half", 64, 64, 2, 2, "fa3-fp8-no-block-quant", "k", "bshd", "arange", "half", True),
    ("v no rope head", "none", 64, 72, 2, 2, "fa3-fp8-kernel-hadamard", "v", "bshd", "arange", "half", True),
    ("q half d128 block amax (pow2=0)", "half", 128, 128, 2, 2, "fa3-fp8,pow2=0", "q", "bshd", "arange", "half", True),
    ("fast: q half d128 block pow2", "half", 128, 128, 2, 2, "fa3-fp8", "q", "bshd", "arange", "half", False),
    ("fast: k interleaved d64 head", "interleaved", 64, 96, 2, 2, "fa3-fp8-kernel-hadamard", "k", "bshd", "offset",
     "half", False),
    # The persistent fast path (rope_persistent) on what the float64 cases cover:
    ("fast: q half d128 head GQA", "half", 128, 200, 4, 2, "fa3-fp8-kernel-hadamard", "q", "bshd", "batch", "half",
     False),
    ("fast: k half d64 smooth=k head", "half", 64, 80, 2, 2, "fa3-fp8-kernel-hadamard,smooth=k", "k", "bshd",
     "arange", "full", False),
    ("fast: q interleaved d64 token", "interleaved", 64, 64, 2, 2, "fa3-fp8,gran=token", "q", "bshd", "offset", "half",
     False),
    ("fast: k half d64 tensor", "half", 64, 64, 2, 2, "fa3-fp8-no-block-quant", "k", "bhsd", "arange", "half", False),
    ("fast: v no rope head", "none", 64, 72, 2, 2, "fa3-fp8-kernel-hadamard", "v", "bshd", "arange", "half", False),
    ("fast: k interleaved d128 block amax", "interleaved", 128, 160, 2, 2, "fa3-fp8,bn=128,pow2=0", "k", "bshd",
     "offset", "full", False),
    ("fast: q half d64 block 48 rows (< the 64-row tile)", "half", 64, 100, 2, 2, "fa3-fp8,bm=48,bn=64", "q", "bshd",
     "arange", "half", False),
]
# The unmarked subset: blocks with pow2 descales, per-head GQA with per-batch tables (float64 path, and the
# persistent fast path with a sequence of three tiles and a partial one)
QUICK = (0, 2, 10)


def _inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _tables(d: int, b: int, n: int, positions: str, width: str, rope: str):
    """(cos, sin) as the model's code builds them, and the positions tensor (or None)."""
    inv = _inv_freq(d)
    if positions == "batch":
        # per-batch offsets, the tables already indexed by position: [B, N, W] and no positions
        ang = torch.stack([torch.arange(n) + 5 * i for i in range(b)]).float()[..., None] * inv
        pos = None
    else:
        t = n + 64 if positions == "offset" else n
        pos = torch.arange(n) + 37 if positions == "offset" else None
        ang = torch.arange(t).float()[:, None] * inv
    if width == "full":  # HF keeps the table at head_dim width: cat(freqs, freqs), or pairs repeated
        ang = torch.cat([ang, ang], -1) if rope == "half" else ang.repeat_interleave(2, -1)
    return torch.cos(ang), torch.sin(ang), pos


def rope_reference(x_bhsd: torch.Tensor, cos, sin, pos, rope: str) -> torch.Tensor:
    """float32 RoPE of [B, H, N, D], the model's formulas, eager CPU torch (products rounded, then the sum)."""
    b, h, n, d = x_bhsd.shape
    x = x_bhsd.float()
    if rope == "none":
        return x
    if cos.dim() == 3:
        c, s = cos[:, None], sin[:, None]  # [B, 1, N, W]
    else:
        idx = pos if pos is not None else torch.arange(n)
        c, s = cos[idx][None, None], sin[idx][None, None]
    if c.shape[-1] == d // 2:
        c = torch.cat([c, c], -1) if rope == "half" else c.repeat_interleave(2, -1)
        s = torch.cat([s, s], -1) if rope == "half" else s.repeat_interleave(2, -1)
    if rope == "half":
        rot_half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * c + rot_half * s
    xe, xo = x[..., 0::2], x[..., 1::2]
    ce, se = c[..., 0::2], s[..., 0::2]
    return torch.stack([xe * ce - xo * se, xo * ce + xe * se], -1).reshape(b, h, n, d)


def _inputs(b, h, n, d, seed, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n, d, generator=g) * (1 + 10 * (torch.rand(b, h, n, d, generator=g) < 0.01))
    if bias:  # a channel mean shared by all tokens: what K smoothing removes
        x = x + 4 * torch.randn(1, 1, 1, d, generator=g)
    return x.to(torch.bfloat16)


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every differing FP8 byte one code step from the other, same sign."""
    ua, ub = a.view(torch.uint8).long(), b.view(torch.uint8).long()
    diff = ua != ub
    return bool((((ua ^ ub) & 0x80) == 0)[diff].all() and ((ua & 0x7F) - (ub & 0x7F)).abs()[diff].le(1).all())


def rope_checks(device: str = "cpu", cases=None, seed: int = 0) -> list[dict]:
    """Run each case through the kernel and the reference; plain dicts of measured numbers."""
    from fa3_numerics.kernels.triton_.rope_quant import rope_bf16, rope_quantize
    from fa3_numerics.numerics.emulator import prepare
    from fa3_numerics.numerics.granularity import PerHead
    from fa3_numerics.numerics.recipe import Recipe
    from fa3_numerics.numerics.rotation import make_rotation

    out = []
    for case in cases or CASES:
        name, rope, d, n, h, hkv, spec, which, layout, positions, width, exact = case
        i = CASES.index(case) if case in CASES else len(CASES)  # each case its own inputs, whatever the subset
        b = 2
        r = Recipe.from_str(spec)
        heads = h if which == "q" else hkv
        x = _inputs(b, heads, n, d, seed + i, bias=which == "k")
        fill = torch.Generator().manual_seed(seed + 100 + i)
        cos, sin, pos = _tables(d, b, n, positions, width, rope)
        ref_in = rope_reference(x, cos, sin, pos, rope)
        swap = "interleaved" if rope == "half" else "half"
        other = rope_reference(x, cos, sin, pos, swap) if rope != "none" else None
        bm, bn = r.tiles(d, True)
        rows = torch.arange(n)
        # The operand under test in its slot; the others are any tensors of the right heads (Q: the
        # operand itself also in K and V cases, whose heads equal the kv heads).
        qi = ref_in
        ki = ref_in if which == "k" else torch.randn(b, hkv, n, d, generator=fill)
        vi = ref_in if which == "v" else torch.randn(b, hkv, n, d, generator=fill)
        seed_rot = 3
        pre = prepare(r, qi, ki, vi, q_index=rows, rotation_seed=seed_rot, causal=True)
        refq = {"q": pre.q, "k": pre.k, "v": pre.v}[which]
        k_mean = None
        if which == "k" and r.smooth != "none":
            # The emulator's mean: over tokens of the float64 rotated K (numerics/smoothing.smooth_k).
            k_mean = make_rotation(r.rot, d, seed_rot).apply(ref_in.to(torch.float64)).mean(dim=2)
        xin = x.transpose(1, 2).contiguous() if layout == "bshd" else x.contiguous()
        group = h // hkv if which == "q" and isinstance(r.gran, PerHead) else 1
        kw = dict(rope=rope, positions=pos, layout=layout, rot=r.rot if which != "v" else "none", seed=seed_rot,
                  fmt=r.qk, gran=r.gran, block_rows=bm if which == "q" else bn, group=group, pow2=r.pow2,
                  k_mean=None if k_mean is None else k_mean.to(device), exact=exact)
        o = rope_quantize(xin.to(device), cos.to(device), sin.to(device), **kw)
        vals = o.values_bhsd().cpu()
        desc = o.descale_like_prepare(heads, n).cpu()
        rv = refq.values[:, :heads] if refq.values.shape[1] != heads else refq.values
        rd = refq.descale.expand(b, heads, n, 1) if refq.descale.shape[1] in (1, heads) else refq.descale
        same = vals.contiguous().view(torch.uint8) == rv.contiguous().view(torch.uint8)
        row = {"case": name, "exact": exact, "launch": o.launch, "elements": int(same.numel()),
               "bytes_identical": float(same.double().mean()), "bytes_differing": int((~same).sum()),
               "adjacent": _adjacent(vals, rv),
               "descales_identical": float((desc.expand_as(rd) == rd).double().mean()),
               "descale_max_rel_diff": float(((desc.expand_as(rd).double() - rd.double()).abs() / rd.double()).max()),
               "finite": bool(torch.isfinite(vals.float()).all())}
        if other is not None:  # negative control: the other pairing gives other bytes
            pre2 = prepare(r, other if which == "q" else qi, other if which == "k" else ki, vi, q_index=rows,
                           rotation_seed=seed_rot, causal=True)
            rv2 = (pre2.q if which == "q" else pre2.k).values
            row["other_layout_identical"] = float((vals.view(torch.uint8) == rv2.view(torch.uint8)).double().mean())
        if rope != "none" and positions == "arange" and width in ("half", "full") and layout == "bshd":
            # The pre-pass's own RoPE values (the same device function), float32, bit for bit.
            f32 = rope_bf16(xin.to(device), cos.to(device), sin.to(device), rope=rope, out_dtype=torch.float32)
            got = f32.cpu().transpose(1, 2)
            row["rope_f32_identical"] = float((got.view(torch.int32) == ref_in.view(torch.int32)).double().mean())
            bf = rope_bf16(xin.to(device), cos.to(device), sin.to(device), rope=rope).cpu().transpose(1, 2).float()
            ulp = (ref_in.abs().to(torch.bfloat16).float() * 2 ** -7).clamp_min(2 ** -126)
            row["rope_bf16_within_ulp"] = bool(((bf - ref_in).abs() <= ulp).all())
            row["rope_bf16_rne"] = float((bf == ref_in.to(torch.bfloat16).float()).double().mean())
        out.append(row)
    # Seed control: another rotation seed, other bytes (the kernel follows make_rotation's signs).
    name, rope, d, n, h, hkv, spec, which, layout, positions, width, exact = (cases or CASES)[0]
    r = Recipe.from_str(spec)
    x = _inputs(2, h, n, d, seed, bias=False)
    cos, sin, pos = _tables(d, 2, n, positions, width, rope)
    ref_in = rope_reference(x, cos, sin, pos, rope)
    pre = prepare(r, ref_in, ref_in, ref_in, q_index=torch.arange(n), rotation_seed=3, causal=True)
    o = rope_quantize(x.transpose(1, 2).contiguous().to(device), cos.to(device), sin.to(device), rope=rope,
                      rot="hadamard", seed=4, gran=r.gran, block_rows=r.tiles(d, True)[0], pow2=r.pow2)
    out.append({"case": "seed control", "other_seed_identical": float(
        (o.values_bhsd().cpu().view(torch.uint8) == pre.q.values.view(torch.uint8)).double().mean())})
    return out


def launch_checks(device: str = "cpu") -> list[dict]:
    """The fast path's launch options change where the work runs, not the bytes: tables held per
    row block or read per head and another tile must give identical bytes and descales; the rotation's
    other products (bf16x2, bf16x1) must not (they drop bits: a control that the split is used);
    the tiled kernel, whose float32 sums run in another order, and the truncated exact split
    (bf16x3t: other parts, so other float32 sums) agree but for near-ties. On a GPU
    the default launch is the compiled kernel's (quant_launch.launch): it must equal Triton's own
    (on the CPU both are the interpreter's, so that row only tests something on a GPU)."""
    from fa3_numerics.kernels.triton_.rope_quant import rope_quantize
    from fa3_numerics.numerics.granularity import PerHead

    out = []
    for rope, width in (("half", "half"), ("interleaved", "full")):
        x = _inputs(2, 4, 150, 128, 11, bias=False)
        cos, sin, _ = _tables(128, 2, 150, "arange", width, rope)
        xin = x.transpose(1, 2).contiguous().to(device)
        kw = dict(rope=rope, gran=PerHead(), seed=2, exact=False, group=2)
        base = rope_quantize(xin, cos.to(device), sin.to(device), **kw)
        for name, extra in (("tables per head", dict(table_per_head=True)), ("tile 32", dict(tile=32)),
                            ("jit launch", {}), ("bf16x1", dict(split="bf16x1")), ("tiled", dict(impl="tiled")),
                            ("bf16x3t", dict(split="bf16x3t"))):
            if name == "jit launch":  # the compiled-kernel launch (quant_launch.launch) against Triton's own
                os.environ["FA3N_TRITON_FAST_LAUNCH"] = "0"
            try:
                o = rope_quantize(xin, cos.to(device), sin.to(device), **kw, **extra)
            finally:
                os.environ.pop("FA3N_TRITON_FAST_LAUNCH", None)
            a, b = o.values.view(torch.uint8).cpu(), base.values.view(torch.uint8).cpu()
            out.append({"case": f"{rope}: {name}", "identical": float((a == b).double().mean()),
                        "adjacent": _adjacent(o.values.cpu(), base.values.cpu()),
                        "descales_equal": bool(torch.equal(o.descale.cpu(), base.descale.cpu())),
                        "launch": o.launch})
    # head_dim 16 with the rotation: the persistent kernel's products would have K = 8, which Triton's
    # tensor-core dots refuse on a GPU (the interpreter does not check), so the tiled kernel runs it.
    x = _inputs(1, 2, 40, 16, 12, bias=False).transpose(1, 2).contiguous().to(device)
    cos, sin, _ = _tables(16, 1, 40, "arange", "half", "half")
    o = rope_quantize(x, cos.to(device), sin.to(device), gran=PerHead(), exact=False)
    out.append({"case": "d16: the tiled kernel", "launch": o.launch})
    return out


def _assert_rows(rows: list[dict], device: str) -> None:
    for r in rows:
        if r["case"] == "seed control":
            assert r["other_seed_identical"] < 0.5, r
            continue
        assert r["finite"], r
        if r["exact"]:
            assert r["bytes_identical"] == 1.0 and r["descales_identical"] == 1.0, r
        else:
            # float32 after RoPE: rare near-ties round the other way, one FP8 step; pow2 descales survive.
            assert r["bytes_identical"] >= 0.999 and r["adjacent"], r
            if "pow2" in r["case"]:
                assert r["descales_identical"] == 1.0, r
            else:  # amax / max from a float32 amax: the last float32 bit may differ
                assert r["descale_max_rel_diff"] <= 2.0 ** -22, r
        if "other_layout_identical" in r:
            assert r["other_layout_identical"] < 0.5, r
        if "rope_f32_identical" in r:
            assert r["rope_f32_identical"] == 1.0, r
            assert r["rope_bf16_within_ulp"], r
            if device != "cpu":  # the interpreter truncates to BF16; the GPU rounds to nearest even
                assert r["rope_bf16_rne"] == 1.0, r


# ---------------------------------------------------------------------------- plain Python


def test_reference_rope_forms_agree_and_preserve_pair_norms():
    """The two layouts' references rotate the right pairs: norms of each pair are kept (to float32
    rounding) and the half-split form is the interleaved one on permuted channels."""
    d, n = 64, 48
    x = _inputs(1, 2, n, d, 1, bias=False)
    cos, sin, pos = _tables(d, 1, n, "arange", "half", "half")
    half = rope_reference(x, cos, sin, pos, "half")
    perm = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], -1).reshape(-1)  # i, i + d/2 adjacent
    inter = rope_reference(x[..., perm], cos, sin, pos, "interleaved")
    assert torch.equal(inter, half[..., perm])
    x32 = x.float()
    pn = lambda t: t[..., :d // 2] ** 2 + t[..., d // 2:] ** 2  # noqa: E731
    torch.testing.assert_close(pn(half), pn(x32), rtol=1e-5, atol=1e-5)
    assert not torch.equal(half, x32)


def test_rope_tables_follow_the_model():
    from fa3_numerics.kernels.triton_.rope_quant import rope_tables

    inv = _inv_freq(64)
    c, s = rope_tables(inv, 10)
    assert c.shape == (10, 32) and c.dtype == torch.float32
    assert torch.equal(c, torch.cos(torch.arange(10).float()[:, None] * inv))
    c2, _ = rope_tables(inv, torch.tensor([[0, 1], [5, 6]]))
    assert c2.shape == (2, 2, 32) and torch.equal(c2[1, 0], c[5])


@pytest.mark.parametrize("kw,words", [
    (dict(rope="neox"), "rope='neox'"), (dict(layout="sbhd"), "layouts"), (dict(rot="orthogonal"), "Hadamard"),
    (dict(fmt="int8"), "e4m3 or e5m2"), (dict(group=3), "multiple of the descale group"),
    (dict(positions=torch.arange(40) + 100), "positions must lie"), (dict(table_rows=10), "rows for"),
    (dict(k_mean=torch.zeros(1, 2, 32)), "k_mean must be"), (dict(d=96), "power of two"),
])
def test_refusals_say_why(kw, words):
    from fa3_numerics.kernels.triton_.rope_quant import rope_quantize

    kw = dict(kw)
    d = kw.pop("d", 64)
    t = kw.pop("table_rows", 64)
    x = torch.zeros(1, 40, 2, d, dtype=torch.bfloat16)
    cos = torch.ones(t, d // 2)
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        rope_quantize(x, cos, cos, **kw)


def test_refuses_block_without_rows_and_missing_tables():
    from fa3_numerics.kernels.triton_.rope_quant import rope_quantize
    from fa3_numerics.numerics.granularity import PerBlock

    x = torch.zeros(1, 40, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="block_rows"):
        rope_quantize(x, torch.ones(64, 32), torch.ones(64, 32), gran=PerBlock(0))
    with pytest.raises(UsageError, match="cos and sin"):
        rope_quantize(x)


# ---------------------------------------------------------------------------- interpreter


def _in_interpreter(call: str, *args: str, gpu_test: str) -> list[dict]:
    """``t.<call>`` of this module in a subprocess under Triton's interpreter, its rows as JSON."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed: the interpreter tests need it (pip install triton)")
    if GPU_REASON is None:
        pytest.skip(f"a GPU is present: {gpu_test} covers this")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_kernels_rope as t; "
            f"print(json.dumps(t.{call}))")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _interpret(which: tuple[int, ...]) -> list[dict]:
    return _in_interpreter("rope_checks('cpu', [t.CASES[i] for i in json.loads(sys.argv[2])])", json.dumps(list(which)),
                           gpu_test="test_gpu_rope_quant_matches_prepare")


def test_interpreted_fast_path_launches_keep_the_bytes():
    _assert_launch_rows(_in_interpreter("launch_checks('cpu')", gpu_test="test_gpu_fast_path_launches_keep_the_bytes"))


def _assert_launch_rows(rows: list[dict]) -> None:
    assert len(rows) == 13
    for r in rows:
        if r["case"].startswith("d16"):
            assert r["launch"].startswith("rope-quant tile"), r
        elif r["case"].endswith(("tables per head", "tile 32", "jit launch")):
            assert r["identical"] == 1.0 and r["descales_equal"], r
        elif r["case"].endswith("bf16x1"):
            assert r["identical"] < 0.99, r  # one BF16 product drops 16 bits: many bytes move
        else:
            assert r["identical"] >= 0.999 and r["adjacent"], r


def test_interpreted_rope_quant_matches_prepare_quick():
    rows = _interpret(QUICK)
    assert len(rows) == len(QUICK) + 1
    _assert_rows(rows, "cpu")


@pytest.mark.slow
def test_interpreted_rope_quant_matches_prepare_all_cases():
    rows = _interpret(tuple(i for i in range(len(CASES)) if i not in QUICK))
    assert len(rows) == len(CASES) - len(QUICK) + 1
    _assert_rows(rows, "cpu")
    assert any("rope_f32_identical" in r for r in rows)


# ---------------------------------------------------------------------------- GPU


gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


@gpu
def test_gpu_rope_quant_matches_prepare():
    _assert_rows(rope_checks("cuda"), "cuda")


@gpu
def test_gpu_fast_path_launches_keep_the_bytes():
    _assert_launch_rows(launch_checks("cuda"))


@gpu
def test_gpu_hardware_cast_equals_soft_encoding():
    """The compiled kernel's cvt.rn.satfinite bytes equal the hand encoding the interpreter uses."""
    from fa3_numerics.kernels.triton_.rope_quant import rope_quantize, rope_tables
    from fa3_numerics.numerics.granularity import PerBlock

    x = (torch.randn(2, 1000, 4, 128, device="cuda") * 30).to(torch.bfloat16)
    cos, sin = rope_tables(_inv_freq(128), 1000, device="cuda")
    for exact in (True, False):
        kw = dict(gran=PerBlock(128), pow2=True, exact=exact, seed=1)
        hw = rope_quantize(x, cos, sin, **kw)
        soft = rope_quantize(x, cos, sin, soft_cast=True, **kw)
        assert torch.equal(hw.values.view(torch.uint8), soft.values.view(torch.uint8))
        assert torch.equal(hw.descale, soft.descale)
    assert math.isfinite(float(hw.values.float().abs().max()))
