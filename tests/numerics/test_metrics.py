import math

import numpy as np
import torch

from fa3_numerics.numerics.metrics import bootstrap_ci, per_sample, pooled


def test_known_values():
    ref = torch.ones(1, 2, 4, 2, dtype=torch.float64)
    out = ref.clone()
    out[0, 1] += 0.5
    m = per_sample(out, ref)
    assert m["rmse"].tolist() == [[0.0, 0.5]]
    assert m["max_abs"].tolist() == [[0.0, 0.5]]
    assert math.isclose(m["rel_l2"][0, 1], 0.5)
    assert math.isclose(m["rel_l1"][0, 1], 0.5)
    assert math.isclose(m["cosine"][0, 1], 1.0)
    assert math.isclose(m["sqnr_db"][0, 1], 10 * math.log10(4))
    assert m["nonfinite"].sum() == 0


def test_nonfinite_counted():
    ref = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    out = ref.clone()
    out[0, 0, 0, 0] = math.nan
    assert per_sample(out, ref)["nonfinite"][0, 0] == 1


def test_pooled_rmse_is_root_mean_square():
    assert math.isclose(pooled("rmse", np.array([3.0, 4.0])), math.sqrt(12.5))


def test_bootstrap_interval_brackets_and_is_reproducible():
    v = np.random.default_rng(0).lognormal(size=64)
    lo, hi = bootstrap_ci("rmse", v)
    assert lo < pooled("rmse", v) < hi
    assert (lo, hi) == bootstrap_ci("rmse", v)


def test_fidelity_known_values_and_the_finite_positions():
    from fa3_numerics.numerics.metrics import compare_outputs, fidelity

    g = torch.Generator().manual_seed(0)
    kernel = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    ref = kernel - 2.0  # RMSE(kernel, ref) = 2
    emu = kernel + 0.5  # RMSE(emu, kernel) = 0.5
    emu.view(-1)[:6] = kernel.view(-1)[:6]  # 6 positions bit-identical, 0 there
    f = fidelity(emu, kernel, ref)
    n = kernel.numel()
    assert math.isclose(f["F"], math.sqrt(0.25 * (n - 6) / n) / 2.0, rel_tol=1e-12)
    assert f["identical"] == 6 / n and f["finite"] == n == f["positions"]
    # The same F as the per-sample sums the validation pools (compare_outputs)
    c = compare_outputs(emu, kernel, ref)
    assert math.isclose(f["F"], math.sqrt(c["vs_se"].sum() / c["vs_ref_se"].sum()), rel_tol=1e-12)
    # Any shape; a NaN of the emulator is left out of F (and is not identical), never hidden as a 0
    e2 = emu.reshape(-1).clone()
    e2[-1] = float("nan")
    f2 = fidelity(e2, kernel.reshape(-1), ref.reshape(-1))
    assert f2["finite"] == n - 1 and f2["identical"] == 6 / n and math.isfinite(f2["F"])
    # The emulator is the kernel: F = 0; the kernel equals the reference but the emulator does not: Inf
    assert fidelity(kernel, kernel, ref)["F"] == 0.0
    assert fidelity(emu, kernel, kernel)["F"] == math.inf
    assert math.isnan(fidelity(torch.full((3,), float("nan")), kernel.reshape(-1)[:3], ref.reshape(-1)[:3])["F"])
