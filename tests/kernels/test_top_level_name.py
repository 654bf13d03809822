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


def test_without_it_the_name_is_empty_and_reads_as_missing(tmp_path):
    # What transformers' _is_package_available does (5.24): find_spec, no distribution metadata, then an
    # unguarded import whose module must have no __version__ and no __file__ for "not installed".
    r = _run("import importlib.util, sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
             "spec = importlib.util.find_spec('kernels'); import importlib; m = importlib.import_module('kernels'); "
             "again = importlib.util.find_spec('kernels'); "
             "print(spec is not None, getattr(m, '__file__', None), getattr(m, '__version__', 'N/A'), "
             "again is not None, [n for n in vars(m) if not n.startswith('__')])\n"
             "try:\n    from kernels import CUDAProperties\nexcept ImportError as e:\n    print('ImportError')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True None N/A True []", "ImportError"]


def test_transformers_sees_no_kernels_package_here():
    """Where Hugging Face's kernels is not installed, transformers' check must say so, not raise
    (a model module import then works under `python -m pytest` from the root)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    code = ("import importlib.metadata as md\n"
            "try:\n    md.version('kernels'); print('installed')\n"
            "except md.PackageNotFoundError:\n"
            "    from transformers.utils import import_utils as iu; print(iu._is_package_available('kernels', return_version=True)[0])")
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("installed", "False")


def test_the_package_side_still_imports():
    r = _run("import fa3_numerics.kernels.availability as a, fa3_numerics.kernels as k; print(k.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "fa3_numerics.kernels"
