"""impact's runner on a model dispatched by --device-map (data.placement): every pass equals the
undispatched model's, so the hooks that move activations between devices change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from fa3_numerics.data import placement


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama("placement", layers=4, hidden=128, positions=256, words=300, by_frequency=True)


def test_module_map_covers_every_parameter(tiny):
    from fa3_numerics.data import capture as cap

    m, _, _ = cap.load_model(str(tiny))
    mm = placement.module_map(m, ["cpu", "cpu", "cpu", "cpu"])
    for name, _ in m.named_parameters():
        assert any(name == k or name.startswith(k + ".") for k in mm), name
    assert mm["model.layers.3"] == "cpu" and "lm_head" in mm and "model.embed_tokens" in mm


def test_dispatched_model_gives_the_same_passes(tiny):
    """The hooks accelerate installs (forced on one device, as on several) leave every pass of the
    impact runner bit-identical: reference logits, a one-layer FP8 pass's KL."""
    pytest.importorskip("accelerate")
    from fa3_numerics.data import capture as cap
    from fa3_numerics.numerics.recipe import get_recipe
    from fa3_numerics.studies.impact import _backend
    from fa3_numerics.studies.impact_model import REF, ModelRunner, recipe_attn, score

    plain, tok, _ = cap.load_model(str(tiny))
    placed, _, _ = cap.load_model(str(tiny), device_map="0-1:cpu,*:cpu")
    assert placed is not plain
    assert all(hasattr(layer, "_hf_hook") for layer in placed.model.layers)  # the dispatch path ran
    assert placement.devices_of(placed) == ["cpu"] * 4
    text, source = cap.default_text()
    ids = cap.tokenize(tok, text, 48, source)
    r = get_recipe("fa3-fp8-kernel").recipe
    be = _backend("emulate", "cpu", [("fp8", r)])
    out = []
    for m in (plain, placed):
        runner = ModelRunner(m, ids, backend=be, device="cpu", seed=0)
        ref = runner.reference()
        plan = [REF] * 4
        plan[2] = recipe_attn("fp8", r)
        full, _ = runner.run(plan)
        started, _ = runner.run(plan, start=2)  # the reference's layer-2 input, fed past the hooks
        out.append((ref.p.numpy(), full.numpy(), score(ref, full)["kl"], started.numpy()))
    for a, b in zip(out[0], out[1]):
        np.testing.assert_array_equal(a, b)
    assert float(np.mean(out[0][2])) > 0  # a negative control: the FP8 layer did change the logits


def test_cli_refuses_a_bad_map_in_one_line(cli, tiny, tmp_path):
    code, _, err = cli("impact", "--model", tiny, "--tokens", 16, "--device-map", "0-1:cpu", "--out", tmp_path / "i")
    assert code == 2 and "leaves layers 2-3 without a device" in err and "Traceback" not in err
    assert not (tmp_path / "i").exists()  # refused before the folder is made
    code, _, err = cli("recommend", "--model", tiny, "--tokens", 16, "--device-map", "0-9:cpu", "--out",
                       tmp_path / "r")
    assert code == 2 and "outside layers 0-3" in err and "Traceback" not in err


def test_impact_study_records_the_layer_devices(cli, tiny, tmp_path):
    import xarray as xr

    code, _, err = cli("impact", "--model", tiny, "--tokens", 24, "--variants", "exact,fa3-fp8-kernel", "--no-sweep",
                       "--decode", "none", "--no-baselines", "--device-map", "0-1:cpu,*:cpu", "--out", tmp_path / "i",
                       "--format", "md")
    assert code == 0, err
    with xr.open_dataset(tmp_path / "i" / "impact.nc") as ds:
        import json

        assert json.loads(ds.attrs["device_map"]) == {"spec": "0-1:cpu,*:cpu", "layers": ["cpu"] * 4}
