"""Entry point module: registers the Gemma 4 architecture names and the assistant draft."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxrunner.plugin import hookimpl

ARCHITECTURE_NAMES = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "gemma4",
                      "gemma4_text")


@hookimpl
def register_architectures(register: Callable[[str, Any], None]) -> None:
    from .model import Gemma4Model

    for name in ARCHITECTURE_NAMES:
        register(name, Gemma4Model)


@hookimpl
def register_drafts(register: Callable[[str, Any], None]) -> None:
    from .assistant import Gemma4AssistantDraft

    register("Gemma4AssistantForCausalLM", Gemma4AssistantDraft)
