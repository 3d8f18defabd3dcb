"""The one sampler pipeline for plain and speculative decoding.

Order (speculative.md, "Sampler"): (0) a grammar's mask (structured output): tokens it
does not allow get -inf logits, so every later stage sees the constrained distribution;
(1) penalties on the raw logits over the last
``repeat_last_n`` tokens of the history; (2) temperature <= 0: a point mass on
the argmax; (3) top_k (0 < k < V): keep the k best, as a sparse distribution;
(4) softmax(x / T) in float32; (5) top_p: keep, in descending order, while the
mass before a token is < p; (6) min_p: drop probabilities < max * min_p;
(7) renormalise; (8) a categorical draw.

Draws are reproducible for a seed: draw number c uses its own key, a hash of
(seed, c), with MLX's threefry generator, so the stream depends only on how many
draws came before, not on how they were batched.

Nothing here syncs with the host: the speculative round builds the target
distributions, residuals and bonus draw lazily and evaluates them once.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..model.distribution import Distribution
from .options import OPTION_HELP, SamplerOptionError, SamplerOptions  # noqa: F401
from .topk import topk_indices

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    """splitmix64's output mix of a 64-bit integer (a bijection)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _normalise_rows(probs: mx.array) -> mx.array:
    return probs / mx.sum(probs, axis=-1, keepdims=True)


class Sampler:
    """The sampler pipeline for one generation: options, vocabulary size and a draw counter."""

    def __init__(self, options: SamplerOptions, vocab_size: int) -> None:
        self.options = options
        self.vocab_size = vocab_size
        seed = options.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._seed_hash = _splitmix64(seed & _MASK64)
        self.draws = 0  # keys consumed so far

    @property
    def greedy(self) -> bool:
        return self.options.temperature <= 0

    # ---- keys and uniforms -------------------------------------------------

    def _keys(self, n: int) -> mx.array:
        """The next n keys of the counter-based stream, [n, 2] uint32.

        Key c is splitmix64(seed_hash + c * golden): computed on the host from
        Python ints (no device sync), distinct per (seed, c) with no structured
        overlap between seeds; MLX's threefry then turns each key into a draw.
        """
        first = self.draws
        self.draws += n
        words = []
        for c in range(first, first + n):
            key = _splitmix64((self._seed_hash + c * _GOLDEN) & _MASK64)
            words.append((key >> 32, key & 0xFFFFFFFF))
        return mx.array(words, dtype=mx.uint32)

    def skip(self, n: int) -> None:
        """Consume n keys without drawing (a path that needs no randomness stays aligned
        with the stream of the general one)."""
        self.draws += n

    def uniform(self, n: int) -> mx.array:
        """[n] float32 in [0, 1), one key each from the same stream as the draws."""
        if n == 0:
            return mx.zeros((0,), dtype=mx.float32)
        keys = self._keys(n)
        return mx.vmap(lambda key: mx.random.uniform(shape=(), key=key))(keys)

    # ---- the pipeline ------------------------------------------------------

    def _penalised(self, logits: mx.array,
                   histories: Sequence[Sequence[int] | mx.array]) -> mx.array:
        o = self.options
        if o.repeat_last_n == 0 or (
            o.repeat_penalty == 1.0 and o.presence_penalty == 0.0 and o.frequency_penalty == 0.0
        ):
            return logits
        if any(isinstance(history, mx.array) for history in histories):
            return self._penalised_on_device(logits, histories)
        rows = []
        for history in histories:
            recent = history if o.repeat_last_n < 0 else history[-o.repeat_last_n :]
            rows.append(Counter(t for t in map(int, recent) if 0 <= t < self.vocab_size))
        width = max((len(c) for c in rows), default=0)
        if width == 0:
            return logits
        ids, counts = [], []
        for counter in rows:
            row_ids = list(counter)
            row_counts = [float(counter[t]) for t in row_ids]
            # Pad with the row's first id (or id 0 for an empty row, whose value
            # is written back unchanged).
            filler = row_ids[0] if row_ids else 0
            row_ids += [filler] * (width - len(row_ids))
            row_counts += [0.0] * (width - len(row_counts))
            ids.append(row_ids)
            counts.append(row_counts)
        logits = logits.astype(mx.float32)
        ids_arr = mx.array(ids, dtype=mx.int32)
        counts_arr = mx.array(counts, dtype=mx.float32)
        seen = mx.take_along_axis(logits, ids_arr, axis=-1)
        present = counts_arr > 0
        changed = seen
        if o.repeat_penalty != 1.0:
            rp = o.repeat_penalty
            changed = mx.where(changed < 0, changed * rp, changed / rp)
        changed = changed - o.presence_penalty - o.frequency_penalty * counts_arr
        changed = mx.where(present, changed, seen)
        # Padding entries share the row's first id; the scatter order of duplicate
        # ids is not defined, so they carry that entry's value too.
        return mx.put_along_axis(logits, ids_arr, _padding_copies(changed, present), axis=-1)

    def _penalised_on_device(self, logits: mx.array, histories: Sequence[Any]) -> mx.array:
        """Penalties from histories that are (partly) device arrays, e.g. drafts not
        yet seen by the host: counts by a scatter-add over [R, V], no host sync."""
        o = self.options
        recent = []
        for history in histories:
            if not isinstance(history, mx.array):
                history = mx.array(list(history), dtype=mx.int32)
            history = history.reshape(-1).astype(mx.int32)
            if o.repeat_last_n > 0:
                history = history[-o.repeat_last_n :]
            recent.append(history)
        width = max(h.shape[0] for h in recent)
        if width == 0:
            return logits
        padded = mx.stack([
            mx.concatenate([h, mx.full((width - h.shape[0],), -1, dtype=mx.int32)])
            for h in recent
        ])
        valid = (padded >= 0) & (padded < self.vocab_size)
        rows = mx.arange(len(recent), dtype=mx.int32)[:, None]
        counts = mx.zeros((len(recent), self.vocab_size), dtype=mx.float32)
        counts = counts.at[rows, mx.where(valid, padded, 0)].add(valid.astype(mx.float32))
        x = logits.astype(mx.float32)
        changed = x
        if o.repeat_penalty != 1.0:
            rp = o.repeat_penalty
            changed = mx.where(x < 0, x * rp, x / rp)
        changed = changed - o.presence_penalty - o.frequency_penalty * counts
        return mx.where(counts > 0, changed, x)

    def distributions(
        self, logits: mx.array, histories: Sequence[Sequence[int] | mx.array],
        allowed: mx.array | None = None,
    ) -> Distribution:
        """Steps 0-7 for each row: [R, V] raw logits -> R distributions.

        ``allowed`` [R, V] bool (a grammar's mask per row,
        :func:`mlxrunner.decode.grammar.allowed_rows`) sets the other tokens' logits to -inf
        first; each row must allow at least one token.

        Row r is penalised with ``histories[r]`` (the committed tokens plus any
        in-flight drafts): a sequence of Python ints, or a 1-D int array for
        tokens still on the device. Nothing is committed. Greedy gives a point
        mass on the argmax (sparse, K = 1). Lazy: no host sync.
        """
        if logits.ndim == 1:
            logits = logits[None]
        if len(histories) != logits.shape[0]:
            raise ValueError(
                f"distributions: {logits.shape[0]} rows of logits but {len(histories)} histories"
            )
        o = self.options
        logits = masked(logits, allowed)
        # Without penalties the logits stay in their dtype (order is exact in any
        # float type); only the k kept values are converted to float32.
        x = self._penalised(logits, histories)
        rows, vocab = x.shape
        ids: mx.array | None
        if self.greedy:
            ids = topk_indices(x, 1)
            return Distribution(mx.ones((rows, 1), dtype=mx.float32), ids)
        ids = None
        if 0 < o.top_k < vocab:
            ids = topk_indices(x, o.top_k)
        elif o.top_p < 1.0:
            ids = topk_indices(x, vocab)  # top_p needs the descending order
        if ids is not None:
            x = mx.take_along_axis(x, ids, axis=-1)
        x = x.astype(mx.float32)
        probs = mx.softmax(x / o.temperature, axis=-1, precise=True)
        if o.top_p < 1.0:
            # sparse and sorted here: keep while the mass before a token is < p
            before = mx.cumsum(probs, axis=-1) - probs
            keep = before < o.top_p
            keep = mx.concatenate([mx.ones((rows, 1), dtype=mx.bool_), keep[:, 1:]], axis=-1)
            probs = mx.where(keep, probs, 0.0)
        if o.min_p > 0.0:
            top = mx.max(probs, axis=-1, keepdims=True)
            probs = mx.where(probs < top * o.min_p, 0.0, probs)
        return Distribution(_normalise_rows(probs), ids)

    def draw(self, dist: Distribution) -> mx.array:
        """One token per row, [R] int32; each row consumes one key of the stream."""
        rows = dist.rows
        if dist.ids is not None and dist.ids.shape[-1] == 1:
            self._keys(rows)  # a point mass still consumes its key: streams stay aligned
            return dist.ids[:, 0]
        u = self.uniform(rows)
        cdf = mx.cumsum(dist.probs, axis=-1)
        total = cdf[:, -1:]
        below = mx.sum(cdf <= u[:, None] * total, axis=-1)
        # Rounding can push u * total up to total: clamp to the last entry with mass.
        last_with_mass = mx.sum(cdf < total, axis=-1)
        index = mx.minimum(below, last_with_mass).astype(mx.int32)
        if dist.ids is None:
            return index
        return mx.take_along_axis(dist.ids, index[:, None], axis=-1)[:, 0]

    def residual(self, p: Distribution, q: Distribution) -> Distribution:
        """Row-wise ``normalise(max(p - q, 0))`` for any mix of sparse and dense.

        Sparse p keeps p's ids; dense p gives a dense result. A row where p <= q
        everywhere (p == q) has no residual mass and returns p's row (rejection
        then had probability 0).
        """
        if p.ids is None:
            if q.ids is None:
                q_at_p = q.probs
            else:
                q_at_p = q.dense(p.probs.shape[-1])
        elif q.ids is None:
            q_at_p = mx.take_along_axis(q.probs, p.ids, axis=-1)
        elif p.ids.shape[-1] * q.ids.shape[-1] <= 1 << 16:
            same = p.ids[:, :, None] == q.ids[:, None, :]
            q_at_p = mx.sum(mx.where(same, q.probs[:, None, :], 0.0), axis=-1)
        else:
            q_at_p = mx.take_along_axis(q.dense(self.vocab_size), p.ids, axis=-1)
        left = mx.maximum(p.probs - q_at_p, 0.0)
        total = mx.sum(left, axis=-1, keepdims=True)
        probs = mx.where(total > 0, left / mx.where(total > 0, total, 1.0), p.probs)
        return Distribution(probs, p.ids)

    def sample(self, logits: mx.array, history: Sequence[int],
               allowed: mx.array | None = None) -> mx.array:
        """Plain decoding: logits [V] or [1, V] -> a scalar int32 token (lazy); ``allowed``
        [1, V] or [V] is a grammar's mask."""
        if allowed is not None:
            allowed = allowed.reshape(1, -1)
        # reshape, not [0]: an integer index is a gather in MLX, a kernel of its own
        return self.draw(self.distributions(logits.reshape(1, -1), [history], allowed)).reshape(())

    def logprobs(
        self, raw_logits: mx.array, tokens: mx.array, allowed: mx.array | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Log-softmax of the raw logits (no penalties, no temperature), after a grammar's
        mask ``allowed`` when there is one (the tokens it forbids have logprob -inf).

        Returns the chosen tokens' logprobs [R], the top ``top_logprobs`` ids [R, n]
        (in ``topk_indices`` order) and their logprobs [R, n].
        """
        if raw_logits.ndim == 1:
            raw_logits = raw_logits[None]
        if allowed is not None:
            allowed = allowed.reshape(raw_logits.shape)
        x = masked(raw_logits, allowed).astype(mx.float32)
        logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        n = min(self.options.top_logprobs, x.shape[-1])
        if n == 0:
            empty_ids = mx.zeros((x.shape[0], 0), dtype=mx.int32)
            return chosen, empty_ids, mx.zeros((x.shape[0], 0), dtype=mx.float32)
        top_ids = topk_indices(x, n)
        return chosen, top_ids, mx.take_along_axis(logp, top_ids, axis=-1)


def masked(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """``logits`` with -inf where ``allowed`` is False (unchanged without a mask)."""
    if allowed is None:
        return logits
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def _padding_copies(changed: mx.array, present: mx.array) -> mx.array:
    """Padding entries (count 0) take the value of the row's first entry, which shares
    their id; a row with no history at all has entry 0 unchanged (not present)."""
    return mx.where(present, changed, changed[:, :1])


def penalties_active(options: SamplerOptions) -> bool:
    """Whether p depends on the history (then drafts must reach the host before p)."""
    return options.repeat_last_n != 0 and (
        options.repeat_penalty != 1.0 or options.presence_penalty != 0.0
        or options.frequency_penalty != 0.0)
