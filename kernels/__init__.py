"""The compiled-kernel side, installed as ``fa3_numerics.kernels`` (pyproject.toml's package-dir), never as a
top-level package: the top-level name ``kernels`` belongs to the PyPI package of that name (Hugging Face's
``kernels``, which transformers >= 5.25 imports as soon as ``transformers.activations`` loads).

Where this checkout's root is on sys.path (``python -m pytest`` or ``python -m fa3_numerics.cli`` run from it),
``import kernels`` would find this folder first. Imported under that name, this module hands the name to the
installed package (a module that replaces itself in sys.modules is what the import system returns), so that
nothing of ours is ever the top-level ``kernels``. Where no such package is installed, the name becomes an empty
module with no ``__file__`` and no ``__version__``, which is how a namespace folder shadowing on sys.path looks:
transformers' availability check (``find_spec``, then the distribution's version, then as a last resort an import
that it does not guard) then reports the package missing. Raising ModuleNotFoundError here instead broke every
``import transformers`` model module under ``python -m pytest`` where Hugging Face's ``kernels`` is absent
(transformers 5.24: find_spec finds this folder, the import raised)."""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        import types as _types

        _module = _types.ModuleType("kernels", "Nothing: no package named kernels is installed (see fa3_numerics.kernels).")
        _module.__spec__ = _machinery.ModuleSpec("kernels", None, is_package=True)
        _module.__spec__.submodule_search_locations = []
        _module.__path__ = []
        _sys.modules["kernels"] = _module
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
