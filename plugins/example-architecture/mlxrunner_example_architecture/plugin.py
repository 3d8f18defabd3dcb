"""The entry point mlxrunner loads: it registers the architecture under its names.

``pyproject.toml`` names this module in the ``mlxrunner`` entry-point group; mlxrunner
calls every ``@hookimpl`` function here with a ``register`` callback.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxrunner.plugin import hookimpl

ARCHITECTURE_NAMES = ("ExampleLlamaForCausalLM", "example_llama")


@hookimpl
def register_architectures(register: Callable[[str, type], None]) -> None:
    # Import lazily: `mlxrunner --help` and `mlxrunner plugins` should not pay for MLX.
    from .model import ExampleLlama

    # config.json's architectures[0] is matched first, then its model_type.
    for name in ARCHITECTURE_NAMES:
        register(name, ExampleLlama)
