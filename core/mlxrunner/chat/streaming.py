"""Decided text from a stream of tokens: what ``run``, the chat loop and ``serve`` show."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class TextStream:
    """Tokens in, text out as soon as it is decided.

    Detokenizes incrementally, skips the model's stop tokens, and ends at the first of
    ``stops`` (stop strings): the text before it is kept, the stop string and anything
    after it are not. Text that might be the start of a stop string is held back until
    the next token settles it. ``on_text`` receives every decided piece.
    """

    def __init__(self, tokenizer: Any, stop_ids: Iterable[int] = (),
                 stops: Iterable[str] = (), on_text: Callable[[str], Any] | None = None
                 ) -> None:
        self._detok = tokenizer.detokenizer()
        self._stop_ids = frozenset(stop_ids)
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self._on_text = on_text
        self.text = ""
        self.stopped = False

    def _emit(self, piece: str) -> None:
        if piece:
            self.text += piece
            if self._on_text is not None:
                self._on_text(piece)

    def add(self, token: int) -> bool:
        """Take one token; True when a stop string has just ended the text."""
        if self.stopped or token in self._stop_ids:
            return self.stopped
        self._pending += self._detok.add(token)
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0:
                self._emit(self._pending[:at])
                self._pending = ""
                self.stopped = True
                return True
        cut = len(self._pending) - self._hold
        if cut > 0:
            self._emit(self._pending[:cut])
            self._pending = self._pending[cut:]
        return False

    def finish(self) -> str:
        """Hand on what is left (nothing after a stop string); returns the whole text."""
        if not self.stopped:
            self._pending += self._detok.finish()
            self._emit(self._pending)
            self._pending = ""
        return self.text
