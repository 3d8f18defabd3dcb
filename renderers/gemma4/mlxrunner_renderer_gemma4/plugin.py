"""Entry point of ``mlxrunner-renderer-gemma4``: the Gemma 4 renderers and parser."""

from __future__ import annotations

import mlxrunner

from . import renderer
from .parser import Gemma4Parser


@mlxrunner.hookimpl
def register_renderers(register):
    register("gemma4", renderer.auto)
    register("gemma4-small", renderer.small)
    register("gemma4-large", renderer.large)
    register("gemma4-nemotron", renderer.nemotron)


@mlxrunner.hookimpl
def register_parsers(register):
    register("gemma4", Gemma4Parser)
