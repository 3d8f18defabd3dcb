"""Helpers for testing output parsers (the ``Parser`` protocol): ``mlxrunner.testing``.

A streaming parser must give the same message however its input is cut up::

    from mlxrunner.testing import chunkings, feed_in_chunks, fixed_chunks, fresh_parser

    expected = fresh_parser("qwen3.5").parse(text)
    for size in range(1, 8):
        assert feed_in_chunks(fresh_parser("qwen3.5"), fixed_chunks(text, size)) == expected

    @given(st.data())
    def test_any_chunking(data):
        chunks = data.draw(chunkings(text))
        assert feed_in_chunks(fresh_parser("qwen3.5"), chunks) == expected

:func:`check_chunking_independent` does the comparison in one call, and
:func:`noisy_text` draws texts dense in a format's markers to run it on;
:func:`json_values` and :func:`tool_names` draw tool-call arguments and names for
render -> parse round trips. The strategies need hypothesis (the ``test`` extra); it is
imported only when they are called.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..chat.formats import ParsedMessage, Parser, RenderContext, get_parser

__all__ = ["check_chunking_independent", "chunkings", "feed_in_chunks", "fixed_chunks",
           "fresh_parser", "json_values", "noisy_text", "tool_names"]


def fresh_parser(name: str, context: RenderContext | None = None, **reset_options: Any) -> Parser:
    """The parser registered as ``name``, reset with ``reset_options`` (``prompt=``, ...)."""
    parser = get_parser(name, context)
    parser.reset(**reset_options)
    return parser


def fixed_chunks(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of ``size`` characters (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return [text[i:i + size] for i in range(0, len(text), size)]


def chunkings(text: str, max_size: int = 7) -> Any:
    """A hypothesis strategy: ``text`` cut into pieces of 1..``max_size`` characters."""
    from hypothesis import strategies as st

    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")

    @st.composite
    def cuts(draw: Any) -> list[str]:
        pieces, pos = [], 0
        while pos < len(text):
            size = draw(st.integers(1, max_size))
            pieces.append(text[pos:pos + size])
            pos += size
        return pieces

    return cuts()


def noisy_text(snippets: Sequence[str], max_pieces: int = 25) -> Any:
    """A hypothesis strategy: up to ``max_pieces`` snippets and short random texts, joined.

    Give the format's markers, their fragments and separators as ``snippets``.
    """
    from hypothesis import strategies as st

    piece = st.one_of(st.sampled_from(list(snippets)), st.text(max_size=3))
    return st.lists(piece, max_size=max_pieces).map("".join)


def json_values(text: Any, keys: Any, max_leaves: int) -> Any:
    """A hypothesis strategy: null, booleans, integers, finite floats and ``text`` strings,
    nested in lists and objects (keys from ``keys``) of up to 3 items."""
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers() | \
        st.floats(allow_nan=False, allow_infinity=False) | text
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(keys, inner, max_size=3), max_leaves=max_leaves)


def tool_names() -> Any:
    """A hypothesis strategy: tool (and argument) names, 1..10 of ``[a-z0-9_.-]``."""
    from hypothesis import strategies as st

    return st.text("abcdefghijklmnopqrstuvwxyz_0123456789.-", min_size=1, max_size=10)


def feed_in_chunks(parser: Parser, chunks: Iterable[str]) -> ParsedMessage:
    """Feed ``chunks`` one by one, then finish: the deltas merged into one message."""
    message = ParsedMessage()
    for chunk in chunks:
        for delta in parser.feed(chunk):
            message.add(delta)
    for delta in parser.finish():
        message.add(delta)
    return message


def check_chunking_independent(name: str, text: str, chunks: Sequence[str],
                               **reset_options: Any) -> ParsedMessage:
    """Parser ``name`` fed ``chunks`` (which join to ``text``) gives what parsing ``text``
    in one call gives; both parsers are reset with ``reset_options``. Returns the message.
    """
    if "".join(chunks) != text:
        raise ValueError("the chunks do not join to the text")
    expected = fresh_parser(name, **reset_options).parse(text)
    streamed = feed_in_chunks(fresh_parser(name, **reset_options), chunks)
    if streamed != expected:
        raise AssertionError(f"parser {name!r} ({reset_options}) fed {list(chunks)!r} gave "
                             f"{streamed!r}; parsing the text in one call gave {expected!r}")
    return expected
