"""The ``qwen3.5`` parser: unit cases, streaming in any chunking, render -> parse round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import testing
from mlxrunner.plugin import ParsedMessage, ToolCall

FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
       "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"},
                                     "days": {"type": "integer"}}}}}]


def parser(**options):
    return testing.fresh_parser("qwen3.5", **options)


def test_thinking_content_and_a_tool_call():
    text = "Let me check.\n</think>\n\nSure.\n\n" + CALL + "<|im_end|>\n"
    message = parser(start_in_thinking=True).parse(text)
    assert message == ParsedMessage("Sure.", "Let me check.",
                                    [ToolCall("get_weather", {"city": "Paris", "days": 3})])


def test_the_prompt_says_whether_output_starts_in_thinking():
    renderer = mlxrunner.get_renderer("qwen3.5")
    on = renderer.render([{"role": "user", "content": "hi"}])
    off = renderer.render([{"role": "user", "content": "hi"}], think=False)
    assert parser(prompt=on).parse("hm</think>yes") == ParsedMessage("yes", "hm")
    assert parser(prompt=off).parse("yes") == ParsedMessage("yes", "")
    assert parser().parse("<think>\nhm\n</think>\n\nyes") == ParsedMessage("yes", "hm")


def test_values_are_json_when_they_parse_and_tool_schemas_keep_strings():
    block = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
             "<parameter=zip>\n01234\n</parameter>\n<parameter=days>\n[1, {\"a\": null}]\n"
             "</parameter>\n<parameter=flag>\nTrue\n</parameter>\n<parameter=note>\n"
             "two\nlines\n</parameter>\n</function>\n</tool_call>")
    untyped = parser().parse(block).tool_calls[0].arguments
    assert untyped == {"city": 123, "zip": "01234", "days": [1, {"a": None}], "flag": True,
                       "note": "two\nlines"}
    typed = parser(tools=WEATHER).parse(block).tool_calls[0].arguments
    assert typed["city"] == "123" and typed["zip"] == "01234" and typed["days"] == [1, {"a": None}]


def test_parallel_calls_and_text_that_is_not_a_call():
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    message = parser().parse(two)
    assert [c.arguments["city"] for c in message.tool_calls] == ["Paris", "Rome"]
    assert message.content == ""
    broken = "<tool_call>\nno function here\n</tool_call>"
    assert parser().parse("a " + broken).content == "a " + broken
    unclosed = parser().parse("ok <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n")
    assert unclosed == ParsedMessage("ok", "", [ToolCall("f", {"x": 1})])
    assert parser().parse("a <tool_call>\nhalf").content == "a <tool_call>\nhalf"


def test_markers_split_across_chunks_and_text_kept():
    text = "Reason <b>1</b>\n</think>\n\nAnswer < 5 and <thin> stays" + CALL + "<|im_end|>"
    expected = parser(start_in_thinking=True).parse(text)
    assert expected.thinking == "Reason <b>1</b>"
    assert expected.content == "Answer < 5 and <thin> stays"
    for size in range(1, 8):
        chunks = testing.fixed_chunks(text, size)
        assert testing.feed_in_chunks(parser(start_in_thinking=True), chunks) == expected, size


def test_deltas_arrive_as_soon_as_they_are_certain():
    p = parser(start_in_thinking=True)
    assert p.feed("abc </th") == [ParsedMessage(thinking="abc")]
    assert p.feed("ink>\n\nHi") == [ParsedMessage(content="Hi")]
    assert p.feed("<tool_call>\n<function=f>\n") == []
    assert p.feed("</function>\n</tool_call>") == [ParsedMessage(tool_calls=[ToolCall("f")])]
    assert p.finish() == []


# -- chunking independence on arbitrary text ------------------------------------------------

SNIPPETS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=f>", "</function>",
            "<parameter=a>", "</parameter>", "<|im_end|>", "<", "</", "\n", " ", "x", "1", "é"]


@FAST
@given(testing.noisy_text(SNIPPETS), st.booleans(), st.data())
def test_any_chunking_gives_the_one_shot_result(text, thinking, data):
    chunks = data.draw(testing.chunkings(text))
    testing.check_chunking_independent("qwen3.5", text, chunks, start_in_thinking=thinking)


# -- round trip: render an assistant turn, parse it back -----------------------------------

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>",
           "</parameter>", "<parameter=", "</function>")
free_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20) | \
    st.text("ab <>/\n\t=é😊", max_size=20)
safe_text = free_text.filter(lambda t: not any(m in t for m in MARKERS))


def _not_json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return value not in ("True", "False", "None")
    return False


name = testing.tool_names()
json_value = testing.json_values(safe_text, safe_text, max_leaves=6)
top_value = (st.none() | st.booleans() | st.integers()
             | st.floats(allow_nan=False, allow_infinity=False)
             | safe_text.filter(_not_json)
             | st.lists(json_value, max_size=3) | st.dictionaries(safe_text, json_value,
                                                                  max_size=3))
tool_calls = st.lists(st.builds(ToolCall, name, st.dictionaries(name, top_value, max_size=3)),
                      max_size=3)


@st.composite
def assistant_turn(draw):
    reply = ParsedMessage(content=draw(safe_text), thinking=draw(safe_text),
                          tool_calls=draw(tool_calls))
    return reply


def _generated(reply: ParsedMessage, think: bool) -> tuple[str, str]:
    """(prompt, the text the model would have produced for ``reply``)."""
    renderer = mlxrunner.get_renderer("qwen3.5")
    user = {"role": "user", "content": "question"}
    prompt = renderer.render([user], think=think)
    history = reply.to_message()
    if not think:
        history.pop("reasoning_content", None)
    full = renderer.render([user, history], think=think, add_generation_prompt=False)
    # the turn as history starts the way the prompt ended (with thinking off: an empty block)
    assert full.startswith(prompt)
    return prompt, full[len(prompt):]


def _expected(reply: ParsedMessage, think: bool) -> ParsedMessage:
    return ParsedMessage(reply.content.strip(), reply.thinking.strip() if think else "",
                         reply.tool_calls)


ROUND_TRIP = settings(max_examples=40, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@ROUND_TRIP
@given(assistant_turn(), st.booleans())
def test_round_trip_every_fixed_chunk_size(reply, think):
    prompt, text = _generated(reply, think)
    expected = _expected(reply, think)
    for size in range(1, 8):
        p = parser(prompt=prompt)
        assert testing.feed_in_chunks(p, testing.fixed_chunks(text, size)) == expected, size


@ROUND_TRIP
@given(assistant_turn(), st.data())
def test_round_trip_random_chunkings(reply, data):
    prompt, text = _generated(reply, True)
    chunks = data.draw(testing.chunkings(text))
    assert testing.feed_in_chunks(parser(prompt=prompt), chunks) == _expected(reply, True)


@pytest.mark.parametrize("size", range(1, 8))
def test_round_trip_of_a_long_reply(size):
    reply = ParsedMessage("Here you go: " + "ok " * 200, "step " * 300, [
        ToolCall("search", {"q": "x" * 500, "n": 3, "deep": {"a": [1, 2, {"b": "c"}]}}),
        ToolCall("get_weather", {"city": "Zürich"})])
    prompt, text = _generated(reply, True)
    chunks = testing.fixed_chunks(text, size)
    assert testing.feed_in_chunks(parser(prompt=prompt), chunks) == _expected(reply, True)
