"""Qwen3.5 text models for mlxrunner (installed as the ``mlxrunner-qwen3-5`` plugin).

Importing this package imports no MLX (``mlxrunner --help`` loads every plugin's hooks):
the names below load ``mlxrunner_qwen3_5.model`` on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["Qwen3_5", "Qwen3_5Config"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(".model", __name__), name)
