"""The package's layers, bottom to top, and the check that every import points down.

Exposed: ``Layer``, ``LAYERS``, ``layer_of``, ``allowed``, ``module_imports``, ``upward_imports``,
``package_modules``, ``unplaced``, ``default_roots``.

A module may import its own layer and the layers below it; the ``kernels`` plug-ins sit beside
the core and may import only what ``Layer.may_import`` names (the numerics, the data and the
engine's backend contract), and nothing below them imports them: the engine reaches them
through the backend registry's "module:Class" strings, the numerics through the device-MMA
registry (``numerics.mma.DEVICE_MMA``), both resolved when first used. docs/architecture.md
draws this table; tests/test_layers.py reads every module's imports (function-level ones
included) and fails on an upward one. Standard library only, so the check runs anywhere.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

PACKAGE = "fa3_numerics"


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    #: module prefixes (dotted, under the package) that belong to the layer
    modules: tuple[str, ...]
    #: None: every layer below; else the only modules (prefixes) it may import outside itself
    may_import: tuple[str, ...] | None = None
    why: str = ""


LAYERS: tuple[Layer, ...] = (
    Layer("base", ("errors", "env", "files", "layers", "text"),
          why="errors, environment settings, whole-or-nothing files, number formats and Markdown escaping, which every layer uses"),
    Layer("numerics", ("numerics",), why="formats, quantizers, recipes, the emulator, metrics"),
    Layer("data", ("data", "experiments"), why="input distributions, captures, row sampling, experiment files"),
    Layer("engine", ("engine",), why="running tasks, caching, datasets, the backend registry"),
    Layer("kernels", ("kernels",),
          may_import=("errors", "env", "files", "numerics", "data", "experiments", "engine.backends"),
          why="hardware backends beside the core: the numerics, the data and the backend contract only"),
    Layer("studies", ("studies",), why="what each study computes, into a dataset"),
    Layer("report", ("report",), why="pages and figures from a dataset"),
    Layer("api", ("api", "cli", "testing", ""), why="the Python API, the command line, test helpers"),
)


def layer_of(module: str, layers: tuple[Layer, ...] = LAYERS, package: str = PACKAGE) -> int | None:
    """Index in ``layers`` of a dotted module name (None: outside the package). The longest
    matching prefix wins; the package's own ``__init__`` is the "" prefix."""
    if module != package and not module.startswith(package + "."):
        return None
    rel = module[len(package) + 1:]
    best, best_len = None, -1
    for i, layer in enumerate(layers):
        for prefix in layer.modules:
            if (prefix == "" and rel == "") or (prefix and (rel == prefix or rel.startswith(prefix + "."))):
                if len(prefix) > best_len:
                    best, best_len = i, len(prefix)
    return best


def allowed(importer: str, imported: str, layers: tuple[Layer, ...] = LAYERS, package: str = PACKAGE) -> bool:
    """Whether module ``importer`` may import module ``imported`` under the layer table."""
    a, b = layer_of(importer, layers, package), layer_of(imported, layers, package)
    if a is None or b is None or a == b:
        return True
    may = layers[a].may_import
    if may is not None:
        rel = imported[len(package) + 1:]
        return any(rel == p or rel.startswith(p + ".") for p in may)
    if layers[b].may_import is not None:
        return a > b  # a side layer is imported only from above
    return b < a


def module_imports(path: Path, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a source file, at any depth (function bodies,
    ``if`` and ``try`` blocks included); relative imports are resolved against ``module``.
    ``from X import name`` gives ``X.name`` when that could be a submodule, which ``allowed``
    judges by its longest layer prefix (``from fa3_numerics.engine import backends`` is an import
    of ``fa3_numerics.engine.backends``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if any(alias.name == "*" for alias in node.names):
                out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*"]
    return out


def package_modules(roots: dict[str, Path]) -> list[tuple[str, Path, bool]]:
    """(dotted name, file, is a package's __init__) of every module under ``roots`` (dotted
    prefix -> folder; pyproject maps kernels/ and experiments/ into the package this way)."""
    out = []
    for prefix, folder in roots.items():
        for path in sorted(Path(folder).rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out.append((".".join([prefix] + parts), path, is_pkg))
    return out


def upward_imports(roots: dict[str, Path], layers: tuple[Layer, ...] = LAYERS,
                   package: str = PACKAGE) -> list[str]:
    """``importer -> imported (file:line)`` for every import the layer table forbids."""
    bad = []
    for module, path, is_pkg in package_modules(roots):
        for line, name in module_imports(path, module, is_pkg):
            if not allowed(module, name, layers, package):
                bad.append(f"{module} -> {name} ({path}:{line})")
    return bad


def unplaced(roots: dict[str, Path], layers: tuple[Layer, ...] = LAYERS, package: str = PACKAGE) -> list[str]:
    """Modules of the package that no layer claims (a new top-level module needs a row)."""
    return [m for m, _, _ in package_modules(roots) if layer_of(m, layers, package) is None]


def default_roots(repo: Path) -> dict[str, Path]:
    """The package's folders in a checkout, as pyproject's package-dir maps them."""
    return {PACKAGE: repo / "fa3_numerics", f"{PACKAGE}.kernels": repo / "kernels",
            f"{PACKAGE}.experiments": repo / "experiments"}
