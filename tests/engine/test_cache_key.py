"""Tests of the cache key's code part (``fa3_numerics.engine.cache.code_key``): what changes it
and what does not.

Every edit is made in a copy of the package (``fa3_numerics/`` and ``kernels/`` under
``tmp_path``, which ``code_key(root=...)`` hashes), never in the tree that runs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

import fa3_numerics
from fa3_numerics.engine.cache import VERSIONED, cache_key, code_key, code_parts, dist_key, study_cells
from fa3_numerics.engine.files import atomic_write
from fa3_numerics.studies.impact import STUDY_MODULES

PKG = Path(fa3_numerics.__file__).resolve().parent
KERNELS = Path(importlib.util.find_spec("fa3_numerics.kernels").submodule_search_locations[0])
OUTLIERS = ("fa3_numerics.studies.outliers",)


@pytest.fixture
def root(tmp_path) -> Path:
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(PKG, tmp_path / "fa3_numerics", ignore=skip)
    shutil.copytree(KERNELS, tmp_path / "kernels", ignore=skip)
    return tmp_path


def _key(root: Path, backend: str = "emulate", study=OUTLIERS) -> str:
    return code_key(backend=backend, study=study, root=root)


def _edit(path: Path) -> None:
    """A real edit: one more line at the end (a comment in Python, C or a template)."""
    mark = {".py": "#", ".c": "//"}.get(path.suffix, "{#")
    path.write_text(path.read_text() + f"\n{mark} edited{' #}' if mark == '{#' else ''}\n")


def test_the_copy_hashes_as_the_running_tree(root):
    # The copy stands for the running package: same key, and the same on a second call.
    assert _key(root) == _key(root) == code_key(backend="emulate", study=OUTLIERS)
    assert _key(root, "triton") == code_key(backend="triton", study=OUTLIERS)


@pytest.mark.parametrize("rel", ["fa3_numerics/numerics/_native.c", "fa3_numerics/numerics/keys/ties.py",
                                 "fa3_numerics/numerics/metrics/core.py", "fa3_numerics/numerics/formats.py",
                                 "fa3_numerics/engine/sampling.py", "fa3_numerics/engine/inputs.py",
                                 "fa3_numerics/data/distributions/captured.py", "fa3_numerics/studies/outliers.py"])
def test_editing_a_source_that_decides_a_number_changes_the_key(root, rel):
    before = _key(root)
    _edit(root / rel)
    assert _key(root) != before


def test_a_same_size_edit_of_the_c_source_changes_the_key(root):
    c = root / "fa3_numerics/numerics/_native.c"
    text = c.read_text()
    i = next(i for i, ch in enumerate(text) if ch.isdigit())
    before = _key(root)
    c.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])
    assert c.stat().st_size == len(text.encode()) and _key(root) != before


@pytest.mark.parametrize("rel", ["fa3_numerics/report/templates/report.md.j2",
                                 "fa3_numerics/report/templates/report.html.j2", "fa3_numerics/report/run.py",
                                 "fa3_numerics/report/figures.py", "fa3_numerics/cli/run.py"])
def test_editing_the_report_or_the_cli_keeps_the_key(root, rel):
    before = _key(root)
    _edit(root / rel)
    assert _key(root) == before


def test_a_study_keys_on_its_own_modules_only(root):
    ablation = ("fa3_numerics.studies.ablation",)
    before = _key(root), _key(root, study=ablation), _key(root, study=STUDY_MODULES)
    _edit(root / "fa3_numerics/studies/impact_model.py")
    after = _key(root), _key(root, study=ablation), _key(root, study=STUDY_MODULES)
    assert after[:2] == before[:2] and after[2] != before[2]


def test_a_backend_keys_on_its_own_module_only(root):
    names = ("emulate", "fa3", "fa3-mock", "sdpa", "triton", "triton-fused")
    keys = {b: _key(root, b) for b in names}
    assert len(set(keys.values())) == len(names)  # every backend has its own key

    (root / "kernels" / "unrelated.py").write_text("X = 1\n")  # a new module no backend uses
    assert {b: _key(root, b) for b in names} == keys

    _edit(root / "kernels" / "fa3.py")
    now = {b: _key(root, b) for b in names}
    assert {b for b in names if now[b] != keys[b]} == {"fa3", "fa3-mock"}

    keys = now
    _edit(root / "kernels" / "triton_" / "rotate_quant.py")  # not the backend's module, but its package
    now = {b: _key(root, b) for b in names}
    assert {b for b in names if now[b] != keys[b]} == {"triton", "triton-fused"}


def test_input_files_are_keyed_by_content_not_path(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one text")
    b.write_text("one text")
    key_a = code_key(backend="emulate", inputs=[a])
    assert code_key(backend="emulate", inputs=[b]) == key_a  # same content elsewhere: same key
    atomic_write(a, "another text")  # replaced as the commands write files
    assert code_key(backend="emulate", inputs=[a]) != key_a
    assert code_key(backend="emulate") != key_a


def test_capturing_again_to_the_same_path_is_a_new_key(tmp_path):
    cap = tmp_path / "cap.safetensors"
    cap.write_bytes(b"\x01" * 4096)
    keys = [dist_key(f"captured:{cap}"), dist_key(f"captured:{cap}@layer=3"), dist_key(f"capture-file:{cap}")]
    assert len(set(keys)) == 3 and not any(str(cap) in k for k in keys)  # the path is not in the key
    cell = {"seqlen": 128, "head_dim": 64, "causal": False}
    args = dict(batch=1, heads=2, kv_heads=2, rows=16, backend="emulate", device="cpu", study=OUTLIERS)
    before = cache_key(f"captured:{cap}", cell, 0, "fa3-fp8", **args)

    atomic_write(cap, b"\x02" * 4096)  # a new capture of the same size at the same path
    new = dist_key(f"captured:{cap}")
    assert new != keys[0]
    assert dist_key(f"captured:{cap}@layer=3") != keys[1]
    assert cache_key(f"captured:{cap}", cell, 0, "fa3-fp8", **args) != before

    moved = tmp_path / "elsewhere.safetensors"
    os.replace(cap, moved)
    assert dist_key(f"captured:{moved}") == new  # the same capture at another path: the same key
    assert dist_key("outliers") == "outliers" and dist_key("outliers:p=0.01") == "outliers:p=0.01"


def test_the_parts_name_library_versions_and_the_device():
    parts = code_parts(backend="emulate", device="cpu")
    assert set(parts["versions"]) == set(VERSIONED)
    for name, version in parts["versions"].items():
        try:
            assert version == importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            assert version is None  # absent, and recorded as absent
    assert parts["device"] == "cpu" and parts["device_model"] is None
    assert code_key(backend="emulate", device="cpu") != code_key(backend="emulate", device="cuda")


def test_a_sequential_study_s_cells_use_the_same_key():
    code = lambda backend: study_cells(None, {}, STUDY_MODULES, backend=backend, device="cpu").context["code"]  # noqa: E731
    assert code("emulate") == code_key(backend="emulate", device="cpu", study=STUDY_MODULES)
    assert code("fa3") != code("emulate")
