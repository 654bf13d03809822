"""dump_field's cudnn-tie probes (tools/device/dump_field.py) and fit_field's tie distance: the
constructed rows must be what the metadata says they are, or the device data cannot be read."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS / "device"))
sys.path.insert(0, str(TOOLS))

import dump_field  # noqa: E402
import fit_field  # noqa: E402


def test_tie_inputs_are_exact_codes_with_the_recorded_margins():
    nk, positions = 256, (0, 255)
    q, k, v, intended, rows = dump_field.tie_inputs(nk, positions, math.log(2.0), 1.0, 7)
    assert len(rows) == dump_field.TIE_ROWS == 128
    s = torch.einsum("bhqd,bhkd->bhqk", q, k)  # dot units = log2 units at attn_scale ln 2
    for h, pos in enumerate(positions):
        top = s[0, h, :dump_field.TIE_ROWS]
        assert bool((top.argmax(-1) == pos).all())
        others = torch.cat([top[:, :pos], top[:, pos + 1:]], -1)
        gap = top[:, pos] - others.max(-1).values
        for i, r in enumerate(rows):
            want = 896.0 if math.isinf(r["margin_target"]) else r["margin_target"]
            assert gap[i].item() == want == r["margin_log2"]
            assert top[i, pos].item() == r["level_target"]
    _, ins = dump_field.cudnn_inputs(q, k, v, False, torch.device("cpu"))
    for name in "qkv":
        assert torch.equal(ins[name].to(torch.float64), intended[f"{name}8"])
    assert [float(ins[f"descale_{n}"]) for n in "qkv"] == [1.0, 1.0, 1.0]


def test_tie_inputs_keep_the_requested_descale_v():
    dv = float(torch.tensor(0.3 / 448.0))
    q, k, v, intended, _ = dump_field.tie_inputs(256, (0,), 1.0 / math.sqrt(128), dv, 3)
    _, ins = dump_field.cudnn_inputs(q, k, v, False, torch.device("cpu"))
    assert float(ins["descale_v"]) == dv
    assert torch.equal(ins["v"].to(torch.float64), intended["v8"])


def test_tie_distance_counts_float32_ulps_from_the_midpoint():
    x = torch.tensor([42.0, 272.0, 41.0, 0.0146484375], dtype=torch.float32)
    up = torch.nextafter(x, torch.tensor(math.inf))
    assert fit_field.tie_distance(x)[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    assert fit_field.tie_distance(up)[[0, 1, 3]].tolist() == [1.0, 1.0, 1.0]
    assert abs(fit_field.tie_distance(x)[2].item()) > 1000  # 41: halfway from the code 40 to the tie 42
