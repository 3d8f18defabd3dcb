"""Errors in each API's own JSON shape: OpenAI's, Ollama's (``/api/...``) and Anthropic's
(``/v1/messages...``)."""

from __future__ import annotations

import json
from typing import Any

OPENAI, OLLAMA, ANTHROPIC = "openai", "ollama", "anthropic"
GENERIC_500 = "internal server error (the server's log has the details)"

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error",
                 503: "server_overloaded"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large",
                    503: "overloaded_error"}


def api_of(path: str) -> str:
    """Which API a path belongs to (its errors take that API's shape)."""
    if path.startswith("/api/") or path in ("/", "/api"):
        return OLLAMA
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    return OPENAI


def error_body(api: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if api == OLLAMA:
        return {"error": message}
    if api == ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                    else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = "model_not_found" if status == 404 and param == "model" else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_bytes(api: str, status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(error_body(api, status, message, param), ensure_ascii=False).encode()
