"""The multi-turn chat of ``mlxrunner run MODEL`` (no prompt at a terminal, or ``--chat``),
over the embedded demo model (its pass-through template makes the prompt the messages'
concatenation, so each turn's prompt is known exactly): its commands, multi-line input,
Ctrl-C, saved conversations and history; and what a one-shot run prints around its reply.
The same chat at a real terminal: test_chat_tmux.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import mlxrunner
from mlxrunner import generate
from mlxrunner import host as plugins
from mlxrunner.cli import (
    COMPLETIONS,
    EXIT_HINT,
    HELP,
    LineEditor,
    chat_loop,
    conversations_folder,
    describe_comparison,
    history_path,
    read_message,
    slowdown_reason,
)

pytestmark = pytest.mark.skipif("demo-qwen3.5" not in plugins.host().registry("models"),
                                reason="the demo plugin (mlxrunner-demo) is not installed")
GREEDY = mlxrunner.SamplerOptions(temperature=0)


@pytest.fixture(scope="module")
def bundle():
    return mlxrunner.load("demo-qwen3.5")


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
        self.inner, self.seen, self.switches = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def render(self, messages, tools=None, **kwargs):
        self.seen.append([dict(m) for m in messages])
        self.switches.append(kwargs)
        return self.inner.render(messages, tools, **kwargs)


def lines_of(*lines: str):
    """A ``read`` giving ``lines`` then end of input (a raised exception is raised)."""
    items = iter(lines)

    def read(prompt: str) -> str:
        item = next(items, EOFError)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    return read


@pytest.fixture
def recorder(bundle, monkeypatch):
    recording = RecordingRenderer(bundle.renderer)
    monkeypatch.setattr(bundle, "renderer", recording)
    return recording


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
    run = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", "demo-qwen3.5", "--chat",
                          "--max-tokens", "8"], input="import os\n/bye\n", text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(HELP) and len(run.stdout.strip().splitlines()) >= 2


@pytest.mark.parametrize("typed, message", [
    (["def add(a, b):"], "def add(a, b):"),
    (['"""', "class Foo:", "    pass", '"""'], "class Foo:\n    pass"),
    (['"""class Foo:', '    pass"""'], "class Foo:\n    pass"),
    (['"""one line"""'], "one line"),
    (['  """', "", "after a blank line", '"""'], "\nafter a blank line"),
    (['/set system """', "be", "brief", '"""'], "/set system be\nbrief"),
    (['/set system """brief"""'], "/set system brief"),
    (['/set system "brief"'], '/set system "brief"'),
])
def test_lines_between_triple_quotes_are_one_message(typed, message):
    prompts: list[str] = []
    items = iter(typed)

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(items)

    assert read_message(read) == message
    assert prompts == [">>> "] + ["... "] * (len(typed) - 1)
    assert next(items, None) is None  # nothing read past the closing marks


def test_commands_are_answered_by_the_chat_never_sent(bundle, recorder):
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=4, write=out.append, read=lines_of(
        "/help", "/?", "/? set", "/show", "/show info", "/show parameters", "/show system",
        "/show template", "/show modelfile", "/set", "/set parameter", "/nonsense 1 2",
        "/bye", "never read"))
    assert recorder.seen == [] and messages == []
    text = "".join(out)
    assert text.count("Available commands:") == 2 and "Available /set commands:" in text
    assert "Available /show commands:" in text
    assert "conversation   0 messages, 0 from you" in text
    assert "No system message was specified for this model." in text
    assert bundle.tokenizer.chat_template in text  # /show template
    assert (bundle.path / "Modelfile").read_text(encoding="utf-8").strip() in text
    assert "  temperature        0.0\n" in text and "  num_predict        4\n" in text
    unknown = [line for line in text.splitlines() if "nonsense" in line]
    assert unknown == ["Unknown command '/nonsense'. Type /? for help"]


def test_set_changes_what_the_next_turn_is_decoded_with(bundle, recorder):
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=30, write=out.append, read=lines_of(
        "/set system # terse", "/set think", "/set parameter num_predict 5",
        "/set parameter top_p 7", "/set parameter top_k x", "/set parameter temperature 0",
        "def add(a, b):", "/set nothink", "/set system", "class Foo:"))
    system = {"role": "system", "content": "# terse"}
    first = reply_to(bundle, [system, {"role": "user", "content": "def add(a, b):"}], 5)
    assert recorder.seen[0] == [system, {"role": "user", "content": "def add(a, b):"}]
    assert recorder.switches[0]["think"] is True and recorder.switches[1]["think"] is False
    # "/set system" alone took the system message out again
    assert messages[:2] == [{"role": "user", "content": "def add(a, b):"},
                            {"role": "assistant", "content": first}]
    assert recorder.seen[1] == messages[:3]
    assert len(bundle.tokenizer.encode(first, add_special_tokens=False)) <= 5
    text = "".join(out)
    assert "Couldn't set parameter: sampling option top_p must be between 0.0 and 1.0" in text
    assert "Couldn't set parameter: sampling option top_k must be an integer" in text


def test_a_system_message_of_several_lines(bundle, recorder):
    messages = chat_loop(bundle, GREEDY, max_tokens=4, write=lambda _: None, read=lines_of(
        '/set system """', "# one", "# two", '"""', '"""', "/help", '"""', "/show info"))
    system = {"role": "system", "content": "# one\n# two"}
    # a quoted message starting with "/" is a message, never a command
    assert recorder.seen == [[system, {"role": "user", "content": "/help"}]]
    assert messages[:2] == recorder.seen[0] and len(messages) == 3


def test_save_then_load_restores_the_conversation_and_parameters(bundle, recorder, tmp_path):
    out: list[str] = []
    saved = chat_loop(bundle, GREEDY, max_tokens=6, write=out.append, conversations=tmp_path,
                      read=lines_of("/set parameter top_k 3", "/set parameter stop xyz",
                                    "def add(a, b):", "/save talk", "/save ../away",
                                    "/load missing"))
    path = tmp_path / "talk.json"
    on_disk = json.loads(path.read_text(encoding="utf-8"))
    assert on_disk["messages"] == saved and on_disk["num_predict"] == 6
    assert on_disk["parameters"] == {"top_k": 3, "stop": ["xyz"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talk.json"]  # no temporary left
    text = "".join(out)
    assert "Couldn't save: '../away' is not a conversation name" in text
    assert "Couldn't load: no saved conversation 'missing'" in text

    out.clear()
    recorder.seen.clear()
    loaded = chat_loop(bundle, GREEDY, max_tokens=99, write=out.append, conversations=tmp_path,
                       read=lines_of("/load talk", "/show parameters", "class Foo:"))
    assert recorder.seen == [saved + [{"role": "user", "content": "class Foo:"}]]
    assert loaded[:2] == saved
    text = "".join(out)
    assert "Loaded conversation 'talk' (2 messages)" in text
    assert "  top_k              3\n" in text and "  num_predict        6\n" in text
    assert '  stop               "xyz"\n' in text

    path.write_text("{not json", encoding="utf-8")
    out.clear()
    chat_loop(bundle, GREEDY, max_tokens=4, write=out.append, conversations=tmp_path,
              read=lines_of("/load talk"))
    assert "Couldn't load:" in "".join(out) and "not a saved conversation" in "".join(out)


@pytest.fixture
def ctrl_c():
    """Ctrl-C as a terminal delivers it: Python's KeyboardInterrupt handler on SIGINT, even
    where pytest started with SIGINT ignored (a background job, nohup, some CI runners); the
    handler it found is put back after."""
    found = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)


def interrupting_parser(bundle, monkeypatch, times: int):
    """Ctrl-C (SIGINT to this process) pressed ``times`` times in a row once the first reply
    has shown some text."""
    feed = bundle.parser.feed
    shown: list[str] = []
    pressed: list[bool] = []

    def feed_then_interrupt(chunk):
        pieces = feed(chunk)
        shown.append(chunk)
        if len("".join(shown).strip()) > 10 and not pressed:
            pressed.append(True)
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return pieces

    monkeypatch.setattr(bundle.parser, "feed", feed_then_interrupt)


def test_ctrl_c_mid_reply_keeps_what_was_written_and_the_chat_goes_on(bundle, recorder,
                                                                       monkeypatch, ctrl_c):
    interrupting_parser(bundle, monkeypatch, times=1)
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=200, write=out.append,
                         read=lines_of("def add(a, b):", "class Foo:"))
    whole = reply_to(bundle, [{"role": "user", "content": "def add(a, b):"}], 200)
    kept = messages[1]["content"]
    assert kept and whole.startswith(kept) and len(kept) < len(whole) // 4
    assert kept in "".join(out)
    assert recorder.seen[1][:2] == messages[:2] and len(messages) == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_abandons_the_reply_and_its_message(bundle, recorder, monkeypatch,
                                                            ctrl_c):
    interrupting_parser(bundle, monkeypatch, times=2)
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=200, write=out.append,
                         read=lines_of("def add(a, b):", "class Foo:"))
    assert [m["content"] for m in messages if m["role"] == "user"] == ["class Foo:"]
    assert "(reply abandoned" in "".join(out)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_reply_cut_at_the_cap_says_so(bundle):
    out: list[str] = []
    chat_loop(bundle, GREEDY, max_tokens=4, write=out.append, read=lines_of("def add(a, b):"))
    text = "".join(out)
    assert "(the reply reached the 4-token cap; /set parameter num_predict N)\n" in text


def test_ctrl_c_at_the_prompt_says_how_to_leave(bundle, ctrl_c):
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=4, write=out.append,
                         read=lines_of(KeyboardInterrupt, "def add(a, b):"))
    assert EXIT_HINT in "".join(out) and len(messages) == 2


def test_the_chat_files_follow_the_model_store_or_their_own_variable(tmp_path):
    home = Path("~/.mlxrunner").expanduser()
    assert history_path({}) == home / "history"
    assert conversations_folder({}) == home / "conversations"
    moved = {"MLXRUNNER_MODELS": str(tmp_path / "store" / "models")}
    assert history_path(moved) == tmp_path / "store" / "models" / ".chat" / "history"
    assert conversations_folder(moved) == \
        tmp_path / "store" / "models" / ".chat" / "conversations"
    # files kept beside a moved store before are still found there
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "history").write_text("old line\n")
    assert history_path(moved) == tmp_path / "store" / "history"
    own = {**moved, "MLXRUNNER_HISTORY": str(tmp_path / "h")}
    assert history_path(own) == tmp_path / "h"


def test_history_is_read_once_and_saved_over_what_another_session_wrote(tmp_path):
    readline = pytest.importorskip("readline", reason="this Python has no readline")
    if "libedit" in (readline.__doc__ or ""):
        pytest.skip("libedit writes its own history format; the file is compared as GNU's")
    path = tmp_path / "history"
    path.write_text("old\n", encoding="utf-8")
    try:
        readline.clear_history()
        editor = LineEditor(path)
        assert readline.get_history_item(1) == "old"
        path.write_text("old\nother session\n", encoding="utf-8")  # written meanwhile
        readline.add_history("mine")  # as input() does with each line typed
        assert editor.new_lines() == ["mine"]
        editor.save()
    finally:
        readline.clear_history()
    assert path.read_text(encoding="utf-8").splitlines() == ["old", "other session", "mine"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history"]


def test_tab_completes_the_commands_word_by_word(tmp_path):
    editor = LineEditor(tmp_path / "history", completions=COMPLETIONS)
    assert editor.complete_word("/s") == ["/save", "/set", "/show"]
    assert editor.complete_word("/set ") == ["nothink", "parameter", "quiet", "system",
                                             "think", "verbose"]
    assert editor.complete_word("/show te") == ["template"]
    assert editor.complete_word("/show info ") == [] and editor.complete_word("hello") == []


def test_without_readline_the_chat_reads_plain_lines(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "readline", None)  # import readline fails
    editor = LineEditor(tmp_path / "history")
    assert editor.readline is None
    monkeypatch.setattr("builtins.input", lambda prompt: f"typed at {prompt}")
    assert editor.read(">>> ") == "typed at >>> "
    editor.save()
    assert not (tmp_path / "history").exists()


def test_a_slowdown_comes_with_its_reason():
    plain = {"tokens_per_second": 400.0}
    costly = {"tau": 5.0, "rounds": 10, "decode_seconds": 0.2}  # 20 ms a round = 8 steps
    reason = slowdown_reason(costly, plain)
    assert "20.00 ms, 8.0 times a plain step (2.50 ms)" in reason
    assert "costs more than it saves" in reason
    assert "acceptance was low" in slowdown_reason({**costly, "tau": 1.2}, plain)
    lines = describe_comparison({**costly, "generated_tokens": 50}, {**plain,
                                "generated_tokens": 50}, 0.62, True, explain=True)
    assert lines[-1] == "slower than plain decoding: " + reason
    assert not any("slower" in line for line in describe_comparison(
        costly, {**plain, "generated_tokens": 50}, 1.4, True))


def demo_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLXRUNNER_LOAD_PLUGINS"}
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", *args], input=stdin,
                          text=True, capture_output=True, timeout=300, env=env)


def test_piped_input_is_the_prompt_of_a_one_shot_run(bundle):
    given = demo_cli(str(bundle.path), "import os", "--max-tokens", "8", "--json")
    piped = demo_cli(str(bundle.path), "--max-tokens", "8", "--json", stdin="import os\n")
    assert given.returncode == piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["tokens"] == json.loads(given.stdout)["tokens"]


def test_verbose_statistics_say_what_the_figures_mean(bundle):
    run = demo_cli(str(bundle.path), "def add(a, b):", "--max-tokens", "24", "--compare",
                   "--verbose")
    assert run.returncode == 0, run.stderr
    out = json.loads(demo_cli(str(bundle.path), "def add(a, b):", "--max-tokens", "24",
                              "--json").stdout)
    assert run.stdout == out["text"] + "\n"  # the prompt is shown only at a terminal
    err = run.stderr.splitlines()
    assert err[0] == "(the reply reached the 24-token cap; --max-tokens or -n raises it)"
    err = err[1:]
    assert err[0].startswith("prompt: ") and err[1].startswith("reply: 24 tokens at ")
    assert any(line.startswith("  tau: tokens kept per round") for line in err)
    assert any(line.startswith("  round: ") for line in err)
    speedup = next(line for line in err if line.startswith("speedup "))
    slower = [line for line in err if line.startswith("slower than plain decoding: ")]
    assert len(slower) == (float(speedup.split()[1].rstrip("x;")) < 1), err
