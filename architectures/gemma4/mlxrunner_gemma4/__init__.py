"""Gemma 4 architectures for mlxrunner.

Importing this package imports no MLX (``mlxrunner --help`` loads every plugin's hooks):
the names below load ``mlxrunner_gemma4.model`` on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["Gemma4Config", "Gemma4Model"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(".model", __name__), name)
