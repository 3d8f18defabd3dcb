"""The Gemma 4 renderers: goldens, variant choice, the nemotron ordering, the format's rules."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import mlxrunner
from mlxrunner import ConversationError
from mlxrunner.plugin import RenderContext

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SHARED = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
FIXTURE = HERE / "fixtures" / "gemma4-nemotron.jinja"
USER = {"role": "user", "content": "Hi"}
CALL_CHAT = [
    USER,
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "Days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def shared(path: str) -> Path:
    target = SHARED / path
    if not target.exists():
        pytest.skip(f"shared data not found: {target} (set MLXRUNNER_SHARED_DATA)")
    return target


def render(name: str, messages, tools=None, context: RenderContext | None = None, **kwargs):
    return mlxrunner.get_renderer(name, context).render(messages, tools, **kwargs)


@pytest.mark.parametrize(("template", "name"), [("gemma4-small.jinja", "gemma4-small"),
                                                ("gemma4-large.jinja", "gemma4-large")])
def test_goldens_byte_identical(template, name):
    cases = [c for c in json.loads(shared("goldens/chat_template_goldens.json").read_text())
             if c["template_file"] == template]
    assert len(cases) == 28
    context = RenderContext(bos_token="<bos>")
    for case in cases:
        kwargs = dict(case["kwargs"])
        think = kwargs.pop("enable_thinking", None)
        assert kwargs.pop("bos_token") == "<bos>"
        out = render(name, case["messages"], case["tools"], context, think=think, **kwargs)
        assert out == case["rendered"], (case["scenario"], case["variant"])


@pytest.mark.parametrize(("context", "variant"), [
    (None, "small"),
    (RenderContext(), "small"),
    (RenderContext(model_name="google/gemma-4-E2B-it"), "small"),
    (RenderContext(model_name="gemma-4-e4b-it"), "small"),
    (RenderContext(model_name="gemma-4-26b-a4b-it"), "large"),
    (RenderContext(model_name="Gemma-4-31B-IT-4bit"), "large"),
    (RenderContext(model_name="gemma4_31b"), "large"),
    (RenderContext(model_name="gemma-4-2.5b"), "small"),
    (RenderContext(num_parameters=31_000_000_000), "large"),
    (RenderContext(num_parameters=12_000_000_000), "large"),
    (RenderContext(model_name="tiny", num_parameters=5_000_000_000), "small"),
])
def test_gemma4_picks_small_or_large_from_the_model(context, variant):
    renderer = mlxrunner.get_renderer("gemma4", context)
    assert renderer.name == f"gemma4-{variant}"
    assert renderer.render([USER], think=False).endswith(
        "<|channel>thought\n<channel|>" if variant == "large" else "<|turn>model\n")


def test_nemotron_is_never_picked_automatically_and_needs_its_name():
    for name in ("nemotron-gemma-4-31b", "gemma4-nemotron"):
        assert mlxrunner.get_renderer("gemma4", RenderContext(model_name=name)).name != \
            "gemma4-nemotron"
    assert mlxrunner.get_renderer("gemma4-nemotron").name == "gemma4-nemotron"


def test_large_differs_from_small_only_in_the_generation_prompt():
    chats = [[USER], CALL_CHAT[:2], [{"role": "system", "content": "s"}, USER,
                                     {"role": "assistant", "content": "x"}, USER]]
    for chat in chats:
        for think in (None, True, False):
            small = render("gemma4-small", chat, think=think, add_generation_prompt=False)
            assert render("gemma4-large", chat, think=think, add_generation_prompt=False) == small
    assert render("gemma4-large", [USER], think=True) == render("gemma4-small", [USER], think=True)


def test_nemotron_writes_content_before_tool_calls():
    small = render("gemma4-small", CALL_CHAT)
    nemotron = render("gemma4-nemotron", CALL_CHAT)
    # keys sorted case-insensitively, as Jinja's dictsort does
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,Days:2}<tool_call|>'
    response = '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
    assert f"<|turn>model\n{call}{response}Let me look.<turn|>\n" in small
    assert f"<|turn>model\nLet me look.{call}{response}<turn|>\n" in nemotron
    assert nemotron.index("Let me look.") < nemotron.index("<|tool_call>")
    # without tool calls the two are the same
    plain = [USER, {"role": "assistant", "content": "Hello", "reasoning_content": "r"}, USER]
    for think in (None, True, False):
        assert render("gemma4-nemotron", plain, think=think) == \
            render("gemma4-small", plain, think=think)


def test_the_nemotron_fixture_is_the_small_template_with_one_block_moved():
    small = shared("templates/gemma4-small.jinja").read_text()
    fixture = FIXTURE.read_text()
    start = small.index("            {%- set captured_content -%}")
    end_line = "{%- set has_content = captured_content | trim | length > 0 -%}\n"
    end = small.index(end_line) + len(end_line)
    block = small[start:end]
    anchor = "            {%- if message.get('tool_calls') -%}\n"
    moved = (small[:start] + small[end:]).replace(anchor, block + "\n" + anchor)
    body = lambda text: text[text.index("#}"):]  # noqa: E731 (the header comment differs)
    assert body(fixture) == body(moved)
    assert fixture.count("{%- set captured_content -%}") == 1


def test_thinking_header_tools_and_bos():
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    out = render("gemma4", [{"role": "developer", "content": " Sys "}, USER], tools, think=True)
    assert out == ('<bos><|turn>system\n<|think|>\nSys<|tool>declaration:f{description:<|"|>d'
                   '<|"|>,parameters:{properties:{q:{type:<|"|>STRING<|"|>}},required:[<|"|>q'
                   '<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n<|turn>user\nHi<turn|>\n'
                   '<|turn>model\n')
    assert render("gemma4", [USER], context=RenderContext(bos_token="")).startswith("<|turn>")


def test_tool_results_end_the_prompt_without_a_new_turn():
    out = render("gemma4-small", CALL_CHAT)
    assert out.endswith("<tool_response|>Let me look.<turn|>\n")
    no_content = [CALL_CHAT[0], dict(CALL_CHAT[1], content=""), CALL_CHAT[2]]
    assert render("gemma4-small", no_content).endswith("<tool_response|>")
    assert render("gemma4-small", no_content, think=True).endswith(
        "<tool_response|><|channel>thought\n")
    pending = render("gemma4-small", CALL_CHAT[:2])
    assert pending.endswith("<tool_call|>Let me look.<|tool_response>")


def test_history_thinking_only_after_the_last_user_turn():
    chat = [USER, {"role": "assistant", "content": "A1", "reasoning": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<|channel>thought\nold<channel|>A2",
             "reasoning_content": "R2"}]
    out = render("gemma4-small", chat, add_generation_prompt=False)
    assert "R1" not in out and "old" not in out
    assert out.endswith("<|turn>model\n<|channel>thought\nR2\n<channel|>A2<turn|>\n")


def test_media_and_tool_result_parts():
    chat = [{"role": "user", "content": [{"type": "text", "text": " look "}, {"type": "image"},
                                         {"type": "input_audio"}, {"type": "video"}]},
            {"role": "assistant", "tool_calls": [{"function": {"name": "snap", "arguments": {}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                         {"type": "text", "text": "b"}]}]
    out = render("gemma4-small", chat)
    assert "<|turn>user\nlook<|image|><|audio|><|video|><turn|>" in out
    assert out.endswith("<|tool_call>call:snap{}<tool_call|><|tool_response>response:snap"
                        '{value:<|"|>ab<|"|>}<tool_response|><|image|>')


def test_malformed_input_is_a_conversation_error():
    with pytest.raises(ConversationError, match="message 1 \\(assistant\\): tool call 0"):
        render("gemma4", [USER, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "[1]"}}]}])
