"""The official openai, anthropic and ollama clients against the demo model and the default
model (SmolLM2 from the store, whose template takes strings and which has no tool-call
parser): a message of content parts gets the reply its plain text gets, and tools sent to
the default model are a clear 400 in each client's own error type."""

from __future__ import annotations

from typing import Any

import pytest

from mlxrunner import host as plugins

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

QUESTION = "What is the capital of France?"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def default_server() -> Any:
    """A server of the default model, where the store holds it (the README's first command
    pulls it; tests do not)."""
    from mlxrunner.store import default_store

    if "smollm2:135m" not in plugins.host().registry("models"):
        pytest.skip("the smollm2 plugin is not installed")
    if default_store().get("smollm2:135m") is None:
        pytest.skip("the default model is not in the store (run the README's first command)")
    import mlxrunner
    from mlxrunner.serve import Service

    from .conftest import Served

    server = Served(Service(mlxrunner.load("smollm2:135m"), name="default"))
    yield server
    server.close()


@pytest.fixture(params=["demo", "default"])
def server(request: Any) -> Any:
    return request.getfixturevalue("served" if request.param == "demo" else "default_server")


def test_content_parts_get_the_reply_of_their_text(server: Any) -> None:
    name = server.service.name
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def chat(content: Any) -> str:
        reply = client.chat.completions.create(
            model=name, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": content}])
        return reply.choices[0].message.content or ""

    text = chat(QUESTION)
    assert text
    assert chat([{"type": "text", "text": QUESTION}]) == text
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    message = claude.messages.create(
        model=name, max_tokens=12, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert "".join(b.text for b in message.content if b.type == "text") == text
    said = ollama.Client(host=server.url).chat(
        name, [{"role": "user", "content": QUESTION}],
        options={"temperature": 0, "num_predict": 12})
    assert said.message.content == text


def test_tools_to_the_default_model_are_a_400_in_every_client(default_server: Any) -> None:
    url = default_server.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        client.chat.completions.create(model="default", messages=ask, tools=[TOOL],
                                       max_tokens=8)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="does not support tools"):
        claude.messages.create(model="default", max_tokens=8, messages=ask, tools=[{
            "name": "get_weather", "input_schema": TOOL["function"]["parameters"]}])
    with pytest.raises(ollama.ResponseError, match="does not support tools") as caught:
        ollama.Client(host=url).chat("default", ask, tools=[TOOL])
    assert caught.value.status_code == 400
