"""The HTTP server: an OpenAI-compatible API over one loaded bundle."""

from __future__ import annotations

from .server import (
           DEFAULT_MAX_TOKENS,
           MAX_BODY_BYTES,
           Handler,
           RequestError,
           Server,
           Service,
           events,
           make_server,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_BODY_BYTES", "Handler", "RequestError", "Server",
           "Service", "events", "make_server"]
