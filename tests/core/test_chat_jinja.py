"""The ``jinja`` renderer: transformers' environment, the sandbox, error reporting."""

from __future__ import annotations

import copy
from datetime import datetime

import pytest

from mlxrunner import ConversationError
from mlxrunner.chat import JinjaRenderer
from mlxrunner.errors import ModelFolderError
from mlxrunner.plugin import RenderContext

USER = {"role": "user", "content": "hi"}


def render(template: str, messages=None, tools=None, context: dict | None = None, **kwargs):
    renderer = JinjaRenderer.from_context(RenderContext(chat_template=template, **(context or {})))
    return renderer.render(messages or [USER], tools, **kwargs)


def test_whitespace_control_is_transformers():
    template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  " \
               "{% endif %}\n{% endfor %}"
    # trim_blocks eats the newline after a tag, lstrip_blocks the indentation before one
    assert render(template) == "[hi]\n"


def test_tojson_is_json_dumps_without_html_escaping():
    value = "{{ messages[0] | tojson }}"
    messages = [{"role": "user", "content": "<b>é & 'q'</b>"}]
    assert render(value, messages) == '{"role": "user", "content": "<b>é & \'q\'</b>"}'
    options = "{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=true) }}|" \
              "{{ {'b': 1} | tojson(separators=(',', ':')) }}|{{ 'é' | tojson(ensure_ascii=true) }}"
    assert render(options) == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}|{"b":1}|"\\u00e9"'


def test_globals_and_variables():
    template = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ strftime_now('%Y') }}|"
                "{{ dict(a=1)['a'] }}|{{ extra_var }}|{{ add_generation_prompt }}|"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% if loop.first %}{% continue %}{% endif %}{% break %}{% endfor %}{{ ns.n }}|"
                "{% generation %}G{{ messages|length }}{% endgeneration %}")
    context = {"bos_token": "<s>", "eos_token": "</s>",
               "special_tokens": {"pad_token": "<pad>", "bos_token": "ignored"},
               "extra": {"template_kwargs": {"extra_var": "X"}}}
    year = str(datetime.now().year)
    assert render(template, [USER, USER], context=context) == \
        f"<s>|</s>|<pad>|{year}|1|X|True|2|G2"


def test_think_becomes_enable_thinking_and_none_leaves_it_undefined():
    template = "{{ enable_thinking is defined }}{% if enable_thinking is defined %}" \
               ":{{ enable_thinking }}{% endif %}"
    assert render(template) == "False"
    assert render(template, think=True) == "True:True"
    assert render(template, think=False) == "True:False"
    assert render("{{ add_generation_prompt }}", add_generation_prompt=False) == "False"


def test_messages_are_prepared_as_transformers_prepares_them():
    template = ("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}/{{ m.thinking }}/"
                "{{ m.reasoning }}/{{ 'content' in m }};{% endfor %}"
                "{{ messages[1].tool_calls[0].function.arguments.a }}")
    messages = [{"role": "user", "content": None},
                {"role": "assistant", "reasoning": "r", "content": "x",
                 "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 7}'}}]}]
    assert render(template, messages) == "user:///False;assistant:r/r/r/True;7"


def test_raise_exception_is_a_conversation_error_with_the_templates_words():
    template = "{% if messages|length > 1 %}{{ raise_exception('Only one message, please') }}" \
               "{% endif %}ok"
    assert render(template) == "ok"
    with pytest.raises(ConversationError, match="rejects this conversation: Only one message"):
        render(template, [USER, USER])
    with pytest.raises(ConversationError, match="failed on this conversation"):
        render("{{ messages[0].content + 1 }}")


def test_conversations_are_validated_before_the_template_sees_them():
    with pytest.raises(ConversationError, match="unknown role"):
        render("x", [{"role": "robot", "content": "hi"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ messages.__class__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace(_private=1) %}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ messages[0].pop('role') }}",
    "{{ ().__class__.__base__ }}",
    "{{ strftime_now.__code__ }}",
])
def test_the_sandbox_keeps_templates_away_from_python(template):
    messages = [dict(USER)]
    before = copy.deepcopy(messages)
    try:
        leaked = render(template, messages)
    except (ModelFolderError, ConversationError) as exc:
        assert "\n" not in str(exc)
    else:  # an unsafe attribute may also read as undefined: nothing comes out
        assert leaked == ""
    assert messages == before


def test_reaching_an_unsafe_attribute_is_reported_as_the_templates_fault():
    with pytest.raises(ModelFolderError, match="sandbox forbids"):
        render("{{ cycler.__init__.__globals__ }}")


def test_syntax_errors_name_the_line():
    with pytest.raises(ModelFolderError, match="syntax error at line 2"):
        JinjaRenderer("ok\n{% if %}")


def test_text_parts_and_absent_content_reach_a_string_template_as_strings():
    """A template written for string content (SmolLM2's, most older ones) takes OpenAI's
    content parts, Anthropic's text blocks and an assistant turn of tool calls only (content
    null): parts joined by a line, none as empty; a list with other parts stays a list."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] + '|' }}"
                "{% endfor %}")
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert render(template, [{"role": "user", "content": parts}]) == "<user>Hi\nthere|"
    calls = [{"type": "function", "function": {"name": "w", "arguments": "{}"}}]
    assert render(template, [{"role": "user", "content": "x"},
                             {"role": "assistant", "content": None, "tool_calls": calls}]) \
        == "<user>x|<assistant>|"
    # a template that reads lists gets them as transformers passes them
    listed = "{% for m in messages %}{{ m['content'] | length }}{% endfor %}"
    assert render(listed, [{"role": "user", "content": parts}]) == "2"
