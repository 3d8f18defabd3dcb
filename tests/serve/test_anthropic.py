"""Anthropic's Messages API through the official ``anthropic`` client, against the demo
model on loopback."""

from __future__ import annotations

from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "class Test"}]
GREEDY = {"temperature": 0}  # the client has no sampler arguments; the API takes them


@pytest.fixture(scope="module")
def client(served: Any) -> Any:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0,
                               timeout=120)


def test_a_streamed_message_adds_up_to_the_whole_one(client: Any) -> None:
    whole = client.messages.create(model="demo", max_tokens=16, messages=MESSAGES,
                                   extra_body=GREEDY, system="be brief")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 16
    text = "".join(b.text for b in whole.content if b.type == "text")
    with client.messages.stream(model="demo", max_tokens=16, messages=MESSAGES,
                                extra_body=GREEDY, system="be brief") as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16


def test_a_stop_sequence_is_reported(client: Any) -> None:
    free = client.messages.create(model="demo", max_tokens=30, messages=MESSAGES,
                                  extra_body=GREEDY).content[0].text
    stop = free[4:7]
    reply = client.messages.create(model="demo", max_tokens=30, messages=MESSAGES,
                                   extra_body=GREEDY, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == free[:free.find(stop)]


def test_tool_use_and_results_and_thinking_blocks_are_rendered(client: Any) -> None:
    tools = [{"name": "get_weather", "description": "the weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    history = [*MESSAGES,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "I should look it up", "signature": ""},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    counted = client.messages.count_tokens(model="demo", messages=history, tools=tools)
    alone = client.messages.count_tokens(model="demo", messages=MESSAGES)
    assert counted.input_tokens > alone.input_tokens > 0
    reply = client.messages.create(model="demo", max_tokens=4, messages=history, tools=tools,
                                   thinking={"type": "disabled"})
    # input_tokens leave out what the prefix cache held, as Anthropic's do
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_errors_are_the_clients_exceptions(client: Any) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="demo", max_tokens=4, messages=MESSAGES,
                               extra_body={"temperature": 1.5})
    assert "temperature" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="demo", max_tokens=0, messages=MESSAGES)
