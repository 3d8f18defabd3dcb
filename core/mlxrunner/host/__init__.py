"""The plugin host: hook specs, plugin discovery and the registries plugins fill.

Plain Python (pluggy, no MLX): the CLI builds its commands from it before anything heavy
is imported.
"""

from __future__ import annotations

from .hookspecs import hookimpl, hookspec
from .manager import (
    ENTRY_POINT_GROUP,
    KINDS,
    KNOWN_ARCHITECTURE_PACKAGES,
    PluginHost,
    PluginInfo,
    Registration,
    architecture_for,
    host,
    import_object,
    iter_registrations,
    lookup,
    names,
    plugin_code,
    register,
    registered,
    reset,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "KINDS",
    "KNOWN_ARCHITECTURE_PACKAGES",
    "PluginHost",
    "PluginInfo",
    "Registration",
    "architecture_for",
    "hookimpl",
    "hookspec",
    "host",
    "import_object",
    "iter_registrations",
    "lookup",
    "names",
    "plugin_code",
    "register",
    "registered",
    "reset",
]
