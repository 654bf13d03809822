"""cuDNN's FP8 forward on the H200's one-key tie probes (``smath=cudnn``, keys/smath.py).

tests/fixtures/cudnn_tie_h200.safetensors (``tools/fit_field.py DUMPS fixture-tie``, from part cudnn-tie of
``tools/device/dump_field.py``) holds constructed rows where one key takes all of P (margins of 32 log2
units and more over the other keys), at attn_scale ln 2 and 1/sqrt(128), four score levels, and the
kernel's O codes at 16 scale_o each, chosen so that O * scale_o lands on E4M3 ties and 1-2 float32 ulps
either side: which side the kernel takes is the last bit of its l and of its epilogue's products.
The preset must give every code; FA3's softmax arithmetic (the preset before) misses thousands.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fa3_numerics.data.dumps import read_grouped
from fa3_numerics.numerics.emulator import emulate
from fa3_numerics.numerics.recipe import get_recipe

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "cudnn_tie_h200.safetensors"
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def probes():
    return read_grouped(FIX)


def _codes(recipe, t, m, smath):
    r = dataclasses.replace(recipe, out="fp32", oscale="none", smath=smath)
    q, k, v = (t[f"{n}8"].view(E4M3).double() * m[f"descale_{n}"] for n in "qkv")
    out = []
    for so in t["scale_o"].tolist():
        if smath == "cudnn":
            y = emulate(r, q, k, v, softmax_scale=m["attn_scale"], scale_o=so).float()
        else:
            y = emulate(r, q, k, v, softmax_scale=m["attn_scale"]).float() * so
        out.append(y.clamp(-448, 448).to(E4M3).view(torch.uint8))
    return torch.stack(out)


def test_cudnn_preset_puts_o_on_the_kernels_side_of_every_tie(probes):
    tensors, info = probes
    recipe = get_recipe("cudnn-fp8-fwd").recipe
    assert recipe.smath == "cudnn"
    missed_before = 0
    for tag, t in tensors.items():
        m = info[tag]
        got = _codes(recipe, t, m, "cudnn")
        assert got.shape == t["o8"].shape
        assert int((got != t["o8"]).sum()) == 0, tag  # every code at every scale_o, ties included
        missed_before += int((_codes(recipe, t, m, "fa3") != t["o8"]).sum())
    # negative control: FA3's arithmetic (the preset before: FFMA exponent, offset 8.80735, O = acc / l
    # then * scale_o) takes the other side of the ties on most of these rows
    assert missed_before > 1000


FIX_SUM = FIX.with_name("cudnn_tie_sum_h200.safetensors")


def test_cudnn_row_sum_form_on_a_multi_tile_run():
    """tests/fixtures/cudnn_tie_sum_h200.safetensors (``fit_field.py DUMPS fixture-tie-sum``): one head of the
    n1024 run at 1/sqrt(128) (4 KV tiles, the dominant key in the third), rows of margin 26-32 where the
    other keys' P~ add up to l's last float32 bits. Only the row sum cuDNN keeps (per-tile sums, then
    fma(tile_sum, descale_s, fl(rs rescale)), l descale_s in O's factor) gives every code: the running
    quad sum of P~ in P~'s units (the form before) misses codes on 6 of these rows."""
    tensors, info = read_grouped(FIX_SUM)
    recipe = get_recipe("cudnn-fp8-fwd").recipe
    assert tensors
    for tag, t in tensors.items():
        m = info[tag]
        assert m["nk"] > 2 * 256 and min(r["margin_log2"] for r in m["row_info"]) < 32  # multi-tile, sum-sensitive
        got = _codes(recipe, t, m, "cudnn")
        assert got.shape == t["o8"].shape
        assert int((got != t["o8"]).sum()) == 0, tag
