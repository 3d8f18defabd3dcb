"""The multi-turn chat of ``mlxrunner run MODEL`` (no prompt at a terminal, or ``--chat``),
over the embedded demo model (its pass-through template makes the prompt the messages'
concatenation, so each turn's prompt is known exactly)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mlxrunner
from mlxrunner import host as plugins
from mlxrunner.cli import HELP, chat_loop
from mlxrunner.decode import generate

pytestmark = pytest.mark.skipif("default" not in plugins.host().registry("models"),
                                reason="the demo plugin (mlxrunner-demo) is not installed")
GREEDY = mlxrunner.SamplerOptions(temperature=0)


@pytest.fixture(scope="module")
def bundle():
    return mlxrunner.load("default")


def reply_to(bundle, messages, max_tokens):
    """The reply's content as the model's parser splits it (what the chat keeps)."""
    prompt = bundle.renderer.render(messages, None, add_generation_prompt=True)
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False)
    stop = bundle.stop_token_ids()
    result = generate(bundle.model, ids, options=GREEDY, max_tokens=max_tokens, eos_ids=stop)
    text = bundle.tokenizer.decode([t for t in result.tokens if t not in stop])
    bundle.parser.reset(prompt)
    return bundle.parser.parse(text).content


class RecordingRenderer:
    """The bundle's renderer, recording the conversations it is asked to render."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def render(self, messages, tools=None, **kwargs):
        self.seen.append([dict(m) for m in messages])
        return self.inner.render(messages, tools, **kwargs)


def test_turns_see_the_conversation_and_clear_forgets_it(bundle, monkeypatch):
    recorder = RecordingRenderer(bundle.renderer)
    monkeypatch.setattr(bundle, "renderer", recorder)
    lines = iter(["def add(a, b):", "class Foo:", "/clear", "def add(a, b):"])
    out: list[str] = []

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    messages = chat_loop(bundle, GREEDY, max_tokens=12, read=read, write=out.append)
    seen = recorder.seen[:]
    first = reply_to(bundle, [{"role": "user", "content": "def add(a, b):"}], 12)
    second = reply_to(bundle, [{"role": "user", "content": "def add(a, b):"},
                               {"role": "assistant", "content": first},
                               {"role": "user", "content": "class Foo:"}], 12)
    # after /clear the conversation starts again: the same first reply
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == first
    text = "".join(out)
    assert text.startswith(HELP)
    assert text.count(first) >= 2 and second in text and "Cleared session context." in text
    user = {"role": "user", "content": "def add(a, b):"}
    assert seen == [[user],
                             [user, {"role": "assistant", "content": first},
                              {"role": "user", "content": "class Foo:"}],
                             [user]]


def test_bye_leaves_at_once(bundle):
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=4, read=lambda _: "/bye",
                         write=out.append, system="# a system line\n")
    assert messages == [{"role": "system", "content": "# a system line\n"}]


def test_the_command_chats_over_piped_lines():
    run = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", "default", "--chat",
                          "--max-tokens", "8"], input="import os\n/bye\n", text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(HELP) and len(run.stdout.strip().splitlines()) >= 2
