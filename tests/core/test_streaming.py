"""TextStream: decided text from tokens, stop tokens skipped, stop strings end the text."""

from __future__ import annotations

from pathlib import Path

import pytest

import mlxrunner
from mlxrunner.chat import TextStream


@pytest.fixture(scope="module")
def tokenizer():
    folder = Path(mlxrunner.__file__).parent / "testdata" / "tokenizer-bytelevel"
    return mlxrunner.Tokenizer.from_folder(folder)


def _feed(stream: TextStream, ids: list[int]) -> list[int]:
    kept = []
    for token in ids:
        kept.append(token)
        if stream.add(token):
            break
    stream.finish()
    return kept


def test_text_is_the_decoding_and_pieces_arrive_in_order(tokenizer):
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False)
    pieces: list[str] = []
    stream = TextStream(tokenizer, on_text=pieces.append)
    _feed(stream, ids)
    assert stream.text == "".join(pieces) == tokenizer.decode(ids)
    assert not stream.stopped


def test_a_stop_string_ends_the_text_before_it_even_across_tokens(tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces: list[str] = []
    stream = TextStream(tokenizer, stops=["ma del"], on_text=pieces.append)
    kept = _feed(stream, ids)
    assert stream.stopped and stream.text == "".join(pieces) == "alpha beta gam"
    assert len(kept) < len(ids)  # generation ends at the token that completes the stop
    assert "ma del" in tokenizer.decode(kept)


def test_stop_tokens_are_not_text(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    stream = TextStream(tokenizer, stop_ids={ids[-1]})
    _feed(stream, ids)
    assert stream.text == tokenizer.decode(ids[:-1])
