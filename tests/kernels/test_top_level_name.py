"""kernels/ is ``fa3_numerics.kernels`` only: the top-level name ``kernels`` stays the PyPI package's."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, *path: Path) -> subprocess.CompletedProcess:
    # sys.path as `python -m pytest` run from the checkout's root has it: the root first
    setup = f"import sys; sys.path[:0] = {[str(p) for p in (ROOT, *path)]!r}; "
    return subprocess.run([sys.executable, "-c", setup + code], capture_output=True, text=True, cwd=ROOT)


def test_the_installed_kernels_package_wins_over_this_folder(tmp_path):
    # a stand-in for Hugging Face's kernels (transformers >= 5.25 runs `from kernels import CUDAProperties`)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("CUDAProperties = 'the PyPI package'\n")
    r = _run("from kernels import CUDAProperties; import kernels; print(CUDAProperties, kernels.__file__)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the PyPI package ") and str(tmp_path) in r.stdout


def test_without_it_the_name_is_missing_not_ours(tmp_path):
    r = _run("import importlib.util, sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
             "import kernels")
    assert r.returncode != 0 and "ModuleNotFoundError: No module named 'kernels'" in r.stderr


def test_the_package_side_still_imports():
    r = _run("import fa3_numerics.kernels.availability as a, fa3_numerics.kernels as k; print(k.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "fa3_numerics.kernels"
