"""Lazy export tables: a package names what it exports and imports each name's module on
first use, so that importing the package (``mlxrunner --help`` builds its commands from a
few of them) loads neither MLX nor the modules behind names nobody touched."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(module: str, table: Mapping[str, str], listed: Iterable[str] | None = None,
                 moved: Mapping[str, str] | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module named ``module`` (a package or a module):
    ``table`` maps a name to the module that defines it, relative to ``module``'s package;
    ``__dir__`` lists ``listed`` (default: the table). A name is imported once, then kept
    in the module's namespace. ``moved``: names that still resolve for old code, each with
    where it belongs now (one DeprecationWarning at its first use)."""
    shown = sorted(table if listed is None else listed)
    package = sys.modules[module].__package__

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if moved and name in moved:
            warnings.warn(f"{module}.{name}: {moved[name]}", DeprecationWarning, stacklevel=2)
        value = getattr(import_module(f".{source}", package), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return list(shown)

    return __getattr__, __dir__
