"""Native renderers == the published Jinja templates, on the goldens and on generated chats.

Each native renderer (plain Python) is compared with the core ``jinja``
renderer given the matching template (``qwen3_5.jinja`` -> ``qwen3.5``,
``gemma4-small.jinja`` -> ``gemma4-small``, ``gemma4-large.jinja`` ->
``gemma4-large``, the team's nemotron fixture -> ``gemma4-nemotron``) on
conversations hypothesis generates: every role, multi-part content with media,
reasoning, parallel tool calls with nested arguments, tool results, tool
schemas of every shape the Gemma declaration code walks, unicode and the
formats' own markers inside text. Both must give the same text, or both a
``ConversationError``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import ConversationError
from mlxrunner.chat import JinjaRenderer
from mlxrunner.plugin import RenderContext

pytest.importorskip("mlxrunner_renderer_qwen3_5", reason="mlxrunner-renderer-qwen3-5 not installed")
pytest.importorskip("mlxrunner_renderer_gemma4", reason="mlxrunner-renderer-gemma4 not installed")

REPO = Path(__file__).resolve().parent.parent
NEMOTRON_FIXTURE = REPO / "renderers" / "gemma4" / "tests" / "fixtures" / "gemma4-nemotron.jinja"
TEMPLATE_OF = {
    "qwen3.5": "qwen3_5.jinja",
    "gemma4-small": "gemma4-small.jinja",
    "gemma4-large": "gemma4-large.jinja",
    "gemma4-nemotron": None,  # the fixture in the gemma4 package
}
NATIVE_OF_FILE = {"qwen3_5.jinja": "qwen3.5", "gemma4-small.jinja": "gemma4-small",
                  "gemma4-large.jinja": "gemma4-large"}


def _template(shared: Path, name: str) -> str:
    file = TEMPLATE_OF[name]
    path = NEMOTRON_FIXTURE if file is None else shared / "templates" / file
    return path.read_text()


def _context(shared: Path, name: str) -> RenderContext:
    bos = None if name == "qwen3.5" else "<bos>"
    return RenderContext(chat_template=_template(shared, name), bos_token=bos)


@functools.cache
def _pair(shared: Path, name: str):
    """(native renderer, jinja renderer); compiling a template is the slow part, so once."""
    context = _context(shared, name)
    return mlxrunner.get_renderer(name, context), JinjaRenderer.from_context(context)


# -- goldens -------------------------------------------------------------------------------


def _golden_cases(shared: Path) -> list[dict]:
    return json.loads((shared / "goldens" / "chat_template_goldens.json").read_text())


def _golden_args(case: dict) -> dict:
    kwargs = dict(case["kwargs"])
    args = {"add_generation_prompt": kwargs.pop("add_generation_prompt")}
    if "enable_thinking" in kwargs:
        args["think"] = kwargs.pop("enable_thinking")
    kwargs.pop("bos_token", None)  # the renderer's context carries it
    assert not kwargs, f"golden kwargs not understood: {kwargs}"
    return args


def test_every_golden_renders_byte_identical_native_and_jinja(shared_data_dir):
    cases = _golden_cases(shared_data_dir)
    assert len(cases) >= 84
    checked = 0
    for case in cases:
        native, jinja = _pair(shared_data_dir, NATIVE_OF_FILE[case["template_file"]])
        args = _golden_args(case)
        where = f"{case['template_file']} {case['scenario']} {case['variant']}"
        assert native.render(case["messages"], case["tools"], **args) == case["rendered"], where
        assert jinja.render(case["messages"], case["tools"], **args) == case["rendered"], where
        checked += 1
    assert checked == len(cases)


# -- generated conversations ---------------------------------------------------------------

MARKERS = ["<think>", "</think>", "<|channel>", "<channel|>", "<tool_response>",
           "</tool_response>", "<|\"|>", "<turn|>", "\n", "  ", "\t"]
text = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
    st.lists(st.one_of(st.sampled_from(MARKERS), st.text("ab é😊\n ", max_size=4)),
             max_size=4).map("".join),
)
name = st.sampled_from(["get_weather", "search", "f", "Run_2"])
key = st.one_of(st.sampled_from(["city", "Unit", "unit", "a", "B", "x_y", "ünï"]),
                st.text("abcXYZ_", min_size=1, max_size=5))
scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=False, allow_infinity=False, width=32), text)
json_value = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(key, inner, max_size=3)), max_leaves=8)
arguments = st.dictionaries(key, json_value, max_size=4)

text_part = st.builds(lambda t: {"type": "text", "text": t}, text)
media_part = st.sampled_from([{"type": "image"}, {"type": "image_url", "image_url": {"url": "x"}},
                              {"type": "video"}, {"type": "audio"}])
content = st.one_of(st.none(), text, st.lists(st.one_of(text_part, text_part, media_part),
                                              max_size=3))


@st.composite
def tool_call(draw):
    call = {"function": {"name": draw(name), "arguments": draw(arguments)}}
    if draw(st.booleans()):
        call = {"id": draw(st.sampled_from(["call_1", "call_2", "c3"])), "type": "function",
                **call}
    if draw(st.integers(0, 5)) == 0:  # arguments as a JSON string
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return call


@st.composite
def message(draw, role):
    msg = {"role": role}
    if role == "assistant":
        msg["content"] = draw(st.one_of(st.none(), text, st.lists(text_part, max_size=2)))
        reasoning_key = draw(st.sampled_from([None, "reasoning_content", "reasoning",
                                              "thinking"]))
        if reasoning_key:
            msg[reasoning_key] = draw(text)
        if draw(st.booleans()):
            msg["tool_calls"] = draw(st.lists(tool_call(), min_size=1, max_size=3))
        if draw(st.integers(0, 5)) == 0:  # Gemma's legacy results on the assistant message
            msg["tool_responses"] = draw(st.lists(st.fixed_dictionaries(
                {}, optional={"name": st.one_of(st.none(), name, st.just("")),
                              "response": json_value}), max_size=2))
    elif role == "tool":
        msg["content"] = draw(st.one_of(st.none(), text, st.lists(
            st.one_of(text_part, media_part), max_size=2)))
        if draw(st.booleans()):
            msg["name"] = draw(name)
        if draw(st.booleans()):
            msg["tool_call_id"] = draw(st.sampled_from(["call_1", "call_2", "zz"]))
    else:
        msg["content"] = draw(content)
    return msg


@st.composite
def conversation(draw, strict_roles=False):
    """``strict_roles``: mostly what Qwen's template accepts (a user query, system first)."""
    middle = ["user", "assistant", "tool", "user", "assistant"]
    if not strict_roles or draw(st.integers(0, 9)) == 0:
        middle += ["system", "developer"]
    roles = draw(st.lists(st.sampled_from(middle), min_size=1, max_size=7))
    if strict_roles and "user" not in roles:
        roles.insert(draw(st.integers(0, len(roles))), "user")
    if draw(st.booleans()):
        roles = [draw(st.sampled_from(["system", "system", "developer"]))] + roles
    if draw(st.booleans()):  # most real chats end on a user turn or tool results
        roles.append(draw(st.sampled_from(["user", "tool"])))
    return [draw(message(role)) for role in roles]


schema_type = st.sampled_from(["string", "number", "integer", "boolean", "array", "object",
                               "STRING", "null"])


@st.composite
def property_schema(draw, depth=0):
    kind = draw(st.one_of(schema_type, st.lists(schema_type, min_size=1, max_size=2)))
    schema = {"type": kind} if draw(st.integers(0, 6)) else {}
    if draw(st.booleans()):
        schema["description"] = draw(text)
    main = kind if isinstance(kind, str) else None
    if main in ("string", "STRING") and draw(st.booleans()):
        schema["enum"] = draw(st.lists(st.one_of(text, st.integers()), max_size=3))
    if main == "array" and draw(st.booleans()):
        items = draw(st.dictionaries(st.sampled_from(["type", "description", "minItems",
                                                      "enum", "required"]),
                                     st.one_of(schema_type, st.integers(0, 3), st.none(),
                                               st.lists(st.sampled_from(["a", "b"]),
                                                        max_size=2)),
                                     max_size=3))
        if "required" in items and not isinstance(items["required"], list):
            items["required"] = ["a"]
        if "type" in items and not isinstance(items["type"], (str, list)):
            items["type"] = "string"
        if depth < 2 and draw(st.booleans()):
            items["properties"] = draw(st.dictionaries(key, property_schema(depth + 1),
                                                       max_size=2))
        schema["items"] = items
    if draw(st.integers(0, 4)) == 0:
        schema["nullable"] = draw(st.booleans())
    if main == "object":
        choice = draw(st.integers(0, 2))
        if choice == 0 and depth < 2:
            schema["properties"] = draw(st.dictionaries(key, property_schema(depth + 1),
                                                        max_size=2))
        elif choice == 1:  # no properties: the template lists the other keys as fields
            schema.update(draw(st.dictionaries(st.sampled_from(["additionalProperties",
                                                                "format", "default"]),
                                               json_value, max_size=2)))
        if draw(st.booleans()):
            schema["required"] = draw(st.lists(key, max_size=2))
    return schema


@st.composite
def tool(draw):
    function = {"name": draw(name)}
    if draw(st.integers(0, 4)):
        function["description"] = draw(text)
    if draw(st.integers(0, 5)):
        parameters = {}
        if draw(st.integers(0, 5)):
            parameters["type"] = "object"
        if draw(st.integers(0, 4)):
            parameters["properties"] = draw(st.dictionaries(key, property_schema(), max_size=3))
        if draw(st.booleans()):
            parameters["required"] = draw(st.lists(key, max_size=2))
        function["parameters"] = parameters
    if draw(st.integers(0, 6)) == 0:
        function["response"] = draw(st.sampled_from([{"type": "object", "description": "r"},
                                                     {"type": "string"}, {}]))
    if draw(st.integers(0, 6)) == 0:
        return function  # the flat form
    return {"type": "function", "function": function}


tools = st.one_of(st.none(), st.just([]), st.lists(tool(), min_size=1, max_size=3))
think = st.sampled_from([None, True, False])


def _same(native, jinja, messages, tool_list, think_choice, generation):
    try:
        expected = jinja.render(messages, tool_list, think=think_choice,
                                add_generation_prompt=generation)
    except ConversationError:
        with pytest.raises(ConversationError):
            native.render(messages, tool_list, think=think_choice,
                          add_generation_prompt=generation)
        return
    got = native.render(messages, tool_list, think=think_choice,
                        add_generation_prompt=generation)
    assert got == expected


# MLXRUNNER_PARITY_EXAMPLES=3000 for a long, randomised run (the default is fixed and quick).
_LONG_RUN = int(os.environ.get("MLXRUNNER_PARITY_EXAMPLES", "0"))
PARITY = settings(max_examples=_LONG_RUN or 100, deadline=None, derandomize=not _LONG_RUN,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("renderer_name", list(TEMPLATE_OF))
def test_native_matches_the_template_on_generated_conversations(shared_data_dir, renderer_name):
    native, jinja = _pair(shared_data_dir, renderer_name)

    @PARITY
    @given(conversation(strict_roles=renderer_name == "qwen3.5"), tools, think, st.booleans())
    def check(messages, tool_list, think_choice, generation):
        _same(native, jinja, messages, tool_list, think_choice, generation)

    check()


@pytest.mark.parametrize("renderer_name", list(TEMPLATE_OF))
def test_native_matches_the_template_on_plain_tool_chats(shared_data_dir, renderer_name):
    """Well-formed tool-use chats (the common case), so most examples render rather than raise."""
    native, jinja = _pair(shared_data_dir, renderer_name)

    @st.composite
    def tool_chat(draw):
        chat = [{"role": "user", "content": draw(text)}]
        for _ in range(draw(st.integers(1, 3))):
            calls = draw(st.lists(tool_call(), min_size=0, max_size=3))
            turn = {"role": "assistant", "content": draw(text)}
            if draw(st.booleans()):
                turn["reasoning_content"] = draw(text)
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
            for call in calls:
                chat.append({"role": "tool", "tool_call_id": call.get("id", "x"),
                             "name": call["function"]["name"], "content": draw(text)})
            if draw(st.booleans()):
                chat.append({"role": "user", "content": draw(text)})
        return chat

    rendered = []

    @settings(PARITY, max_examples=_LONG_RUN or 60)
    @given(tool_chat(), st.lists(tool(), max_size=2), think, st.booleans())
    def check(messages, tool_list, think_choice, generation):
        _same(native, jinja, messages, tool_list, think_choice, generation)
        rendered.append(1)

    check()
    assert rendered


# -- the jinja renderer against transformers itself ----------------------------------------


def _transformers_tokenizer(bos: str | None):
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    from tokenizers import Tokenizer, models

    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokens = {"eos_token": "<eos>", "unk_token": "<unk>"}
    if bos is not None:
        tokens["bos_token"] = bos
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)


@pytest.mark.reference
@pytest.mark.parametrize("renderer_name", list(TEMPLATE_OF))
def test_jinja_renderer_matches_transformers_apply_chat_template(shared_data_dir, renderer_name):
    """transformers' own ``apply_chat_template`` is the reference for the ``jinja`` renderer."""
    from mlxrunner.chat import validate_conversation

    context = _context(shared_data_dir, renderer_name)
    tokenizer = _transformers_tokenizer(context.bos_token)
    tokenizer.chat_template = context.chat_template
    context.special_tokens = dict(tokenizer.special_tokens_map)
    jinja = JinjaRenderer.from_context(context)

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversation(strict_roles=renderer_name == "qwen3.5"), tools, think, st.booleans())
    def check(messages, tool_list, think_choice, generation):
        try:
            # transformers takes arguments as given; ours are parsed to objects first
            messages, tool_list = validate_conversation(messages, tool_list)
        except ConversationError:
            return
        extra = {} if think_choice is None else {"enable_thinking": think_choice}
        try:
            expected = tokenizer.apply_chat_template(messages, tools=tool_list, tokenize=False,
                                                     add_generation_prompt=generation, **extra)
        except Exception:  # the template raised
            with pytest.raises(ConversationError):
                jinja.render(messages, tool_list, think=think_choice,
                             add_generation_prompt=generation)
            return
        assert jinja.render(messages, tool_list, think=think_choice,
                            add_generation_prompt=generation) == expected

    check()
