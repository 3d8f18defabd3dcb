"""The embedded demo model of mlxrunner: a small Qwen3.5-architecture model and its DFlash2 draft.

The model folder ships inside this package (``MODEL_PATH``); the plugin registers it as the
model ``default``, which ``mlxrunner run`` uses when no model is given. How it was built:
``plugins/demo/recipe/build_demo.py`` and ``MODEL_CARD.md``.
"""

from __future__ import annotations

from pathlib import Path

#: the shipped model folder (config.json, model.safetensors, tokenizer, draft/)
MODEL_PATH: Path = Path(__file__).resolve().parent / "model"

__all__ = ["MODEL_PATH"]
