"""Qwen3.5 chat format for mlxrunner: renderer and parser ``qwen3.5``."""

from .parser import Qwen35Parser
from .renderer import Qwen35Renderer

__all__ = ["Qwen35Parser", "Qwen35Renderer"]
