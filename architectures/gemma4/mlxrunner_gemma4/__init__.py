"""Gemma 4 architectures for mlxrunner."""

from .model import Gemma4Config, Gemma4Model

__all__ = ["Gemma4Config", "Gemma4Model"]
