"""The ``gemma4`` parser: thought channel, content and tool calls from Gemma 4 output.

Output looks like ``<|channel>thought\\nREASONING\\n<channel|>CONTENT`` and
tool calls ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (strings in
``<|"|>``, objects, arrays, numbers, ``true``/``false``/``null``); the model
then stops at ``<|tool_response>``. The prompt may already have opened the
thought channel (``<|channel>thought\\n``, after tool results with thinking
on): pass it to ``reset`` or say ``start_in_thinking``.

Thinking comes back as written, less the one newline the format puts before
``<channel|>``; content is trimmed (the template trims it). Tool-response
blocks (``<|tool_response>...<tool_response|>``) are not the model's words and
are skipped; ``<turn|>`` and ``<eos>`` are dropped. A tool call that does not
parse comes back as content, unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxrunner.plugin import ParseEvents, ReplyParser, ToolCall

Q = '<|"|>'
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
END_MARKERS = ("<turn|>", "<eos>")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")


class _Malformed(ValueError):
    pass


class _ValueReader:
    """Reads the Gemma 4 argument notation (a JSON cousin) from a string."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def expect(self, token: str) -> None:
        if not self.text.startswith(token, self.pos):
            raise _Malformed(f"expected {token!r} at {self.pos}")
        self.pos += len(token)

    def string(self) -> str:
        self.expect(Q)
        end = self.text.find(Q, self.pos)
        if end < 0:
            raise _Malformed("unterminated string")
        value, self.pos = self.text[self.pos:end], end + len(Q)
        return value

    def value(self) -> Any:
        if self.text.startswith(Q, self.pos):
            return self.string()
        if self.text.startswith("{", self.pos):
            return self.object()
        if self.text.startswith("[", self.pos):
            return self.array()
        end = self.pos
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        token, self.pos = self.text[self.pos:end], end
        if token in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[token]
        if _NUMBER.fullmatch(token):
            return json.loads(token)
        if not token:
            raise _Malformed(f"missing value at {end}")
        return token  # a bare word: keep it as text rather than lose it

    def array(self) -> list[Any]:
        self.expect("[")
        items: list[Any] = []
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return items
        while True:
            items.append(self.value())
            if self.text.startswith(",", self.pos):
                self.pos += 1
            else:
                self.expect("]")
                return items

    def object(self) -> dict[str, Any]:
        self.expect("{")
        result: dict[str, Any] = {}
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return result
        while True:
            if self.text.startswith(Q, self.pos):
                key = self.string()
            else:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    raise _Malformed("key without ':'")
                key, self.pos = self.text[self.pos:colon], colon
            self.expect(":")
            result[key] = self.value()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            else:
                self.expect("}")
                return result


def parse_call(block: str) -> ToolCall | None:
    """``call:NAME{...}`` to a ToolCall, or None when it does not parse."""
    block = block.strip()
    if not block.startswith("call:"):
        return None
    brace = block.find("{")
    if brace < 0:
        return None
    name = block[len("call:"):brace].strip()
    reader = _ValueReader(block)
    reader.pos = brace
    try:
        arguments = reader.object()
    except _Malformed:
        return None
    if not name or reader.pos != len(block):
        return None
    return ToolCall(name=name, arguments=arguments)


class ThoughtText:
    """Thinking as written, less the single newline before ``<channel|>``."""

    def __init__(self) -> None:
        self.held = ""

    def write(self, text: str) -> str:
        text = self.held + text
        self.held = "\n" if text.endswith("\n") else ""
        return text[:-1] if self.held else text

    def close(self) -> str:
        self.held = ""
        return ""

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Gemma4Parser(ReplyParser):
    """Streams a Gemma 4 reply apart; see the module docstring for the format."""

    thinking_text: ThoughtText  # what new_thinking_text makes

    MARKERS = {
        "content": (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, RESPONSE_OPEN, *END_MARKERS),
        "channel_name": ("\n", CHANNEL_CLOSE),
        "thought": (CHANNEL_CLOSE, *END_MARKERS),
        "call": (CALL_CLOSE,),
        "response": (RESPONSE_CLOSE,),
    }
    BLOCK_STATES = frozenset({"channel_name", "call", "response"})
    THINKING_STATE = "thought"
    CALL_OPEN, CALL_CLOSE = CALL_OPEN, CALL_CLOSE

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return prompt.endswith(CHANNEL_OPEN + "thought\n")

    def read_tools(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.tools = list(tools)  # the notation is typed already; kept for symmetry

    def new_thinking_text(self) -> ThoughtText:
        return ThoughtText()

    def parse_call(self, block: str) -> ToolCall | None:
        return parse_call(block)

    # -- handlers ----------------------------------------------------------------------
    def on_marker(self, marker: str, block: str, events: ParseEvents) -> None:
        state = self.state
        if state == "content":
            if marker == CHANNEL_OPEN:
                self.state = "channel_name"
            elif marker == CALL_OPEN:
                self.state = "call"
            elif marker == RESPONSE_OPEN:
                self.state = "response"
            # a stray <channel|>, <turn|>, <eos>: dropped
        elif state == "channel_name":
            self.thinking_text = self.new_thinking_text()
            if marker == "\n":
                self.state = "thought"
                if block.strip() != "thought":  # another channel: keep its name visible
                    events.thinking(self.thinking_text.write(block + "\n"))
            else:  # <|channel>NAME<channel|>: a channel with no body
                events.thinking(block if block.strip() != "thought" else "")
                self.state = "content"
        elif state == "thought":
            if marker == CHANNEL_CLOSE:
                self.thinking_text.close()
                self.state = "content"
        elif state == "call":
            self.state = "content"
            self.emit_call(block, events)
        elif state == "response":
            self.state = "content"  # tool results are not the model's output

    def on_finish(self, block: str | None, events: ParseEvents) -> None:
        if self.state == "thought":
            events.thinking(self.thinking_text.flush())
        elif self.state == "channel_name" and block:
            events.thinking(block)
        elif self.state == "call" and block is not None:
            self.emit_call(block, events, closed=False)
        elif self.state == "response" and block:
            events.content(self.content_text.write(block))
        self.restart()
