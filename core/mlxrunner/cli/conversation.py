"""A chat's state as ``/save NAME`` writes it and ``/load NAME`` reads it back.

One JSON object in ``conversations/NAME.json`` (see :mod:`.history` for the folder): the
model it was held with, the messages (the system message first when there is one), the
sampling options set, ``num_predict`` and the think switch. Written under a temporary name
and renamed, so a crash leaves the previous file or none.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MLXRunnerError

FORMAT = "mlxrunner-conversation"
VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ROLES = ("system", "user", "assistant", "tool")


class ConversationFileError(MLXRunnerError):
    """A conversation name or file ``/save`` or ``/load`` cannot use."""


@dataclass
class SavedConversation:
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    num_predict: int | None = None
    think: bool | None = None

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model,
                "messages": self.messages, "parameters": self.parameters,
                "num_predict": self.num_predict, "think": self.think}


def conversation_file(folder: Path, name: str) -> Path:
    """``folder/NAME.json``; a name that is not a plain file name is refused."""
    if not _NAME.fullmatch(name) or name.endswith(".json"):
        raise ConversationFileError(
            f"{name!r} is not a conversation name (letters, digits, '.', '_' and '-', "
            "starting with a letter or digit)")
    return folder / f"{name}.json"


def save_conversation(path: Path, conversation: SavedConversation) -> None:
    text = json.dumps(conversation.as_json(), ensure_ascii=False, indent=1) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConversationFileError(f"{path}: cannot write ({exc.strerror or exc})") from None


def load_conversation(path: Path) -> SavedConversation:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversationFileError(f"no saved conversation {path.stem!r} ({path})") from None
    except OSError as exc:
        raise ConversationFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversationFileError(f"{path}: not a saved conversation ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConversationFileError(f"{path}: not a saved conversation")
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in _ROLES and _content(m.get("content"))
            for m in messages):
        raise ConversationFileError(f"{path}: its messages are not a list of "
                                    "{role, content} objects")
    parameters = data.get("parameters") or {}
    num_predict = data.get("num_predict")
    think = data.get("think")
    if not isinstance(parameters, dict) or not (
            num_predict is None or (type(num_predict) is int and num_predict >= 1)) or \
            think not in (None, True, False):
        raise ConversationFileError(f"{path}: bad parameters, num_predict or think")
    return SavedConversation(model=str(data.get("model") or ""), messages=messages,
                             parameters=parameters, num_predict=num_predict, think=think)


def _content(content: Any) -> bool:
    """A message's content as a chat saves it: text, or text, image and audio parts (each by
    its file's path, read again when the conversation goes on)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and ((p.get("type") == "text" and isinstance(p.get("text"), str))
                                 or (p.get("type") in ("image", "audio")
                                     and isinstance(p.get("data"), str)))
        for p in content)
