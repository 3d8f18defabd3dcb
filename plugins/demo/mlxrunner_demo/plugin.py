"""The entry point mlxrunner loads: registers the shipped model folder as ``demo-qwen3.5``
(the default model's fallback when it cannot be fetched)."""

from __future__ import annotations

from collections.abc import Callable

from mlxrunner.plugin import hookimpl

from . import MODEL_PATH


@hookimpl
def register_models(register: Callable[[str, str], None]) -> None:
    # A path, not a loaded model: nothing heavy happens until a command asks for it.
    register("demo-qwen3.5", str(MODEL_PATH))
