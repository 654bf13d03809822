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


# -- sliding windows and soft-capping (numerics/masking.py) ------------------------------------

def _masked_f(kw: dict, *, n: int = 512, heads: int = 2, d: int = 128, causal: bool = True, seed: int = 0):
    """F = RMSE(emulator, kernel) / RMSE(kernel, float64) and the non-finite count, for the FA3
    FP8 recipe with the Hopper MMA model, on the paper's outliers, every query row."""
    import dataclasses

    from fa3_numerics.data.distributions import AttnShape, generate
    from fa3_numerics.engine.backends import get_backend
    from fa3_numerics.numerics.reference import reference_attention

    q, k, v = (x.cuda() for x in generate("outliers", AttnShape(1, heads, n, d), seed, p=0.001, sigma=10.0))
    rows = torch.arange(n, device="cuda")
    r = dataclasses.replace(case_recipe(Case()), acc="fp22")
    ko = get_backend("fa3").attention(r, q, k, v, causal=causal, q_index=rows, rotation_seed=seed, cache={}, **kw)
    eo = get_backend("emulate").attention(r, q, k, v, causal=causal, q_index=rows, rotation_seed=seed, cache={}, **kw)
    ref = reference_attention(q, k, v, causal=causal, **kw)
    bad = int((~torch.isfinite(ko)).sum() + (~torch.isfinite(eo)).sum())
    rmse = lambda x: float(x.pow(2).mean().sqrt())  # noqa: E731
    return rmse(eo - ko) / rmse(ko - ref), bad


@pytest.mark.parametrize("cap", [5.0, 50.0])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_emulator_with_softcap(cap, causal):
    f, bad = _masked_f(dict(softcap=cap), causal=causal)
    assert bad == 0 and f <= 0.05, f"F = {f:.4f}, {bad} non-finite (softcap {cap}, causal {causal})"


def test_kernel_matches_emulator_with_a_sliding_window():
    from fa3_numerics.kernels.fa3 import kernel_features

    if not kernel_features()["window"]:
        # the wheel's build has no local attention: the backend refuses, it never computes a wrong answer
        from fa3_numerics.errors import UsageError

        with pytest.raises(UsageError, match="no sliding windows"):
            _masked_f(dict(window_size=(100, 0)))
        # a window past the sequence is unbounded in FA3's own rewriting: that runs
        f, bad = _masked_f(dict(window_size=(4096, 0)))
        assert bad == 0 and f <= F_LIMIT
        return
    for window in ((100, 0), (31, 0), (64, 64)):
        f, bad = _masked_f(dict(window_size=window), causal=window[1] == 0)
        assert bad == 0 and f <= 0.05, f"F = {f:.4f}, {bad} non-finite (window {window})"
