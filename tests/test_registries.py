"""The four registries, each shown by adding one entry the way a newcomer would (docs/architecture.md):
(a) a distribution family with CLI-settable parameters, (b) a metric, (c) a backend, (d) a recipe
key. Each test adds the entry in one place and checks that the CLI, its help, the studies and
the reports pick it up without any other edit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fa3_numerics.engine.dataset import read
from fa3_numerics.testing import run_cli

TINY = ["--seqlen", "64", "--heads", "2", "--batch", "1", "--rows", "16"]


pytestmark = pytest.mark.slow  # each registry exercised through CLI runs


def cli_with(app, argv, capsys):
    """Run ``argv`` on a freshly built app (options generated from the registries as they are now)."""
    from fa3_numerics.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv, application=app)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


# -- (a) a distribution family -----------------------------------------------------------------

def ramp(shape, seed, *, slope: float):
    """N(0,1) with K's channel c scaled by 1 + slope * c / head_dim (a smooth channel ramp)."""
    from fa3_numerics.data.distributions import generator

    g = generator(seed)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape.q_shape, shape.kv_shape,
                                                                       shape.kv_shape))
    return q, k * (1 + slope * torch.arange(shape.head_dim, dtype=torch.float64) / shape.head_dim), v


@pytest.fixture()
def ramp_family(monkeypatch):
    from fa3_numerics.data import distributions

    distributions.available()  # the built-in families first
    # What `@register("ramp", ...)` in a module of fa3_numerics/data/distributions/ does.
    monkeypatch.setitem(distributions._REGISTRY, "ramp", distributions.Entry(
        "ramp", ramp, "K channels scaled up linearly", {"slope": (1.0, "scale of the last K channel minus 1")}))


def test_a_distribution_family_is_an_option_a_sweep_and_validate_data(ramp_family, tmp_path, capsys):
    from fa3_numerics.cli import build_app

    app = build_app()
    code, out, _ = cli_with(app, ["run", "outliers", "--help"], capsys)
    # the help's box borders out of the way: the text wraps where the terminal's width puts it
    assert code == 0 and "--slope" in out and "ramp: scale of the last K channel" in " ".join(
        out.replace("│", " ").split())
    code, _, err = cli_with(app, ["run", "outliers", "--dist", "ramp", "--slope", "0,30", *TINY, "--variants",
                                  "fa3-fp8-kernel,acc=fp32", "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    ds = read(tmp_path / "r" / "outliers.nc")
    assert ds["rmse"].dims[0] == "slope" and list(ds["slope"].values) == [0.0, 30.0]
    assert ds.attrs["dist"] == "ramp"
    # per-head scales do not fix a channel ramp: the error grows with the slope
    assert float(ds["rmse"].sel(slope=30.0).mean()) > float(ds["rmse"].sel(slope=0.0).mean())
    # the same family through `validate --dist` (syntax NAME:k=v)
    code, _, err = cli_with(app, ["validate", "--grid", "tiny", "--dist", "ramp:slope=3", "--backend", "fa3-mock",
                                  "--device", "cpu", "--acc", "fp32", "--out", str(tmp_path / "v")], capsys)
    assert code == 0, err
    import xarray as xr

    v = xr.load_dataset(tmp_path / "v" / "validation.nc", engine="h5netcdf")
    assert set(v["dist"].values) == {"ramp"} and all("ramp[slope=3]" in str(c) for c in v["case"].values)


# -- (b) a metric ------------------------------------------------------------------------------

@pytest.fixture()
def p99_metric():
    from fa3_numerics.numerics.metrics import register_metric, unregister_metric

    # What a module of fa3_numerics/numerics/metrics/ does.
    @register_metric("p99_abs", "99th percentile of |O - O_ref|", pool="max", units="output units")
    def p99_abs(t):
        return t.err.abs().flatten(2).quantile(0.99, dim=-1)

    yield
    unregister_metric("p99_abs")


def test_a_metric_is_in_datasets_reports_compare_and_the_audit(p99_metric, tmp_path, capsys):
    from fa3_numerics.studies.audit import rank_metrics

    code, _, err = run_cli(["run", "outliers", *TINY, "--variants", "fa3-fp8", "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    ds = read(tmp_path / "r" / "outliers.nc")
    assert "p99_abs" in ds and ds["p99_abs"].attrs["description"].startswith("99th percentile")
    assert (ds["p99_abs"] <= ds["max_abs"]).all() and (ds["p99_abs"] > 0).all()
    assert "p99_abs [95% CI]" in (tmp_path / "r" / "report.md").read_text()
    nc = str(tmp_path / "r" / "outliers.nc")
    code, out, err = run_cli(["compare", nc, nc, "--metric", "p99_abs"], capsys)
    assert code == 0 and "A p99_abs" in out, err
    assert "p99_abs" in rank_metrics()


# -- (c) a backend -----------------------------------------------------------------------------

class Float32Attention:
    """Plain float32 softmax attention on the unquantized inputs: what a framework without FP8 runs."""

    name = "float32"
    description = "softmax attention in float32 (no quantization), PyTorch matmuls"
    hardware = False

    def check(self, device):
        return None if device == "cpu" else "this example backend runs on the CPU; use --device cpu"

    def supports(self, recipe):
        if (recipe.qk, recipe.v, recipe.p, recipe.out) != ("fp32",) * 4:
            return "it computes in float32 only; use qk=fp32,v=fp32,p=fp32,out=fp32"
        return None

    def attention(self, recipe, q, k, v, *, causal, q_index, rotation_seed, cache, softmax_scale=None):
        from fa3_numerics.numerics.reference import expand_kv

        scale = softmax_scale or q.shape[-1] ** -0.5
        s = torch.matmul(q.float()[:, :, q_index], expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
        return torch.matmul(torch.softmax(s, dim=-1), expand_kv(v, q.shape[1]).float()).double()


def test_a_backend_is_listed_runs_and_refuses_what_it_cannot(tmp_path, capsys, monkeypatch):
    from fa3_numerics.engine import backends

    # One line registers it (in a module of your own: register_backend(...) or an entry point).
    monkeypatch.setitem(backends.BACKENDS, "float32", (None, f"{__name__}:Float32Attention"))
    code, out, _ = run_cli(["backends", "--device", "cpu"], capsys)
    assert code == 0 and "float32" in out and "softmax attention in float32" in out
    code, _, err = run_cli(["run", "outliers", *TINY, "--backend", "float32", "--variants", "fa3-fp8",
                            "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "it computes in float32 only" in err
    code, _, err = run_cli(["run", "outliers", *TINY, "--backend", "float32", "--variants",
                            "qk=fp32,v=fp32,p=fp32,out=fp32,poff=0", "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    ds = read(tmp_path / "r" / "outliers.nc")
    assert ds.attrs["backend"] == "float32" and float(ds["rmse"].max()) < 1e-6  # float32 rounding only


# -- (d) a recipe key --------------------------------------------------------------------------

KEY_MODULE = '''
"""Recipe key ``vclip``: clip |V| before it is quantized (an example key, not implemented)."""
from fa3_numerics.numerics.keys import Factor, RecipeKey, parse_float, register_factor, register_key

register_key(RecipeKey("vclip", 0.0, "clip |V| to this before quantizing (0 = off)", parse=parse_float,
                       stages=("v",), exact=0.0, tensors=("v",), cost=lambda v: 1 if v else 0))
register_factor(Factor("vclip", "off", "V clipping: off or clip8", {"off": "", "clip8": "vclip=8"}))
'''

CHECKS = '''
import json
from typer.testing import CliRunner
from fa3_numerics.cli import app
from fa3_numerics.numerics.keys import keys
from fa3_numerics.numerics.recipe import PRESETS, Recipe
from fa3_numerics.studies.attribution import exact_recipe, stage_recipe
from fa3_numerics.studies.audit import recipe_cost
specs = {n: [p.recipe.short_str(), p.recipe.spec()] for n, p in PRESETS.items()}
if "vclip" not in [k.key for k in keys()]:
    print(json.dumps({"specs": specs}))
    raise SystemExit(0)
r = Recipe.from_str("fa3-fp8,vclip=8")
run = CliRunner()
print(json.dumps({
    "specs": specs,
    "default": Recipe().vclip, "short": r.short_str(), "round_trip": Recipe.from_str(r.spec()) == r,
    "namespace": list(map(list, r.cache_namespace())),
    "stage_v": stage_recipe(r, "v").vclip, "exact": exact_recipe(r).vclip,
    "cost": recipe_cost(r) - recipe_cost(PRESETS["fa3-fp8"].recipe),
    "variants": run.invoke(app, ["variants"]).output,
    "ablation_help": run.invoke(app, ["run", "ablation", "--help"]).output,
    "refused": run.invoke(app, ["run", "outliers", "--variants", "fa3-fp8-kernel,vclip=8", "--backend", "fa3-mock",
                                "--out", "unused"]).exception.args[0],
}))
'''


def _checks(env_path: str | None) -> dict:
    import json

    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_recipe_key_from_one_module(tmp_path):
    """The key module is the whole change; it is found through the ``fa3_numerics.recipe_keys``
    entry-point group (a module of fa3_numerics/numerics/keys/ is found the same way)."""
    (tmp_path / "fa3n_vclip.py").write_text(textwrap.dedent(KEY_MODULE))
    info = tmp_path / "fa3n_vclip-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fa3n-vclip\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fa3_numerics.recipe_keys]\nvclip = fa3n_vclip\n")
    got = _checks(str(tmp_path))
    assert got["default"] == 0.0 and got["short"] == "gran=block,pow2=1,rot=hadamard,vclip=8" and got["round_trip"]
    assert got["namespace"] == [["vclip", 8.0]]  # its V is never taken from another recipe's cache
    assert got["stage_v"] == 8.0 and got["exact"] == 0.0 and got["cost"] == 1
    assert "vclip (default 0): clip |V| to this before quantizing" in got["variants"]
    assert "--vclip" in got["ablation_help"]
    assert "vclip=8 is not implemented by backend 'fa3-mock' (only emulate)" in got["refused"]
    # A key at its default changes no stored spec string.
    assert got["specs"] == _checks(None)["specs"]


def test_ftz_key_is_default_on_and_invisible_in_existing_specs():
    from fa3_numerics.engine.backends import get_backend, refusal
    from fa3_numerics.numerics.recipe import PRESETS, Recipe

    assert Recipe().ftz is True
    for p in PRESETS.values():
        assert "ftz" not in p.recipe.short_str() and "ftz" not in p.recipe.spec()
    r = Recipe.from_str("fa3-fp8-kernel,ftz=0")
    assert r.ftz is False and r.short_str() == "acc=fp22,ftz=0" and Recipe.from_str(r.spec()) == r
    assert "ftz=0 is not implemented by backend 'fa3'" in refusal(get_backend("fa3"), r)
    assert refusal(get_backend("emulate"), r) is None
    assert refusal(get_backend("fa3"), PRESETS["fa3-fp8-kernel"].recipe) is None
