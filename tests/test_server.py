"""``mlxrunner serve``: the OpenAI-compatible API over the embedded demo model, end to end
through HTTP on a free local port."""

from __future__ import annotations

import json
import threading
import types
import urllib.error
import urllib.request
from typing import Any

import pytest

import mlxrunner
from mlxrunner import host as plugins
from mlxrunner.decode import generate
from mlxrunner.serve import Service, events, make_server

pytestmark = pytest.mark.skipif("default" not in plugins.host().registry("models"),
                                reason="the demo plugin (mlxrunner-demo) is not installed")


@pytest.fixture(scope="module")
def served():
    bundle = mlxrunner.load("default")
    server = make_server(Service(bundle, name="demo"), port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield bundle, f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


def post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            if response.headers.get("Content-Type") == "text/event-stream":
                return response.status, list(events(iter(response.readline, b"")))
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_it_binds_to_this_machine_only_by_default(served):
    _, base = served
    assert base.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as response:
        listing = json.loads(response.read())
    assert [m["id"] for m in listing["data"]] == ["demo"]


def test_a_completion_is_what_generate_gives(served):
    bundle, base = served
    prompt = "def fibonacci(n):"
    status, reply = post(base + "/v1/completions", {"prompt": prompt, "max_tokens": 20,
                                                    "temperature": 0})
    assert status == 200
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=True)
    want = generate(bundle.model, ids, options=mlxrunner.SamplerOptions(temperature=0),
                    max_tokens=20)
    choice = reply["choices"][0]
    assert choice["text"] == bundle.tokenizer.decode(want.tokens)
    assert choice["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 20,
                              "total_tokens": len(ids) + 20}
    assert reply["statistics"]["mode"] == "speculative"  # the demo has a draft


def test_streamed_chat_adds_up_to_the_whole_reply(served):
    _, base = served
    body = {"messages": [{"role": "system", "content": "import os\n"},
                         {"role": "user", "content": "class Test"}],
            "max_tokens": 40, "temperature": 0}
    status, whole = post(base + "/v1/chat/completions", body)
    assert status == 200
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    status, chunks = post(base + "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert len({c["id"] for c in chunks}) == 1


def test_a_stop_string_ends_the_text_before_it(served):
    _, base = served
    body = {"prompt": "def fibonacci(n):", "max_tokens": 60, "temperature": 0}
    _, free = post(base + "/v1/completions", body)
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    first = text.find(stop)
    assert first > 0
    for stream in (False, True):
        status, reply = post(base + "/v1/completions", {**body, "stop": [stop],
                                                        "stream": stream})
        assert status == 200
        if stream:
            got = "".join(c["choices"][0]["text"] for c in reply)
            finish = reply[-1]["choices"][0]["finish_reason"]
        else:
            got, finish = reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]
            assert reply["usage"]["prompt_tokens"] == free["usage"]["prompt_tokens"] > 0
        assert (got, finish) == (text[:first], "stop")


def test_logprobs_survive_a_stop_string(served):
    """A stop string ends the reply; the logprobs of every token kept come back with it."""
    _, base = served
    body = {"prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    _, free = post(base + "/v1/completions", body)
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    status, reply = post(base + "/v1/completions", {**body, "stop": [stop]})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "stop"
    content = reply["choices"][0]["logprobs"]["content"]
    assert 0 < len(content) < len(free["choices"][0]["logprobs"]["content"])
    assert len(content) == reply["usage"]["completion_tokens"]
    # the same greedy tokens as the free run, up to where the stop string appeared
    assert content == free["choices"][0]["logprobs"]["content"][:len(content)]


def test_logprobs_come_back_per_token(served):
    _, base = served
    status, reply = post(base + "/v1/completions", {"prompt": "import", "max_tokens": 5,
                                                    "temperature": 0, "logprobs": True,
                                                    "top_logprobs": 3})
    assert status == 200
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        # greedy: the chosen token is the likeliest
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])


@pytest.mark.parametrize("route, body, raw, needle", [
    ("/v1/chat/completions", None, b"{not json", "not JSON"),
    ("/v1/chat/completions", [], None, "JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, None, "messages must be a list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None,
     "unknown role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, None, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, None, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, None, "prompt must be a string"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, None, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, "stream"),
    # streamed requests are checked before the event stream starts
    ("/v1/completions", {"prompt": "x", "stream": True, "temperature": "hot"}, None,
     "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stop": 3}, None, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream": True, "max_tokens": 0}, None, "max_tokens"),
])
def test_bad_requests_get_one_clear_line_and_the_server_goes_on(served, route, body, raw,
                                                                needle):
    _, base = served
    status, reply = post(base + route, body, raw)
    assert status == 400
    message = reply["error"]["message"]
    assert needle in message and "\n" not in message
    status, ok = post(base + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_unknown_routes_are_404(served):
    _, base = served
    status, reply = post(base + "/v1/embeddings", {"input": "x"})
    assert status == 404 and "/v1/embeddings" in reply["error"]["message"]


def test_concurrent_requests_are_served_one_at_a_time_and_agree(served):
    _, base = served
    body = {"prompt": "class Test", "max_tokens": 16, "temperature": 0}
    results: list[Any] = [None] * 4

    def ask(i: int) -> None:
        results[i] = post(base + "/v1/completions", body)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    texts = {reply["choices"][0]["text"] for status, reply in results if status == 200}
    assert len(texts) == 1 and all(status == 200 for status, _ in results)


def test_a_taken_port_is_one_clear_error(served, capsys):
    from mlxrunner.cli import main

    port = served[1].rsplit(":", 1)[1]
    assert main(["serve", "--port", port]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlxrunner: error: cannot listen on 127.0.0.1:")


def test_concurrent_streamed_chats_each_get_the_whole_reply(served):
    """Each request parses its reply with a parser of its own."""
    _, base = served
    body = {"messages": [{"role": "user", "content": "class Test"}], "max_tokens": 24,
            "temperature": 0}
    _, whole = post(base + "/v1/chat/completions", body)
    want = whole["choices"][0]["message"]["content"]
    results: list[Any] = [None] * 3

    def ask(i: int) -> None:
        results[i] = post(base + "/v1/chat/completions", {**body, "stream": True})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for status, chunks in results:
        assert status == 200
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


def test_a_port_out_of_range_is_refused_by_the_command_line():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "serve", "--port", "70000"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("'70000' is not a port (0-65535)")


def test_requests_on_new_threads_replay_the_first_requests_traces():
    """The real ``mlxrunner serve`` situation, in a fresh process so that nothing was traced
    before: each request arrives on a new thread, and the second (after the first traced the
    model's and the draft's forwards) must decode too. MLX's streams belong to the thread
    that made them, so the service runs every generation on its one model thread."""
    import subprocess
    import sys

    script = (
        "import threading, mlxrunner\n"
        "from mlxrunner.serve import Service\n"
        "service = Service(mlxrunner.load('default'), name='demo')\n"
        "texts = []\n"
        "for prompt in ('def fibonacci(n):', 'import os'):\n"
        "    def ask(p=prompt):\n"
        "        r = service.request(p, {'max_tokens': 12, 'temperature': 0}, rendered=False)\n"
        "        texts.append(service.generate(r).stats['generated_tokens'])\n"
        "    t = threading.Thread(target=ask); t.start(); t.join()\n"
        "print(texts)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.strip() == "[12, 12]", run.stdout


class _FailingRenderer:
    def render(self, messages, tools=None, *, think=None, add_generation_prompt=True):
        raise ValueError("renderer bug")


class _FailingParser:
    """Parses nothing: fails on the first piece of a streamed reply."""

    def reset(self, prompt=None, *, start_in_thinking=None, tools=None):
        pass

    def feed(self, chunk):
        raise RuntimeError("parser bug")

    def finish(self):
        return []

    def parse(self, text):
        raise RuntimeError("parser bug")


def test_a_failing_renderer_or_parser_is_a_500_naming_it_and_the_server_goes_on(served):
    import dataclasses

    bundle, _ = served
    previous = plugins.host()
    test_host = plugins.reset()
    test_host.add_plugin(types.SimpleNamespace(
        register_renderers=mlxrunner.hookimpl(
            lambda register: register("failing", lambda context: _FailingRenderer())),
        register_parsers=mlxrunner.hookimpl(
            lambda register: register("failing", lambda context: _FailingParser()))),
        "failing-plugin", "mlxrunner-failing")
    try:
        broken = dataclasses.replace(bundle, renderer=_FailingRenderer(),
                                     renderer_name="failing")
        parsing = dataclasses.replace(bundle, parser=_FailingParser(), parser_name="failing")
        for which, failing_bundle, needle in (
                ("renderer", broken, "ValueError: renderer bug"),
                ("parser", parsing, "RuntimeError: parser bug")):
            server = make_server(Service(failing_bundle, name="demo"), port=0)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            host, port = server.server_address[:2]
            url = f"http://{host}:{port}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "class Test"}], "max_tokens": 4}
            try:
                status, reply = post(url, body)
                assert status == 500, reply
                message = reply["error"]["message"]
                assert message == (f"{which} 'failing' (plugin mlxrunner-failing) failed: "
                                   f"{needle}")
                if which == "parser":  # mid-stream: the last event says what failed
                    status, chunks = post(url, {**body, "stream": True})
                    assert status == 200 and chunks[-1]["error"]["message"] == message
                status, ok = post(url.replace("chat/", ""), {"prompt": "x", "max_tokens": 2})
                assert status == 200 and ok["usage"]["completion_tokens"] == 2
            finally:
                server.shutdown()
                server.server_close()
    finally:
        plugins.reset(previous)
