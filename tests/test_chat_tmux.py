"""The chat of ``mlxrunner run MODEL`` at a real terminal: the command runs in a tmux pane,
keys go in through ``send-keys`` and what the terminal shows comes back through
``capture-pane``. The model is the demo plugin's folder, by path (greedy, so its replies are
quick to come and never stop at an end token before ``num_predict``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

demo = pytest.importorskip("mlxrunner_demo", reason="the demo plugin is not installed")
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux)")

WAIT = 90.0  # seconds: generous, the machine may be busy


class Pane:
    """One command in a detached tmux session on a server of its own."""

    def __init__(self, folder: Path, name: str) -> None:
        self.socket = f"mlxrunner-test-{os.getpid()}-{name}"
        self.config = folder / "tmux.conf"
        # remain-on-exit keeps the pane and what it shows after the command ends
        self.config.write_text("set -g remain-on-exit on\nset -g history-limit 50000\n")
        self.status = folder / f"status-{name}"

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", str(self.config), *args],
                              capture_output=True, text=True, check=True, timeout=30).stdout

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        # The exit status is written by a shell around the command: tmux may be slow to
        # reap a pane's process on a busy machine (it sits as a zombie, the pane alive).
        command = shlex.join(["bash", "-c", f'"$@"; echo $? > {shlex.quote(str(self.status))}',
                              "bash", "env", *(f"{k}={v}" for k, v in env.items()), *argv])
        self.tmux("new-session", "-d", "-s", "chat", "-x", "160", "-y", "50", command)

    def type(self, text: str) -> None:
        """Type ``text`` and press Enter."""
        self.tmux("send-keys", "-t", "chat", "-l", text)
        self.tmux("send-keys", "-t", "chat", "Enter")

    def keys(self, *names: str) -> None:
        self.tmux("send-keys", "-t", "chat", *names)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def wait(self, done: Callable[[str], bool], what: str, timeout: float = WAIT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if done(screen):
                return screen
            if time.monotonic() > deadline:
                pytest.fail(f"waited {timeout:.0f}s for {what}; the terminal shows:\n{screen}")
            time.sleep(0.1)

    def wait_prompts(self, count: int, what: str, timeout: float = WAIT) -> str:
        """Until the terminal shows ``count`` prompts (the last one waiting for input)."""
        return self.wait(lambda s: prompts(s) >= count and last_line(s) == ">>>", what, timeout)

    def exit_status(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            written = self.status.read_text() if self.status.exists() else ""
            if written.endswith("\n"):
                return int(written)
            if time.monotonic() > deadline:
                pytest.fail(f"waited {timeout:.0f}s for the command to end; the terminal "
                            f"shows:\n{self.screen()}")
            time.sleep(0.1)

    def close(self) -> None:
        try:
            socket = Path(self.tmux("display-message", "-p", "#{socket_path}").strip())
        except subprocess.CalledProcessError:  # the server has gone already
            return
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=30)
        socket.unlink(missing_ok=True)  # tmux may leave it behind


def prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith(">>>"))


def last_line(screen: str) -> str:
    lines = [line for line in screen.splitlines() if line.strip()]
    return lines[-1].rstrip() if lines else ""


def infos(screen: str) -> list[str]:
    """What each ``/show info`` said of the conversation's length, in order."""
    return re.findall(r"conversation\s+(\d+ messages, \d+ from you)", screen)


def conversation_length(screen: str) -> str:
    found = infos(screen)
    assert found, screen
    return found[-1]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "models").mkdir()
    return tmp_path


@pytest.fixture
def pane_factory(home: Path):
    panes: list[Pane] = []

    def make(*run_args: str) -> Pane:
        pane = Pane(home, str(len(panes)))
        panes.append(pane)
        env = {"MLXRUNNER_MODELS": str(home / "models"),
               "MLXRUNNER_HISTORY": str(home / "history"), "PYTHONUNBUFFERED": "1"}
        env.update({k: v for k, v in os.environ.items()
                    if k in ("PATH", "PYTHONPATH", "MLXRUNNER_SHARED_DATA")})
        pane.start([sys.executable, "-m", "mlxrunner.cli", "run", *run_args], env)
        return pane

    yield make
    for pane in panes:
        pane.close()


def demo_tokens(text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(demo.MODEL_PATH / "tokenizer.json")).encode(text).ids)


def test_a_conversation_at_a_terminal(pane_factory, home: Path):
    pane = pane_factory(str(demo.MODEL_PATH), "--max-tokens", "12")
    pane.wait_prompts(1, "the first prompt")

    pane.type("def add(a, b):")
    screen = pane.wait_prompts(2, "the first reply")
    reply = screen.split(">>> def add(a, b):", 1)[1].rsplit(">>>", 1)[0]
    assert reply.strip(), screen

    # /help is answered by the chat, not sent to the model; an unknown command neither
    pane.type("/help")
    pane.wait(lambda s: "Available commands:" in s and prompts(s) >= 3, "the help")
    pane.type("/nonsense")
    pane.wait(lambda s: "Unknown command '/nonsense'" in s and prompts(s) >= 4, "one line")
    pane.type("/show info")
    screen = pane.wait_prompts(5, "/show info")
    assert conversation_length(screen) == "2 messages, 1 from you"

    # Up recalls the line before; Enter runs it again
    pane.keys("Up")
    pane.wait(lambda s: last_line(s) == ">>> /show info", "Up to recall /show info")
    pane.keys("Enter")
    screen = pane.wait_prompts(6, "the recalled /show info")
    assert len(infos(screen)) == 2

    # lines between """ marks are one message
    pane.type('"""')
    pane.wait(lambda s: last_line(s) == "...", "the continuation prompt")
    pane.type("class Foo:")
    pane.type("    pass")
    pane.type('"""')
    pane.wait_prompts(7, "the reply to the multi-line message")

    # Ctrl-C mid-reply: the prompt comes back at once, the partial reply kept
    pane.type("/set parameter num_predict 4000")
    pane.wait_prompts(8, "/set parameter")
    pane.type("import os")
    pane.wait(lambda s: len(s.rsplit(">>> import os", 1)[-1].strip()) > 40
              and ">>> import os" in s, "the reply to start")  # (the line may not show yet)
    pane.keys("C-c")
    stopped = time.monotonic()
    screen = pane.wait_prompts(9, "the prompt after Ctrl-C", timeout=30)
    assert time.monotonic() - stopped < 20
    assert "^C" not in screen.rsplit(">>> import os", 1)[1]  # the terminal did not echo it
    pane.type("/show info")
    screen = pane.wait_prompts(10, "/show info after Ctrl-C")
    assert conversation_length(screen) == "6 messages, 3 from you"

    # Ctrl-C at the prompt says how to leave
    pane.keys("C-c")
    pane.wait(lambda s: "Use Ctrl + d or /bye to exit." in s, "the hint")
    pane.wait_prompts(11, "the prompt after the hint")

    pane.type("/save talk")
    pane.wait(lambda s: "Saved conversation 'talk' (6 messages)" in s, "/save")
    pane.type("/clear")
    pane.wait(lambda s: "Cleared session context." in s, "/clear")
    pane.type("/show info")
    pane.wait(lambda s: conversation_length(s) == "0 messages, 0 from you", "an empty chat")
    pane.type("/load talk")
    pane.wait(lambda s: "Loaded conversation 'talk' (6 messages)" in s, "/load")
    # Tab completes commands word by word
    pane.tmux("send-keys", "-t", "chat", "-l", "/sh")
    pane.keys("Tab")
    pane.wait(lambda s: last_line(s) == ">>> /show", "Tab to complete /show")
    pane.tmux("send-keys", "-t", "chat", "-l", "in")
    pane.keys("Tab")
    pane.wait(lambda s: last_line(s) == ">>> /show info", "Tab to complete info")
    pane.keys("Enter")
    pane.wait(lambda s: len(infos(s)) == 5 and
              conversation_length(s) == "6 messages, 3 from you", "the loaded chat")
    pane.type("/bye")
    assert pane.exit_status() == 0

    # inside the moved store (MLXRUNNER_MODELS), not beside it
    saved = json.loads((home / "models" / ".chat" / "conversations" / "talk.json")
                       .read_text(encoding="utf-8"))
    messages = saved["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in messages[::2]] == ["def add(a, b):", "class Foo:\n    pass",
                                                     "import os"]
    assert saved["num_predict"] == 4000
    interrupted = messages[-1]["content"]
    assert interrupted and demo_tokens(interrupted) < 3000, len(interrupted)
    assert interrupted.strip()[:20] in screen  # what was kept is what was shown

    history = (home / "history").read_text(encoding="utf-8")
    for line in ("def add(a, b):", "/show info", "class Foo:", "import os", "/bye"):
        assert line in history


def test_history_outlives_the_session_and_ctrl_d_leaves(pane_factory, home: Path):
    first = pane_factory(str(demo.MODEL_PATH), "--max-tokens", "4")
    first.wait_prompts(1, "the first prompt")
    first.type("import sys")
    first.wait_prompts(2, "a reply")
    first.type("/bye")
    assert first.exit_status() == 0

    second = pane_factory(str(demo.MODEL_PATH), "--max-tokens", "4")
    second.wait_prompts(1, "the second session's prompt")
    second.keys("Up")
    second.wait(lambda s: last_line(s) == ">>> /bye", "Up to recall the last session's /bye")
    second.keys("Up")
    second.wait(lambda s: last_line(s) == ">>> import sys", "Up again: the line before")
    second.keys("C-u", "C-d")
    assert second.exit_status() == 0


def test_a_one_shot_run_shows_its_prompt(pane_factory):
    pane = pane_factory(str(demo.MODEL_PATH), "def add(a, b):", "--max-tokens", "8")
    assert pane.exit_status() == 0
    lines = [line for line in pane.screen().splitlines() if line.strip()]
    assert lines[0] == ">>> def add(a, b):" and len(lines) >= 2, lines  # then the reply


def test_a_stored_model_by_name_at_a_terminal(pane_factory, home: Path):
    """A model stored under a name: a typo of it is one line and a non-zero exit (no
    conversation, the name never a prompt); its bare name runs its ``:latest``, whose
    ``/show info`` names it as stored; a reply at the token cap says so; ``/save`` writes
    inside the moved store."""
    modelfile = home / "Modelfile"
    modelfile.write_text(f"FROM {demo.MODEL_PATH}\n", encoding="utf-8")
    env = {**os.environ, "MLXRUNNER_MODELS": str(home / "models")}
    subprocess.run([sys.executable, "-m", "mlxrunner.cli", "create", "mysmol:latest", "-f",
                    str(modelfile)], env=env, check=True, capture_output=True, timeout=300)

    typo = pane_factory("mysmoll")
    assert typo.exit_status() != 0
    said = [line for line in typo.screen().splitlines()
            if line.strip() and not line.startswith("Pane is dead")]
    assert len(said) == 1 and "unknown model 'mysmoll'" in said[0] and \
        "mysmol:latest" in said[0], said

    pane = pane_factory("mysmol", "--max-tokens", "6")
    pane.wait_prompts(1, "the first prompt")
    pane.type("def add(a, b):")
    screen = pane.wait_prompts(2, "the reply")
    assert "(the reply reached the 6-token cap; /set parameter num_predict N)" in screen
    pane.type("/show info")
    screen = pane.wait_prompts(3, "/show info")
    named = [line.split() for line in screen.splitlines() if line.strip().startswith("model ")]
    assert named and named[-1][1] in ("mysmol", "mysmol:latest"), screen
    pane.type("/save talk")
    pane.wait(lambda s: "Saved conversation 'talk' (2 messages)" in s, "/save")
    pane.type("/bye")
    assert pane.exit_status() == 0
    saved = json.loads((home / "models" / ".chat" / "conversations" / "talk.json")
                       .read_text(encoding="utf-8"))
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert not (home / "conversations").exists()
