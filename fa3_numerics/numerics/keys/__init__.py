"""Recipe keys and ablation factors: the vocabulary of ``Recipe``, one registry entry per key.

Exposed: ``RecipeKey``, ``Factor``, ``KEEP``, ``register_key``, ``register_factor``, ``register_check``,
``checks``, ``keys``,
``key``, ``factors``, ``load``, ``parse_bool``, ``parse_int``, ``parse_float``, ``fmt_value``.

A key states in one place everything the toolkit needs to know about it (microxcaling's single
spec table): how it is written and parsed, its default and help, the attribution stage it belongs
to and its value in the all-float32 recipe, the prepared tensors it changes, the backends besides
the emulator that implement its non-default values, and its cost in the audit's recommendation.
``Recipe`` (``fa3_numerics.numerics.recipe``) is built from this registry; the CLI's help, the
``variants`` listing, backend refusals, attribution and the audit read it.

A *factor* is an ablation axis: named levels, each a recipe fragment (``Factor``). A key module
may register one, and ``run ablation`` grows an option for it.

A *check* (``register_check``) refuses combinations of keys that no kernel computes (e.g. an
FP16 accumulator under FP8 P): ``fn(recipe) -> None or the reason``; ``Recipe`` runs every
check when it is made, so a refused combination never reaches a backend. A key that merely has
no effect under the other keys' values (``ties`` without an integer format) is not refused.

Where keys come from, in order: ``core.py`` (the original keys, in the order that stored spec
strings use), then every other module of this package by name, then modules named by entry
points in the group ``fa3_numerics.recipe_keys``. All are loaded before ``Recipe`` is built,
at the first import of ``fa3_numerics.numerics.recipe``; registering later is refused, because
recipes already made could not carry the key. A key module therefore imports from this package
and the numerics it validates against (formats, granularities), never ``recipe`` itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
from typing import Any, Callable, Iterable

from ...errors import UsageError, require

ENTRY_POINT_GROUP = "fa3_numerics.recipe_keys"
STAGES = ("qk", "p", "v", "acc", "out")


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


#: ``RecipeKey.exact`` value meaning "the all-float32 recipe keeps this key's value".
KEEP = _Keep()


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t not in ("0", "1", "true", "false"):
        raise ValueError(text)
    return t in ("1", "true")


def parse_int(text: str) -> int:
    return int(text)


def parse_float(text: str) -> float:
    return float(text)


def fmt_value(val) -> str:
    """A value as spec strings write it: 1/0 for booleans, %g for floats, short_str for objects."""
    if hasattr(val, "short_str"):
        return val.short_str()
    if isinstance(val, bool):
        return "1" if val else "0"
    if isinstance(val, float):
        return f"{val:g}"
    return str(val)


@dataclasses.dataclass(frozen=True)
class RecipeKey:
    """One recipe key. Only ``key``, ``default`` and ``help`` are required."""

    key: str  # as written in spec strings: "poff"
    default: Any
    help: str
    field: str = ""  # attribute of Recipe (default: ``key``): "p_offset"
    parse: Callable[[str], Any] = str  # text -> value; ValueError for bad text
    # value -> canonical value, raising UsageError (e.g. a format alias -> its name)
    normalize: Callable[[Any], Any] | None = None
    # allowed values (a tuple, or a function giving them: registries that grow); None = any
    choices: tuple | Callable[[], Iterable[str]] | None = None
    # attribution stages (``STAGES``) whose single-stage recipe takes this key from the full
    # recipe; every other stage uses ``exact``
    stages: tuple[str, ...] = ()
    exact: Any = KEEP  # value in the all-float32 recipe; KEEP = the recipe's own
    # prepared tensors ("q", "k", "v") this key changes, so caches of them are kept apart
    tensors: tuple[str, ...] = ()
    # backends besides ``emulate`` that compute its non-default values; "any": each backend's
    # ``supports`` decides (the original keys). A new key is refused elsewhere until listed.
    backends: tuple[str, ...] | str = ()
    cost: Callable[[Any], int] | None = None  # added to the audit's recipe cost
    # Original keys appear in every full spec string; a newer key appears only when it differs
    # from its default, so specs stored in datasets (and cache keys) do not change.
    in_spec: bool = False
    # The emulator's own prepare cache already keys on it (the original keys).
    emulator_cache: bool = False

    def __post_init__(self):
        if not self.field:
            object.__setattr__(self, "field", self.key.replace("-", "_"))
        require(self.field.isidentifier(), f"recipe key {self.key!r}: field {self.field!r} is not an identifier")
        bad = set(self.stages) - set(STAGES)
        require(not bad, f"recipe key {self.key!r}: unknown stages {sorted(bad)}; stages: {', '.join(STAGES)}")

    def allowed(self) -> tuple[str, ...] | None:
        c = self.choices
        return None if c is None else tuple(c() if callable(c) else c)

    def check(self, value):
        """The canonical value, or UsageError naming the key and its allowed values."""
        if self.normalize is not None:
            try:
                value = self.normalize(value)
            except UsageError as exc:
                raise UsageError(f"recipe key {self.key}: {exc}") from None
        allowed = self.allowed()
        if allowed is not None and value not in allowed:
            raise UsageError(f"recipe key {self.key}={fmt_value(value)} is not one of {', '.join(map(str, allowed))}")
        return value

    def from_text(self, text: str):
        try:
            return self.parse(text)
        except UsageError:
            raise
        except ValueError:
            hint = f"; choose one of {', '.join(map(str, self.allowed()))}" if self.allowed() else ""
            raise UsageError(f"recipe value {text!r} is not valid for {self.key}{hint}") from None

    def describe(self) -> str:
        allowed = self.allowed()
        vals = ", ".join(map(str, allowed)) if allowed else ""
        return f"{self.key} (default {fmt_value(self.default)}{'; ' + vals if vals else ''}): {self.help}"


@dataclasses.dataclass(frozen=True)
class Factor:
    """An ablation factor: levels, each a recipe fragment over the base recipe.

    ``levels`` None means the level *is* the value of recipe key ``name`` (``gran=<level>``).
    """

    name: str
    default: str
    help: str
    levels: dict[str, str] | None = None

    def fragment(self, level: str) -> str:
        if self.levels is None:
            return f"{self.name}={level}"
        require(level in self.levels, f"unknown level {level!r} of factor {self.name}; levels: {', '.join(self.levels)}")
        return self.levels[level]

    def level_names(self) -> list[str] | None:
        return None if self.levels is None else list(self.levels)


_KEYS: dict[str, RecipeKey] = {}
_FACTORS: dict[str, Factor] = {}
_CHECKS: list[Callable[[Any], str | None]] = []
_state = {"loaded": False, "frozen": False}


def register_key(k: RecipeKey) -> RecipeKey:
    """Add a key. Call it at import time of a module of this package (or of an entry point)."""
    require(not _state["frozen"], f"recipe key {k.key!r} registered after Recipe was built; put it in a module of "
            f"fa3_numerics/numerics/keys/ or name it in the {ENTRY_POINT_GROUP!r} entry-point group")
    require(k.key not in _KEYS, f"recipe key {k.key!r} is registered twice")
    require(all(o.field != k.field for o in _KEYS.values()), f"recipe field {k.field!r} is registered twice")
    _KEYS[k.key] = k
    return k


def register_factor(f: Factor) -> Factor:
    """Add an ablation factor (any time: factors are read when an ablation is loaded)."""
    require(f.name not in _FACTORS, f"ablation factor {f.name!r} is registered twice")
    _FACTORS[f.name] = f
    return f


def register_check(fn: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """Add a combination check ``fn(recipe) -> None | reason`` (usable as a decorator)."""
    _CHECKS.append(fn)
    return fn


def checks() -> list[Callable[[Any], str | None]]:
    load()
    return list(_CHECKS)


def load() -> None:
    """Import core, the other modules of this package, then entry points (once)."""
    if _state["loaded"]:
        return
    _state["loaded"] = True
    importlib.import_module(f"{__name__}.core")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name != "core" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def freeze() -> list[RecipeKey]:
    """Load every key and close the registry (``Recipe`` is being built from it)."""
    load()
    _state["frozen"] = True
    return list(_KEYS.values())


def keys() -> list[RecipeKey]:
    load()
    return list(_KEYS.values())


def key(name: str) -> RecipeKey:
    """A key by its spelling or by its field name."""
    load()
    if name in _KEYS:
        return _KEYS[name]
    for k in _KEYS.values():
        if k.field == name:
            return k
    raise UsageError(f"unknown recipe key {name!r}; keys: {', '.join(sorted(_KEYS))}")


def factors() -> dict[str, Factor]:
    load()
    return dict(_FACTORS)


__all__ = ["RecipeKey", "Factor", "KEEP", "STAGES", "register_key", "register_factor", "register_check", "checks",
           "keys", "key", "factors", "load",
           "parse_bool", "parse_int", "parse_float", "fmt_value", "ENTRY_POINT_GROUP"]
