"""A prefix cache: model state kept across requests and chat turns, so that a prompt that
starts the way an earlier one did (a system prompt, the conversation so far) only prefills
what is new.

Each cache kind says how it is kept (:meth:`Cache.prefix_kind`; a kind that says None
keeps the model out of the prefix cache). State is kept in a trie of token blocks
(``block`` tokens each). Every block holds its own copy of the attention keys and values of
its positions (one array pair per "kv" layer: full attention), so prompts that share a
beginning share its blocks, and the bytes held are simply the sum of the arrays' sizes.
Layers whose state is not a list of positions ("snapshot": a sliding window ring, a Gated
DeltaNet conv tail and recurrent state) are kept as snapshots: the whole layer state at one
offset, taken where a store was made (the callers store at each prefill chunk's end, at
each prompt's end and at each generation's end). A prompt's last partial block is a *tail*
on its parent block, with its keys and values and its snapshot.

A lookup returns the longest prefix it can rebuild, never the whole prompt (the last
token must still run through the model to give the next token's logits): for a model
whose caches are all "kv", any length (keys and values are cut); with a snapshot layer,
the longest stored boundary with a snapshot. The rebuilt caches are new objects from the
model's ``make_cache``, holding exactly what a run over those tokens left: restoring one is
the same as having prefilled it (up to the shapes the arithmetic ran in: a prefix
prefilled in other chunks, or decoded token by token, can differ from a cold prefill in the
last bits).

Optionally each block also keeps the target's tapped hidden states of its positions (keyed
by the tap layers): a speculative draft builds its context from them, so a hit can rebuild
the draft's session too (see :class:`mlxrunner.batch.Scheduler`).

LRU eviction under ``budget_bytes``: the least recently used leaf (a tail, or a block with
nothing after it) goes first, until the arrays held fit.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .. import settings
from ..media import cache_key
from .base import Cache

log = logging.getLogger("mlxrunner.cache")

#: tokens per block of the trie
DEFAULT_BLOCK = 256
#: the arrays a prefix cache may hold unless told otherwise
DEFAULT_BUDGET_BYTES = 2 << 30

Taps = tuple[int, ...]
MakeCache = Callable[[], "list[Cache | None]"]


def _copy(a: mx.array) -> mx.array:
    """An array of its own (a slice would keep the whole buffer it views alive)."""
    return mx.contiguous(a)


@dataclass
class _Stretch:
    """What one stretch of positions holds: per full-attention layer its keys and values,
    per tap tuple the tapped states, and (non-KV layers) the snapshot at its end."""

    tokens: tuple[int, ...]
    kv: list[tuple[mx.array, mx.array]]
    taps: dict[Taps, mx.array] = field(default_factory=dict)
    snapshot: list[tuple[mx.array, mx.array]] | None = None
    #: the logits of the next token, where a prompt ended here
    logits: mx.array | None = None
    used: int = 0

    def nbytes(self) -> int:
        arrays = [a for pair in self.kv for a in pair] + list(self.taps.values())
        arrays += [a for pair in self.snapshot or () for a in pair]
        arrays += [self.logits] if self.logits is not None else []
        return sum(a.nbytes for a in arrays)


@dataclass
class _Node(_Stretch):
    """A full block: its children (the blocks that followed it) and tails (prompts that
    ended inside the next block)."""

    parent: _Node | None = None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    tails: dict[tuple[int, ...], _Stretch] = field(default_factory=dict)


@dataclass
class PrefixHit:
    """A lookup's answer: ``length`` prompt tokens are in ``caches`` (fresh from the
    model's ``make_cache``; nothing cached: length 0 and empty caches), and with taps asked
    for, ``tapped`` holds their tapped states ``[1, length, ...]``. A prompt met before
    whole comes back whole, with the ``logits`` its prefill gave (nothing left to run);
    otherwise ``length`` is shorter than the prompt and ``logits`` None."""

    length: int
    caches: list[Cache | None]
    tapped: mx.array | None = None
    logits: mx.array | None = None


class PrefixCache:
    """Cached model state for one model (see the module). ``lookup(tokens)`` before a
    prefill, ``store(tokens, caches)`` with caches that hold exactly ``tokens``.
    Safe to share between threads (one lock)."""

    def __init__(self, make_cache: MakeCache, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be at least 1 token, got {block}")
        self.make_cache = make_cache
        self.budget_bytes = int(budget_bytes)
        self.block = int(block)
        self._root = _Node(tokens=(), kv=[])
        self._lock = threading.Lock()
        self._tick = 0
        self.bytes = 0
        template = make_cache()
        # how each layer's cache is kept (Cache.prefix_kind; None: not at all, or no cache)
        kinds = [None if c is None else c.prefix_kind() for c in template]
        self._kinds = kinds
        kept = [c is None or k in ("kv", "snapshot") for c, k in zip(template, kinds)]
        self.supported = all(kept)
        if not self.supported:
            names = sorted({type(c).__name__ for c, ok in zip(template, kept) if not ok})
            log.info("mlxrunner: no prefix cache for this model (cache kind %s)",
                     ", ".join(names))
        self._kv = [i for i, k in enumerate(kinds) if k == "kv"]
        self._snap = [i for i, k in enumerate(kinds) if k == "snapshot"]
        #: every offset restorable (all KV): a hit may cut anywhere
        self.any_length = not self._snap

    # -- lookup --------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], taps: Taps | None = None) -> PrefixHit:
        """The longest cached prefix of ``tokens`` as fresh caches (the whole prompt only
        where its logits were kept: see :class:`PrefixHit`); with ``taps``, only a prefix
        whose tapped states are kept too. (A prompt holding media is filed under its
        :meth:`~mlxrunner.media.MediaPrompt.cache_key`.)"""
        tokens = cache_key(tokens)
        with self._lock:
            length, path, partial = self._match(tokens, taps) if self.supported else (0, [], None)
            caches = self.make_cache()
            if length == 0:
                return PrefixHit(0, caches)
            self._tick += 1
            stretches: list[_Stretch] = list(path) + ([partial] if partial is not None else [])
            for s in stretches:
                s.used = self._tick
            tapped = None
            if taps is not None:
                tapped = mx.concatenate([s.taps[taps] for s in stretches], axis=1)[:, :length]
            for slot, i in enumerate(self._kv):
                keys = mx.concatenate([s.kv[slot][0] for s in stretches], axis=2)
                values = mx.concatenate([s.kv[slot][1] for s in stretches], axis=2)
                _layer(caches, i).fill_prefix(keys, values, length)
            if self._snap:
                last = stretches[-1]
                assert last.snapshot is not None  # _match picks snapshotted ends only
                for (a, b), i in zip(last.snapshot, self._snap):
                    _layer(caches, i).restore_prefix_snapshot(a, b, length)
            logits = stretches[-1].logits if length == len(tokens) else None
            return PrefixHit(length, caches, tapped, logits)

    def _match(self, tokens: list[int], taps: Taps | None
               ) -> tuple[int, list[_Node], _Stretch | None]:
        """(length, the full blocks used, the partial stretch after them or None)."""
        limit = len(tokens) - 1
        block = self.block
        path: list[_Node] = []
        node = self._root
        while True:
            key = tuple(tokens[len(path) * block:(len(path) + 1) * block])
            child = node.children.get(key) if len(key) == block else None
            if child is None or (taps is not None and taps not in child.taps):
                break
            path.append(child)
            node = child

        def usable(s: _Stretch) -> bool:
            return taps is None or taps in s.taps

        # the whole prompt, met before: its logits stand for its last token's forward
        start = len(path) * block
        if start == len(tokens) and path and path[-1].logits is not None:
            return len(tokens), path, None
        whole = node.tails.get(tuple(tokens[start:]))
        if whole is not None and whole.logits is not None and usable(whole):
            return len(tokens), path, whole

        if self.any_length:
            # the longest run of equal tokens into a child block or a tail after the path
            start = len(path) * block
            best, best_stretch = 0, None
            for s in [*node.children.values(), *node.tails.values()]:
                if not usable(s):
                    continue
                same = _common(s.tokens, tokens, start)
                if same > best:
                    best, best_stretch = same, s
            length = min(start + best, limit)
            full = min(len(path), length // block)
            rest = length - full * block
            partial = best_stretch if rest and full == len(path) else \
                (path[full] if rest else None)
            return length, path[:full], partial
        # only boundaries with a snapshot: a block's end or a tail that matches entirely
        best_length, best_full, best_tail = 0, 0, None
        for depth in range(len(path) + 1):
            at = depth * block
            if at > limit:
                break
            owner = path[depth - 1] if depth else self._root
            if depth and owner.snapshot is not None and at > best_length:
                best_length, best_full, best_tail = at, depth, None
            for tail in owner.tails.values():
                end = at + len(tail.tokens)
                if end <= limit and end > best_length and tail.snapshot is not None and \
                        usable(tail) and tuple(tokens[at:end]) == tail.tokens:
                    best_length, best_full, best_tail = end, depth, tail
        return best_length, path[:best_full], best_tail

    # -- store ---------------------------------------------------------------------------
    def store(self, tokens: Sequence[int], caches: Sequence[Cache | None],
              tapped: tuple[Taps, mx.array] | None = None,
              logits: mx.array | None = None) -> bool:
        """Keep what ``caches`` hold after exactly ``tokens`` (every cache at offset
        ``len(tokens)``); ``tapped``: (tap layers, their states ``[1, len(tokens), ...]``);
        ``logits``: the next token's, where ``tokens`` are a whole prompt.
        Returns False (keeping nothing) where the caches do not hold exactly that."""
        tokens = cache_key(tokens)
        n = len(tokens)
        if not self.supported or n == 0 or len(caches) != len(self._kinds):
            return False
        live = [c for c in caches if c is not None]
        if any(c.offset != n or not c.state for c in live):
            return False  # an interrupted forward, or caches of other tokens
        if tapped is not None and tapped[1].shape[1] != n:
            raise ValueError(f"tapped states hold {tapped[1].shape[1]} positions, not {n}")
        block = self.block
        made: list[mx.array] = []
        with self._lock:
            self._tick += 1
            node = self._root
            for b in range(n // block):
                key = tuple(tokens[b * block:(b + 1) * block])
                child = node.children.get(key)
                if child is None:
                    child = _Node(tokens=key, kv=self._rows(caches, b * block, (b + 1) * block),
                                  parent=node)
                    node.children[key] = child
                    made += [a for pair in child.kv for a in pair]
                self._add_taps(child, tapped, b * block, made)
                child.used = self._tick
                node = child
            rest = n % block
            if rest:
                key = tuple(tokens[n - rest:])
                end = node.tails.get(key)
                if end is None:
                    end = _Stretch(tokens=key, kv=self._rows(caches, n - rest, n))
                    node.tails[key] = end
                    made += [a for pair in end.kv for a in pair]
                self._add_taps(end, tapped, n - rest, made)
                end.used = self._tick
            else:
                end = node
            if self._snap and end.snapshot is None:
                end.snapshot = [_layer(caches, i).prefix_snapshot() for i in self._snap]
                made += [a for pair in end.snapshot for a in pair]
            if logits is not None and end.logits is None and end is not self._root:
                end.logits = _copy(logits)
                made.append(end.logits)
            if made:
                # evaluated now: the copies then let go of the live caches' buffers
                mx.eval(*made)
                self.bytes += sum(a.nbytes for a in made)
            self._evict()
        return True

    def _rows(self, caches: Sequence[Cache | None], start: int, end: int
              ) -> list[tuple[mx.array, mx.array]]:
        return [_layer(caches, i).prefix_rows(start, end) for i in self._kv]

    @staticmethod
    def _add_taps(stretch: _Stretch, tapped: tuple[Taps, mx.array] | None, start: int,
                  made: list[mx.array]) -> None:
        if tapped is None or tapped[0] in stretch.taps:
            return
        rows = _copy(tapped[1][:, start:start + len(stretch.tokens)])
        stretch.taps[tapped[0]] = rows
        made.append(rows)

    # -- eviction ------------------------------------------------------------------------
    def _evict(self) -> None:
        while self.bytes > self.budget_bytes:
            victim = self._least_recent_leaf()
            if victim is None:
                return
            owner, key, stretch, is_tail = victim
            if is_tail:
                del owner.tails[key]
            else:
                del owner.children[key]
            self.bytes -= stretch.nbytes()

    def _least_recent_leaf(self) -> tuple[_Node, tuple[int, ...], _Stretch, bool] | None:
        best: tuple[_Node, tuple[int, ...], _Stretch, bool] | None = None
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, tail in node.tails.items():
                if best is None or tail.used < best[2].used:
                    best = (node, key, tail, True)
            for key, child in node.children.items():
                if child.children or child.tails:
                    stack.append(child)
                elif best is None or child.used < best[2].used:
                    best = (node, key, child, False)
        return best

    def clear(self) -> None:
        with self._lock:
            self._root = _Node(tokens=(), kv=[])
            self.bytes = 0


def _layer(caches: Sequence[Cache | None], i: int) -> Cache:
    """Layer ``i``'s cache, one the prefix cache keeps (never None)."""
    cache = caches[i]
    assert cache is not None
    return cache


def _common(stored: tuple[int, ...], tokens: list[int], start: int) -> int:
    """How many of ``stored`` equal ``tokens[start:]``, from the first."""
    n = 0
    for a, b in zip(stored, tokens[start:start + len(stored)]):
        if a != b:
            break
        n += 1
    return n


#: the default budget's bounds, and its share of the weights and of the machine's memory
PREFIX_BUDGET_MIN = 256 << 20
PREFIX_BUDGET_MAX = 2048 << 20
PREFIX_BUDGET_PER_WEIGHT_BYTE = 4
PREFIX_BUDGET_MACHINE_SHARE = 8


def default_prefix_budget(weights_bytes: int | None) -> int:
    """Bytes of cached state for a model of ``weights_bytes`` (None: not known): four times
    its weights, at least 256 MiB, at most 2 GiB and an eighth of this machine's memory (a
    135M model's server grew to 2.9 GB under the fixed 2 GiB)."""
    return scaled_budget(weights_bytes, PREFIX_BUDGET_MIN, PREFIX_BUDGET_MAX)


def scaled_budget(weights_bytes: int | None, low: int, high: int) -> int:
    """Four times a model's weights (``high`` where they are not known), within
    ``[low, high]`` and at most an eighth of this machine's memory: what a server lets one
    model's caches take."""
    budget = high if weights_bytes is None else max(
        low, min(high, PREFIX_BUDGET_PER_WEIGHT_BYTE * weights_bytes))
    try:
        machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf: no share known
        return budget
    return min(budget, machine // PREFIX_BUDGET_MACHINE_SHARE)


def prefix_cache_for(make_cache: MakeCache, weights_bytes: int | None = None
                     ) -> PrefixCache | None:
    """The prefix cache ``serve`` and the chat keep for a model (``make_cache``: its
    ``make_cache``; ``weights_bytes``: its weights' size), as the settings say
    (``MLXRUNNER_PREFIX_CACHE``, ``MLXRUNNER_PREFIX_CACHE_MIB``, else
    :func:`default_prefix_budget`); None when they turn it off or the model keeps a cache
    kind it cannot rebuild."""
    chosen = settings.current()
    if not chosen.prefix_cache:
        return None
    budget = chosen.prefix_cache_mib << 20 if chosen.prefix_cache_mib is not None \
        else default_prefix_budget(weights_bytes)
    cache = PrefixCache(make_cache, budget_bytes=budget)
    return cache if cache.supported else None
