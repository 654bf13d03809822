"""--device-map: the per-layer device spec and its one-line refusals (a dispatched model's passes:
tests/studies/test_impact_device_map.py)."""

from __future__ import annotations

import pytest
import torch

from fa3_numerics.data import placement
from fa3_numerics.errors import UsageError


def test_auto_splits_layers_into_equal_contiguous_runs():
    assert placement.parse_device_map("auto", 5, gpus=2) == ["cuda:0"] * 3 + ["cuda:1"] * 2
    assert placement.parse_device_map("auto", 30, gpus=4) == (["cuda:0"] * 8 + ["cuda:1"] * 8 + ["cuda:2"] * 7
                                                              + ["cuda:3"] * 7)
    assert placement.parse_device_map("auto", 3, gpus=1) == ["cuda:0"] * 3


def test_explicit_map_with_rest():
    assert placement.parse_device_map("0-1:cpu,*:cpu", 4) == ["cpu"] * 4
    assert placement.parse_device_map(" 2 : cpu , 0-1:cpu,3:cpu", 4) == ["cpu"] * 4


@pytest.mark.parametrize("spec, needle", [
    ("0-1:cpu", "leaves layers 2-3 without a device"),
    ("0-2:cpu,2-3:cpu", "places layer 2 twice"),
    ("0-9:cpu", "outside layers 0-3"),
    ("0-3:meta", "only cpu and cuda"),
    ("0-3:tpu0", "torch does not know"),
    ("0-3", "is not LAYERS:DEVICE"),
    ("*:cpu,*:cpu", r"names \* twice"),
    ("", "is empty"),
])
def test_bad_maps_are_one_line_errors(spec, needle):
    with pytest.raises(UsageError, match=needle):
        placement.parse_device_map(spec, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_maps_refused_without_a_gpu():
    with pytest.raises(UsageError, match="sees none"):
        placement.parse_device_map("auto", 4)
    with pytest.raises(UsageError, match="sees 0 GPU"):
        placement.parse_device_map("*:cuda:1", 4)
