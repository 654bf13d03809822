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
