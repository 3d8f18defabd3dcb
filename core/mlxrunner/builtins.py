"""The core's own features, registered through the same hooks as any plugin."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def register_renderers(register):
    from .jinja_renderer import JinjaRenderer

    register("jinja", JinjaRenderer.from_context)
