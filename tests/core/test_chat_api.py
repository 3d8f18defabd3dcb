"""The chat API of the core: validation, conversation files, lookup, message types."""

from __future__ import annotations

import copy
import json

import pytest

import mlxrunner
import mlxrunner.plugin
from mlxrunner import ConversationError
from mlxrunner.chat import load_conversation_file, reasoning_of, validate_conversation
from mlxrunner.errors import ModelFolderError, UnknownNameError
from mlxrunner.plugin import ParsedMessage, RenderContext, ToolCall

USER = {"role": "user", "content": "hi"}


def _error(messages, tools=None) -> str:
    with pytest.raises(ConversationError) as info:
        validate_conversation(messages, tools)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


@pytest.mark.parametrize(("messages", "expected"), [
    ("hello", "messages must be a list"),
    ([], "no messages"),
    ([USER, "hi"], "message 1: must be an object"),
    ([{"content": "x"}], "message 0: has no role"),
    ([USER, {"role": "bot", "content": "x"}], "message 1: unknown role 'bot'"),
    ([{"role": "user", "content": 3}], "message 0 (user): content must be a string"),
    ([{"role": "user", "content": {"text": "x"}}], "content must be a string, a list of parts"),
    ([{"role": "user", "content": ["x"]}], "content part 0 must be an object"),
    ([{"role": "user", "content": [{"type": "file"}]}], "content part 0 has type 'file'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content part 0 (text) needs a string"),
    ([{"role": "user", "content": "x", "reasoning_content": "r"}], "only allowed on assistant"),
    ([USER, {"role": "assistant", "content": "x", "reasoning": 5}], "'reasoning' must be a string"),
    ([USER, {"role": "assistant", "reasoning": "a", "reasoning_content": "b"}], "disagree"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages have"),
    ([USER, {"role": "assistant", "tool_calls": {"name": "f"}}], "tool_calls must be a list"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     "message 1 (assistant): tool call 0: has no function name"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}],
     "tool call 0: has no function name"),
    ([USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}],
     "tool call 0: needs a 'function' object"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": [1, 2]}}]}],
     "tool call 0: arguments must be a JSON object, not array"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}],
     "arguments must be a JSON object, not array"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{bad json"}}]}],
     "arguments are not valid JSON"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {1: "x"}}}]}], "object key 1 is not a string"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"type": "code", "function": {"name": "f"}}]}], "type 'code' is not 'function'"),
    ([USER, {"role": "tool", "content": "x", "tool_call_id": 3}], "'tool_call_id' must be"),
    ([USER, {"role": "user", "content": [{"type": "image", "data": object()}]}],
     "is not a JSON value"),
])
def test_malformed_conversations_are_one_clear_line(messages, expected):
    assert expected in _error(messages)


@pytest.mark.parametrize(("tools", "expected"), [
    ({"name": "f"}, "tools must be a list"),
    (["f"], "tool 0: must be an object"),
    ([{"type": "function"}], "tool 0: expected"),
    ([{"type": "function", "function": {"description": "x"}}], "tool 0: has no function name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "'parameters' must be a JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": "string"}}}}], "property 'a' must be a schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "object", "properties": {"b": {"required": "b"}}}}}}}],
     "tool 0 (f) parameters.a.b: 'required' must be a list"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     "'description' must be a string"),
])
def test_malformed_tools_are_one_clear_line(tools, expected):
    assert expected in _error([USER], tools)


def test_normalising_parses_string_arguments_and_keeps_the_input_untouched():
    messages = [
        {"role": "system", "content": "s", "name": None},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"name": "g", "arguments": {"b": [1, {"c": None}]}},  # the flat form
            {"function": {"name": "h", "arguments": ""}},
            {"function": {"name": "k"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]
    before = copy.deepcopy((messages, tools))
    checked, checked_tools = validate_conversation(messages, tools)
    assert (messages, tools) == before
    assert checked[0] == {"role": "system", "content": "s"}
    assert "content" not in checked[2]
    calls = checked[2]["tool_calls"]
    assert calls[0] == {"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": {"a": 1}}}
    assert calls[1] == {"function": {"name": "g", "arguments": {"b": [1, {"c": None}]}}}
    assert calls[2]["function"]["arguments"] == {} and calls[3]["function"]["arguments"] == {}
    assert checked_tools == [{"type": "function", "function": tools[0]}]
    assert validate_conversation([USER])[1] is None


def test_reasoning_under_any_name():
    for key in ("reasoning_content", "reasoning", "thinking"):
        checked, _ = validate_conversation([USER, {"role": "assistant", key: "r"}])
        assert reasoning_of(checked[1]) == "r"
    both = {"role": "assistant", "reasoning": "r", "reasoning_content": "r"}
    assert reasoning_of(validate_conversation([USER, both])[0][1]) == "r"


def test_conversation_files(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([USER]))
    assert load_conversation_file(plain) == ([USER], None)
    wrapped = tmp_path / "wrapped.json"
    tools = [{"type": "function", "function": {"name": "f"}}]
    wrapped.write_text(json.dumps({"messages": [USER], "tools": tools}))
    assert load_conversation_file(str(wrapped)) == ([USER], tools)

    def error(text: str | None, name: str = "bad.json") -> str:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConversationError) as info:
            load_conversation_file(path)
        message = str(info.value)
        assert "\n" not in message and name in message
        return message

    assert "invalid JSON at line 2 column" in error('[\n{"role": }]')
    assert "cannot read" in error(None, "missing.json")
    assert "expected a list of messages" in error('"hello"')
    assert "no 'messages'" in error('{"tools": []}')
    assert "'messages' must be a list" in error('{"messages": {}}')
    assert "'tools' must be a list" in error('{"messages": [], "tools": {}}')
    assert "unexpected keys extra" in error('{"messages": [], "extra": 1}')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe[")
    assert "not UTF-8" in error(None, "binary.json")


def test_lookup_names_the_installed_choices():
    with pytest.raises(UnknownNameError) as info:
        mlxrunner.get_renderer("no-such-format")
    assert "'no-such-format'" in str(info.value) and "jinja" in str(info.value)
    with pytest.raises(UnknownNameError) as info:
        mlxrunner.get_parser("no-such-parser")
    assert "'no-such-parser'" in str(info.value)


def test_the_jinja_renderer_needs_a_template():
    with pytest.raises(ModelFolderError, match="no chat template"):
        mlxrunner.get_renderer("jinja")
    with pytest.raises(ModelFolderError, match="tiny has no chat template"):
        mlxrunner.get_renderer("jinja", RenderContext(model_name="tiny"))
    renderer = mlxrunner.get_renderer("jinja", RenderContext(
        chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"))
    assert isinstance(renderer, mlxrunner.plugin.Renderer)
    assert renderer.render([USER, {"role": "assistant", "content": "yo"}]) == \
        "[user]hi[assistant]yo"


def test_context_defaults_are_independent():
    a, b = RenderContext(), RenderContext()
    a.special_tokens["x"] = 1
    assert b.special_tokens == {} and b.extra == {} and b.model_name is None


def test_parsed_messages_accumulate_deltas_and_become_history():
    message = ParsedMessage()
    deltas = [ParsedMessage(thinking="hm"), ParsedMessage(content="Hel"),
              ParsedMessage(content="lo"), ParsedMessage(tool_calls=[ToolCall("f", {"a": 1})])]
    assert [d.kind for d in deltas] == ["thinking", "content", "content", "tool_call"]
    for delta in deltas:
        message.add(delta)
    assert message == ParsedMessage("Hello", "hm", [ToolCall("f", {"a": 1})])
    history = message.to_message()
    assert history == {"role": "assistant", "content": "Hello", "reasoning_content": "hm",
                       "tool_calls": [{"type": "function",
                                       "function": {"name": "f", "arguments": {"a": 1}}}]}
    validate_conversation([USER, history])
    assert ToolCall("g").to_message("c9")["id"] == "c9"
