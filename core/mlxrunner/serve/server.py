"""``mlxrunner serve``: one model behind an OpenAI-compatible HTTP API.

Routes: ``POST /v1/chat/completions`` (messages and tools through the model's renderer,
the reply through its parser: content, ``reasoning_content``, ``tool_calls``),
``POST /v1/completions`` (a raw prompt), ``GET /v1/models``, ``GET /health``. Both POST
routes stream server-sent events with ``"stream": true``. Requests decode one at a time
(speculatively when the model has a draft, which leaves the output unchanged); a bad
request gets status 400 and one line naming the problem, and the server keeps serving; a
renderer or parser (plugin code) that fails gets status 500 naming it and its plugin (logged
on ``mlxrunner.serve`` too).

It binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..chat.formats import ParsedMessage, validate_conversation
from ..chat.streaming import TextStream
from ..decode.generation import generate
from ..errors import MLXRunnerError, PluginFailedError
from ..host import plugin_code

log = logging.getLogger("mlxrunner.serve")
MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_TOKENS = 1024
#: request fields that are sampler options (OpenAI's names, plus Ollama's top_k, min_p, ...)
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repeat_penalty", "repeat_last_n", "logprobs",
                  "top_logprobs")


class RequestError(MLXRunnerError):
    """A request the server cannot take (status 400, or ``status``)."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Reply:
    """What one request produced."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Request:
    """A checked request: prompt ids and decoding settings."""

    ids: list[int]
    options: Any
    max_tokens: int
    stops: list[str]


def _stop_strings(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them")
    return stops


def _max_tokens(body: Mapping[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {value!r}")
    return value


class ModelThread:
    """Runs every generation on one thread, one at a time: MLX state is not shared, and
    MLX's streams belong to the thread that made them, so a forward traced (``mx.compile``)
    on one request's thread cannot be replayed on another's. A daemon thread: with MLX 0.32.4
    a thread pool's worker that ran traced forwards, joined at exit, aborted the process."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="mlxrunner-model", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, future = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # the request's thread raises it
                    future.set_exception(exc)

    def run(self, job: Callable[[], Any]) -> Any:
        """``job()`` on the model thread; its result or its exception here."""
        future: Future = Future()
        self.jobs.put((job, future))
        return future.result()


class Service:
    """The model side of the server: requests in, replies (or streamed pieces) out."""

    def __init__(self, bundle: Any, name: str | None = None) -> None:
        self.bundle = bundle
        self.name = name or bundle.path.name
        self.worker = ModelThread()
        self.stop_ids = bundle.stop_token_ids()
        self.default_max_tokens = int(bundle.extra.get("max_tokens") or DEFAULT_MAX_TOKENS)

    # -- requests --------------------------------------------------------------------
    def chat_prompt(self, body: Mapping[str, Any]) -> tuple[str, list[Any] | None]:
        """The rendered prompt of a chat request, and its normalised tools."""
        renderer = self.bundle.renderer
        if renderer is None:
            raise RequestError(f"model {self.name} has no chat format: use /v1/completions")
        messages, tools = validate_conversation(body.get("messages"), body.get("tools"))
        think = body.get("think")
        if think is not None and not isinstance(think, bool):
            raise RequestError(f"think must be true or false, got {think!r}")
        with plugin_code("renderers", self.bundle.renderer_name):
            text = renderer.render(messages, tools, think=think, add_generation_prompt=True)
        return text, tools

    def request(self, prompt_text: str, body: Mapping[str, Any], *, rendered: bool
                ) -> Request:
        """Check a request's options and encode its prompt (``rendered``: a chat prompt
        whose special tokens are in the text, so none are added). Every problem is raised
        here, before a streamed reply has sent its first byte."""
        bundle = self.bundle
        ids = bundle.tokenizer.encode(prompt_text, add_special_tokens=not rendered)
        if not ids:
            raise RequestError("the prompt is empty")
        return Request(ids=ids,
                       options=bundle.defaults.merged(
                           {k: body[k] for k in SAMPLER_FIELDS if k in body}),
                       max_tokens=_max_tokens(body, self.default_max_tokens),
                       stops=_stop_strings(body))

    def generate(self, request: Request,
                 on_text: Callable[[str], None] | None = None) -> Reply:
        """Decode ``request``; ``on_text`` receives the text as it is decided (held back
        where a stop string may be starting)."""
        bundle = self.bundle
        reply = Reply(stats={"prompt_tokens": len(request.ids)})
        text = TextStream(bundle.tokenizer, self.stop_ids, request.stops, on_text)

        def on_token(token: int) -> bool:
            reply.tokens.append(token)
            return text.add(token)  # True at a stop string: generation ends, logprobs kept

        result = self.worker.run(lambda: generate(
            bundle.model, request.ids, options=request.options, max_tokens=request.max_tokens,
            eos_ids=self.stop_ids, on_token=on_token, draft=bundle.draft))
        reply.text = text.finish()
        reply.finish_reason = result.finish_reason
        reply.logprobs = result.logprobs
        reply.stats.update(result.stats.as_dict())
        return reply

    def logprobs_entry(self, reply: Reply) -> dict[str, Any] | None:
        if not reply.logprobs:
            return None
        tok = self.bundle.tokenizer
        content = []
        for token, info in zip(reply.tokens, reply.logprobs):
            content.append({"token": tok.decode([token]), "logprob": info["logprob"],
                            "top_logprobs": [{"token": tok.decode([i]), "logprob": lp}
                                             for i, lp in info["top_logprobs"]]})
        return {"content": content}


def _tool_call_entries(parsed: ParsedMessage, start: int = 0) -> list[dict[str, Any]]:
    return [{"index": start + i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name,
                          "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(parsed.tool_calls)]


def _usage(reply: Reply) -> dict[str, int]:
    prompt = int(reply.stats.get("prompt_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": len(reply.tokens),
            "total_tokens": prompt + len(reply.tokens)}


class Handler(BaseHTTPRequestHandler):
    """HTTP in and out; the work is the :class:`Service`'s."""

    server: Server
    server_version = "mlxrunner"
    protocol_version = "HTTP/1.1"

    @property
    def service(self) -> Service:
        assert self.server.service is not None, "serve_forever before the service was set"
        return self.server.service

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        if self.server.verbose:
            super().log_message(format, *args)

    # -- plumbing --------------------------------------------------------------------
    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind}})

    def _read_body(self) -> dict[str, Any]:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("the request has no Content-Length",
                               HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the request body is over {MAX_BODY_BYTES} bytes",
                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RequestError(f"the request body is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    def _start_events(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        self.events_started = True

    def _event(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    # -- routes ----------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - the base's name
        if self.path == "/health":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send_json(HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.service.name, "object": "model", "owned_by": "mlxrunner"}]})
        else:
            self._send_error(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - the base's name
        routes = {"/v1/chat/completions": self._chat, "/v1/completions": self._completion}
        route = routes.get(self.path)
        if route is None:
            self._send_error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
            return
        self.events_started = False
        try:
            body = self._read_body()
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError(f"stream must be true or false, got {stream!r}")
            route(body, stream)
        except RequestError as exc:
            self._send_error(exc.status, str(exc))
        except PluginFailedError as exc:  # a renderer's or parser's failure, not the request's
            log.warning("mlxrunner: %s (answered with status 500)", exc)
            if self.events_started:  # the status went out: the stream's last event says it
                self._event({"error": {"message": str(exc), "type": "server_error"}})
            else:
                self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc))
        except (MLXRunnerError, ValueError) as exc:  # a conversation or option problem
            self._send_error(HTTPStatus.BAD_REQUEST, str(exc).splitlines()[0])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; the next request is served as usual

    def _envelope(self, kind: str, request_id: str) -> dict[str, Any]:
        return {"id": request_id, "object": kind, "created": int(time.time()),
                "model": self.service.name}

    def _chat(self, body: dict[str, Any], stream: bool) -> None:
        service = self.service
        prompt, tools = service.chat_prompt(body)
        parser = service.bundle.new_parser()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        request = service.request(prompt, body, rendered=True)
        if not stream:
            reply = service.generate(request)
            message: dict[str, Any] = {"role": "assistant", "content": reply.text}
            finish = reply.finish_reason
            if parser is not None:
                with plugin_code("parsers", service.bundle.parser_name):
                    parser.reset(prompt, tools=tools)
                    parsed = parser.parse(reply.text)
                message["content"] = parsed.content
                if parsed.thinking:
                    message["reasoning_content"] = parsed.thinking
                if parsed.tool_calls:
                    message["tool_calls"] = [{k: v for k, v in entry.items() if k != "index"}
                                             for entry in _tool_call_entries(parsed)]
                    finish = "tool_calls"
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
            logprobs = service.logprobs_entry(reply)
            if logprobs is not None:
                choice["logprobs"] = logprobs
            self._send_json(HTTPStatus.OK, {**self._envelope("chat.completion", request_id),
                                            "choices": [choice], "usage": _usage(reply),
                                            "statistics": reply.stats})
            return

        chunk_head = self._envelope("chat.completion.chunk", request_id)
        calls = 0

        def send(delta: dict[str, Any], finish: str | None = None) -> None:
            self._event({**chunk_head, "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish}]})

        def send_parsed(pieces: list[ParsedMessage]) -> None:
            nonlocal calls
            for piece in pieces:
                if piece.tool_calls:
                    entries = _tool_call_entries(piece, calls)
                    calls += len(entries)
                    send({"tool_calls": entries})
                elif piece.thinking:
                    send({"reasoning_content": piece.thinking})
                elif piece.content:
                    send({"content": piece.content})

        def parsing(call: Callable[..., Any], *args: Any) -> Any:
            with plugin_code("parsers", service.bundle.parser_name):
                return call(*args)

        if parser is not None:
            parsing(lambda: parser.reset(prompt, tools=tools))
        self._start_events()
        send({"role": "assistant", "content": ""})

        def on_text(text: str) -> None:
            if parser is None:
                send({"content": text})
            else:
                send_parsed(parsing(parser.feed, text))

        reply = service.generate(request, on_text)
        if parser is not None:
            send_parsed(parsing(parser.finish))
        send({}, "tool_calls" if calls else reply.finish_reason)
        self._event("[DONE]")

    def _completion(self, body: dict[str, Any], stream: bool) -> None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string")
        request = self.service.request(prompt, body, rendered=False)
        head = self._envelope("text_completion", f"cmpl-{uuid.uuid4().hex}")
        if not stream:
            reply = self.service.generate(request)
            choice: dict[str, Any] = {"index": 0, "text": reply.text,
                                      "finish_reason": reply.finish_reason}
            logprobs = self.service.logprobs_entry(reply)
            if logprobs is not None:
                choice["logprobs"] = logprobs
            self._send_json(HTTPStatus.OK, {**head, "choices": [choice],
                                            "usage": _usage(reply), "statistics": reply.stats})
            return
        self._start_events()

        def on_text(text: str) -> None:
            self._event({**head, "choices": [{"index": 0, "text": text,
                                              "finish_reason": None}]})

        reply = self.service.generate(request, on_text)
        self._event({**head, "choices": [{"index": 0, "text": "",
                                          "finish_reason": reply.finish_reason}]})
        self._event("[DONE]")


class Server(ThreadingHTTPServer):
    """The listening socket and its :class:`Service` (set before ``serve_forever``)."""

    daemon_threads = True

    def __init__(self, host: str, port: int, verbose: bool = False) -> None:
        super().__init__((host, port), Handler)
        self.verbose = verbose
        self.service: Service | None = None


def make_server(service: Service | None, host: str = "127.0.0.1", port: int = 8080,
                verbose: bool = False) -> Server:
    """A server bound to ``host:port`` for ``service`` (not yet serving: call
    ``serve_forever``). The service may be set later, e.g. after binding has shown that
    the port is free and before a slow model load."""
    server = Server(host, port, verbose)
    server.service = service
    return server


def events(lines: Iterator[bytes]) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream, until ``[DONE]`` (for clients)."""
    for raw in lines:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
