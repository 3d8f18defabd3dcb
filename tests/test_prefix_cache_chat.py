"""The chat's second turn prefills only what is new: the model's prefix cache holds the
first turn's prompt and reply, ``/set verbose`` says how many prompt tokens it held, and the
replies are those of cold runs (over the embedded demo model: Qwen3.5 layers, a DFlash2
draft whose session is rebuilt from the kept taps)."""

from __future__ import annotations

import pytest

import mlxrunner
from mlxrunner import generate
from mlxrunner import host as plugins
from mlxrunner.cli import chat_loop

pytestmark = pytest.mark.skipif("demo-qwen3.5" not in plugins.host().registry("models"),
                                reason="the demo plugin (mlxrunner-demo) is not installed")
GREEDY = mlxrunner.SamplerOptions(temperature=0)


def _cold_reply(bundle, messages, max_tokens):
    prompt = bundle.renderer.render(messages, None, add_generation_prompt=True)
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False)
    stop = bundle.stop_token_ids()
    result = generate(bundle.model, ids, options=GREEDY, max_tokens=max_tokens, eos_ids=stop)
    text = bundle.tokenizer.decode([t for t in result.tokens if t not in stop])
    bundle.parser.reset(prompt)
    return bundle.parser.parse(text).content, len(ids)


def test_the_second_turn_reads_only_the_new_tokens():
    bundle = mlxrunner.load("demo-qwen3.5")
    lines = iter(["/set verbose", "def add(a, b):", "class Foo:"])
    out: list[str] = []

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    messages = chat_loop(bundle, GREEDY, max_tokens=12, read=read, write=out.append)
    first, first_len = _cold_reply(bundle, [{"role": "user", "content": "def add(a, b):"}], 12)
    second, _ = _cold_reply(bundle, messages[:3], 12)
    assert [m["content"] for m in messages[1::2]] == [first, second]
    held = [line for line in "".join(out).splitlines() if "prompt tokens cached" in line]
    assert len(held) == 1  # the first turn had nothing to reuse
    cached = int(held[0].split("(")[1].split()[0])
    assert cached >= first_len  # at least the first prompt, without prefilling it again


def test_the_statistics_say_how_much_of_the_prompt_was_cached():
    from mlxrunner.cli import describe_run

    stats = {"mode": "plain", "prompt_tokens": 100, "cached_tokens": 90,
             "generated_tokens": 3, "prefill_tokens_per_second": 50.0,
             "tokens_per_second": 9.0}
    assert describe_run(stats)[0] == \
        "prompt: 100 tokens (90 prompt tokens cached, 10 read at 50.0 tokens/s)"
    assert describe_run({**stats, "cached_tokens": 0})[0] == \
        "prompt: 100 tokens read at 50.0 tokens/s"
