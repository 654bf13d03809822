"""The compiled FA3 kernel against the emulator: runs only where a Hopper GPU and the kernel are.

Elsewhere every test here is skipped with the reason (the backend's own one-line diagnosis).
"""

import pytest
import torch

from fa3_numerics.engine.backends import get_backend
from fa3_numerics.studies.validate import F_LIMIT, Case, case_recipe, run_validation

_WHY = get_backend("fa3").check("cuda")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"FA3 kernel unavailable: {_WHY}")


def _f(case: Case, acc: str = "fp22") -> float:
    """F of the emulator's Hopper MMA model (acc=fp22), the model fitted to this kernel."""
    ds = run_validation([case], device="cuda", accs=[acc], progress=lambda m: None)
    return float(ds["fidelity"].values[0, 0])


@pytest.mark.parametrize("case", [
    Case(seqlen=512, heads=2, kv_heads=2, batch=1),
    Case(seqlen=333, heads=4, kv_heads=2, batch=1, causal=True, rot="hadamard"),
    Case(seqlen=512, heads=2, kv_heads=2, batch=1, head_dim=64, gran="tensor"),
], ids=lambda c: c.name)
def test_kernel_matches_emulator_fp8(case):
    f = _f(case)
    assert f <= F_LIMIT, f"F = {f:.4f} > {F_LIMIT} for {case.name}"


def test_kernel_bf16_is_close_to_emulator():
    f = _f(Case(seqlen=512, heads=2, kv_heads=2, batch=1, dtype="bf16"))
    assert f <= 0.2, f"F = {f:.4f} for BF16"


def test_kernel_inputs_round_trip_on_gpu():
    """The kernel's output for the emulator's inputs is deterministic and finite."""
    from fa3_numerics.kernels.fa3 import Fa3Backend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 128, generator=g, dtype=torch.float64).cuda() for _ in range(3))
    rows = torch.arange(256, device="cuda")
    r = case_recipe(Case())
    o1 = Fa3Backend().attention(r, q, k, v, causal=False, q_index=rows, rotation_seed=0, cache={})
    o2 = Fa3Backend().attention(r, q, k, v, causal=False, q_index=rows[::3], rotation_seed=0, cache={})
    assert torch.isfinite(o1).all() and torch.equal(o1[:, :, ::3], o2)
