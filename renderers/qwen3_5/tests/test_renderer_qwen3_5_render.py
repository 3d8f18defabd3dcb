"""The ``qwen3.5`` renderer: the goldens, and the format's rules one by one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import mlxrunner
from mlxrunner import ConversationError
from mlxrunner.plugin import Parser, Renderer

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def renderer():
    return mlxrunner.get_renderer("qwen3.5")


def test_registered_under_its_name(renderer):
    assert isinstance(renderer, Renderer)
    assert isinstance(mlxrunner.get_parser("qwen3.5"), Parser)


def test_goldens_byte_identical(renderer):
    goldens = SHARED / "goldens" / "chat_template_goldens.json"
    if not goldens.is_file():
        pytest.skip(f"shared goldens not found at {goldens} (set MLXRUNNER_SHARED_DATA)")
    cases = [c for c in json.loads(goldens.read_text()) if c["template_file"] == "qwen3_5.jinja"]
    assert len(cases) == 28
    for case in cases:
        kwargs = dict(case["kwargs"])
        think = kwargs.pop("enable_thinking", None)
        out = renderer.render(case["messages"], case["tools"], think=think, **kwargs)
        assert out == case["rendered"], (case["scenario"], case["variant"])


def test_generation_prompt_thinks_by_default(renderer):
    assert renderer.render([USER]).endswith("<|im_start|>assistant\n<think>\n")
    assert renderer.render([USER], think=True).endswith("<|im_start|>assistant\n<think>\n")
    assert renderer.render([USER], think=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert renderer.render([USER], add_generation_prompt=False) == \
        "<|im_start|>user\nHi<|im_end|>\n"


def test_thinking_is_kept_only_after_the_last_user_query(renderer):
    chat = [USER, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning": " R2 \n"}]
    out = renderer.render(chat, add_generation_prompt=False)
    assert "<|im_start|>assistant\nA1<|im_end|>" in out and "R1" not in out
    assert "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>" in out


def test_inline_think_in_content_is_split(renderer):
    chat = [USER, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nAnswer"}]
    out = renderer.render(chat, add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\n<think>\nhm\n</think>\n\nAnswer<|im_end|>\n")


def test_tool_calls_and_merged_tool_results(renderer):
    chat = [USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"name": "f", "arguments": {"s": "x", "n": 1.5, "b": True, "z": None,
                                                 "o": {"k": ["é"]}}}},
        {"function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "r1"}, {"role": "tool", "content": [
            {"type": "text", "text": "r2"}]}]
    out = renderer.render(chat)
    assert ("Checking.\n\n<tool_call>\n<function=f>\n<parameter=s>\nx\n</parameter>\n"
            "<parameter=n>\n1.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n"
            "<parameter=z>\nNone\n</parameter>\n<parameter=o>\n{\"k\": [\"é\"]}\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call>"
            "<|im_end|>\n") in out
    assert ("<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n") in out


def test_tools_header_and_system_prompt(renderer):
    tools = [{"type": "function", "function": {"name": "f", "description": "dé"}}]
    out = renderer.render([{"role": "system", "content": " Be brief. "}, USER], tools)
    assert out.startswith('<|im_start|>system\n# Tools\n\nYou have access to the following '
                          'functions:\n\n<tools>\n{"type": "function", "function": '
                          '{"name": "f", "description": "dé"}}\n</tools>')
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nHi" in out


def test_media_placeholders(renderer):
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"},
                                         {"type": "video"}]}]
    assert "Look: <|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|>" \
           "<|vision_end|>" in renderer.render(chat)


@pytest.mark.parametrize(("chat", "expected"), [
    ([{"role": "developer", "content": "x"}, USER], "no 'developer' role"),
    ([USER, {"role": "system", "content": "late"}], "system message only at the beginning"),
    ([{"role": "system", "content": [{"type": "image"}]}, USER], "cannot contain images"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "type 'audio' is not supported"),
    ([{"role": "system", "content": "s"}, {"role": "tool", "content": "r"}], "needs a user"),
    ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}], "needs a user"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     "has no function name"),
])
def test_what_the_template_refuses_is_a_clear_error(renderer, chat, expected):
    with pytest.raises(ConversationError, match=expected):
        renderer.render(chat)
