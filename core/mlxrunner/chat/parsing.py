"""Incremental marker scanning for output parsers (plain Python, no MLX).

Text arrives in arbitrary chunks. In each state the scanner looks for that
state's markers; text that cannot be the start of a marker is passed on at
once, a tail that could be is held until the next chunk decides. Block states
(a tool call, say) keep everything until their closing marker arrives.

:class:`ReplyParser` builds a whole chat-output parser (the ``Parser`` protocol) on
the scanner: thinking, content and tool calls, with ``reset``/``feed``/``finish``/``parse``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .formats import ParsedMessage, RenderContext, ToolCall


class TrimmedText:
    """One kind of text, streamed with the whitespace at both ends dropped."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def write(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body):]
        return out

    def close(self) -> str:
        self.held = ""
        return ""


class ParseEvents:
    """The deltas of one ``feed``/``finish`` call, neighbours of one kind merged."""

    def __init__(self) -> None:
        self.items: list[ParsedMessage] = []

    def content(self, text: str) -> None:
        self._text("content", text)

    def thinking(self, text: str) -> None:
        self._text("thinking", text)

    def _text(self, kind: str, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last.kind == kind:
            setattr(last, kind, getattr(last, kind) + text)
        else:
            self.items.append(ParsedMessage(content=text) if kind == "content"
                              else ParsedMessage(thinking=text))

    def tool_call(self, call: ToolCall) -> None:
        self.items.append(ParsedMessage(tool_calls=[call]))


class MarkerScanner:
    """Base of a streaming parser: subclasses fill ``MARKERS`` and the handlers."""

    MARKERS: dict[str, tuple[str, ...]] = {}
    BLOCK_STATES: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.state = ""
        self.buffer = ""
        self.scanned = 0

    # -- to implement ------------------------------------------------------------------
    def on_text(self, text: str, events: ParseEvents) -> None:
        raise NotImplementedError

    def on_marker(self, marker: str, block: str, events: ParseEvents) -> None:
        """``block``: the text a block state collected before its closing marker."""
        raise NotImplementedError

    def on_finish(self, block: str | None, events: ParseEvents) -> None:
        """End of output; ``block`` is an unclosed block's text (None outside a block)."""
        raise NotImplementedError

    # -- machinery ---------------------------------------------------------------------
    def _earliest(self, markers: tuple[str, ...], start: int) -> tuple[int, str | None]:
        best, found = -1, None
        for marker in markers:
            pos = self.buffer.find(marker, start)
            if pos >= 0 and (found is None or pos < best
                             or (pos == best and len(marker) > len(found))):
                best, found = pos, marker
        return best, found

    def _partial(self, markers: tuple[str, ...]) -> int:
        """Length of the longest buffer tail that begins some marker."""
        longest = max((len(m) for m in markers), default=1)
        for size in range(min(len(self.buffer), longest - 1), 0, -1):
            tail = self.buffer[-size:]
            if any(m.startswith(tail) for m in markers):
                return size
        return 0

    def feed_events(self, chunk: str) -> list[ParsedMessage]:
        events = ParseEvents()
        self.buffer += chunk
        while self.buffer:
            markers = self.MARKERS[self.state]
            in_block = self.state in self.BLOCK_STATES
            start = max(0, self.scanned - max(map(len, markers)) + 1) if in_block else 0
            pos, marker = self._earliest(markers, start)
            if marker is not None:
                before, self.buffer = self.buffer[:pos], self.buffer[pos + len(marker):]
                self.scanned = 0
                if in_block:
                    self.on_marker(marker, before, events)
                else:
                    self.on_text(before, events)
                    self.on_marker(marker, "", events)
                continue
            if in_block:
                self.scanned = len(self.buffer)
                break
            keep = self._partial(markers)
            text = self.buffer[:len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            self.on_text(text, events)
            break
        return events.items

    def finish_events(self) -> list[ParsedMessage]:
        events = ParseEvents()
        rest, self.buffer, self.scanned = self.buffer, "", 0
        if self.state in self.BLOCK_STATES:
            self.on_finish(rest, events)
        else:
            self.on_text(rest, events)
            self.on_finish(None, events)
        return events.items


class TextStream(Protocol):
    """A filter on one kind of streamed text (``TrimmedText`` is one)."""

    def write(self, text: str) -> str: ...

    def close(self) -> str: ...


class ReplyParser(MarkerScanner):
    """Base of a chat-output parser: thinking, content and tool calls, streamed.

    Implements the ``Parser`` protocol on :class:`MarkerScanner`. Text in
    ``THINKING_STATE`` goes through ``thinking_text`` (``new_thinking_text()``,
    trimmed by default), other text through ``content_text`` (trimmed). Subclasses
    set ``MARKERS``, ``BLOCK_STATES``, ``THINKING_STATE``, ``CALL_OPEN`` /
    ``CALL_CLOSE`` and implement ``on_marker``, ``on_finish`` (calling ``restart()``
    at its end), ``prompt_opens_thinking`` and ``parse_call``; ``read_tools`` takes
    the declared tools on each ``reset``.
    """

    THINKING_STATE = "thinking"
    CALL_OPEN = ""
    CALL_CLOSE = ""

    def __init__(self, context: RenderContext | None = None, *,
                 start_in_thinking: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        self.context = context
        self.reset(start_in_thinking=start_in_thinking, tools=tools)

    # -- to implement ------------------------------------------------------------------
    def prompt_opens_thinking(self, prompt: str) -> bool:
        """Whether output after the rendered ``prompt`` starts inside thinking."""
        raise NotImplementedError

    def parse_call(self, block: str) -> ToolCall | None:
        """A tool-call block (between ``CALL_OPEN`` and ``CALL_CLOSE``), or None."""
        raise NotImplementedError

    def read_tools(self, tools: Sequence[Mapping[str, Any]]) -> None:
        """Keep what ``parse_call`` needs from the declared tools (default: nothing)."""

    def new_thinking_text(self) -> TextStream:
        return TrimmedText()

    # -- Parser protocol ---------------------------------------------------------------
    def reset(self, prompt: str | None = None, *, start_in_thinking: bool | None = None,
              tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        if start_in_thinking is None:
            start_in_thinking = prompt is not None and self.prompt_opens_thinking(prompt)
        self.start_in_thinking = start_in_thinking
        self.read_tools(tools or ())
        self.restart()

    def restart(self) -> None:
        """Back to the start of a reply, with the settings of the last ``reset``."""
        self.state = self.THINKING_STATE if self.start_in_thinking else "content"
        self.buffer, self.scanned = "", 0
        self.thinking_text = self.new_thinking_text()
        self.content_text = TrimmedText()

    def feed(self, chunk: str) -> list[ParsedMessage]:
        return self.feed_events(chunk)

    def finish(self) -> list[ParsedMessage]:
        return self.finish_events()

    def parse(self, text: str) -> ParsedMessage:
        self.restart()
        message = ParsedMessage()
        for delta in self.feed(text) + self.finish():
            message.add(delta)
        return message

    # -- shared handlers ---------------------------------------------------------------
    def on_text(self, text: str, events: ParseEvents) -> None:
        if self.state == self.THINKING_STATE:
            events.thinking(self.thinking_text.write(text))
        else:
            events.content(self.content_text.write(text))

    def emit_call(self, block: str, events: ParseEvents, *, closed: bool = True) -> None:
        """A tool call, or (when it does not parse) its text, markers included, as content."""
        call = self.parse_call(block)
        if call is None:
            close = self.CALL_CLOSE if closed else ""
            events.content(self.content_text.write(self.CALL_OPEN + block + close))
        else:
            events.tool_call(call)
