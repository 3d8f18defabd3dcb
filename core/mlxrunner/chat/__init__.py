"""Chat formats: the renderer and parser interfaces, conversation validation, lookup,
incremental parsing, the sandboxed ``jinja`` renderer and streaming text. Names resolve
lazily (the plugin host loads :mod:`.builtins` at start-up; Jinja waits until it renders)."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ParsedMessage": "formats",
    "Parser": "formats",
    "RenderContext": "formats",
    "Renderer": "formats",
    "ToolCall": "formats",
    "get_parser": "formats",
    "get_renderer": "formats",
    "load_conversation_file": "formats",
    "media_parts": "formats",
    "reasoning_of": "formats",
    "validate_conversation": "formats",
    "MarkerScanner": "parsing",
    "ParseEvents": "parsing",
    "ReplyParser": "parsing",
    "TrimmedText": "parsing",
    "JinjaRenderer": "jinja",
    "compile_template": "jinja",
    "RenderLimits": "limits",
    "TextStream": "streaming",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
