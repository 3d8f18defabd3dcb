"""mlxrunner hook implementations of the Qwen3.5 plugin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxrunner.plugin import hookimpl

#: config.json ``architectures[0]`` values and ``model_type`` values this plugin serves
NAMES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "qwen3_5", "qwen3_5_text")
MOE_NAMES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", "qwen3_5_moe",
             "qwen3_5_moe_text")


@hookimpl
def register_architectures(register: Callable[[str, Any], None]) -> None:
    from .model import Qwen3_5
    from .moe import Qwen3_5Moe

    for name in NAMES:
        register(name, Qwen3_5)
    for name in MOE_NAMES:
        register(name, Qwen3_5Moe)


@hookimpl
def register_drafts(register: Callable[[str, Any], None]) -> None:
    from .mtp import Qwen3_5MTP

    register("Qwen3_5MTP", Qwen3_5MTP)
