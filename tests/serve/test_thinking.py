"""Thinking split out by the model's parser, in every API's shape: the demo model behind the
qwen3.5 renderer, whose prompt with thinking on ends inside ``<think>``, so the parser takes
the whole reply as reasoning."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from mlxrunner.chat import get_renderer

httpx = pytest.importorskip("httpx")

ASK = [{"role": "user", "content": "class Test"}]
# Seeded sampling: greedy decoding after this prompt is only newlines, which parsers trim.
SEEDED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def thinking_server(demo_bundle: Any, demo_service: Any) -> Any:
    from mlxrunner.serve import Service

    from .conftest import Served

    bundle = dataclasses.replace(demo_bundle, renderer=get_renderer("qwen3.5"),
                                 renderer_name="qwen3.5", parser_name="qwen3.5")
    server = Served(Service(bundle, name="demo", engine=demo_service.engine))
    yield server
    server.close()


def _post(server: Any, path: str, body: dict) -> Any:
    reply = httpx.post(server.url + path, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply


def test_openai_reasoning_content(thinking_server: Any) -> None:
    body = {"messages": ASK, "max_tokens": 8, **SEEDED, "think": True}
    message = _post(thinking_server, "/v1/chat/completions", body).json()["choices"][0][
        "message"]
    assert message["reasoning_content"] and message["content"] == ""
    lines = _post(thinking_server, "/v1/chat/completions", {**body, "stream": True}).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == \
        message["reasoning_content"]
    off = _post(thinking_server, "/v1/chat/completions",
                {**body, "think": None, "reasoning_effort": "none"}).json()
    assert "reasoning_content" not in off["choices"][0]["message"]


def test_ollama_thinking(thinking_server: Any) -> None:
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=thinking_server.url, timeout=120)
    options = {**SEEDED, "num_predict": 8}
    reply = client.chat("demo", ASK, think=True, options=options)
    assert reply.message.thinking and not reply.message.content
    streamed = list(client.chat("demo", ASK, think=True, options=options, stream=True))
    assert "".join(c.message.thinking or "" for c in streamed) == reply.message.thinking
    generated = client.generate("demo", "class Test", think=True, options=options)
    assert generated.thinking == reply.message.thinking


def test_anthropic_thinking_blocks(thinking_server: Any) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="x", max_retries=0)
    kwargs = {"model": "demo", "max_tokens": 8, "messages": ASK, "extra_body": SEEDED,
              "thinking": {"type": "enabled", "budget_tokens": 1024}}
    reply = client.messages.create(**kwargs)
    assert reply.content[0].type == "thinking" and reply.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        thought = "".join(e.delta.thinking for e in stream
                          if e.type == "content_block_delta"
                          and e.delta.type == "thinking_delta")
    assert thought == reply.content[0].thinking


def test_responses_reasoning_item(thinking_server: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="x", max_retries=0)
    reply = client.responses.create(model="demo", input="class Test", max_output_tokens=8,
                                    extra_body=SEEDED, reasoning={"effort": "high"})
    assert reply.output[0].type == "reasoning" and reply.output[0].content[0].text
    events = list(client.responses.create(model="demo", input="class Test", stream=True,
                                          max_output_tokens=8, extra_body=SEEDED,
                                          reasoning={"effort": "high"}))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reply.output[0].content[0].text
