"""data.dumps.read_grouped: a device dump's GROUP/NAME tensors and its JSON info, read back as written."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from fa3_numerics.data.dumps import read_grouped


def test_groups_and_info_round_trip(tmp_path):
    x, y = torch.arange(6, dtype=torch.uint8).view(2, 3), torch.randn(4)
    path = tmp_path / "d.safetensors"
    # a name may hold further slashes: only the first one separates the group
    save_file({"c_a/o8": x, "c_a/lse": y, "probe/q/rows": y * 2}, str(path),
              metadata={"info": json.dumps({"c_a": {"scale_o": 1.5}})})
    groups, info = read_grouped(path)
    assert set(groups) == {"c_a", "probe"} and set(groups["c_a"]) == {"o8", "lse"}
    assert torch.equal(groups["c_a"]["o8"], x) and torch.equal(groups["probe"]["q/rows"], y * 2)
    assert info == {"c_a": {"scale_o": 1.5}}


def test_a_dump_without_info_reads_as_empty(tmp_path):
    path = tmp_path / "d.safetensors"
    save_file({"g/t": torch.zeros(2)}, str(path))
    groups, info = read_grouped(path)
    assert info == {} and list(groups) == ["g"]
