"""OpenAI's API through the official ``openai`` client, against the demo model on loopback."""

from __future__ import annotations

from typing import Any

import pytest

import mlxrunner
from mlxrunner import generate

openai = pytest.importorskip("openai")

CHAT = [{"role": "system", "content": "import os\n"}, {"role": "user", "content": "class Test"}]


@pytest.fixture(scope="module")
def client(served: Any) -> Any:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_models_are_listed_and_retrieved(client: Any) -> None:
    # the model served, then the registered ones it would load by name
    listed = [m.id for m in client.models.list()]
    assert listed[0] == "demo" and "demo-qwen3.5" in listed  # the served one, then registered
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


def test_a_completion_is_what_generate_gives(client: Any, demo_bundle: Any) -> None:
    prompt = "def fibonacci(n):"
    reply = client.completions.create(model="demo", prompt=prompt, max_tokens=20,
                                      temperature=0)
    ids = demo_bundle.tokenizer.encode(prompt, add_special_tokens=True)
    want = generate(demo_bundle.model, ids, options=mlxrunner.SamplerOptions(temperature=0),
                    max_tokens=20)
    assert reply.choices[0].text == demo_bundle.tokenizer.decode(want.tokens)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 20)
    assert reply.model_extra["statistics"]["mode"] == "speculative"  # the demo's draft


def test_a_streamed_chat_adds_up_to_the_whole_reply(client: Any) -> None:
    whole = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=40,
                                           temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    chunks = list(client.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == \
        whole.usage.total_tokens
    assert len({c.id for c in chunks}) == 1


def test_a_stop_string_ends_the_text_before_it(client: Any) -> None:
    free = client.completions.create(model="demo", prompt="def fibonacci(n):", max_tokens=60,
                                     temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    first = free.find(stop)
    assert first > 0
    reply = client.completions.create(model="demo", prompt="def fibonacci(n):",
                                      max_tokens=60, temperature=0, stop=[stop])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (free[:first], "stop")
    streamed = client.completions.create(model="demo", prompt="def fibonacci(n):",
                                         max_tokens=60, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == free[:first]


def test_logprobs_come_back_per_token(client: Any) -> None:
    reply = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    streamed = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              stream=True)
    joined = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for entry in chunk.choices[0].logprobs.content]
    assert joined == content
    legacy = client.completions.create(model="demo", prompt="import", max_tokens=4,
                                       temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 for top in legacy.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("changes, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 2}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function",
                                            "function": {"name": "f"}}]}, "tool_choice"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"extra_body": {"stream": "yes"}}, "stream"),
])
def test_values_out_of_bounds_are_refused_naming_the_field(client: Any, changes: dict,
                                                           param: str) -> None:
    body = {"model": "demo", "messages": CHAT, "max_tokens": 2, **changes}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = caught.value.body
    assert error["param"] == param and param in error["message"], error
    assert "\n" not in error["message"]


def test_a_malformed_conversation_is_refused_naming_the_message(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", max_tokens=2,
                                       messages=[{"role": "robot", "content": "x"}])
    assert caught.value.body["param"] == "messages"
    assert caught.value.body["message"].startswith("message 0: unknown role 'robot'")


def test_an_unknown_model_is_a_404(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert "gpt-4o" in caught.value.body["message"]


def test_max_tokens_is_capped_by_the_servers_limit(serve_with: Any, demo_bundle: Any,
                                                   demo_service: Any) -> None:
    from mlxrunner.serve import Limits, Service

    capped = Service(demo_bundle, name="demo", limits=Limits(max_tokens_limit=3),
                     engine=demo_service.engine)
    server = serve_with(capped)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    reply = client.completions.create(model="demo", prompt="import", max_tokens=10**9,
                                      temperature=0)
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (3, "length")


def test_a_prompt_beyond_the_context_is_refused(client: Any, demo_service: Any) -> None:
    prompt = "x = 1\n" * demo_service.context
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    assert f"context is {demo_service.context}" in caught.value.body["message"]


def test_the_openapi_schema_is_served(served: Any) -> None:
    import httpx

    schema = httpx.get(served.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate",
                 "/v1/messages"):
        assert path in schema["paths"]


def test_a_response_streamed_or_not_is_the_chat_reply(client: Any) -> None:
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12,
                                          temperature=0)
    want = chat.choices[0].message.content
    whole = client.responses.create(model="demo", instructions="import os\n",
                                    input="class Test", max_output_tokens=12, temperature=0)
    assert whole.output_text == want and whole.status == "incomplete"
    assert whole.usage.output_tokens == 12
    events = list(client.responses.create(
        model="demo", instructions="import os\n", stream=True, max_output_tokens=12,
        input=[{"role": "user", "content": "class Test"}], temperature=0))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == want
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "response.incomplete"  # as OpenAI ends at max_output_tokens
    assert events[-1].response.output_text == want


def test_a_response_takes_function_calls_and_outputs_and_refuses_stored_state(client: Any
                                                                             ) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "the weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    reply = client.responses.create(model="demo", tools=tools, max_output_tokens=2, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    alone = client.responses.create(model="demo", input="weather in Paris?",
                                    max_output_tokens=2)
    assert reply.usage.input_tokens > alone.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input="x", previous_response_id="resp_1")
    assert caught.value.body["param"] == "previous_response_id"
