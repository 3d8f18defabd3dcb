"""Ollama's API through the official ``ollama`` client, against the demo model on loopback."""

from __future__ import annotations

from typing import Any

import pytest

ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")

MESSAGES = [{"role": "user", "content": "class Test"}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def client(served: Any) -> Any:
    return ollama.Client(host=served.url, timeout=120)


def test_the_model_is_listed_shown_and_loaded(client: Any, served: Any, demo_bundle: Any
                                              ) -> None:
    listed = [m.model for m in client.list().models]
    assert listed[0] == "demo" and "demo-qwen3.5" in listed  # the served one, then registered
    shown = client.show("demo")
    assert shown.details.family == demo_bundle.config["model_type"]
    assert "completion" in shown.capabilities
    assert [m.model for m in client.ps().models] == ["demo"]
    assert httpx.get(served.url + "/api/version").json()["version"]
    assert httpx.get(served.url + "/").text == "mlxrunner is running"
    assert httpx.head(served.url + "/").status_code == 200


def test_a_streamed_chat_adds_up_to_the_whole_reply_and_ends_with_counters(client: Any
                                                                           ) -> None:
    whole = client.chat("demo", MESSAGES, options=GREEDY, keep_alive="5m")
    assert whole.done and whole.message.content
    assert whole.eval_count == 16 and whole.done_reason == "length"
    assert whole.prompt_eval_count > 0 and whole.total_duration > 0 and whole.eval_duration > 0
    chunks = list(client.chat("demo", MESSAGES, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done
    assert chunks[-1].eval_count == 16 and chunks[-1].prompt_eval_count == \
        whole.prompt_eval_count


def test_generate_raw_and_templated(client: Any, served: Any) -> None:
    raw = client.generate("demo", "def fibonacci(n):", raw=True, options=GREEDY)
    streamed = list(client.generate("demo", "def fibonacci(n):", raw=True, options=GREEDY,
                                    stream=True))
    assert "".join(c.response for c in streamed) == raw.response and raw.eval_count == 16
    chat = client.chat("demo", [{"role": "system", "content": "be brief"}, *MESSAGES],
                       options=GREEDY)
    templated = client.generate("demo", "class Test", system="be brief", options=GREEDY)
    assert templated.response == chat.message.content  # one renderer path
    stop = raw.response[3:6]
    stopped = client.generate("demo", "def fibonacci(n):", raw=True,
                              options={**GREEDY, "stop": [stop]})
    assert stopped.response == raw.response[:raw.response.find(stop)]
    assert stopped.done_reason == "stop"


def test_a_tool_round_trip_is_rendered(client: Any) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = [*MESSAGES,
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    reply = client.chat("demo", messages, tools=tools, think=False, options=GREEDY)
    plain = client.chat("demo", MESSAGES, options=GREEDY)
    assert reply.done and reply.prompt_eval_count > plain.prompt_eval_count


@pytest.mark.parametrize("call, status, needle", [
    (lambda c: c.chat("no-such-model", MESSAGES), 404, "no-such-model"),
    (lambda c: c.chat("demo", MESSAGES, format={"type": "strin"}), 400, "format"),
    (lambda c: c.chat("demo", MESSAGES, options={"temperature": -1}), 400,
     "options.temperature"),
    (lambda c: c.chat("demo", MESSAGES, options={"no_such_option": 1}), 400,
     "options.no_such_option"),
    (lambda c: c.generate("demo", "x", images=["aGk="]), 400, "demo takes no image input"),
])
def test_errors_are_the_clients_response_errors(client: Any, call: Any, status: int,
                                                needle: str) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        call(client)
    assert caught.value.status_code == status and needle in caught.value.error


def test_logprobs_come_back(client: Any) -> None:
    reply = client.generate("demo", "import", raw=True, options={**GREEDY, "num_predict": 3},
                            logprobs=True, top_logprobs=2)
    assert len(reply.logprobs) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in reply.logprobs)
