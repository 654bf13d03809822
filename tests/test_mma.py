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
