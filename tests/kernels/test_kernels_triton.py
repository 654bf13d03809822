"""The Triton FP8 kernels (kernels/triton_): fused rotate-and-quantize and the per-block attention.

Three layers, each skipped with its reason where it cannot run:

- plain Python (always): what the backend refuses and why, the tile decomposition;
- the kernels under Triton's CPU interpreter (needs the triton package): the same bytes as the
  emulator's ``prepare`` (float64 path), the attention against the emulator with the float32
  accumulator (the interpreter's dots are float32 sums), GQA and masking properties. Run in a
  subprocess because ``triton.jit`` reads TRITON_INTERPRET when the kernels' modules import;
- the kernels on a GPU (needs CUDA + an FP8 tensor core): hardware casts equal the soft
  rounding, bytes equal ``prepare``'s, the emulator reproduces the kernel (F <= 0.01).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from fa3_numerics.engine.backends import BACKENDS, get_backend
from fa3_numerics.kernels.triton_.attention import kv_chunks
from fa3_numerics.kernels.triton_.backend import recipe_problem, shape_problem
from fa3_numerics.numerics.recipe import Recipe

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _gpu_reason() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (the compiled kernels run on the device; tools/device/triton_h200.py runs these there)"
    if torch.cuda.get_device_capability() < (8, 9):
        return "the GPU has no FP8 tensor cores (sm_89+ needed)"
    return None


GPU_REASON = _gpu_reason()


# ---------------------------------------------------------------------------- plain Python


@pytest.mark.parametrize("bn,parts", [(224, (128, 64, 32)), (160, (128, 32, 0)), (128, (128, 0, 0)),
                                      (96, (64, 32, 0)), (480, None), (100, None), (0, None)])
def test_kv_tiles_split_into_powers_of_two(bn, parts):
    assert kv_chunks(bn) == parts
    if parts:
        assert sum(parts) == bn and all(p == 0 or p >= 32 for p in parts)


@pytest.mark.parametrize("preset", ["fa3-fp8", "fa3-fp8-no-block-quant", "fa3-fp8-no-incoherent", "fa3-fp8-kernel",
                                    "fa3-fp8-kernel-hadamard", "fa3-fp8,order=forward", "fa3-fp8,acc=two-level"])
def test_paper_fp8_rows_are_supported(preset):
    r = Recipe.from_str(preset)
    assert recipe_problem(r) is None
    for d in (64, 128, 256):
        assert shape_problem(r, d, causal=False) is None


@pytest.mark.parametrize("spec,words", [
    ("fa3-fp8,pscale=tensor", "pscale=tensor"), ("baseline-fp16", "algo=standard"), ("fa3-fp16", "FP8 forward"),
    ("fa3-fp8,gran=token", "per key"), ("fa3-fp8,bn=100", "multiple of 32"),
    ("fa3-fp8,v=e5m2", "share a format"),
])
def test_refusals_say_why(spec, words):
    why = recipe_problem(Recipe.from_str(spec))
    assert why is not None and words in why


def test_shape_refusals():
    r = Recipe.from_str("fa3-fp8")
    assert "head_dim 96" in shape_problem(r, 96, False)
    # V blocks of 64 keys cannot be applied per KV tile of 224 keys.
    assert "straddle" in shape_problem(Recipe.from_str("fa3-fp8,gran=block64"), 128, False)
    assert shape_problem(Recipe.from_str("fa3-fp8,gran=block64,bn=64"), 128, False) is None


@pytest.mark.parametrize("d,parts", [(64, 2), (128, 2), (128, 4), (256, 4)])
def test_split_rotation_factors_rebuild_the_hadamard_rotation(d, parts):
    """The shared-memory quantizer's rotation: the products of the column parts with the
    factors of ``split_matrices``, combined by H_parts, are x diag(s) H_d (Sylvester order), so
    the kernel rotates with the emulator's signs for a seed."""
    from fa3_numerics.kernels.triton_.rotate_quant_smem import split_matrices
    from fa3_numerics.numerics.rotation import hadamard_matrix, random_signs

    x = torch.randn(37, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d + parts))
    m = split_matrices(d, 7, "cpu", parts).double()
    pw = d // parts
    prods = [x[:, i * pw:(i + 1) * pw] @ m[i * pw:(i + 1) * pw] for i in range(parts)]
    hp = hadamard_matrix(parts)
    split = torch.cat([sum(hp[i, c] * prods[i] for i in range(parts)) for c in range(parts)], 1)
    full = x @ (random_signs(d, 7)[:, None] * hadamard_matrix(d))
    torch.testing.assert_close(split, full, rtol=0, atol=1e-12)
    assert not torch.allclose(split, x @ hadamard_matrix(d))  # the signs are in it


def test_smem_quantizer_refuses_with_its_reason():
    from fa3_numerics.errors import UsageError
    from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
    from fa3_numerics.kernels.triton_.rotate_quant_smem import smem_problem
    from fa3_numerics.numerics.granularity import PerBlock

    x = torch.zeros(1, 448, 2, 128, dtype=torch.bfloat16)
    why = smem_problem(x, "bshd", "bhsd", 224, 128, "hadamard")
    assert why and ("Hopper" in why or "Gluon" in why)
    with pytest.raises(UsageError, match="reread='smem'"):
        rotate_quantize(x, layout="bshd", gran=PerBlock(224), rot="hadamard", reread="smem")


def test_smem_kernel_is_the_default_only_where_no_launch_is_asked_for():
    """Per-block scales of more than 128 rows (V: at least 128) on the fast path go to a
    shared-memory kernel (where one runs); a reread mode, ``persistent``, a launch setting, the
    float64 path, e5m2, shorter blocks and other granularities keep the tl kernel."""
    from fa3_numerics.kernels.triton_.rotate_quant import smem_candidate

    base = dict(gran_code=2, rows=224, rot="hadamard", reread=None, persistent=None, exact=False, fmt="e4m3",
                tuning=(0,) * 7)
    assert smem_candidate(**base)
    assert smem_candidate(**dict(base, rows=160))
    assert smem_candidate(**dict(base, rows=128, rot="none"))  # V: from 128 rows
    assert not smem_candidate(**dict(base, rows=96, rot="none"))
    for change in (dict(rows=128), dict(gran_code=1), dict(gran_code=3), dict(reread=True), dict(reread="skewed"),
                   dict(persistent=True), dict(persistent=False), dict(exact=True), dict(fmt="e5m2"),
                   dict(tuning=(0, 0, 0, 2, 0, 0, 0)), dict(tuning=(0, 0, True, 0, 0, 0, 0)),
                   dict(tuning=(0, 0, 0, 0, 0, 0, 0, True))):
        assert not smem_candidate(**dict(base, **change)), change


def test_backends_registered_and_explain_themselves():
    for name in ("triton", "triton-two-level", "triton-fused"):
        assert name in BACKENDS
        b = get_backend(name)
        assert b.hardware
        why = b.check("cpu")
        if GPU_REASON is not None and not os.environ.get("TRITON_INTERPRET"):
            assert why, "check() must explain why the kernel cannot run on this machine"
    assert "rot=orthogonal" in get_backend("triton-fused").supports(Recipe.from_str("fa3-fp8,rot=orthogonal"))
    assert get_backend("triton").pv_mode(Recipe.from_str("fa3-fp8,acc=two-level")) == "two-level"
    assert get_backend("triton").pv_mode(Recipe.from_str("fa3-fp8")) == "chained"
    assert get_backend("triton-two-level").pv_mode(Recipe.from_str("fa3-fp8")) == "two-level"


# ---------------------------------------------------------------------------- interpreter


def _interpret(args: list[str], covered_by: str) -> subprocess.CompletedProcess:
    """``python args`` with Triton's interpreter on the CPU (skipped without triton, and where a
    GPU runs the compiled kernels instead: ``covered_by`` names what covers it there)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed: the interpreter tests need it (pip install triton)")
    if GPU_REASON is None:
        pytest.skip(f"a GPU is present: {covered_by} covers this")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def interpreted():
    proc = _interpret(["-m", "fa3_numerics.kernels.triton_.selfcheck", "--json", "--quick", "--device", "cpu"],
                      "the compiled-kernel tests below")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_interpreted_quantizer_matches_prepare(interpreted):
    for r in interpreted["quant"]:
        if r["mode"] == "exact-f64":
            # Bit-identical values; the interpreter's own FP8 cast drops the sign of zero, so
            # compare values (the device test compares bytes).
            assert r["values_equal"] == 1.0 and r["descales_identical"] == 1.0, r
        else:
            # float32 rotation: rare near-ties round the other way (measured on the device).
            assert r["values_equal"] >= 0.999 and r["descales_identical"] >= 0.99, r
            assert r["max_abs_value_diff"] <= 32.0, r  # at most one e4m3 step at the top binade


def test_interpreted_attention_matches_emulator(interpreted):
    assert interpreted["attention"], "no attention case ran"
    for r in interpreted["attention"]:
        assert r["finite"], r
        assert r["F_fp32"] <= 0.01, r
        assert r["identical_fp32"] >= 0.99, r
        assert abs(r["rmse_kernel"] / r["rmse_emulator_fp32"] - 1) < 0.01, r


def test_interpreted_gqa_and_masking(interpreted):
    g = interpreted["gqa"]
    assert g["gqa_identical"] and g["finite"] and g["masked_rows_zero"] and g["live_rows_nonzero"], g


# Persistent (software-pipelined) fast kernel against the one-program-per-tile kernel: the same
# float32 arithmetic, so the same bytes. Cases cover every granularity, a GQA group, rotation on
# and off, the three output layouts, a seqlen that is no multiple of the tile and several work
# items per program (the interpreter runs 3 programs); blocks in one tile, in sub-tiles kept in
# registers (2, 3 and 4 of them, the last partly or wholly past the block or the sequence), in
# sub-tiles read again (as more steps, at the block's end, one block behind), and with the
# sub-tiles' inputs kept and rotated again (2, 3, 4).
_PERSIST_SNIPPET = r"""
import json, torch
from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken
g = torch.Generator().manual_seed(5)
b, n, h, d = 2, 150, 4, 64
x = (torch.randn(b, n, h, d, generator=g) * (1 + 10 * (torch.rand(b, n, h, d, generator=g) < 0.01))).to(torch.bfloat16)
x128 = (torch.randn(1, 500, 2, 128, generator=g) * 3).to(torch.bfloat16)
out = []
for name, gran, grp, rot, lay, pw, extra in [
        ("token", PerToken(), 1, "hadamard", "bhsd", 0, {}), ("head", PerHead(), 2, "hadamard", "bhds", 0, {}),
        ("head", PerHead(), 1, "none", "bshd", 1, {}), ("tensor", PerTensor(), 1, "hadamard", "bhsd", 0, {}),
        ("block96", PerBlock(96), 1, "hadamard", "bhds", 0, {}), ("block64", PerBlock(64), 1, "none", "bhsd", 1, {}),
        ("block96", PerBlock(96), 1, "hadamard", "bhsd", 0, {"sub_tile": 32, "reread": False}), ("block64", PerBlock(64), 1, "none", "bhsd", 1, {"sub_tile": 32}),
        ("block96", PerBlock(96), 1, "none", "bhds", 0, {"sub_tile": 32}),
        ("block112", PerBlock(112), 1, "hadamard", "bshd", 1, {"sub_tile": 32, "reread": False}),
        ("block96", PerBlock(96), 1, "hadamard", "bhsd", 0, {"sub_tile": 32, "reread": True}),
        ("block96", PerBlock(96), 1, "hadamard", "bshd", 1, {"sub_tile": 32, "reread": "sync"}),
        ("block128", PerBlock(128), 1, "none", "bhsd", 0, {"sub_tile": 16}),
        ("block96", PerBlock(96), 1, "hadamard", "bhsd", 0, {"sub_tile": 32, "reread": "inputs"}),
        ("block112", PerBlock(112), 1, "hadamard", "bshd", 1, {"sub_tile": 32, "reread": "inputs"}),
        ("block96", PerBlock(96), 1, "none", "bhds", 0, {"sub_tile": 32, "reread": "inputs"}),
        ("block64", PerBlock(64), 1, "hadamard", "bhds", 0, {"sub_tile": 32, "reread": "inputs"}),
        ("block112", PerBlock(112), 1, "hadamard", "bshd", 1, {"sub_tile": 32, "reread": "skewed"}),
        ("block96", PerBlock(96), 1, "none", "bhds", 0, {"sub_tile": 32, "reread": "skewed"}),
        ("block64", PerBlock(64), 1, "hadamard", "bhsd", 0, {"sub_tile": 32, "reread": "skewed"}),
        ("vblock224 d128", PerBlock(224), 1, "none", "bhds", 1, {})]:  # V's default: 32-row sub-tiles, skewed
    xin = x if "d128" not in name else x128
    for hf in (True, False):
        kw = dict(layout="bshd", gran=gran, group=grp, rot=rot, seed=3, out_layout=lay, pow2=bool(pw), tile=32)
        a = rotate_quantize(xin, persistent=False, **kw)
        p = rotate_quantize(xin, persistent=True, head_fast=hf, **kw, **extra)
        out.append({"case": f"{name} {rot} {lay} {extra} head_fast={hf}: {p.launch}", "shape_ok": a.values.shape == p.values.shape,
                    "bytes": bool(torch.equal(a.values.view(torch.uint8), p.values.view(torch.uint8))),
                    "descales": bool(torch.equal(a.descale, p.descale))})
print(json.dumps(out))
"""


def test_interpreted_persistent_kernel_matches_tiled():
    proc = _interpret(["-c", _PERSIST_SNIPPET], "test_gpu_persistent_kernel_matches_tiled")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 42
    launches = " ".join(r["case"] for r in rows)
    for mode in ("x2 kept", "x3 kept", "x4 kept", "x3 reread ", "reread-sync", "x2 kept-inputs", "x3 kept-inputs",
                 "x4 kept-inputs", "x2 reread-skewed", "x3 reread-skewed", "x4 reread-skewed", "tile32 x7 reread-skewed"):
        assert mode in launches, mode
    for r in rows:
        assert r["shape_ok"] and r["bytes"] and r["descales"], r


# ---------------------------------------------------------------------------- GPU


gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


@gpu
def test_gpu_hardware_casts_equal_soft_rounding():
    from fa3_numerics.kernels.triton_.selfcheck import cast_checks

    res = cast_checks("cuda")
    assert all(v for k, v in res.items() if k.endswith("_hw_eq_soft")), res


@gpu
def test_gpu_exact_quantizer_is_bit_identical_to_prepare():
    from fa3_numerics.kernels.triton_.selfcheck import quantizer_checks

    for r in quantizer_checks("cuda", shape=(1, 8, 1024, 128), impls=("butterfly", "dot")):
        if r["mode"] == "exact-f64":
            assert r["values_identical"] == 1.0 and r["descales_identical"] == 1.0, r
        else:
            assert r["values_equal"] >= 0.999, r


@gpu
def test_gpu_gqa_and_masking():
    from fa3_numerics.kernels.triton_.selfcheck import gqa_check

    g = gqa_check("cuda")
    assert all(g.values()), g


@gpu
def test_gpu_emulator_reproduces_kernel():
    from fa3_numerics.kernels.triton_.selfcheck import ATT_CASES, attention_checks

    for r in attention_checks("cuda", cases=ATT_CASES, accs=("fp32", "fp22", "two-level")):
        assert r["finite"], r
        model = "two-level" if r["backend"] == "triton-two-level" or "acc=two-level" in r["recipe"] else "fp22"
        # The MMA model fitted to the FA3 kernel also fits Triton's FP8 dot; F <= 0.01 is the bar.
        # Exception, by construction: amax (not power-of-two) V descales per KV tile. The emulator feeds
        # dequantized V (no longer FP8 values) into its MMA model; the kernel keeps V in FP8 and rescales
        # O by vd_prev / vd_cur, which aligns the MMA's truncation differently (measured F 0.017).
        limit = 0.03 if "pow2=0" in r["recipe"] else 0.01
        assert r[f"F_{model}"] <= limit, r


def _adjacent_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every differing e4m3 byte one code step from the other (same sign): a near-tie rounded the other way."""
    ua, ub = a.view(torch.uint8).long(), b.view(torch.uint8).long()
    diff = ua != ub
    return bool((((ua ^ ub) & 0x80) == 0)[diff].all() and ((ua & 0x7F) - (ub & 0x7F)).abs()[diff].le(1).all())


@gpu
def test_gpu_smem_quantizer_matches_prepare():
    """The shared-memory kernel (Gluon, TMA, split rotation) against the emulator's rotation and
    ``quantize`` in float64: the bytes differ only in rare near-ties, each one FP8 step (as the
    one-product kernel's; its count beside), power-of-two descales identical, amax descales
    within a float32 ulp. Blocks of 224 (short last sub-tile), 96, 128 and 256 rows, a sequence
    that ends inside a block, both layouts, 2 and 4 column parts, the last sub-tile kept or not
    (its units staging the FP8 tiles, or a staging buffer)."""
    from fa3_numerics.errors import UsageError
    from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
    from fa3_numerics.numerics.granularity import PerBlock
    from fa3_numerics.numerics.quant import quantize
    from fa3_numerics.numerics.rotation import make_rotation

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the shared-memory kernel is written for sm_90 (TMA, wgmma)")
    g = torch.Generator(device="cuda").manual_seed(11)
    b, n, h, d = 2, 1000, 4, 128
    x = torch.randn(b, n, h, d, generator=g, device="cuda")
    x = (x * (1 + 30 * (torch.rand(b, n, h, d, generator=g, device="cuda") < 0.01))).to(torch.bfloat16)
    for rows, lay, out, pow2, extra in [(224, "bshd", "bhsd", True, {}), (224, "bhsd", "bshd", False, {}),
                                        (224, "bshd", "bhsd", False, {"parts": 4}),
                                        (224, "bshd", "bhsd", True, {"keep_last": True}),
                                        (224, "bhsd", "bhsd", False, {"keep_last": True}),
                                        (224, "bshd", "bhsd", True, {"keep_last": True, "stage_in_ring": False}),
                                        (224, "bshd", "bhsd", False, {"stage_in_ring": False}),
                                        (96, "bshd", "bhsd", False, {}), (128, "bhsd", "bhsd", True, {}),
                                        (256, "bshd", "bhsd", False, {"parts": 4})]:
        xin = x if lay == "bshd" else x.transpose(1, 2).contiguous()
        kw = dict(layout=lay, gran=PerBlock(rows), rot="hadamard", seed=4, pow2=pow2, out_layout=out)
        o = rotate_quantize(xin, reread="smem", **kw, **extra)
        assert o.launch.startswith("gluon smem"), o.launch
        if pow2:  # one multiply by (1/sqrt(d)) / descale: the corrected division's bytes
            od = rotate_quantize(xin, reread="smem", pow2_div=True, **kw, **extra)
            assert "pow2-mul" in o.launch and "pow2-mul" not in od.launch, (o.launch, od.launch)
            assert torch.equal(o.values.view(torch.uint8), od.values.view(torch.uint8)), (rows, lay, extra)
        ref = quantize(make_rotation("hadamard", d, 4).apply(x.transpose(1, 2).double()), "e4m3", PerBlock(rows),
                       pow2=pow2)
        vals = o.values_bhsd()
        same = (vals.contiguous().view(torch.uint8) == ref.values.contiguous().view(torch.uint8)).double().mean().item()
        tl_o = rotate_quantize(xin, reread=True, **kw)
        tl_same = (tl_o.values_bhsd().contiguous().view(torch.uint8)
                   == ref.values.contiguous().view(torch.uint8)).double().mean().item()
        assert same >= 1 - 2e-5 and same >= tl_same - 1e-5, (rows, lay, extra, same, tl_same)
        assert _adjacent_fp8(vals.contiguous(), ref.values.contiguous()), (rows, lay, extra)
        dl = o.descale_like_prepare(h, n).expand_as(ref.descale)
        if pow2:
            assert torch.equal(dl, ref.descale.float()), (rows, lay, extra)
        else:
            torch.testing.assert_close(dl, ref.descale.float(), rtol=2.5e-7, atol=0)
        assert torch.isfinite(o.descale).all()
    # many blocks a program (progs_per_sm=1: 132 programs, 640 blocks): both mbarrier phases, the
    # ring's refills, the staging units reused across blocks; against the tl kernel's bytes
    xb = torch.randn(4, 2048, 16, d, generator=g, device="cuda").to(torch.bfloat16)
    for rows, pow2, extra in [(224, True, {}), (224, False, {}), (224, True, {"keep_last": True}),
                              (224, False, {"stage_in_ring": False}), (128, True, {})]:
        kw = dict(layout="bshd", gran=PerBlock(rows), rot="hadamard", seed=4, pow2=pow2, out_layout="bhsd")
        o = rotate_quantize(xb, reread="smem", progs_per_sm=1, **kw, **extra)
        t = rotate_quantize(xb, reread=True, **kw)
        same = (o.values.view(torch.uint8) == t.values.view(torch.uint8)).double().mean().item()
        assert same >= 1 - 1e-5 and _adjacent_fp8(o.values, t.values), (rows, pow2, extra, same)
        if pow2:
            assert torch.equal(o.descale, t.descale), (rows, extra)
        else:
            torch.testing.assert_close(o.descale, t.descale, rtol=2.5e-7, atol=0)
    # the default for blocks of more than 128 rows written row by row; a launch setting keeps the tl kernel
    for rows, out, extra, kernel in [(224, "bhsd", {}, "gluon smem"), (160, "bshd", {}, "gluon smem"),
                                     (128, "bhsd", {}, "persistent"), (224, "bhds", {}, "persistent"),
                                     (224, "bhsd", {"persistent": True}, "persistent"),
                                     (224, "bhsd", {"stages": 2}, "persistent"),
                                     (224, "bhsd", {"soft_cast": True}, "persistent")]:
        o = rotate_quantize(x, layout="bshd", gran=PerBlock(rows), rot="hadamard", seed=4, out_layout=out, **extra)
        assert o.launch.startswith(kernel), (rows, out, extra, o.launch)
    with pytest.raises(UsageError, match="at most 512 rows"):  # the ring would not fit shared memory
        rotate_quantize(x, layout="bshd", gran=PerBlock(1024), rot="hadamard", out_layout="bhsd", reread="smem")


@gpu
def test_gpu_smem_v_quantizer_matches_tiled():
    """The shared-memory V kernel (no rotation, written (b, h, d, s)) gives the tiled kernel's bytes
    (IEEE division) and descales exactly: blocks of 224, 160 and 96 rows, power-of-two and amax
    descales, both input layouts, a sequence that ends inside a block. It is the default for V
    blocks of at least 128 rows; a seqlen that is not a multiple of 16 keeps the tl kernel."""
    from fa3_numerics.errors import UsageError
    from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
    from fa3_numerics.numerics.granularity import PerBlock

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the shared-memory kernel is written for sm_90 (TMA)")
    g = torch.Generator(device="cuda").manual_seed(12)
    b, n, h, d = 4, 1008, 16, 128  # 1008 = 4 x 224 + 112; 320 blocks of 224 rows
    x = torch.randn(b, n, h, d, generator=g, device="cuda")
    x = (x * (1 + 30 * (torch.rand(b, n, h, d, generator=g, device="cuda") < 0.01))).to(torch.bfloat16)
    # progs_per_sm=1: 132 programs take 2-3 blocks each (both mbarrier phases, the ring's refills,
    # the staging tiles reused across blocks, an odd number of units a block at 224 and 160 rows)
    for rows, lay, pow2, extra in [(224, "bshd", True, {}), (224, "bshd", True, {"progs_per_sm": 1}),
                                   (224, "bshd", False, {"progs_per_sm": 1}), (224, "bhsd", True, {"progs_per_sm": 1}),
                                   (160, "bshd", False, {"progs_per_sm": 1}), (96, "bhsd", True, {"progs_per_sm": 1}),
                                   (128, "bshd", True, {"progs_per_sm": 1})]:
        xin = x if lay == "bshd" else x.transpose(1, 2).contiguous()
        kw = dict(layout=lay, gran=PerBlock(rows), rot="none", pow2=pow2, out_layout="bhds")
        o = rotate_quantize(xin, reread="smem", **kw, **extra)
        assert o.launch.startswith("gluon smem-v"), o.launch
        assert ("pow2-mul" in o.launch) == pow2, o.launch
        ref = rotate_quantize(xin, persistent=False, **kw)
        assert torch.equal(o.descale, ref.descale), (rows, lay, pow2)
        assert torch.equal(o.values.view(torch.uint8), ref.values.view(torch.uint8)), (rows, lay, pow2, extra)
        if pow2:  # the corrected division instead of the exact multiply: the same bytes
            od = rotate_quantize(xin, reread="smem", pow2_div=True, **kw, **extra)
            assert "pow2-mul" not in od.launch and torch.equal(od.values.view(torch.uint8), o.values.view(torch.uint8))
    for rows, kernel in ((224, "gluon smem-v"), (128, "gluon smem-v"), (96, "persistent")):
        o = rotate_quantize(x, layout="bshd", gran=PerBlock(rows), rot="none", out_layout="bhds")
        assert o.launch.startswith(kernel), (rows, o.launch)
    odd = rotate_quantize(x[:, :1000].contiguous(), layout="bshd", gran=PerBlock(224), rot="none", out_layout="bhds")
    assert odd.launch.startswith("persistent"), odd.launch
    with pytest.raises(UsageError, match="at most 512 rows"):  # the ring would not fit shared memory
        rotate_quantize(x, layout="bshd", gran=PerBlock(1024), rot="none", out_layout="bhds", reread="smem")


@gpu
def test_gpu_persistent_kernel_matches_tiled():
    """The persistent kernel's descale division (reciprocal + one Markstein correction, fused
    multiply-adds) gives the IEEE division's bytes; head-first and seq-first orders agree; blocks in
    sub-tiles kept in registers (2, 3, 4; written transposed on request) and read again (pipelined:
    the default for 224 rows; at the block's end: on request; one block behind, in the first pass's
    steps: the default for transposed outputs), their inputs kept and rotated again, and launches
    with a register cap (more programs per SM). The sweep of tools/device/triton_h200.py compares
    one-tile blocks."""
    from fa3_numerics.kernels.triton_.rotate_quant import rotate_quantize
    from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken

    g = torch.Generator(device="cuda").manual_seed(5)
    b, n, h, d = 2, 1000, 8, 128
    x = torch.randn(b, n, h, d, generator=g, device="cuda")
    x = (x * (1 + 10 * (torch.rand(b, n, h, d, generator=g, device="cuda") < 0.01))).to(torch.bfloat16)
    for gran, grp, rot, lay, extra in [
            (PerToken(), 1, "hadamard", "bhsd", {}), (PerHead(), 2, "hadamard", "bshd", {}), (PerHead(), 1, "none", "bhds", {}),
            (PerTensor(), 1, "hadamard", "bhsd", {}), (PerBlock(128), 1, "hadamard", "bhsd", {}),
            (PerBlock(224), 1, "hadamard", "bhds", {}), (PerBlock(128), 1, "none", "bhds", {}),
            (PerBlock(224), 1, "none", "bhds", {}), (PerBlock(128), 1, "none", "bhds", {"reread": False}),
            (PerBlock(224), 1, "hadamard", "bhsd", {"reread": False}), (PerBlock(224), 1, "hadamard", "bshd", {"reread": "sync"}),
            (PerBlock(160), 1, "hadamard", "bhsd", {"reread": False}), (PerBlock(512), 1, "hadamard", "bhsd", {"reread": True}),
            (PerBlock(224), 1, "hadamard", "bshd", {"reread": "inputs"}), (PerBlock(160), 1, "hadamard", "bhsd", {"reread": "inputs"}),
            (PerBlock(128), 1, "hadamard", "bhds", {"reread": "inputs"}),
            (PerBlock(224), 1, "none", "bhds", {"reread": "inputs"}), (PerBlock(128), 1, "none", "bhds", {"reread": "inputs"}),
            (PerBlock(224), 1, "hadamard", "bhsd", {"reread": True, "stages": 4}),
            (PerBlock(224), 1, "hadamard", "bhsd", {"reread": True}),
            (PerBlock(224), 1, "none", "bhds", {"reread": True, "max_regs": 128}),
            (PerBlock(224), 1, "hadamard", "bshd", {"reread": "skewed"}), (PerBlock(160), 1, "none", "bhds", {"reread": "skewed"}),
            (PerBlock(128), 1, "hadamard", "bhsd", {"reread": "skewed", "num_warps": 8}),
            (PerBlock(224), 1, "none", "bhds", {"reread": "skewed", "max_regs": 168, "stages": 2}),
            (PerToken(), 1, "hadamard", "bhsd", {"max_regs": 168, "stages": 2})]:
        for pow2 in (False, True):  # power-of-two descales: one multiply by the reciprocal (exact)
            kw = dict(layout="bshd", gran=gran, group=grp, rot=rot, seed=3, out_layout=lay, pow2=pow2)
            # the tiled kernel's blocks of over 256 rows: 64-row sub-tiles (256 need more shared memory than there is)
            a = rotate_quantize(x, persistent=False, **kw, **({"tile": 64} if isinstance(gran, PerBlock) and gran.rows > 256 else {}))
            for hf in (True, False):
                p = rotate_quantize(x, persistent=True, head_fast=hf, **kw, **extra)
                assert p.launch.startswith("persistent"), (gran, extra, p.launch)
                assert ("pow2-mul" in p.launch) == pow2, p.launch
                assert torch.equal(a.descale, p.descale), (gran, rot, lay, hf, extra, p.launch)
                same = (a.values.view(torch.uint8) == p.values.view(torch.uint8)).double().mean().item()
                assert same == 1.0, (gran, rot, lay, hf, extra, p.launch, same)
