"""Errors, limits and safety: every error is JSON in the API's shape, our own failures are
never the client's fault, and the guard refuses what a browser or a stranger should not do."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import types
from typing import Any

import pytest

import mlxrunner
import mlxrunner.plugin
from mlxrunner import host as plugins

httpx = pytest.importorskip("httpx")

CHAT = {"messages": [{"role": "user", "content": "class Test"}], "max_tokens": 2}


def raw_exchange(url: str, data: bytes) -> bytes:
    """Send ``data`` as it is on a fresh connection; everything the server answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("method, path, api_shape", [
    ("POST", "/v1/embeddings", "openai"),
    ("PUT", "/v1/chat/completions", "openai"),
    ("POST", "/api/embed", "ollama"),
    ("DELETE", "/v1/messages", "anthropic"),
])
def test_unknown_routes_and_methods_are_json_in_the_apis_shape(served: Any, method: str,
                                                               path: str, api_shape: str
                                                               ) -> None:
    reply = httpx.request(method, served.url + path, json={"x": 1})
    assert reply.status_code in (404, 405)
    body = reply.json()
    if api_shape == "ollama":
        assert path in body["error"] or method in body["error"]
    elif api_shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] in ("not_found_error",
                                                                      "invalid_request_error")
    else:
        assert path in body["error"]["message"]


@pytest.mark.parametrize("data, needle", [
    (b"{not json", "not valid JSON"),
    (b"[]", "dictionary"),
    (b"[" * 100000 + b"]" * 100000, ""),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "surrogate"),
])
def test_malformed_bodies_are_400s_and_the_server_goes_on(served: Any, data: bytes,
                                                          needle: str) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", content=data,
                            headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and needle in reply.json()["error"]["message"]
        again = client.post("/v1/chat/completions", json=CHAT)  # the same connection
        assert again.status_code == 200


def test_a_request_http_cannot_parse_is_a_json_400(served: Any) -> None:
    answer = raw_exchange(served.url, b"GARBAGE\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert b"invalid HTTP request" in body
    answer = raw_exchange(served.url, b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " +
                          b"a" * 70000 + b"\r\n\r\n")
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431"))
    assert b"application/json" in answer


def test_a_body_over_the_limit_is_a_413(serve_with: Any) -> None:
    from mlxrunner.serve import ServeConfig

    server = serve_with(config=ServeConfig(max_body_bytes=1000))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    reply = httpx.post(server.url + "/v1/chat/completions", json=big)
    assert reply.status_code == 413 and "1000 bytes" in reply.json()["error"]["message"]

    def chunked() -> Any:  # no Content-Length: counted as it is read
        yield b'{"messages": [{"role": "user", "content": "'
        yield b"x" * 2000
        yield b'"}]}'

    reply = httpx.post(server.url + "/v1/chat/completions", content=chunked())
    assert reply.status_code == 413 and "too large" in reply.json()["error"]["message"]


def test_foreign_hosts_and_origins_are_refused(served: Any) -> None:
    url = served.url + "/v1/models"
    refused = httpx.get(url, headers={"Host": "evil.example"})
    assert refused.status_code == 403 and "evil.example" in refused.json()["error"]["message"]
    refused = httpx.post(served.url + "/v1/chat/completions", content=b"{}",
                         headers={"Origin": "https://evil.example",
                                  "Content-Type": "text/plain"})
    assert refused.status_code == 403 and "origin" in refused.json()["error"]["message"]
    local = httpx.get(url, headers={"Origin": "http://localhost:3000"})
    assert local.status_code == 200
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    # a page served on IPv6's loopback (its brackets are an address, not a glob's set)
    for origin in ("http://[::1]:8080", "https://[::1]"):
        assert httpx.get(url, headers={"Origin": origin}).status_code == 200, origin
    for origin in ("http://:", "http://1:8080"):  # what the glob's set [::1] matched
        assert httpx.get(url, headers={"Origin": origin}).status_code == 403, origin
    preflight = httpx.options(url, headers={"Origin": "http://127.0.0.1:5173",
                                            "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204 and "POST" in \
        preflight.headers["access-control-allow-methods"]


def test_origins_and_hosts_can_be_allowed(serve_with: Any) -> None:
    from mlxrunner.serve import ServeConfig

    server = serve_with(config=ServeConfig(allowed_hosts=("models.lan",),
                                           origins=("https://*.example.org",)))
    reply = httpx.get(server.url + "/v1/models",
                      headers={"Host": "models.lan:8080", "Origin": "https://app.example.org"})
    assert reply.status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 403  # 127.0.0.1 not listed


def test_an_api_key_is_required_when_set(serve_with: Any) -> None:
    openai = pytest.importorskip("openai")
    from mlxrunner.serve import ServeConfig

    server = serve_with(config=ServeConfig(api_key="sesame"))
    assert httpx.get(server.url + "/health").status_code == 200  # health checks stay open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame",
                           max_retries=0).models.list()
    assert [m.id for m in models][0] == "demo"
    assert httpx.get(server.url + "/api/tags", headers={"x-api-key": "sesame"}).status_code \
        == 200


def test_a_full_queue_is_a_503_with_retry_after(served: Any, demo_service: Any) -> None:
    engine = demo_service.engine
    release = threading.Event()
    ids = demo_service.encode("import", rendered=False)
    blocker = engine.submit(demo_service.generation(ids, {"temperature": 0}, max_tokens=2),
                            on_text=lambda _: release.wait(60))
    saved, engine.queue_size = engine.queue_size, 0
    try:
        reply = httpx.post(served.url + "/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert "busy" in reply.json()["error"]["message"]
    finally:
        engine.queue_size = saved
        release.set()
    assert blocker.future.result(timeout=60).tokens


class _FailingRenderer:
    def render(self, messages, tools=None, *, think=None, add_generation_prompt=True):
        raise ValueError("renderer bug")


class _FailingParser:
    """Fails on the first piece of a streamed reply and on a whole one."""

    def reset(self, prompt=None, *, start_in_thinking=None, tools=None):
        pass

    def feed(self, chunk):
        raise RuntimeError("parser bug")

    def finish(self):
        return []

    def parse(self, text):
        raise RuntimeError("parser bug")


@pytest.fixture
def failing_plugin() -> Any:
    previous = plugins.host()
    test_host = plugins.reset()
    test_host.add_plugin(types.SimpleNamespace(
        register_renderers=mlxrunner.plugin.hookimpl(
            lambda register: register("failing", lambda context: _FailingRenderer())),
        register_parsers=mlxrunner.plugin.hookimpl(
            lambda register: register("failing", lambda context: _FailingParser()))),
        "failing-plugin", "mlxrunner-failing")
    yield
    plugins.reset(previous)


@pytest.mark.parametrize("which, needle", [("renderer", "ValueError: renderer bug"),
                                           ("parser", "RuntimeError: parser bug")])
def test_a_failing_renderer_or_parser_is_a_500_naming_its_plugin(
        failing_plugin: Any, serve_with: Any, demo_bundle: Any, demo_service: Any,
        which: str, needle: str) -> None:
    from mlxrunner.serve import Service

    if which == "renderer":
        bundle = dataclasses.replace(demo_bundle, renderer=_FailingRenderer(),
                                     renderer_name="failing")
    else:
        bundle = dataclasses.replace(demo_bundle, parser=_FailingParser(),
                                     parser_name="failing")
    server = serve_with(Service(bundle, name="demo", engine=demo_service.engine))
    message = f"{which} 'failing' (plugin mlxrunner-failing) failed: {needle}"
    reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert reply.status_code == 500 and reply.json()["error"]["message"] == message
    if which == "parser":  # mid-stream: the last event says what failed
        lines = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                           timeout=60).text.strip().splitlines()
        assert message in lines[-1] and "[DONE]" not in lines[-1]
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}
                      ).status_code == 200


def test_a_bug_of_ours_is_a_500_not_the_clients_fault(serve_with: Any, demo_bundle: Any,
                                                      demo_service: Any, caplog: Any) -> None:
    from mlxrunner.serve import Service

    class Tokenizer:
        def __getattr__(self, name: str) -> Any:
            return getattr(demo_bundle.tokenizer, name)

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise ValueError("an internal bug")

    bundle = dataclasses.replace(demo_bundle, tokenizer=Tokenizer())
    server = serve_with(Service(bundle, name="demo", engine=demo_service.engine))
    with caplog.at_level(logging.ERROR, logger="mlxrunner.serve"):
        for path, body, api_message in (
                ("/v1/completions", {"prompt": "x", "max_tokens": 2},
                 lambda b: b["error"]["message"]),
                ("/api/generate", {"model": "demo", "prompt": "x", "raw": True,
                                   "stream": False}, lambda b: b["error"])):
            reply = httpx.post(server.url + path, json=body)
            assert reply.status_code == 500
            assert "internal bug" not in api_message(reply.json())
    assert "ValueError: an internal bug" in caplog.text  # the traceback is logged


def test_a_client_that_goes_away_cancels_its_generation(served: Any, demo_service: Any,
                                                        caplog: Any) -> None:
    engine = demo_service.engine
    started = threading.Event()
    for stream in (False, True):
        caplog.clear()
        body = ('{"prompt": "def f():", "max_tokens": 100000, "temperature": 0.9, '
                f'"stream": {str(stream).lower()}}}').encode()
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        with caplog.at_level(logging.INFO, logger="mlxrunner.serve"):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " +
                         str(len(body)).encode() + b"\r\n\r\n" + body)
            while not engine.running:
                started.wait(0.01)
            sock.close()
            while engine.running:
                started.wait(0.01)
        assert "generation cancelled (the client went away)" in caplog.text
    reply = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200


def test_each_request_is_one_access_log_line(served: Any, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="mlxrunner.serve.access"):
        httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        httpx.get(served.url + "/nowhere")
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxrunner.serve.access"]
    assert len(lines) == 2
    assert lines[0].startswith("POST /v1/completions 200 ") and lines[0].endswith(" 3 tokens")
    assert lines[1].startswith("GET /nowhere 404 ")


def test_a_generation_past_the_request_timeout_is_ended(served: Any, demo_service: Any,
                                                        caplog: Any) -> None:
    engine = demo_service.engine
    saved, engine.request_timeout = engine.request_timeout, 0.0
    try:
        with caplog.at_level(logging.INFO, logger="mlxrunner.serve"):
            reply = httpx.post(served.url + "/v1/completions",
                               json={"prompt": "def f():", "max_tokens": 500}, timeout=120)
    finally:
        engine.request_timeout = saved
    choice = reply.json()["choices"][0]
    assert reply.status_code == 200 and choice["finish_reason"] == "length"
    assert reply.json()["usage"]["completion_tokens"] < 500
    assert "generation timed out" in caplog.text


def test_an_idle_connection_is_closed_by_the_server(demo_service: Any) -> None:
    from mlxrunner.serve import Listener, bind, create_app

    listener = Listener(create_app(demo_service), bind("127.0.0.1", 0),
                        keep_alive_timeout=1).start()
    try:
        host, port = listener.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            received = b""
            while chunk := sock.recv(65536):  # ends when the server closes the connection
                received += chunk
        assert received.startswith(b"HTTP/1.1 200") and received.endswith(b'{"status":"ok"}')
    finally:
        listener.stop()


@pytest.mark.parametrize("partial", [
    b"",  # nothing at all
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n",  # headers never end
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json"
    b"\r\ncontent-length: 100\r\n\r\n{\"prompt\":",  # nor does the body
])
def test_a_request_sent_too_slowly_is_a_408_and_closed(demo_service: Any, partial: bytes
                                                       ) -> None:
    """A client that sends part of a request (or nothing) and stops holds its connection no
    longer than the read timeout (many such clients would take every place the server has);
    a connection that sends whole requests slowly but in time is served."""
    from mlxrunner.serve import Listener, bind, create_app

    listener = Listener(create_app(demo_service), bind("127.0.0.1", 0),
                        read_timeout=1.0).start()
    try:
        host, port = listener.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(partial)
            started = time.monotonic()
            received = b""
            while chunk := sock.recv(65536):  # ends when the server closes the connection
                received += chunk
            waited = time.monotonic() - started
        assert received.startswith(b"HTTP/1.1 408") and b"did not arrive" in received
        assert 0.9 <= waited < 30
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            for piece in (b"GET /health HTTP/1.1\r\n", b"Host: localhost\r\n",
                          b"Connection: close\r\n\r\n"):
                sock.sendall(piece)
                time.sleep(0.2)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    finally:
        listener.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "x", "text": {"format": 1.5}}),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": 3}]}),
    ("/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "x",
                                                  "images": 5}]}),
    ("/v1/messages", {"model": "demo", "max_tokens": 2, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": 5, "name": 7,
                                           "input": 3}]}]}),
])
def test_odd_shapes_found_by_fuzzing_are_400s(served: Any, path: str, body: dict) -> None:
    reply = httpx.post(served.url + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text


def test_a_body_is_never_read_as_the_next_request(served: Any) -> None:
    """A POST to an unknown route, its body an HTTP request, on a keep-alive connection: the
    next answer is the next real request's, and the body gets none."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    answer = raw_exchange(served.url,
                          b"POST /nowhere HTTP/1.1\r\nHost: localhost\r\nContent-Length: " +
                          str(len(smuggled)).encode() + b"\r\n\r\n" + smuggled +
                          b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                          b"Connection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 ") == 2
    assert answer.startswith(b"HTTP/1.1 404") and b"HTTP/1.1 200" in answer
    assert b'"status":"ok"' not in answer and b'"object":"list"' in answer


def test_a_template_that_raises_is_the_requests_400(serve_with: Any, demo_bundle: Any,
                                                    demo_service: Any) -> None:
    from mlxrunner.chat import RenderContext, get_renderer
    from mlxrunner.serve import Service

    template = ("{% if messages[0].role == 'system' %}"
                "{{ raise_exception('system messages are not supported') }}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    renderer = get_renderer("jinja", RenderContext(chat_template=template))
    bundle = dataclasses.replace(demo_bundle, renderer=renderer, renderer_name="jinja")
    server = serve_with(Service(bundle, name="demo", engine=demo_service.engine))
    reply = httpx.post(server.url + "/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "system", "content": "x"}, *CHAT["messages"]]})
    assert reply.status_code == 400
    assert "system messages are not supported" in reply.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}),
    ("/v1/chat/completions", {**CHAT, "top_k": 10 ** 12}),
    ("/v1/chat/completions", {**CHAT, "repeat_last_n": 10 ** 12}),
    ("/v1/chat/completions", {**CHAT, "seed": 2 ** 70}),
    ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 10_000}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}),
    ("/api/generate", {"prompt": "x", "options": {"seed": 2 ** 70}}),
    ("/api/generate", {"prompt": "x", "options": {"top_k": 10 ** 12}}),
    ("/api/generate", {"prompt": "x", "options": {"num_predict": True}}),
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}],
                   "options": {"stop": ["x"] * 10_000}}),
    ("/v1/messages", {"max_tokens": True, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/responses", {"input": "x", "max_output_tokens": True}),
])
def test_values_no_model_can_use_are_400s(served: Any, path: str, body: dict) -> None:
    """JSON true is not a count; seeds, top_k, repeat windows and stop lists have bounds
    (each well above what a model can use): a 400, not a 200 or a 500."""
    reply = httpx.post(served.url + path, json={"model": "demo", **body}, timeout=60)
    assert reply.status_code == 400, (reply.status_code, reply.text[:300])


def test_completions_default_to_openais_16_tokens(served: Any) -> None:
    reply = httpx.post(served.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": "def f(x):", "temperature": 0})
    assert reply.status_code == 200
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] <= 16
    assert usage["completion_tokens"] == 16 or reply.json()["choices"][0]["finish_reason"] == \
        "stop"


def _four_streams_beside(url: str, bad: Any) -> tuple[list[str], list[str], Any]:
    """Four chats (greedy) one at a time, then streamed together while ``bad()`` runs:
    (alone, together, what bad returned)."""
    import json

    prompts = [f"def f{i}(x):" for i in range(4)]

    def body(prompt: str) -> dict[str, Any]:
        return {"model": "demo", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16, "temperature": 0}

    alone = [httpx.post(url + "/v1/chat/completions", json=body(p), timeout=120)
             .json()["choices"][0]["message"]["content"] for p in prompts]
    together: dict[int, str] = {}

    def stream(i: int) -> None:
        text = []
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={**body(prompts[i]), "stream": True}, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["delta"].get("content")
                                or "")
        together[i] = "".join(text)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    got = bad()
    for t in threads:
        t.join(300)
    return alone, [together.get(i, "") for i in range(4)], got


def test_a_failing_parser_fails_its_request_alone(failing_plugin: Any, serve_with: Any,
                                                  demo_bundle: Any, demo_service: Any) -> None:
    """Four streams of one service decode while a request to another service of the same
    engine (its parser raises) arrives: it gets its 500 naming the plugin, the four finish
    with what each gives alone."""
    from mlxrunner.serve import Service

    good = serve_with(demo_service)
    failing = serve_with(Service(dataclasses.replace(demo_bundle, parser=_FailingParser(),
                                                     parser_name="failing"),
                                 name="demo", engine=demo_service.engine))
    alone, together, bad = _four_streams_beside(
        good.url, lambda: httpx.post(failing.url + "/v1/chat/completions",
                                     json={**CHAT, "max_tokens": 8}, timeout=120))
    assert bad.status_code == 500 and "parser 'failing'" in bad.json()["error"]["message"]
    assert together == alone


def test_a_draft_that_raises_leaves_every_request_its_reply(serve_with: Any) -> None:
    """The model's draft raises on its third proposal while four requests decode together:
    each drafted sequence goes on without it, every reply is the one plain decoding gives."""
    from mlxrunner.serve import Service

    bundle = mlxrunner.load("demo-qwen3.5")  # its own draft object, patched below
    plain = serve_with(Service(dataclasses.replace(bundle, draft=None), name="demo"))
    calls: list[Any] = []
    made = bundle.draft.new_batch  # greedy rows draft through the draft's shared context

    def new_batch(*args: Any) -> Any:
        shared = made(*args)
        propose = shared.propose

        def breaking(*args: Any) -> Any:
            calls.append(args)
            if len(calls) == 3:
                raise RuntimeError("the draft broke")
            return propose(*args)

        shared.propose = breaking
        return shared

    bundle.draft.new_batch = new_batch
    broken = serve_with(Service(bundle, name="demo"))
    alone, _, _ = _four_streams_beside(plain.url, lambda: None)
    _, together, _ = _four_streams_beside(broken.url, lambda: None)
    assert len(calls) >= 3 and together == alone
