"""Structured output end to end: OpenAI's ``response_format`` and ``text.format``, Ollama's
``format``, through the official clients, against the demo model (which writes Python, not
JSON, unless a grammar makes it)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema_rs
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

CHAT = [{"role": "user", "content": "def point(x, y):"}]
POINT = {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 6},
    "x": {"type": "integer", "minimum": -9, "maximum": 9},
    "kind": {"enum": ["a", "b"]}},
    "required": ["label", "x", "kind"], "additionalProperties": False}


class Point(BaseModel):
    label: str = Field(max_length=6)
    x: int = Field(ge=-9, le=9)


@pytest.fixture(scope="module")
def client(served: Any) -> Any:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def ollama_client(served: Any) -> Any:
    return ollama.Client(host=served.url, timeout=120)


def valid(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema_rs.validator_for(schema).validate(value)
    return value


def test_chat_json_schema_through_the_clients_parse(client: Any) -> None:
    """openai's own structured-output helper: it sends the pydantic model's strict schema and
    parses the reply into the model."""
    reply = client.chat.completions.parse(model="demo", messages=CHAT, response_format=Point,
                                          max_tokens=300, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Point)
    assert len(choice.message.parsed.label) <= 6 and -9 <= choice.message.parsed.x <= 9


def test_chat_json_schema_streamed_adds_up_to_a_valid_object(client: Any) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}
    chunks = list(client.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=300, temperature=0, stream=True,
        response_format=form))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    valid(text, POINT)


def test_json_mode_starts_an_object_where_free_text_does_not(client: Any) -> None:
    """Any object is unbounded, so a few tokens: the grammar has the first say."""
    def reply(**extra: Any) -> str:
        return client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6,
                                              temperature=0, **extra).choices[0].message.content
    assert not (reply() or "").lstrip().startswith("{")
    assert reply(response_format={"type": "json_object"}).startswith("{")


def test_responses_text_format_json_schema(client: Any) -> None:
    form = {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}
    reply = client.responses.create(model="demo", input="def point(x, y):",
                                    max_output_tokens=300, temperature=0,
                                    text={"format": form})
    assert reply.status == "completed"
    valid(reply.output_text, POINT)
    assert reply.text.format.type == "json_schema"


def test_ollama_format_schema_and_json(ollama_client: Any) -> None:
    greedy = {"temperature": 0, "num_predict": 300}
    reply = ollama_client.chat("demo", CHAT, format=POINT, options=greedy)
    assert reply.done_reason == "stop"
    valid(reply.message.content, POINT)
    generated = ollama_client.generate("demo", "import json\n", format="json",
                                       options={"temperature": 0, "num_predict": 6})
    assert generated.response.startswith("{")


@pytest.mark.parametrize("response_format, needle", [
    ({"type": "yaml"}, "'yaml' is not one of"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs a 'schema' object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
     "not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "a" * 70_000}}}, "at most 65536"),
])
def test_bad_formats_are_400s_naming_the_field(client: Any, response_format: dict,
                                               needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2,
                                       response_format=response_format)
    error = caught.value.body
    assert error["param"] == "response_format" and needle in error["message"], error
    assert "\n" not in error["message"]


def test_bad_formats_are_400s_in_the_other_apis(client: Any, ollama_client: Any,
                                                served: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input="x", max_output_tokens=2,
                                text={"format": {"type": "json_schema", "name": "x"}})
    assert caught.value.body["param"] == "text.format"
    with pytest.raises(ollama.ResponseError) as refused:  # the client takes only schemas
        ollama_client.chat("demo", CHAT, format={"type": "object", "minProperties": "two"})
    assert refused.value.status_code == 400 and refused.value.error.startswith("format: ")
    yaml = httpx.post(served.url + "/api/generate", json={"model": "demo", "prompt": "x",
                                                           "format": "yaml"}, timeout=60)
    assert yaml.status_code == 400 and "format must be 'json'" in yaml.json()["error"]


def test_a_schema_that_admits_nothing_is_a_400_and_the_batch_goes_on(served: Any) -> None:
    """Four streams decode together while a request with a self-referring schema arrives:
    it gets a 400 when its schema is compiled, before it joins the batch, and the four
    finish with what each gives alone."""
    import threading

    prompts = [f"def f{i}(x):" for i in range(4)]

    def body(prompt: str) -> dict[str, Any]:
        return {"model": "demo", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24, "temperature": 0}

    alone = [httpx.post(served.url + "/v1/chat/completions", json=body(p), timeout=120)
             .json()["choices"][0]["message"]["content"] for p in prompts]
    together: dict[int, str] = {}

    def stream(i: int) -> None:
        text = []
        with httpx.stream("POST", served.url + "/v1/chat/completions",
                          json={**body(prompts[i]), "stream": True}, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text.append(delta.get("content") or "")
        together[i] = "".join(text)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    bad = httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
        **body("x"), "response_format": {"type": "json_schema", "json_schema": {
            "name": "loop", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                       "$ref": "#/$defs/a"}}}})
    for t in threads:
        t.join(300)
    assert bad.status_code == 400 and "not supported" in bad.json()["error"]["message"]
    assert [together.get(i) for i in range(4)] == alone


def test_the_engine_builds_the_models_token_table_before_any_format_is_asked(served: Any):
    """The engine builds structured output's token table when it starts: the first request
    with a format then finds it (the same table its grammar is compiled over)."""
    from mlxrunner.decode import compile_format

    engine = served.service.engine
    bundle = served.service.bundle
    ready = engine.grammar_vocabulary.result(timeout=60)
    assert ready is not None
    grammar = compile_format("json", bundle.tokenizer, bundle.model.vocab_size,
                             engine.stop_ids)
    assert grammar is not None and grammar.vocabulary is ready
