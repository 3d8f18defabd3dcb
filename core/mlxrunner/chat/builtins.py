"""The core's own features, registered through the same hooks as any plugin.

The plugin host loads this module by name (``mlxrunner.host.manager.BUILTINS_MODULE``), as
it loads an entry point's module, and lists it as the plugin ``mlxrunner.builtins``.
"""

from __future__ import annotations

from ..host.hookspecs import hookimpl


@hookimpl
def register_renderers(register):
    from .jinja import JinjaRenderer

    register("jinja", JinjaRenderer.from_context)
