"""The Hopper FP8 MMA model: known values, and bit-identity with the real FA3 kernel's outputs."""

import json
from pathlib import Path

import pytest
import torch

from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.mma import hopper_fp8_mma
from fa3_numerics.numerics.recipe import Recipe

DATA = Path(__file__).parent / "data" / "fa3_h200_s1000_h4_d128.safetensors"


def test_small_integers_are_exact():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-2, 3, (5, 96), generator=g).float()
    b = torch.randint(-2, 3, (96, 7), generator=g).float()
    assert torch.equal(hopper_fp8_mma(a, b), a @ b)


def test_small_products_are_truncated_away():
    a = torch.zeros(1, 32)
    b = torch.zeros(32, 1)
    a[0, 0], b[0, 0] = 1.0, 1.0
    a[0, 1], b[1, 0] = 2.0 ** -9, 2.0 ** -9  # product 2^-18 lies below ulp 2^(0-13)
    assert hopper_fp8_mma(a, b).item() == 1.0
    a[0, 1], b[1, 0] = 2.0 ** -6, 2.0 ** -7  # 2^-13: exactly one ulp, kept
    assert hopper_fp8_mma(a, b).item() == 1.0 + 2.0 ** -13


def test_truncation_is_toward_zero_and_accumulator_counts():
    a = torch.tensor([[-1.0, -0.001953125 * 1.5]])  # -1 and -1.5 * 2^-9 (an e4m3 subnormal)
    a = torch.nn.functional.pad(a, (0, 30))
    b = torch.nn.functional.pad(torch.tensor([[1.0], [2.0 ** -4]]), (0, 0, 0, 30))
    # second product -1.5 * 2^-13 truncates toward zero at ulp 2^-13 to -2^-13
    assert hopper_fp8_mma(a, b).item() == -1.0 - 2.0 ** -13
    # an accumulator C with a larger exponent coarsens the ulp of the whole step
    c = torch.tensor([[64.0]])
    assert hopper_fp8_mma(a, b, c).item() == 63.0  # ulp 2^(6-13): the small product vanishes


def test_steps_of_32_keys():
    """Within one 32-key step the terms align to the step's largest exponent; across steps they don't."""
    a = torch.zeros(1, 64)
    b = torch.zeros(64, 1)
    a[0, 0] = b[0, 0] = 16.0  # 256 in step 0
    a[0, 1] = b[1, 0] = 2.0 ** -3  # 2^-6: below ulp 2^(8-13) = 2^-5 in the same step -> dropped
    assert hopper_fp8_mma(a, b).item() == 256.0
    a[0, 1] = b[1, 0] = 0.0
    a[0, 32] = b[32, 0] = 2.0 ** -3  # the same product in the next step is added to C = 256
    assert hopper_fp8_mma(a, b).item() == 256.0  # C's exponent still sets ulp 2^-5: dropped
    a[0, 33] = b[33, 0] = 2.0 ** -2  # 2^-4 = 2 ulps: kept
    assert hopper_fp8_mma(a, b).item() == 256.0 + 2.0 ** -4


def _kernel_case():
    from safetensors import safe_open
    from safetensors.torch import load_file

    t = load_file(DATA)
    with safe_open(DATA, "pt") as f:
        meta = f.metadata()

    def deq(x, d):
        x = x.view(torch.float8_e4m3fn).double().transpose(1, 2)
        return x * d.double().repeat_interleave(x.shape[1] // d.shape[1], dim=1)[:, :, None, None]

    # Dequantized inputs re-quantize to exactly the kernel's FP8 bytes and descales.
    q, k, v = (deq(t[n + "8"], t[n + "_descale"]) for n in ("q", "k", "v"))
    return q, k, v, t["rows"], t["o_fp8_rows"].transpose(1, 2).double(), json.loads(meta["config"])


@pytest.mark.skipif(not DATA.is_file(), reason="kernel fixture missing")
def test_emulator_matches_h200_kernel_bit_for_bit():
    """Outputs of the real FA3 FP8 kernel (H200, fa3-fwd 0.0.3), seqlen 1000 (a partial last
    KV tile), 4 heads, head dim 128, per-head descales."""
    q, k, v, rows, o_kernel, cfg = _kernel_case()
    assert not cfg["causal"]
    same = {}
    for acc in ("fp22", "fp32"):
        o = emulate(Recipe.from_str(f"fa3-fp8-kernel,acc={acc}"), q, k, v, q_index=rows)
        same[acc] = (o == o_kernel).double().mean().item()
    assert same["fp22"] >= 0.999, same
    assert same["fp32"] < 0.8, same  # the MMA model is what makes the difference


# -- the rules of the model, each pinned by a case that a wrong variant would fail ----------


def _ab(pairs, k=64):
    """a [1, k], b [k, 1] with a[0, i] * b[i, 0] given as (i, a_i, b_i)."""
    a, b = torch.zeros(1, k), torch.zeros(k, 1)
    for i, x, y in pairs:
        a[0, i], b[i, 0] = x, y
    return a, b


def test_k_step_is_exactly_32():
    """+1 and -1 cancel in the first products; a small product 2^-20 in the same 32-product
    step is aligned to their exponent 0 (ulp 2^-13) and dropped, in the next step it stands
    alone and is kept. A k-step of 16 would keep it at position 31, one of 64 drop it at 32."""
    a, b = _ab([(0, 1.0, 1.0), (1, -1.0, 1.0), (31, 2.0 ** -10, 2.0 ** -10)])
    assert hopper_fp8_mma(a, b).item() == 0.0
    a, b = _ab([(0, 1.0, 1.0), (1, -1.0, 1.0), (32, 2.0 ** -10, 2.0 ** -10)])
    assert hopper_fp8_mma(a, b).item() == 2.0 ** -20


def test_alignment_uses_sum_of_input_exponents_not_product_exponent():
    """1.75 * 1.75 = 3.0625 has exponent 1, but E(a) + E(b) = 0 sets the ulp at 2^-13, so a
    product of 2^-13 survives; aligned to the true exponent (ulp 2^-12) it would vanish. A
    -1.5 brings the sum below 2, so the final 13-bit truncation keeps the 2^-13 too."""
    a, b = _ab([(0, 1.75, 1.75), (1, -1.5, 1.0), (2, 2.0 ** -6, 2.0 ** -7)])
    assert hopper_fp8_mma(a, b).item() == 1.5625 + 2.0 ** -13


def test_e4m3_subnormal_operands_count_with_exponent_minus_6():
    """-1.5 * 2^-7 = -0.75 * 2^-6 is an e4m3 subnormal (mantissa 0.110); its exponent is taken
    as -6 (the format's smallest normal), not -7."""
    x = -1.5 * 2.0 ** -7
    assert float(torch.tensor(x).to(torch.float8_e4m3fn).float()) == x  # representable
    a, b = _ab([(0, 2.0 ** -6, 1.0), (1, x, 2.0 ** -7)])
    # emax = max(-6 + 0, -6 + -7) = -6: ulp 2^-19; the second product -1.5 * 2^-14 = -3 * 2^-15 keeps
    # its value (a multiple of 2^-19), so the result is exact.
    assert hopper_fp8_mma(a, b).item() == 2.0 ** -6 - 1.5 * 2.0 ** -14


def test_tiny_and_subnormal_accumulators_stay_finite():
    """A C of 2^-120 (normal) or 2^-140 (subnormal) with an all-zero step: 2^(13 - E(C)) leaves
    the float32 range, which made the old model return inf / inf = NaN. The result is C
    truncated to 14 significant bits."""
    a, b = torch.zeros(1, 32), torch.zeros(32, 1)
    for c in (2.0 ** -120 * 1.2345, -(2.0 ** -140) * 1.5, 2.0 ** -149):
        cc = torch.tensor([[c]], dtype=torch.float32)
        d = hopper_fp8_mma(a, b, cc)
        assert torch.isfinite(d).all()
        assert d.item() == torch.tensor(c, dtype=torch.float32).item() or abs(d.item()) < abs(c)
        from fa3_numerics.numerics.mma import hopper_fp8_mma_reference
        assert torch.equal(d, hopper_fp8_mma_reference(a, b, cc))


def test_cancellation_to_zero():
    a, b = _ab([(0, 448.0, 448.0), (5, -448.0, 448.0)])
    assert hopper_fp8_mma(a, b).item() == 0.0
    # C is aligned to the step's largest exponent too (2^16: ulp 2^3) even though the products
    # cancel: 3 is truncated away, 27 keeps its multiple of 8
    assert hopper_fp8_mma(a, b, torch.tensor([[3.0]])).item() == 0.0
    assert hopper_fp8_mma(a, b, torch.tensor([[27.0]])).item() == 24.0


def test_e5m2_operands_use_their_own_smallest_exponent():
    """e5m2 subnormals sit below 2^-14; with min_exp -14 their products align like normals."""
    a, b = _ab([(0, 2.0 ** -16, 1.0), (1, 2.0 ** -15, 1.0)])
    assert hopper_fp8_mma(a, b, a_min_exp=-14, b_min_exp=-6).item() == 2.0 ** -16 + 2.0 ** -15


def test_rows_are_blocked_without_changing_results(monkeypatch):
    """The reference walks rows in blocks to bound memory; block boundaries change nothing."""
    from fa3_numerics.numerics import mma

    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 50, 64, generator=g).to(torch.float8_e4m3fn).float()
    b = torch.randn(3, 64, 20, generator=g).to(torch.float8_e4m3fn).float()
    whole = mma.hopper_fp8_mma_reference(a, b)
    monkeypatch.setattr(mma, "_BLOCK_ELEMS", 3 * 20 * 32 * 7)  # 7 rows per block
    assert torch.equal(mma.hopper_fp8_mma_reference(a, b), whole)


def test_bf16_model_keeps_25_bits_per_16_products():
    """The 16-bit tensor core (fitted to the FA3 BF16 kernel): products aligned at 2^(emax-25)
    within a 16-product step. Four terms of 2^-25 beside a 1 are one ulp each and add up to
    2^-23, which the 24-bit result keeps (lost if fewer than 25 bits were kept); eight terms of
    2^-26 are half an ulp each and vanish (kept if 26 bits were). In the next step the same
    terms align to the accumulator, so the step length is pinned too."""
    from fa3_numerics.numerics.formats import get_format
    from fa3_numerics.numerics.mma import hopper_mma

    bf = get_format("bf16")
    a, b = _ab([(0, 1.0, 1.0)] + [(i, 2.0 ** -12, 2.0 ** -13) for i in range(1, 5)], k=32)
    assert hopper_mma(a, b, a_fmt=bf, b_fmt=bf).item() == 1.0 + 2.0 ** -23
    a, b = _ab([(0, 1.0, 1.0)] + [(i, 2.0 ** -13, 2.0 ** -13) for i in range(1, 9)], k=32)
    assert hopper_mma(a, b, a_fmt=bf, b_fmt=bf).item() == 1.0
    # +1 and -1 cancel in step one; in step two (position 16) the small terms stand alone
    a, b = _ab([(0, 1.0, 1.0), (1, -1.0, 1.0)] + [(i, 2.0 ** -13, 2.0 ** -13) for i in range(15, 17)], k=32)
    assert hopper_mma(a, b, a_fmt=bf, b_fmt=bf).item() == 2.0 ** -26  # position 15 dropped, 16 kept
