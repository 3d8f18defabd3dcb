"""Rendered prompts tokenize with the real tokenizers so that every marker is one id.

For each golden case and for conversations that use every part of each format
(system, tools, tool calls and results, thinking, media), the native
renderer's prompt is encoded without special-token insertion: each marker of
formats.md must appear as exactly its own id, as often as it appears in the
text, and decoding must give the text back.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import mlxrunner
from mlxrunner.plugin import RenderContext

pytest.importorskip("mlxrunner_renderer_qwen3_5", reason="mlxrunner-renderer-qwen3-5 not installed")
pytest.importorskip("mlxrunner_renderer_gemma4", reason="mlxrunner-renderer-gemma4 not installed")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed")

QWEN_IDS = {"<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
            "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067,
            "<think>": 248068, "</think>": 248069}
GEMMA_IDS = {"<bos>": 2, "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48, "<tool_call|>": 49,
             "<|tool_response>": 50, "<tool_response|>": 51, '<|"|>': 52, "<|think|>": 98,
             "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
             "<|image|>": 258880, "<|audio|>": 258881, "<|video|>": 258884}
FORMATS = {"qwen3.5": ("qwen3_5", QWEN_IDS), "gemma4-small": ("gemma4", GEMMA_IDS),
           "gemma4-large": ("gemma4", GEMMA_IDS), "gemma4-nemotron": ("gemma4", GEMMA_IDS)}
GOLDEN_RENDERER = {"qwen3_5.jinja": "qwen3.5", "gemma4-small.jinja": "gemma4-small",
                   "gemma4-large.jinja": "gemma4-large"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City"},
        "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["c", "f"]},
        "spots": {"type": "array", "items": {"type": "string"}}}}}}]
CHATS = [
    [{"role": "system", "content": "Be brief. «ok»"},
     {"role": "user", "content": [{"type": "text", "text": "What is this? "}, {"type": "image"}]},
     {"role": "assistant", "content": "A cat 🐈.", "reasoning_content": "Looks like fur."},
     {"role": "user", "content": "Weather in Zürich and Paris?"},
     {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.",
      "tool_calls": [
          {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {
              "city": "Zürich", "days": 2, "spots": ["lake", "old town"]}}},
          {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Paris"}'}}]},
     {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21, "sky": "clear"}'},
     {"role": "tool", "tool_call_id": "b", "content": "rain"}],
    [{"role": "user", "content": "Say hi in three languages, 你好."}],
]


def _tokenizer(shared: Path, name: str):
    path = shared / "tokenizers" / f"{name}-tokenizer.json.gz"
    if not path.is_file():
        pytest.skip(f"tokenizer not found: {path}")
    with gzip.open(path) as f:
        return tokenizers.Tokenizer.from_str(f.read().decode("utf-8"))


@pytest.fixture(scope="module")
def loaded(request):
    cache: dict[str, object] = {}

    def get(shared: Path, name: str):
        if name not in cache:
            cache[name] = _tokenizer(shared, name)
        return cache[name]

    return get


def _check(tokenizer, ids_of: dict[str, int], text: str, where: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for marker, marker_id in ids_of.items():
        assert tokenizer.token_to_id(marker) == marker_id, f"{marker} is not id {marker_id}"
        assert ids.count(marker_id) == text.count(marker), f"{where}: {marker} split or merged"
    assert tokenizer.decode(ids, skip_special_tokens=False) == text, where
    return sum(text.count(marker) for marker in ids_of)


def test_golden_prompts_keep_every_marker_one_id(shared_data_dir, loaded):
    cases = json.loads((shared_data_dir / "goldens" / "chat_template_goldens.json").read_text())
    seen = 0
    for case in cases:
        name = GOLDEN_RENDERER[case["template_file"]]
        tokenizer = loaded(shared_data_dir, FORMATS[name][0])
        seen += _check(tokenizer, FORMATS[name][1], case["rendered"],
                       f"{case['template_file']} {case['scenario']} {case['variant']}")
    assert seen > 500


@pytest.mark.parametrize("renderer_name", list(FORMATS))
def test_rendered_prompts_keep_every_marker_one_id(shared_data_dir, loaded, renderer_name):
    tokenizer_name, ids_of = FORMATS[renderer_name]
    tokenizer = loaded(shared_data_dir, tokenizer_name)
    renderer = mlxrunner.get_renderer(renderer_name, RenderContext(bos_token="<bos>"))
    markers_seen = set()
    for chat in CHATS:
        for think in (None, True, False):
            for tools in (None, TOOLS):
                text = renderer.render(chat, tools, think=think)
                _check(tokenizer, ids_of, text, f"{renderer_name} think={think}")
                markers_seen.update(m for m in ids_of if m in text)
    expected = set(ids_of) - {"<|audio|>", "<|video|>"}
    assert markers_seen >= expected, f"not exercised: {sorted(expected - markers_seen)}"
