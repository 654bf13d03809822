import pytest
import torch

from fa3_numerics.numerics.formats import get_format, round_to_format
from fa3_numerics.numerics.granularity import PerBlock, PerHead, PerTensor, PerToken, amax, parse_granularity
from fa3_numerics.numerics.quant import amax_to_scale, quantize


@pytest.fixture
def x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 300, 64, generator=g, dtype=torch.float64) * 3


@pytest.mark.parametrize("gran,shape", [(PerTensor(), (1, 1, 1, 1)), (PerHead(), (2, 4, 1, 1)),
                                        (PerToken(), (2, 4, 300, 1)), (PerBlock(128), (2, 4, 300, 1))])
def test_amax_shapes(x, gran, shape):
    assert amax(x, gran).shape == shape


def test_block_amax_is_blockwise(x):
    a = amax(x, PerBlock(128))
    for s in (0, 128, 256):
        blk = x[:, :, s:s + 128].abs().amax(dim=(2, 3))
        assert torch.equal(a[:, :, s, 0], blk)
        assert torch.equal(a[:, :, min(s + 127, 299), 0], blk)  # constant across the block, last block short


def test_grouped_head_amax(x):
    a = amax(x, PerHead(), group=2)
    assert torch.equal(a[:, 0], a[:, 1]) and torch.equal(a[:, 2], a[:, 3])
    assert torch.equal(a[:, 0, 0, 0], x[:, :2].abs().amax(dim=(1, 2, 3)))


@pytest.mark.parametrize("gran", [PerTensor(), PerHead(), PerToken(), PerBlock(64)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_is_independent_rounding_of_scaled_values(x, gran, fmt):
    q = quantize(x, fmt, gran)
    f = get_format(fmt)
    d = q.descale.double()
    assert q.descale.dtype == torch.float32
    # amax maps exactly to the format's max (up to the float32 descale) and nothing saturates beyond it
    assert torch.all(q.values.double().abs() <= f.max)
    assert torch.equal(q.values.double(), round_to_format(x / d, fmt))
    rel = ((q.dequantize() - x).abs() / x.abs().clamp_min(1e-3)).median()
    assert rel < 2.0 ** -(f.mbits + 1)


def test_pow2_scales_are_powers_of_two(x):
    q = quantize(x, "e4m3", PerHead(), pow2=True)
    m, _ = torch.frexp(q.descale)
    assert torch.all(m == 0.5)
    assert torch.all(q.values.double().abs() <= 448)


def test_zero_tensor_scale_is_one():
    assert amax_to_scale(torch.zeros(1), get_format("e4m3")).item() == 1.0


def test_rows_quantize_equals_full_then_select(x):
    rows = torch.tensor([0, 5, 127, 128, 299])
    for gran in (PerTensor(), PerHead(), PerBlock(128), PerToken()):
        full = quantize(x, "e4m3", gran)
        part = quantize(x, "e4m3", gran, rows=rows)
        assert torch.equal(part.values.double(), full.values.double()[:, :, rows])


def test_parse_granularity():
    assert parse_granularity("block64") == PerBlock(64)
    assert parse_granularity("block") == PerBlock()
    with pytest.raises(ValueError):
        parse_granularity("row")
