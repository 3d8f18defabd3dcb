"""The ``gemma4`` parser: unit cases, streaming in any chunking, render -> parse round trip."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import testing
from mlxrunner.plugin import ParsedMessage, RenderContext, ToolCall

FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,opts:{deep:[1,-2.5e-07,' \
       'true,null,<|"|>x}<|"|>],<|"|>quoted key<|"|>:{}}}<tool_call|>'
CALL_ARGS = {"city": "Paris, FR", "days": 3,
             "opts": {"deep": [1, -2.5e-07, True, None, "x}"], "quoted key": {}}}


def parser(**options):
    return testing.fresh_parser("gemma4", **options)


def test_thought_channel_content_and_a_tool_call():
    text = "<|channel>thought\nPlan:\n  look it up\n<channel|>" + CALL + "<|tool_response>"
    assert parser().parse(text) == ParsedMessage(
        "", "Plan:\n  look it up", [ToolCall("get_weather", CALL_ARGS)])
    answer = parser().parse("<|channel>thought\n<channel|>  The answer is 4.<turn|>\n")
    assert answer == ParsedMessage("The answer is 4.", "")


def test_the_prompt_says_whether_output_starts_in_thinking():
    after_results = mlxrunner.get_renderer("gemma4").render([
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "r"}], think=True)
    assert after_results.endswith("<|channel>thought\n")
    assert parser(prompt=after_results).parse("hm\n<channel|>ok") == ParsedMessage("ok", "hm")
    fresh = mlxrunner.get_renderer("gemma4").render([{"role": "user", "content": "q"}], think=True)
    assert parser(prompt=fresh).parse("ok") == ParsedMessage("ok", "")
    assert parser(start_in_thinking=True).parse("a<channel|>b") == ParsedMessage("b", "a")


def test_tool_results_and_end_markers_are_not_content():
    text = CALL + '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}' \
                  "<tool_response|>It is sunny.<turn|>"
    message = parser().parse(text)
    assert message.content == "It is sunny." and len(message.tool_calls) == 1


def test_what_does_not_parse_stays_as_content():
    for broken in ("<|tool_call>call:f{a:<|\"|>open}<tool_call|>",
                   "<|tool_call>nocall{}<tool_call|>", "<|tool_call>call:f{a:1}x<tool_call|>",
                   "<|tool_call>call:{a:1}<tool_call|>"):
        assert parser().parse("pre " + broken).content == "pre " + broken
    # output that stopped before <tool_call|>: a complete call still counts, a cut one is text
    assert parser().parse("a <|tool_call>call:f{a:1}") == ParsedMessage("a", "",
                                                                         [ToolCall("f", {"a": 1})])
    assert parser().parse("a <|tool_call>call:f{a:1").content == "a <|tool_call>call:f{a:1"
    assert parser().parse("<|channel>other\nnote<channel|>x") == ParsedMessage("x", "other\nnote")
    assert parser().parse("x <|tool_response>tail") == ParsedMessage("x tail", "")
    assert parser().parse("<|tool_call>call:f{w:bare words}<tool_call|>").tool_calls == [
        ToolCall("f", {"w": "bare words"})]


def test_deltas_arrive_as_soon_as_they_are_certain():
    p = parser()
    assert p.feed("<|chan") == []
    assert p.feed("nel>thought\nabc\n") == [ParsedMessage(thinking="abc")]
    assert p.feed("<channel|>Hi <|tool_") == [ParsedMessage(content="Hi")]
    assert p.feed("call>call:f{}<tool_call|>") == [ParsedMessage(tool_calls=[ToolCall("f")])]
    assert p.finish() == []


# -- chunking independence on arbitrary text ------------------------------------------------

SNIPPETS = ["<|channel>", "thought\n", "<channel|>", "<|tool_call>", "call:f{", "a:", "}",
            "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<turn|>", "<", "|",
            "\n", " ", "1", "é", ","]


@FAST
@given(testing.noisy_text(SNIPPETS), st.booleans(), st.data())
def test_any_chunking_gives_the_one_shot_result(text, thinking, data):
    chunks = data.draw(testing.chunkings(text))
    testing.check_chunking_independent("gemma4", text, chunks, start_in_thinking=thinking)


# -- round trip: render an assistant turn, parse it back -----------------------------------

MARKERS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
           "<tool_response|>", '<|"|>', "<turn|>", "<eos>", "<|turn>")
free_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20) | \
    st.text("ab <|>/\n\t{}:,é😊", max_size=20)
safe_text = free_text.filter(lambda t: not any(m in t for m in MARKERS))
key = st.text("abcdefghijklmnopqrstuvwxyzABC_0123456789ßé", min_size=1, max_size=8)
value = testing.json_values(safe_text, key, max_leaves=8)
tool_calls = st.lists(st.builds(ToolCall, testing.tool_names(),
                                st.dictionaries(key, value, max_size=4)),
                      max_size=3)
assistant_turn = st.builds(ParsedMessage, safe_text, safe_text, tool_calls)


def _generated(variant: str, reply: ParsedMessage, think: bool) -> tuple[str, str]:
    renderer = mlxrunner.get_renderer(variant, RenderContext(bos_token="<bos>"))
    user = {"role": "user", "content": "question"}
    prompt = renderer.render([user], think=think)
    full = renderer.render([user, reply.to_message()], think=think, add_generation_prompt=False)
    assert full.startswith(prompt)
    return prompt, full[len(prompt):]


def _expected(reply: ParsedMessage) -> ParsedMessage:
    return ParsedMessage(reply.content.strip(), reply.thinking, reply.tool_calls)


ROUND_TRIP = settings(max_examples=30, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# Large with thinking off opens an empty thought channel in the prompt, so a reply with
# thinking cannot follow it; small and nemotron cover both settings.
VARIANTS = [("gemma4-small", False), ("gemma4-small", True), ("gemma4-nemotron", False),
            ("gemma4-large", True)]


@pytest.mark.parametrize(("variant", "think"), VARIANTS)
def test_round_trip_every_fixed_chunk_size(variant, think):
    @ROUND_TRIP
    @given(assistant_turn)
    def check(reply):
        prompt, text = _generated(variant, reply, think)
        for size in range(1, 8):
            chunks = testing.fixed_chunks(text, size)
            assert testing.feed_in_chunks(parser(prompt=prompt), chunks) == _expected(reply), size

    check()


@ROUND_TRIP
@given(assistant_turn, st.data())
def test_round_trip_random_chunkings(reply, data):
    prompt, text = _generated("gemma4-small", reply, True)
    chunks = data.draw(testing.chunkings(text))
    assert testing.feed_in_chunks(parser(prompt=prompt), chunks) == _expected(reply)


@pytest.mark.parametrize("size", range(1, 8))
def test_round_trip_of_a_long_reply(size):
    reply = ParsedMessage("Here: " + "ok " * 200, "step\n" * 300, [
        ToolCall("search", {"q": "x" * 500, "n": 3, "deep": {"a": [1, 2.5, {"b": "c"}]}}),
        ToolCall("get_weather", {"city": "Zürich"})])
    prompt, text = _generated("gemma4-small", reply, True)
    chunks = testing.fixed_chunks(text, size)
    assert testing.feed_in_chunks(parser(prompt=prompt), chunks) == _expected(reply)
