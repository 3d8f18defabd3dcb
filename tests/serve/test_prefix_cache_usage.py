"""The server keeps each model's state across requests and says so: OpenAI's
``usage.prompt_tokens_details.cached_tokens`` (chat and completions), Anthropic's
``cache_read_input_tokens``, the Ollama reply's ``statistics.cached_tokens`` (Ollama's own
``prompt_eval_count`` stays the whole prompt)."""

from __future__ import annotations

import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_a_conversation_that_goes_on_reports_its_cached_prompt(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x")
    messages = [{"role": "user", "content": "def multiply(x, y):"}]
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=6,
                                           temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "class Point:"}]
    second = client.chat.completions.create(model="demo", messages=messages, max_tokens=6,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens

    text = "import os\nimport sys\n"
    ids = served.service.encode(text, rendered=False)
    longer = served.service.encode(text + "import re\n", rendered=False)
    assert longer[:len(ids)] == ids  # the shorter prompt's tokens begin the longer's
    client.completions.create(model="demo", prompt=text, max_tokens=3, temperature=0)
    more = client.completions.create(model="demo", prompt=text + "import re\n", max_tokens=3,
                                     temperature=0)
    assert more.usage.prompt_tokens_details.cached_tokens >= len(ids)

    ollama = _post(served.url + "/api/generate", {"model": "demo", "stream": False,
                                                  "prompt": text + "import re\nimport io\n",
                                                  "raw": True,
                                                  "options": {"num_predict": 2}})
    assert ollama["prompt_eval_count"] > ollama["statistics"]["cached_tokens"] >= len(longer)

    anthropic = _post(served.url + "/v1/messages", {
        "model": "demo", "max_tokens": 3, "messages": messages[:1]})
    usage = anthropic["usage"]
    assert usage["cache_read_input_tokens"] > 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        first.usage.prompt_tokens
