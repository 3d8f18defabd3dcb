"""DFlash and DFlash2 block-diffusion drafts for mlxrunner (registered by ``plugin``).

Importing this package imports no MLX (``mlxrunner --help`` loads every plugin's hooks):
the names below load their module on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_NAMES = {"DFlashArgs": ".dflash", "DFlashDraftModel": ".dflash",
          "DFlash2DraftModel": ".dflash2", "block_convolve": ".dflash2"}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_NAMES[name], __name__), name)
