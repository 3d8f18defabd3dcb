"""Gemma 4 architectures for mlxrunner.

Importing this package imports no MLX (``mlxrunner --help`` loads every plugin's hooks):
the names below load their module (``model``, ``vision``, ``image``, ``audio``,
``audio_features``) on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: name -> the module that defines it
_MODULES = {"Gemma4Config": ".model", "Gemma4Model": ".model", "Gemma4Vision": ".vision",
            "load_vision": ".vision", "image_inputs": ".image",
            "placeholder_count": ".image", "placeholder_ids": ".image",
            "Gemma4Audio": ".audio", "load_audio": ".audio", "FeatureConfig": ".audio_features",
            "log_mel_features": ".audio_features"}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_MODULES[name], __name__), name)
