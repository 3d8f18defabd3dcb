"""The entry point mlxrunner loads: registers ``smollm2:135m`` and makes it ``default``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxrunner.plugin import hookimpl

from . import SMOLLM2_135M


@hookimpl
def register_models(register: Callable[[str, Any], None]) -> None:
    # A source, not a file: nothing is fetched until a command asks for the model.
    register("smollm2:135m", SMOLLM2_135M)
    register("default", "smollm2:135m")
