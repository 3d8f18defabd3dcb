"""mlxrunner hook implementations of the Llama plugin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxrunner.plugin import hookimpl

#: config.json ``architectures[0]`` and ``model_type`` values this plugin serves. SmolLM2 and
#: Llama 3.x folders say LlamaForCausalLM / llama; Mistral's are the same math when they
#: attend over the whole context (``sliding_window`` null).
ARCHITECTURE_NAMES = ("LlamaForCausalLM", "llama", "MistralForCausalLM", "mistral")


@hookimpl
def register_architectures(register: Callable[[str, Any], None]) -> None:
    from .model import Llama  # lazily: `mlxrunner --help` does not pay for MLX

    for name in ARCHITECTURE_NAMES:
        register(name, Llama)
