"""Qwen3.5 text models for mlxrunner (installed as the ``mlxrunner-qwen3-5`` plugin)."""

from .model import Qwen3_5, Qwen3_5Config

__all__ = ["Qwen3_5", "Qwen3_5Config"]
