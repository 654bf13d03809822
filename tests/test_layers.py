"""Every import in the package points down the layer table (``fa3_numerics.layers``, drawn in
docs/architecture.md): read from the sources with ``ast``, function-level imports included."""

from __future__ import annotations

from pathlib import Path

import pytest

from fa3_numerics import layers

REPO = Path(__file__).resolve().parents[1]

# Upward imports other engineers are removing in parallel, allowed here until their branches
# merge; the lead deletes this list after merging. (importer, imported prefix): owner's area.
PENDING: set[tuple[str, str]] = set()  # known upward arrows being removed (none left)


def _pending(entry: str) -> bool:
    importer, rest = entry.split(" -> ", 1)
    imported = rest.split(" ", 1)[0]
    return any(importer == a and (imported == b or imported.startswith(b + ".")) for a, b in PENDING)


def test_every_import_points_down():
    bad = [e for e in layers.upward_imports(layers.default_roots(REPO)) if not _pending(e)]
    assert not bad, "upward imports (module -> import):\n" + "\n".join(bad)


def test_pending_entries_are_still_needed():
    # An entry whose import is gone should leave the list, so that it cannot hide a new one.
    found = layers.upward_imports(layers.default_roots(REPO))
    stale = [p for p in PENDING if not any(_pending(e) and e.startswith(p[0] + " -> " + p[1]) for e in found)]
    assert not stale, f"PENDING entries no longer needed (delete them): {stale}"


def test_every_module_is_in_a_layer():
    assert layers.unplaced(layers.default_roots(REPO)) == []


def test_the_architecture_page_draws_every_layer():
    text = (REPO / "docs" / "architecture.md").read_text()
    drawing = text.split("## Layers", 1)[1].split("```")[1]
    for layer in layers.LAYERS:
        for prefix in layer.modules:
            if prefix:
                name = prefix.replace(".", "/")
                assert f"{name}/" in drawing or f"{name}.py" in drawing, f"docs/architecture.md does not draw {prefix}"


def test_device_scripts_live_outside_the_package():
    assert not (REPO / "kernels" / "device").exists()
    assert (REPO / "tools" / "device" / "h200.py").is_file()
    # and the package never reaches out to them
    scripts = {p.stem for p in (REPO / "tools" / "device").glob("*.py")}
    for module, path, is_pkg in layers.package_modules(layers.default_roots(REPO)):
        for line, name in layers.module_imports(path, module, is_pkg):
            top = name.split(".")[0]
            assert top != "tools" and top not in scripts, f"{module} imports {name} ({path}:{line})"


# -- the checker itself, on a synthetic package ---------------------------------------------------

def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def toy(tmp_path):
    """pkg/{base,core,engine,plug}: core may import base; plug beside the core, base and
    engine.contract only."""
    root = tmp_path / "pkg"
    for rel in ("__init__.py", "base/__init__.py", "core/__init__.py", "engine/__init__.py", "plug/__init__.py"):
        _write(root, rel, "")
    _write(root, "base/err.py", "X = 1\n")
    _write(root, "engine/contract.py", "from ..base import err\n")
    _write(root, "engine/run.py", "from . import contract\n")
    table = (layers.Layer("base", ("base",)), layers.Layer("core", ("core",)), layers.Layer("engine", ("engine",)),
             layers.Layer("plug", ("plug",), may_import=("base", "engine.contract")),
             layers.Layer("top", ("",)))
    return root, table


def _check(root, table):
    return layers.upward_imports({"pkg": root}, table, package="pkg")


def test_checker_passes_a_clean_package(toy):
    root, table = toy
    _write(root, "core/a.py", "from ..base.err import X\nimport pkg.base\n")
    _write(root, "plug/k.py", "from pkg.engine.contract import err\nfrom ..base import err as e\n")
    assert _check(root, table) == []


def test_checker_reports_an_upward_import_in_a_function(toy):
    root, table = toy
    _write(root, "core/a.py", "def f():\n    if True:\n        from ..engine.run import contract\n    return contract\n")
    bad = _check(root, table)
    assert len(bad) == 1 and bad[0].startswith("pkg.core.a -> pkg.engine.run.contract (") and "a.py:3" in bad[0]


def test_checker_reports_an_import_of_a_plug_in_from_below(toy):
    root, table = toy
    _write(root, "plug/k.py", "Y = 2\n")
    _write(root, "engine/run.py", "import pkg.plug.k\n")
    assert [b.split(" (")[0] for b in _check(root, table)] == ["pkg.engine.run -> pkg.plug.k"]


def test_checker_holds_a_plug_in_to_what_it_may_import(toy):
    root, table = toy
    _write(root, "plug/k.py", "from pkg.engine import contract\nfrom pkg.engine import run\nfrom pkg.core import a\n")
    _write(root, "core/a.py", "")
    got = sorted(b.split(" (")[0] for b in _check(root, table))
    assert got == ["pkg.plug.k -> pkg.core.a", "pkg.plug.k -> pkg.engine.run"]


def test_checker_resolves_relative_imports_in_a_package_init(toy):
    root, table = toy
    _write(root, "base/__init__.py", "from .. import core\n")
    assert [b.split(" (")[0] for b in _check(root, table)] == ["pkg.base -> pkg.core"]


def test_the_triton_mma_model_is_registered_for_the_core():
    # The numerics reach the Triton kernel of the MMA model only through this registry.
    from fa3_numerics.numerics import mma

    assert "triton" in mma.device_mma_names(), (
        "the fa3_numerics.device_mma entry point is missing: reinstall the project (pip install -e .)")
    assert mma.DEVICE_MMA["triton"] == "fa3_numerics.kernels.triton_.mma_model:for_device"
    assert mma.device_mma("cpu") is None
