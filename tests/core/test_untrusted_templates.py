"""A chat template is untrusted code: past its time or size limit it is one TemplateError
line, quickly and with bounded memory; the tokenizer refuses what it cannot take."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import pytest

from mlxrunner.chat import JinjaRenderer, RenderLimits
from mlxrunner.errors import TemplateError, TokenizerInputError
from mlxrunner.model import Tokenizer

TOKENIZER = Path(__file__).resolve().parents[2] / "core" / "mlxrunner" / "testdata" / \
    "tokenizer-bytelevel"

MESSAGES = [{"role": "user", "content": "hi"}]
QUICK = RenderLimits(seconds=1.0)
#: for the size limits: a deadline that a loaded machine does not reach first
SLOW = RenderLimits(seconds=30.0)
#: far above what one second of any of these may take, far below a hang
HANG = 60.0

ATTACKS = {
    "huge_range": ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                        "nested its macros deeper than 64"),
    "repeat": ("{{ 'x' * 10**10 }}", "a value of 10000000000"),
    "repeat_literal": ("{{ 'x' * 10000000000 }}", "a value of 10000000000"),
    "repeat_list": ("{{ (['x' * 100000] * 100000)|length }}", "size limit"),
    "power": ("{{ 2 ** (10 ** 10) }}", "bits for a number"),
    "center": ("{{ 'x'|center(9999999999) }}", "a width or count of 9999999999"),
    "ljust": ("{{ 'x'.ljust(9999999999) }}", "a width or count of 9999999999"),
    "format_width": ("{{ '{:>9999999999}'.format('x') }}", "a format width"),
    "percent_width": ("{{ '%9999999999s' % 'x' }}", "a format width"),
    "format_filter": ("{{ '%9999999999s'|format('x') }}", "a format width"),
    "doubling": ("{% set x = 'x' * 1000000 %}" + "{% set x = x ~ x %}" * 40 + "{{ x }}",
                 "size limit"),
    "namespace_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "size limit"),
    "nested_lists": ("{% set x = ['ab'] %}" + "{% set x = [x, x] %}" * 40 + "{{ x }}",
                     "size limit"),
    "nested_dicts_to_json": ("{% set x = {'a': 'b'} %}" + "{% set x = {'l': x, 'r': x} %}" * 40
                             + "{{ x|tojson }}", "size limit"),
    "join": ("{{ range(20)|map('string')|join('x' * 1000000) }}", "size limit"),
    "str_join": ("{{ ('y' * 1000000).join(range(20)|map('string')) }}", "size limit"),
    "replace": ("{{ ('x' * 100000)|replace('x', 'y' * 100000) }}", "size limit"),
    "indent": ("{{ ('\\n' * 100000)|indent(100000) }}", "size limit"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}", "output limit"),
    "busy_loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                  "{% endfor %}", "ran longer than 1 s"),
    "silent_loop": ("{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                    "{% endfor %}", "ran longer than 1 s"),
}


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_template_past_its_limits_is_one_template_error(name):
    source, needle = ATTACKS[name]
    before, start = _max_rss_bytes(), time.monotonic()
    with pytest.raises(TemplateError) as info:
        JinjaRenderer(source, limits=QUICK if "ran longer" in needle else SLOW).render(MESSAGES)
    assert time.monotonic() - start < HANG
    assert _max_rss_bytes() - before < 512 * 2**20
    message = str(info.value)
    assert message.startswith("the chat template ") and "\n" not in message
    assert needle in message, message


def test_the_limits_leave_ordinary_templates_alone():
    source = ("{% for m in messages %}<{{ m.role }}>{{ m.content|trim }}\n{% endfor %}"
              "{{ '%-5s|%3d' % ('ab', 7) }}{{ '{:>4}'.format(3) }}{{ ['a', 'b']|join(', ') }}"
              "{{ 'a-b'|replace('-', '+') }}{{ 2 ** 10 }}{{ 'ab' * 2 }}{{ 4294967295|string }}"
              "{% set a, b = (1, [2]) %}{{ a ~ b }}{% for k, v in {'k': (3,)}.items() %}{{ k }}"
              "{{ v }}{% endfor %}{{ messages|tojson }}")
    text = JinjaRenderer(source, limits=QUICK).render(MESSAGES)
    assert text == ('<user>hi\nab   |  7   3a, ba+b1024abab42949672951[2]k(3,)'
                    '[{"role": "user", "content": "hi"}]')


def test_a_template_ending_just_before_the_deadline_leaves_no_pending_interrupt():
    renderer = JinjaRenderer("{% for i in range(3) %}{{ i }}{% endfor %}",
                             limits=RenderLimits(seconds=0.05))
    for _ in range(20):
        assert renderer.render(MESSAGES) == "012"
    time.sleep(0.2)  # a watchdog that fired late would raise here


def test_the_tokenizer_refuses_a_gigantic_text(monkeypatch):
    tok = Tokenizer.from_folder(TOKENIZER)
    monkeypatch.setattr(Tokenizer, "max_encode_chars", 1000)
    with pytest.raises(TokenizerInputError, match="longer than the tokenizer takes"):
        tok.encode("x" * 1001)
    assert tok.encode("x" * 10)


def test_a_panic_in_the_rust_tokenizer_is_one_error():
    class PanicException(BaseException):  # pyo3's, raised where the Rust code panics
        pass

    class Panicking:
        def encode(self, text, add_special_tokens=False):
            raise PanicException("capacity overflow")

    tok = Tokenizer.from_folder(TOKENIZER)
    tok._backend = Panicking()
    with pytest.raises(TokenizerInputError, match="capacity overflow"):
        tok.encode("hello")
