"""The FP16 P.V accumulator of SageAttention v1, against a numpy float16 step-by-step model."""

import numpy as np
import pytest
import torch

from fa3_numerics.numerics.accumulators import ACCUMULATORS, FP16_K_STEP, fp16_mma, get_accumulator


def _numpy_model(p: np.ndarray, v: np.ndarray, step: int = 16) -> np.ndarray:
    """One rounding to float16 (numpy: nearest even, inf past 65504) after each 16-key MMA."""
    acc = np.zeros((p.shape[0], v.shape[1]), dtype=np.float16)
    for k0 in range(0, p.shape[1], step):
        part = p[:, k0:k0 + step].astype(np.float64) @ v[k0:k0 + step].astype(np.float64)
        with np.errstate(over="ignore"):
            acc = (acc.astype(np.float64) + part).astype(np.float16)
    return acc.astype(np.float32)


@pytest.mark.parametrize("n", [16, 64, 80, 7])
def test_fp16_mma_matches_numpy_float16_steps(n):
    g = torch.Generator().manual_seed(n)
    p = torch.rand(32, n, generator=g).half().float()
    v = (torch.randn(n, 24, generator=g) * 3).half().float()
    got = fp16_mma(p, v)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), _numpy_model(p.numpy(), v.numpy()))
    assert torch.equal(got, got.half().float())  # FP16 values
    exact = p.double() @ v.double()
    err = (got.double() - exact).abs().max().item()
    assert 0 < err <= exact.abs().max().item() * 2.0 ** -10 * (-(-n // 16))  # about one FP16 ulp per MMA


def test_fp16_accumulation_overflows_to_inf():
    p = torch.ones(1, 16)
    v = torch.full((16, 1), 65504.0)
    assert torch.isinf(fp16_mma(p, v)).all()


def test_fp16_accumulator_contract_and_registration():
    g = torch.Generator().manual_seed(1)
    acc = torch.randn(2, 8, 4, generator=g)
    p = torch.rand(2, 8, 64, generator=g).half().float()
    v = torch.randn(2, 64, 4, generator=g).half().float()
    fn = get_accumulator("fp16")
    assert torch.equal(fn(acc, p, v, None), acc + fp16_mma(p, v))
    assert FP16_K_STEP == 16
    # not a model of the FA3 kernel: kept out of the list `validate` runs by default
    assert "fp16" not in ACCUMULATORS
