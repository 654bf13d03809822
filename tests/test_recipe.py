import pytest

from fa3_numerics.errors import UsageError
from fa3_numerics.numerics.granularity import PerBlock, PerTensor
from fa3_numerics.numerics.recipe import PRESETS, TABLE3, Recipe, parse_recipes


def test_table3_presets_exist_with_paper_values():
    for name in TABLE3:
        assert PRESETS[name].paper_rmse is not None


@pytest.mark.parametrize("name", list(PRESETS))
def test_strings_round_trip(name):
    r = PRESETS[name].recipe
    assert Recipe.from_str(r.short_str()) == r
    assert Recipe.from_str(r.spec()) == r
    assert Recipe.from_str(name) == r


def test_preset_with_overrides():
    r = Recipe.from_str("fa3-fp8,acc=fp22,bn=128,gran=block64")
    assert r.acc == "fp22" and r.bn == 128 and r.gran == PerBlock(64) and r.rot == "hadamard"
    assert Recipe.from_str("fa3-fp8-no-block-quant").gran == PerTensor()


def test_kernel_tiles_fill_zeros():
    assert PRESETS["fa3-fp8"].recipe.tiles(128) == (128, 224)
    assert PRESETS["fa3-fp16"].recipe.tiles(128) == (128, 176)
    assert PRESETS["fa3-fp16"].recipe.tiles(128, causal=True) == (128, 128)
    assert PRESETS["fa2-fp16"].recipe.tiles(128) == (128, 64)


@pytest.mark.parametrize("bad,words", [("foo", "unknown variant"), ("qk=e9m9", "unknown number format"),
                                       ("acc=fp16", "acc"), ("gran=row", "granularity"), ("bogus=1", "unknown recipe key"),
                                       ("poff=99", "poff"), ("fa3-fp8,x", "key=value")])
def test_bad_specs(bad, words):
    with pytest.raises(UsageError, match=words):
        Recipe.from_str(bad)


def test_parse_recipes_mixes_presets_and_specs():
    got = parse_recipes("fa3-fp8,baseline-fp8;fa3-fp8,acc=fp22")
    assert [l for l, _ in got] == ["fa3-fp8", "baseline-fp8", "fa3-fp8,acc=fp22"]
    with pytest.raises(UsageError, match="repeat"):
        parse_recipes("fa3-fp8,fa3-fp8")
