"""Media in a prompt: the encoder contract and a prompt whose placeholders hold media.

A chat template writes one placeholder token per image or audio clip (Gemma 4's
``<|image|>``, Qwen3.5's ``<|image_pad|>``). An architecture that reads media offers an
:class:`Encoder` per modality (:meth:`mlxrunner.plugin.Model.load_encoders`); the encoder
turns one decoded item into a :class:`MediaItem`: the tokens that stand for it in the prompt
in place of the placeholder (begin and end markers, one token per embedding), which of them
take its embeddings, and the encoder run that computes those (deferred to prefill).
:func:`place_media` splices the items into a prompt's token ids as a :class:`MediaPrompt`,
which every decoding path (plain, speculative, the batch) prefills alike: a chunk holding
media slots runs ``model(ids, cache, embeddings=...)`` with ``embed_tokens(ids)`` whose slot
rows are the encoder's. The prefix cache keys a slot by its item's content digest, so a
cached prefix holds the very media it saw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, SupportsIndex, overload

import mlx.core as mx
import numpy as np

from ..errors import MediaError

#: the modalities an encoder may serve
MODALITIES = ("image", "audio")


@dataclass(frozen=True)
class MediaItem:
    """One image or audio clip as a prompt holds it.

    ``tokens``: the ids that replace its placeholder; ``slots``: the indices into ``tokens``
    (ascending) whose input embeddings are the encoder's rows, in order; ``digest``: a hash
    of everything the embeddings depend on (the media's content and its preprocessing);
    ``encode()``: the embeddings ``[len(slots), hidden]``, called at most once, when
    prefill first reaches a slot.

    A model whose positions are not one per token (Qwen's multimodal rotary positions)
    gives ``positions``: ``[C, len(tokens)]`` integers, each token's position in each of
    ``C`` components counted from the item's first position, and ``span``: the positions
    the item takes (the text after it starts that many positions on). Without them the
    item's tokens take one position each."""

    modality: str
    tokens: tuple[int, ...]
    slots: tuple[int, ...]
    digest: str
    encode: Callable[[], mx.array] = field(compare=False, repr=False)
    positions: np.ndarray | None = field(default=None, compare=False, repr=False)
    span: int | None = None
    #: its tokens attend to each other both ways (Gemma 4's larger checkpoints' images): a
    #: prefill chunk never ends inside it
    whole: bool = False

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"unknown modality {self.modality!r:.40}")
        if not self.slots or list(self.slots) != sorted(set(self.slots)) or \
                self.slots[0] < 0 or self.slots[-1] >= len(self.tokens):
            raise ValueError("slots must be ascending indices into tokens, at least one")
        if (self.positions is None) != (self.span is None):
            raise ValueError("positions and span come together")
        if self.positions is not None and (
                self.positions.ndim != 2 or self.positions.shape[1] != len(self.tokens)
                or not np.issubdtype(self.positions.dtype, np.integer)
                or self.positions.min() < 0 or self.span is None
                or self.positions.max() >= self.span):
            raise ValueError("positions must be [C, len(tokens)] integers in [0, span)")

    @property
    def length(self) -> int:
        """The positions the item takes."""
        return len(self.tokens) if self.span is None else self.span


class Encoder(Protocol):
    """What an architecture offers for one modality (:meth:`Model.load_encoders`).

    ``placeholder``: the token id a chat template writes for one item. ``prepare(media)``:
    an image as ``[H, W, 3]`` uint8 RGB pixels (:func:`mlxrunner.media.decode_image`), an
    audio clip as float32 mono samples (:func:`mlxrunner.media.decode_audio`) at the
    encoder's ``sample_rate`` attribute where it has one, else 16 kHz; returns its
    :class:`MediaItem`. ``prepare`` runs on a server's request threads beside the model's
    own: keep it to NumPy (the MLX work belongs in ``encode``, which prefill calls)
    (preprocessing runs here; the tower runs in ``encode``). Bad media raises
    :class:`mlxrunner.errors.MediaError`."""

    modality: str
    placeholder: int

    def prepare(self, media: np.ndarray) -> MediaItem: ...


class MediaPrompt(tuple[int, ...]):
    """A prompt's token ids with media items at their places: a tuple of ints to everything
    that reads ids (the sampler's history, stop checks), and what prefill asks for the
    input embeddings of a chunk (:meth:`embeddings`), its positions (:meth:`positions`) and
    a prefix cache for keys (:meth:`cache_key`). A slice from the start keeps the items
    that begin inside it.

    Positions: where items take fewer positions than tokens (``span``), the text after them
    sits earlier than its index. Rotary positions act through their differences alone, so
    every position of the prompt is moved on by the items' total shortfall: the first
    token after the prompt then sits at its index, and decoding goes on from the cache's
    offset as for any prompt. The shift is part of the prefix cache's key (prompts with
    other shifts share no cached prefix)."""

    placed: tuple[tuple[int, MediaItem], ...]
    _rows: dict[int, mx.array]
    _shift: int
    _table: np.ndarray

    def __new__(cls, tokens: Sequence[int], placed: Sequence[tuple[int, MediaItem]]
                ) -> MediaPrompt:
        self = super().__new__(cls, (int(t) for t in tokens))
        self.placed = tuple(placed)
        self._rows = {}
        for start, item in self.placed:
            if tuple.__getitem__(self, slice(start, start + len(item.tokens))) != item.tokens:
                raise ValueError("a media item's tokens are not at its place in the prompt")
        self._shift = sum(len(item.tokens) - item.length for _, item in self.placed)
        self._table = self._position_table()
        return self

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | tuple[int, ...]:
        if not isinstance(index, slice):
            return super().__getitem__(index)
        got = super().__getitem__(index)
        if not self.placed or index.step not in (None, 1) or index.start not in (None, 0):
            return got
        end = len(got)
        kept = [(s, item) for s, item in self.placed if s < end]
        if not kept:
            return tuple(got)
        part = tuple.__new__(MediaPrompt, got)  # (the kept items hold their places)
        # rows shared (encoded once); positions as in the whole prompt (its shift)
        part.placed, part._rows = tuple(kept), self._rows
        part._shift, part._table = self._shift, self._table[:, :end]
        return part

    def __reduce__(self) -> Any:  # (pickled as plain ids: the encoder runs are not data)
        return (tuple, (tuple(self),))

    def slot_rows(self) -> Iterator[tuple[int, int, int]]:
        """``(position in the prompt, item index, row of the item's embeddings)`` for every
        slot, in prompt order."""
        for i, (start, item) in enumerate(self.placed):
            for row, slot in enumerate(item.slots):
                yield start + slot, i, row

    def chunk_end(self, end: int) -> int:
        """``end``, or past the item it falls inside where that item is prefilled whole."""
        for start, item in self.placed:
            if item.whole and start < end < start + len(item.tokens):
                return start + len(item.tokens)
        return end

    def shift(self) -> int:
        """How far every position is moved on: the positions the items' tokens hold beyond
        those the items take (0 where no item says)."""
        return self._shift

    def positions(self, begin: int, end: int) -> mx.array | None:
        """The positions ``[C, 1, end - begin]`` (int32) of tokens ``begin:end``, where an
        item gives positions (see the class); None where none does."""
        if self._table.size == 0:
            return None
        return mx.array(self._table[:, None, begin:end])

    def _position_table(self) -> np.ndarray:
        given = [item.positions for _, item in self.placed if item.positions is not None]
        if not given:
            return np.zeros((0, 0), np.int32)
        components = max(p.shape[0] for p in given)
        table = np.empty((components, len(self)), np.int64)
        position, at = self._shift, 0
        for start, item in (*self.placed, (len(self), None)):
            text = start - at  # the text before this item (or the prompt's end)
            table[:, at:start] = position + np.arange(text)
            position, at = position + text, start
            if item is None:
                break
            own = item.positions if item.positions is not None else \
                np.arange(len(item.tokens))[None]
            table[:, start:start + len(item.tokens)] = position + np.broadcast_to(
                own, (components, len(item.tokens)))
            position, at = position + item.length, start + len(item.tokens)
        return table.astype(np.int32)

    def embeddings(self, model: Any, ids: mx.array, begin: int) -> mx.array | None:
        """The input embeddings ``[1, L, hidden]`` of the chunk ``ids [1, L]`` that starts at
        prompt position ``begin``: ``model.embed_tokens(ids)`` with each media slot's row
        replaced by its encoder's; None where the chunk holds no slot."""
        end = begin + ids.shape[1]
        where: list[int] = []
        rows: list[mx.array] = []
        for i, (start, item) in enumerate(self.placed):
            first, last = start + item.slots[0], start + item.slots[-1]
            if last < begin or first >= end:
                continue
            encoded = self._encoded(i, item)
            picked = [(start + slot - begin, row) for row, slot in enumerate(item.slots)
                      if begin <= start + slot < end]
            where += [p for p, _ in picked]
            rows.append(encoded[mx.array([r for _, r in picked], dtype=mx.int32)])
        if not where:
            return None
        embedded = model.embed_tokens(ids)
        media = mx.concatenate(rows, axis=0).astype(embedded.dtype)
        embedded[0, mx.array(where, dtype=mx.int32)] = media
        return embedded

    def _encoded(self, i: int, item: MediaItem) -> mx.array:
        rows = self._rows.get(i)
        if rows is None:
            rows = item.encode()
            if rows.ndim != 2 or rows.shape[0] != len(item.slots):
                raise MediaError(f"the {item.modality} encoder gave {tuple(rows.shape)} rows "
                                 f"for {len(item.slots)} slots")
            mx.eval(rows)
            self._rows[i] = rows
        return rows

    def cache_key(self) -> list[int]:
        """The ids a prefix cache files this prompt under: each slot's id replaced by a
        negative number drawn from its item's digest (two prompts share a cached prefix
        only where they hold the same media there)."""
        key = list(self)
        for position, i, _ in self.slot_rows():
            if position < len(key):  # (a prefix may end inside an item)
                key[position] = -1 - int(self.placed[i][1].digest[:15], 16)
        if self.shift() and key:
            # every position moved: shared with same-shift prompts only (the first id or
            # digest kept in it)
            key[0] = -(1 << 62) - hash((self.shift(), key[0])) % (1 << 60)
        return key


def cache_key(tokens: Sequence[int]) -> list[int]:
    """What a prefix cache files ``tokens`` under (a :class:`MediaPrompt`'s
    :meth:`~MediaPrompt.cache_key`, else the ids)."""
    return tokens.cache_key() if isinstance(tokens, MediaPrompt) else [int(t) for t in tokens]


def history_key(prompt: Sequence[int], history: Sequence[int]) -> list[int]:
    """What a prefix cache files ``history`` under: a generation's ids so far (``prompt``'s,
    then the generated ones), the prompt's media slots keyed as :func:`cache_key` keys
    them."""
    if not isinstance(prompt, MediaPrompt):
        return [int(t) for t in history]
    key = prompt.cache_key()
    return (key + [int(t) for t in history[len(key):]])[:len(history)]


def place_media(tokens: Sequence[int], items: Sequence[MediaItem],
                placeholders: Mapping[str, int]) -> MediaPrompt:
    """``tokens`` with each placeholder (``placeholders``: modality -> the id a template
    writes) replaced by the next item of its modality, in order. One clear error where
    the counts differ."""
    by_kind: dict[str, list[MediaItem]] = {}
    for item in items:
        if item.modality not in placeholders:
            raise MediaError(f"this model takes no {item.modality} input")
        by_kind.setdefault(item.modality, []).append(item)
    wanted = {placeholders[kind]: kind for kind in by_kind}
    for kind, listed in by_kind.items():
        found = sum(1 for t in tokens if t == placeholders[kind])
        if found != len(listed):
            raise MediaError(f"the prompt holds {found} {kind} placeholder(s) for "
                             f"{len(listed)} {kind}(s)")
    out: list[int] = []
    placed: list[tuple[int, MediaItem]] = []
    taken = dict.fromkeys(by_kind, 0)
    for t in tokens:
        found_kind = wanted.get(int(t))
        if found_kind is None:
            out.append(int(t))
            continue
        kind = found_kind
        item = by_kind[kind][taken[kind]]
        taken[kind] += 1
        placed.append((len(out), item))
        out.extend(item.tokens)
    return MediaPrompt(out, placed)


def content_digest(*parts: Any) -> str:
    """A hex digest of media content and the settings that shaped it (arrays by dtype,
    shape and bytes; anything else by ``repr``)."""
    import hashlib

    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()
