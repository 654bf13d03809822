"""The validation report's per-head table on captured layers."""

import numpy as np
import xarray as xr

from fa3_numerics.report.validation import _per_head


def test_per_head_ranks_measured_heads_first_and_counts_the_cases_not_run():
    # two captured cases: the FP8 one ran (F per head), the BF16 one was not run (all NaN), as a kernel
    # without a BF16 path records it; the NaN heads must not take the top of the "largest F" table
    f = np.array([[[0.002, 0.0005, 0.009]], [[np.nan, np.nan, np.nan]]])
    ds = xr.Dataset({"fidelity_sample": (("case", "acc", "sample"), f),
                     "identical_sample": (("case", "acc", "sample"), np.zeros_like(f))},
                    coords={"case": ["fp8-layer3-head", "bf16-layer3"], "acc": ["fp22"],
                            "dist": ("case", ["capture-file:c.safetensors"] * 2),
                            "params": ("case", ["layer=3", "layer=3"]), "heads": ("case", [3, 3])})
    para, table = _per_head(ds, ["fp22"])
    assert "3 layer x head x accumulator values; 3 without an F" in para.text
    assert [r[2] for r in table.rows] == ["2", "0", "1"]  # heads by F, largest first
    assert all(r[0] == "fp8-layer3-head" for r in table.rows)
