"""Entry point of ``mlxrunner-renderer-qwen3-5``: registers renderer and parser ``qwen3.5``."""

from __future__ import annotations

from mlxrunner.plugin import hookimpl

from .parser import Qwen35Parser
from .renderer import Qwen35Renderer


@hookimpl
def register_renderers(register):
    register("qwen3.5", Qwen35Renderer)


@hookimpl
def register_parsers(register):
    register("qwen3.5", Qwen35Parser)
