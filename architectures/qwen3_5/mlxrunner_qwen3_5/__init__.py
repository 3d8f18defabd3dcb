"""Qwen3.5 text models for mlxrunner (installed as the ``mlxrunner-qwen3-5`` plugin).

Importing this package imports no MLX (``mlxrunner --help`` loads every plugin's hooks):
the names below load their module (``model``, ``vision``, ``image``, ``encoder``) on first
use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: name -> the module that defines it
_MODULES = {"Qwen3_5": ".model", "Qwen3_5Config": ".model", "Qwen3_5Vision": ".vision",
            "load_vision": ".vision", "image_inputs": ".image",
            "placeholder_count": ".image", "Qwen3_5ImageEncoder": ".encoder"}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_MODULES[name], __name__), name)
