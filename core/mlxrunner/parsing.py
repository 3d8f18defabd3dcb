"""Incremental marker scanning for output parsers (plain Python, no MLX).

Text arrives in arbitrary chunks. In each state the scanner looks for that
state's markers; text that cannot be the start of a marker is passed on at
once, a tail that could be is held until the next chunk decides. Block states
(a tool call, say) keep everything until their closing marker arrives.
"""

from __future__ import annotations

from .chat import ParsedMessage, ToolCall


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
        if text:
            if self.items and self.items[-1].kind == "content":
                self.items[-1].content += text
            else:
                self.items.append(ParsedMessage(content=text))

    def thinking(self, text: str) -> None:
        if text:
            if self.items and self.items[-1].kind == "thinking":
                self.items[-1].thinking += text
            else:
                self.items.append(ParsedMessage(thinking=text))

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
            if pos >= 0 and (best < 0 or pos < best or (pos == best and len(marker) > len(found))):
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
