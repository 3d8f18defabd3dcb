"""A tool-call round trip through the qwen3.5 and gemma4 renderers and parsers, in every API.

A tiny random target never writes a tool call, so the target here is scripted: a model whose
logits, at each position after the prompt, pick the next token of a tool call written in the
chat format's own syntax (then its end token). Everything else is the real path: the
renderer, the decoding loop, the streaming detokenizer, the parser and each API's shape."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxrunner import settings
from mlxrunner.chat import get_renderer
from mlxrunner.plugin import KVCache, Model

httpx = pytest.importorskip("httpx")

CALLS = {"qwen3.5": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>",
         "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


class ScriptedModel(Model):
    """Says ``script`` after a prompt of ``start`` tokens, then ``end``, then ``end`` again."""

    supports_taps = False

    def __init__(self, script: list[int], start: int, end: int, vocab: int) -> None:
        super().__init__({})
        self.embed = nn.Embedding(vocab, 8)
        self._script, self._start, self._vocab = [*script, end], start, vocab

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def __call__(self, ids: mx.array, cache: Any = None, *, taps: Any = None) -> mx.array:
        batch, length = ids.shape
        starts: Any = [0] * batch
        if cache:
            # one offset, or one per row in serve's batch
            starts = mx.array(cache[0].offset).tolist()
            starts = starts if isinstance(starts, list) else [starts] * batch
            dummy = mx.zeros((batch, 1, length, 1))
            cache[0].update_and_fetch(dummy, dummy)
        said = [[self._script[min(max(q - self._start + 1, 0), len(self._script) - 1)]
                 for q in range(start, start + length)] for start in starts]
        chosen = mx.arange(self._vocab)[None, None, :] == mx.array(said)[:, :, None]
        return mx.where(chosen, 100.0, 0.0)

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.embed(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        return self.embed.as_linear(hidden)

    num_layers = property(lambda self: 1)
    vocab_size = property(lambda self: self._vocab)
    hidden_size = property(lambda self: 8)


@pytest.fixture(params=["qwen3.5", "gemma4"])
def tool_server(request: Any, demo_bundle: Any) -> Any:
    from mlxrunner.serve import Service

    from .conftest import Served

    name = request.param
    renderer = get_renderer(name)
    prompt = renderer.render(ASK, [TOOL], think=False, add_generation_prompt=True)
    tok = demo_bundle.tokenizer
    script = tok.encode(CALLS[name], add_special_tokens=False)
    assert tok.decode(script) == CALLS[name]
    start = len(tok.encode(prompt, add_special_tokens=False))
    end = min(demo_bundle.stop_token_ids())
    model = ScriptedModel(script, start, end, demo_bundle.model.vocab_size)
    bundle = dataclasses.replace(demo_bundle, model=model, draft=None, renderer=renderer,
                                 renderer_name=name, parser_name=name)
    server = Served(Service(bundle, name="demo"))
    with settings.overridden(compile=False):  # the script reads positions eagerly
        yield server
    server.close()


def test_openai_tool_calls_streamed_or_not_and_the_result_sent_back(tool_server: Any
                                                                    ) -> None:
    body = {"messages": ASK, "tools": [TOOL], "max_tokens": 64, "temperature": 0,
            "think": False}
    reply = httpx.post(tool_server.url + "/v1/chat/completions", json=body, timeout=120)
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    lines = httpx.post(tool_server.url + "/v1/chat/completions", json={**body, "stream": True},
                       timeout=120).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    streamed = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in streamed] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    history = [*ASK, choice["message"],
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    again = httpx.post(tool_server.url + "/v1/chat/completions",
                       json={**body, "messages": history, "max_tokens": 1}, timeout=120)
    assert again.status_code == 200
    assert again.json()["usage"]["prompt_tokens"] > reply.json()["usage"]["prompt_tokens"]


def test_ollama_anthropic_and_responses_tool_calls(tool_server: Any) -> None:
    ollama = pytest.importorskip("ollama")
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    chat = ollama.Client(host=tool_server.url).chat(
        "demo", ASK, tools=[TOOL], think=False, options={"temperature": 0, "num_predict": 64})
    [call] = chat.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather",
                                                                  {"city": "Paris"})
    claude = anthropic.Anthropic(base_url=tool_server.url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "the weather in a city",
              "input_schema": TOOL["function"]["parameters"]}]
    message = claude.messages.create(model="demo", max_tokens=64, messages=ASK, tools=tools,
                                     thinking={"type": "disabled"},
                                     extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    with claude.messages.stream(model="demo", max_tokens=64, messages=ASK, tools=tools,
                                thinking={"type": "disabled"},
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}]
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(
        model="demo", input=ASK, max_output_tokens=64, temperature=0,
        reasoning={"effort": "none"},
        tools=[{"type": "function", **TOOL["function"]}])
    [function_call] = [item for item in response.output if item.type == "function_call"]
    assert json.loads(function_call.arguments) == {"city": "Paris"}
    assert response.status == "completed"


def test_tools_for_a_model_without_a_tool_call_parser_are_a_400(serve_with: Any,
                                                                tmp_path: Any) -> None:
    """A model with no tool-call parser (the default model's template through jinja) would
    drop tools unseen: the request is refused naming the model, as Ollama refuses it;
    without tools it answers."""
    pytest.importorskip("mlxrunner_example_architecture")
    import mlxrunner
    from mlxrunner.serve import Service
    from mlxrunner_test_support import write_model_folder

    folder = write_model_folder(tmp_path / "plain")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    server = serve_with(Service(mlxrunner.load(folder), name="plain"))
    body = {"model": "plain", "messages": ASK, "max_tokens": 2, "temperature": 0}
    refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "tools": [TOOL]},
                         timeout=120)
    assert refused.status_code == 400
    assert "plain does not support tools" in refused.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/chat/completions", json=body,
                      timeout=120).status_code == 200


def test_two_step_round_trips_through_the_official_clients(tool_server: Any) -> None:
    """Each official client asks, gets the tool call, sends the tool's result back in its
    own shape and gets the next reply (a longer prompt: the result was rendered)."""
    ollama = pytest.importorskip("ollama")
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model="demo", messages=ASK, tools=[TOOL],
                                           max_tokens=64, temperature=0,
                                           extra_body={"think": False})
    [call] = first.choices[0].message.tool_calls
    second = client.chat.completions.create(
        model="demo", max_tokens=4, temperature=0, tools=[TOOL], extra_body={"think": False},
        messages=[*ASK, first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert second.usage.prompt_tokens > first.usage.prompt_tokens

    claude = anthropic.Anthropic(base_url=tool_server.url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "the weather in a city",
              "input_schema": TOOL["function"]["parameters"]}]
    asked = claude.messages.create(model="demo", max_tokens=64, messages=ASK, tools=tools,
                                   thinking={"type": "disabled"}, extra_body={"temperature": 0})
    [use] = [b for b in asked.content if b.type == "tool_use"]
    answered = claude.messages.create(
        model="demo", max_tokens=4, tools=tools, thinking={"type": "disabled"},
        extra_body={"temperature": 0},
        messages=[*ASK, {"role": "assistant", "content": asked.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "sunny, 21 C"}]}])

    def prompt(usage: Any) -> int:  # (Anthropic counts the prefix cache's part apart)
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert prompt(answered.usage) > prompt(asked.usage)

    ask = ollama.Client(host=tool_server.url)
    chat = ask.chat("demo", ASK, tools=[TOOL], think=False,
                    options={"temperature": 0, "num_predict": 64})
    again = ask.chat("demo", [*ASK, chat.message,
                              {"role": "tool", "tool_name": "get_weather",
                               "content": "sunny, 21 C"}],
                     tools=[TOOL], think=False, options={"temperature": 0, "num_predict": 4})
    assert again.prompt_eval_count > chat.prompt_eval_count
