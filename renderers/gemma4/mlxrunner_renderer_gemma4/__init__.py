"""Gemma 4 chat formats for mlxrunner: renderers ``gemma4``, ``gemma4-small``,
``gemma4-large``, ``gemma4-nemotron`` and the ``gemma4`` parser."""

from .parser import Gemma4Parser
from .renderer import Gemma4Renderer, is_large

__all__ = ["Gemma4Parser", "Gemma4Renderer", "is_large"]
