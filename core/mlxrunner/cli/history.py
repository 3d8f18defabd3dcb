"""Where the chat keeps what outlives a session, and its line editor.

The chat's files live under one folder, ``~/.mlxrunner`` (``.chat`` inside the store when
``MLXRUNNER_MODELS`` moves it, so a moved store takes them along and nothing lands beside
it; the store reads only its entries' folders): the input history in
``history`` (``MLXRUNNER_HISTORY`` names another file) and saved conversations in
``conversations/``.

:class:`LineEditor` gives ``input`` line editing and Up/Down recall through Python's
``readline`` where it exists (without it, input works as plain lines). The history file is
read once, at the start; at the end the session's lines are added to what the file holds
then (another session may have written it meanwhile) and the whole is written under a
temporary name and renamed over it, so a crash never leaves half a file.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

#: lines kept in the history file
HISTORY_LENGTH = 1000


def chat_home(env: Mapping[str, str] | None = None) -> Path:
    """The folder of the chat's files: ``.chat`` inside the model store when
    ``MLXRUNNER_MODELS`` moves it (no model name starts with a dot, so no entry can take its
    place), else ``~/.mlxrunner``."""
    env = os.environ if env is None else env
    models = env.get("MLXRUNNER_MODELS", "").strip()
    if models:
        return Path(models).expanduser() / ".chat"
    return Path("~/.mlxrunner").expanduser()


def _kept(env: Mapping[str, str], name: str) -> Path:
    """``name`` in :func:`chat_home`; where only the folder beside a moved store holds it
    (where the chat kept its files before), that one."""
    path = chat_home(env) / name
    models = env.get("MLXRUNNER_MODELS", "").strip()
    if models and not path.exists():
        before = Path(models).expanduser().parent / name
        if before.exists():
            return before
    return path


def history_path(env: Mapping[str, str] | None = None) -> Path:
    """The input history file: ``MLXRUNNER_HISTORY``, else ``history`` in :func:`chat_home`."""
    env = os.environ if env is None else env
    named = env.get("MLXRUNNER_HISTORY")
    return Path(named).expanduser() if named else _kept(env, "history")


def conversations_folder(env: Mapping[str, str] | None = None) -> Path:
    """Where ``/save NAME`` writes ``NAME.json``."""
    return _kept(os.environ if env is None else env, "conversations")


def _readline() -> ModuleType | None:
    try:
        import readline
    except ImportError:  # Python built without it (some Windows and minimal builds)
        return None
    return readline


class LineEditor:
    """``read(prompt)`` with line editing and a persisted history (see the module's text).

    ``readline_module`` is for tests (None: the real one, when Python has it)."""

    def __init__(self, path: Path | None, readline_module: Any = None,
                 completions: Sequence[str] = ()) -> None:
        self.path = path
        self.readline = readline_module if readline_module is not None else _readline()
        self.completions = list(completions)
        self._first_new = 0
        if self.readline is None:
            return
        if hasattr(self.readline, "set_auto_history"):
            self.readline.set_auto_history(True)
        if self.completions:
            self.readline.set_completer_delims(" ")
            self.readline.set_completer(self._complete)
            # libedit (macOS) takes its own binding syntax
            binding = "bind ^I rl_complete" if "libedit" in (self.readline.__doc__ or "") \
                else "tab: complete"
            self.readline.parse_and_bind(binding)
        if path is not None and path.is_file():
            try:
                self.readline.read_history_file(str(path))
            except OSError as exc:  # unreadable: start without it, say so once
                logger.warning("chat history %s not read (%s)", path, exc.strerror or exc)
        self._first_new = self.readline.get_current_history_length()

    def read(self, prompt: str) -> str:
        return input(prompt)

    def complete_word(self, line: str) -> list[str]:
        """The words that may complete the last word of ``line`` (the text before the cursor):
        the matching words of ``completions`` at that position."""
        done = line.split(" ")[:-1]
        matches = set()
        for completion in self.completions:
            words = completion.split(" ")
            if len(words) > len(done) and words[:len(done)] == done and \
                    words[len(done)].startswith(line.split(" ")[-1]):
                matches.add(words[len(done)])
        return sorted(matches)

    def _complete(self, text: str, state: int) -> str | None:
        """readline's completer: the ``state``-th completion of the word being typed."""
        rl = self.readline
        if rl is None:
            return None
        try:
            matches = self.complete_word(rl.get_line_buffer()[:rl.get_endidx()])
            return matches[state] + " " if state < len(matches) else None
        except Exception:  # readline swallows errors; one here must not end the chat
            return None

    def new_lines(self) -> list[str]:
        """The lines entered in this session, oldest first."""
        if self.readline is None:
            return []
        end = self.readline.get_current_history_length()
        # readline numbers history items from 1
        items = (self.readline.get_history_item(i) for i in range(self._first_new + 1, end + 1))
        return [item for item in items if item]

    def save(self) -> None:
        """Add this session's lines to the history file (atomically; see the module)."""
        if self.readline is None or self.path is None:
            return
        lines = self.new_lines()
        if not lines:
            return
        rl = self.readline
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rl.clear_history()
            if self.path.is_file():
                rl.read_history_file(str(self.path))
            for line in lines:
                rl.add_history(line)
            rl.set_history_length(HISTORY_LENGTH)
            fd, temporary = tempfile.mkstemp(prefix=".history.", dir=self.path.parent)
            os.close(fd)
            try:
                rl.write_history_file(temporary)
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:
            logger.warning("chat history not saved to %s (%s)", self.path,
                           exc.strerror or exc)
