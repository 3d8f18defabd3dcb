"""Entry point of ``mlxrunner-renderer-gemma4``: the Gemma 4 renderers and parser."""

from __future__ import annotations

from mlxrunner.plugin import hookimpl

from . import renderer
from .parser import Gemma4Parser


@hookimpl
def register_renderers(register):
    register("gemma4", renderer.auto)
    register("gemma4-small", renderer.small)
    register("gemma4-large", renderer.large)
    register("gemma4-nemotron", renderer.nemotron)


@hookimpl
def register_parsers(register):
    register("gemma4", Gemma4Parser)
