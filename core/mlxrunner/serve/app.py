"""The ASGI application: ``create_app(service, config)``.

Every request passes :class:`Guard` first: the ``Host`` allow-list (DNS rebinding), the
``Origin`` check for browser requests (a web page the user visits must not drive the server),
the optional bearer key, the body limit and one access-log line. Every error, the guard's,
the routes' and an unexpected exception's, is JSON in the API's own shape.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import MLXRunnerError, PluginFailedError
from .engine import RequestError, Service
from .errors import GENERIC_500, api_of, error_body, error_bytes
from .models import Models

log = logging.getLogger("mlxrunner.serve")
access_log = logging.getLogger("mlxrunner.serve.access")

MAX_BODY_BYTES = 16 << 20
MAX_HEADER_BYTES = 32 << 10
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: browser origins allowed by default: pages served from this machine (as Ollama does)
DEFAULT_ORIGINS = ("http://localhost", "https://localhost", "http://localhost:*",
                   "https://localhost:*", "http://127.0.0.1", "https://127.0.0.1",
                   "http://127.0.0.1:*", "https://127.0.0.1:*", "http://[::1]",
                   "https://[::1]", "http://[::1]:*", "https://[::1]:*")
#: paths answered without the API key (health checks)
OPEN_PATHS = ("/", "/health")


@dataclass
class ServeConfig:
    """What the guard enforces. ``allowed_hosts``: ``Host`` names taken (``*``: any);
    ``origins``: extra browser origins (glob patterns, ``*``: any); ``api_key``: the bearer
    token every request but health checks must carry (None: none needed)."""

    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    origins: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES

    def host_allowed(self, host: str) -> bool:
        return "*" in self.allowed_hosts or host.lower() in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        patterns = (*DEFAULT_ORIGINS, *self.origins)
        return any(origin_matches(origin, p) for p in patterns)


def origin_matches(origin: str, pattern: str) -> bool:
    """Whether ``origin`` fits ``pattern``, where ``*`` stands for any text and every other
    character for itself (as Ollama's origins: ``[::1]`` is an address, not a glob's set)."""
    parts = [re.escape(part) for part in pattern.lower().split("*")]
    return re.fullmatch(".*".join(parts), origin.lower()) is not None


def _host_name(value: str) -> str:
    """``Host`` without its port (``[::1]:8080`` -> ``::1``)."""
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class BodyTooLargeError(Exception):
    """A chunked body grew past the limit while it was read."""


@dataclass
class _Exchange:
    status: int = 0
    started: bool = False
    logged: bool = False
    headers: dict[str, str] = field(default_factory=dict)


class Guard:
    """The checks every request passes before a route, and its access-log line."""

    def __init__(self, app: ASGIApp, config: ServeConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        exchange = _Exchange()
        state = scope.setdefault("state", {})  # shared with the copies routes see
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        api = api_of(scope["path"])
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None and self.config.origin_allowed(origin):
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin")]

        def log_line() -> None:
            if exchange.logged:
                return
            exchange.logged = True
            tokens = state.get("tokens")
            access_log.info("%s %s %s %.3fs%s", scope["method"], scope["path"],
                            exchange.status or "-", time.monotonic() - started,
                            "" if tokens is None else f" {tokens} tokens")

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                exchange.started = True
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                log_line()  # before the client has it all: the line is there when it is
            await send(message)

        async def answer(status: int, message: str, extra: Iterable[tuple[bytes, bytes]] = ()
                         ) -> None:
            body = error_bytes(api, status, message)
            await send_logged({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()), *extra]})
            await send_logged({"type": "http.response.body", "body": body})

        try:
            problem = self._refusal(scope, headers, origin)
            if problem is not None:
                status, text, extra = problem
                await answer(status, text, extra)
            elif scope["method"] == "OPTIONS" and origin is not None:
                await send_logged({"type": "http.response.start", "status": 204, "headers": [
                    (b"access-control-allow-methods", b"GET, HEAD, POST, DELETE, OPTIONS"),
                    (b"access-control-allow-headers",
                     headers.get("access-control-request-headers", "*").encode("latin-1")),
                    (b"access-control-max-age", b"600")]})
                await send_logged({"type": "http.response.body", "body": b""})
            else:
                await self.app(self._as_json(scope), self._limited(receive), send_logged)
        except Exception:
            log.exception("mlxrunner: %s %s failed", scope["method"], scope["path"])
            if not exchange.started:
                await answer(500, GENERIC_500)
        finally:
            log_line()  # a reply that never ended (the client left) is logged here

    def _refusal(self, scope: Scope, headers: dict[str, str], origin: str | None
                 ) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        config = self.config
        if sum(len(k) + len(v) for k, v in scope.get("headers", [])) > MAX_HEADER_BYTES:
            return 431, f"the request headers are over {MAX_HEADER_BYTES} bytes", [
                (b"connection", b"close")]
        host = headers.get("host")
        if host is not None and not config.host_allowed(_host_name(host)):
            return 403, f"host {host!r} is not allowed (see --allowed-hosts)", []
        if origin is not None and not config.origin_allowed(origin):
            return 403, f"origin {origin!r} is not allowed (see --origins)", []
        if config.api_key is not None and scope["path"] not in OPEN_PATHS \
                and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "")
            token = given[7:].strip() if given.lower().startswith("bearer ") \
                else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), config.api_key.encode()):
                return 401, "a valid API key is required (Authorization: Bearer KEY)", [
                    (b"www-authenticate", b"Bearer")]
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            return 413, f"the request body is over {config.max_body_bytes} bytes", [
                (b"connection", b"close")]
        return None

    @staticmethod
    def _as_json(scope: Scope) -> Scope:
        """Bodies are JSON whatever their Content-Type says (``curl -d`` sends a form type;
        browsers' cross-origin requests are refused by the Origin check instead)."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return scope
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}

    def _limited(self, receive: Receive) -> Receive:
        limit, seen = self.config.max_body_bytes, 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError
            return message

        return counted


def _json_error(request: Request, status: int, message: str, param: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(api_of(request.url.path), status, message, param),
                        status_code=status, headers=headers)


def _field(loc: Iterable[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return _json_error(request, 400, "invalid request")
    first = errors[0]
    name = _field(first.get("loc", ()))
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return _json_error(request, 400, f"the request body is not valid JSON ({message})")
    if not name:
        return _json_error(request, 400, f"the request body: {message}")
    return _json_error(request, 400, f"{name}: {message}", param=name)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, BodyTooLargeError):
        return _json_error(request, 413, "the request body is too large",
                           headers={"Connection": "close"})
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 400 and exc.__cause__ is not None:
        message = "the request body is not valid JSON"
    else:
        message = str(exc.detail)
    return _json_error(request, exc.status_code, message,
                       headers=dict(exc.headers) if exc.headers else None)


async def _on_request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return _json_error(request, exc.status, str(exc).splitlines()[0], exc.param,
                       exc.headers or None)


async def _on_plugin_failure(request: Request, exc: Exception) -> Response:
    log.warning("mlxrunner: %s (answered with status 500)", exc)
    return _json_error(request, 500, str(exc))


async def _on_our_error(request: Request, exc: Exception) -> Response:
    """An MLXRunnerError the request did not cause (a broken model folder): its one line."""
    log.error("mlxrunner: %s (answered with status 500)", exc)
    return _json_error(request, 500, str(exc).splitlines()[0])


def create_app(service: Service, config: ServeConfig | None = None,
               models: Models | None = None) -> FastAPI:
    """The server's ASGI application over ``service`` (mount it, or run it with uvicorn);
    ``models``: the other models it may load by name (default: the registered ones)."""
    from . import anthropic_api, ollama_api, openai_api, responses_api

    config = config or ServeConfig()
    app = FastAPI(title="mlxrunner", version=ollama_api.VERSION,
                  description="OpenAI, Ollama and Anthropic APIs over one MLX model")
    app.state.models = models or Models(service)
    app.state.config = config
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestError, _on_request_error)
    app.add_exception_handler(PluginFailedError, _on_plugin_failure)
    app.add_exception_handler(MLXRunnerError, _on_our_error)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(ollama_api.router)
    app.include_router(anthropic_api.router)
    app.add_middleware(Guard, config=config)
    return app
