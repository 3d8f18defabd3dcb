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

from mlxrunner import (
    MarkerScanner,
    ParsedMessage,
    ParseEvents,
    RenderContext,
    ToolCall,
    TrimmedText,
)

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


class Gemma4Parser(MarkerScanner):
    """Streams a Gemma 4 reply apart; see the module docstring for the format."""

    MARKERS = {
        "content": (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN, RESPONSE_OPEN, *END_MARKERS),
        "channel_name": ("\n", CHANNEL_CLOSE),
        "thought": (CHANNEL_CLOSE, *END_MARKERS),
        "call": (CALL_CLOSE,),
        "response": (RESPONSE_CLOSE,),
    }
    BLOCK_STATES = frozenset({"channel_name", "call", "response"})

    def __init__(self, context: RenderContext | None = None, *,
                 start_in_thinking: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        self.context = context
        self.reset(start_in_thinking=start_in_thinking, tools=tools)

    def reset(self, prompt: str | None = None, *, start_in_thinking: bool | None = None,
              tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        if start_in_thinking is None:
            start_in_thinking = prompt is not None and prompt.endswith(CHANNEL_OPEN + "thought\n")
        self.start_in_thinking = start_in_thinking
        self.tools = list(tools or ())  # the notation is typed already; kept for symmetry
        self._restart()

    def _restart(self) -> None:
        self.state = "thought" if self.start_in_thinking else "content"
        self.buffer, self.scanned = "", 0
        self.thought_text = ThoughtText()
        self.content_text = TrimmedText()

    def feed(self, chunk: str) -> list[ParsedMessage]:
        return self.feed_events(chunk)

    def finish(self) -> list[ParsedMessage]:
        return self.finish_events()

    def parse(self, text: str) -> ParsedMessage:
        self._restart()
        message = ParsedMessage()
        for delta in self.feed(text) + self.finish():
            message.add(delta)
        return message

    # -- handlers ----------------------------------------------------------------------
    def on_text(self, text: str, events: ParseEvents) -> None:
        if self.state == "thought":
            events.thinking(self.thought_text.write(text))
        else:
            events.content(self.content_text.write(text))

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
            self.thought_text = ThoughtText()
            if marker == "\n":
                self.state = "thought"
                if block.strip() != "thought":  # another channel: keep its name visible
                    events.thinking(self.thought_text.write(block + "\n"))
            else:  # <|channel>NAME<channel|>: a channel with no body
                events.thinking(block if block.strip() != "thought" else "")
                self.state = "content"
        elif state == "thought":
            if marker == CHANNEL_CLOSE:
                self.thought_text.close()
                self.state = "content"
        elif state == "call":
            self.state = "content"
            call = parse_call(block)
            if call is None:
                events.content(self.content_text.write(CALL_OPEN + block + CALL_CLOSE))
            else:
                events.tool_call(call)
        elif state == "response":
            self.state = "content"  # tool results are not the model's output

    def on_finish(self, block: str | None, events: ParseEvents) -> None:
        if self.state == "thought":
            events.thinking(self.thought_text.flush())
        elif self.state == "channel_name" and block:
            events.thinking(block)
        elif self.state == "call" and block is not None:
            call = parse_call(block)
            if call is None:
                events.content(self.content_text.write(CALL_OPEN + block))
            else:
                events.tool_call(call)
        elif self.state == "response" and block:
            events.content(self.content_text.write(block))
        self._restart()
