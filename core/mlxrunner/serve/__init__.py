"""The HTTP server: OpenAI's, Ollama's and Anthropic's APIs over one loaded bundle, an ASGI
app (``create_app``) that ``mlxrunner serve`` runs on uvicorn."""

from __future__ import annotations

from .app import MAX_BODY_BYTES, ServeConfig, create_app
from .engine import DEFAULT_MAX_TOKENS, Engine, Limits, RequestError, Service
from .models import Models
from .server import Listener, bind, is_loopback

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_BODY_BYTES", "Engine", "Limits", "Listener", "Models",
           "RequestError", "ServeConfig", "Service", "bind", "create_app", "is_loopback"]
