"""Plain decoding: prefill in chunks, then one token per target forward.

The sampler is the same pipeline the speculative round uses; greedy is its
point-mass case. Each decode step goes through the core's compiled step
(:func:`mlxrunner.decode.step.forward`). The step for token t+1 is queued from the
still-lazy token t before the host reads t, so the device never waits for the host
between steps (unless repetition penalties need the history on the host first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from ..cache.prefix import PrefixCache
from ..media import MediaPrompt, history_key
from ..model.interface import Model
from ..nn import last_logits_only
from .grammar import Constraint, allowed_rows
from .sampler import Sampler, penalties_active
from .step import eager_forward, forward

PREFILL_CHUNK = 512


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    target_forwards: int = 0
    #: prompt tokens a prefix cache held (not prefilled again)
    cached_tokens: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens prefilled (those not cached) per second."""
        read = self.prompt_tokens - self.cached_tokens
        return read / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": "plain",
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "prefill_tokens_per_second": round(self.prefill_tokens_per_second, 2),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    stats: Any
    logprobs: list[dict[str, Any]] = field(default_factory=list)


def prefill(model: Model, prompt: Sequence[int], cache: list, *, taps: Sequence[int] | None = None,
            on_taps: Callable[[mx.array], Sequence[mx.array]] | None = None,
            chunk: int = PREFILL_CHUNK, start: int = 0,
            on_chunk: Callable[[int], None] | None = None) -> tuple[mx.array, mx.array | None]:
    """Run the prompt tokens from ``start`` on (the caches already hold ``prompt[:start]``)
    through the model in chunks; return the last row's logits and, with ``taps``, the tapped
    states of the rows run. ``on_taps(chunk_taps)`` sees each chunk's taps as they come (a
    draft building its context) and returns arrays to evaluate with that chunk;
    ``on_chunk(end)`` is called once each chunk is evaluated, the caches holding
    ``prompt[:end]`` (a prefix cache storing them). A :class:`MediaPrompt`'s chunks that
    hold media slots run with their input embeddings (the encoders' rows placed).

    Chunks end at multiples of ``chunk`` (absolute positions): a prefill resumed at such a
    boundary runs the very chunks, so the very arithmetic, of one from the start."""
    ids = mx.array(list(prompt), dtype=mx.int32)[None]
    tapped_parts = []
    logits = None
    total = ids.shape[1]
    if total == 0:
        raise ValueError("the prompt must hold at least one token")
    if not 0 <= start < total:
        raise ValueError(f"prefill must start inside the prompt (start {start}, {total} tokens)")
    bounds = [start, *range((start // chunk + 1) * chunk, total, chunk), total]
    if isinstance(prompt, MediaPrompt):  # (an item prefilled whole moves a chunk's end)
        bounds = sorted({start, total, *(min(prompt.chunk_end(b), total) for b in bounds)})
    for begin, end in zip(bounds, bounds[1:]):
        chunk_ids = ids[:, begin:end]
        extra: Sequence[mx.array] = ()
        embedded = positions = None
        if isinstance(prompt, MediaPrompt):
            embedded = prompt.embeddings(model, chunk_ids, begin)
            positions = prompt.positions(begin, end)
        with last_logits_only():  # the last row's logits are all a prefill reads
            if taps:
                out, tapped = cast("tuple[mx.array, mx.array]", eager_forward(
                    model, chunk_ids, cache, taps, embedded, positions))
                tapped_parts.append(tapped)
                extra = on_taps(tapped) if on_taps is not None else (tapped,)
            else:
                out = cast(mx.array, eager_forward(model, chunk_ids, cache,
                                                   embeddings=embedded, positions=positions))
        # Only the last chunk's logits are wanted: earlier chunks evaluate the caches alone,
        # so their vocabulary head (the widest matmul) is never computed.
        wanted = []
        if end >= total:
            logits = out[:, -1, :]
            wanted = [logits]
        mx.eval(*wanted, *[c.state for c in cache if c is not None], *extra)
        if on_chunk is not None:
            on_chunk(end)
    assert logits is not None  # the last chunk ends at total
    tapped_all = None
    if tapped_parts and on_taps is None:
        tapped_all = mx.concatenate(tapped_parts, axis=1)
    return logits, tapped_all


def stream_plain(model: Model, prompt: Sequence[int], sampler: Sampler, max_tokens: int,
                 eos_ids: frozenset[int] | set[int] = frozenset(),
                 stats: GenerationStats | None = None,
                 want_logprobs: bool = False, constraint: Constraint | None = None,
                 prefix_cache: PrefixCache | None = None
                 ) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Yield ``(token, logprob_info)`` one at a time; stops after an EOS token or ``max_tokens``,
    or once ``constraint`` (structured output) is complete. Each token is drawn under the
    constraint's mask and commits to it.

    With a ``prefix_cache``, the longest cached prefix of the prompt is not prefilled again,
    and the caches are stored there at each prefill chunk's end and once generation ends
    (the next chat turn starts with this prompt and its reply)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    stats = stats if stats is not None else GenerationStats()
    t0 = time.perf_counter()
    history = list(prompt)
    cache, logits = _start(model, prompt, prefix_cache, stats)
    stats.prompt_tokens = len(prompt)
    stats.target_forwards += 1

    def pick(logits_row: mx.array) -> tuple[mx.array, Any]:
        allowed = None if constraint is None else \
            allowed_rows([constraint.words()], logits_row.shape[-1])
        token = sampler.sample(logits_row, history, allowed)
        info = sampler.logprobs(logits_row.reshape(1, -1), token.reshape(1), allowed) \
            if want_logprobs else None
        return token, info

    token, info = pick(logits)
    mx.async_eval(token)
    # without penalties a step needs no token on the host: queue it from the lazy one (a
    # grammar's next mask needs the token on the host)
    pipelined = not penalties_active(sampler.options) and constraint is None

    def step(ids: mx.array) -> tuple[mx.array, Any]:
        stats.target_forwards += 1
        following = pick(forward(model, ids, cache)[:, -1, :])
        mx.async_eval(following[0])
        return following

    t_decode = time.perf_counter()
    completed = False
    try:
        for n in range(max_tokens):
            more = n + 1 < max_tokens
            following = step(token.reshape(1, 1).astype(mx.int32)) if pipelined and more \
                else None
            value = int(token)
            if n == 0:
                stats.prefill_seconds = time.perf_counter() - t0
                t_decode = time.perf_counter()
            history.append(value)
            if value in eos_ids:
                more = False
            elif constraint is not None:
                constraint.advance(value)
                more = more and not constraint.complete
            if more and following is None:
                following = step(mx.array([[value]], dtype=mx.int32))
            stats.generated_tokens += 1
            yield value, logprob_entry(info)
            if not more:
                break
            assert following is not None  # stepped above when more
            token, info = following
        completed = True
    except GeneratorExit:  # the consumer stopped early: the caches are whole
        completed = True
        raise
    finally:  # also when the consumer stops early
        stats.decode_seconds = max(time.perf_counter() - t_decode, 1e-9)
        if prefix_cache is not None and completed:
            # the caches hold the tokens fed so far (a queued step's included)
            fed = [c.offset for c in cache if c is not None]
            if fed and fed[0] <= len(history):
                prefix_cache.store(history_key(prompt, history[:fed[0]]), cache)


def _start(model: Model, prompt: Sequence[int], prefix_cache: PrefixCache | None,
           stats: GenerationStats) -> tuple[list[Any], mx.array]:
    """The caches after ``prompt`` and its last logits: the longest prefix the prefix cache
    holds is not prefilled again, and the cache keeps each prefill chunk's end and the
    prompt's with its logits."""
    hit = prefix_cache.lookup(prompt) if prefix_cache is not None else None
    cache = hit.caches if hit is not None else model.make_cache()
    stats.cached_tokens = hit.length if hit is not None else 0
    if hit is not None and hit.logits is not None:  # the whole prompt, met before
        return cache, hit.logits

    def keep_chunk(end: int) -> None:
        if prefix_cache is not None and end < len(prompt):  # the end: below, with logits
            prefix_cache.store(prompt[:end], cache)

    logits, _ = prefill(model, prompt, cache, start=stats.cached_tokens,
                        on_chunk=keep_chunk if prefix_cache is not None else None)
    if prefix_cache is not None:
        prefix_cache.store(prompt, cache, logits=logits)
    return cache, logits


def logprob_entry(info: Any) -> dict[str, Any] | None:
    """One token's logprob entry as generation reports it, from the sampler's
    ``(chosen, top ids, top logprobs)`` of one row."""
    if info is None:
        return None
    chosen, top_ids, top_lp = info
    # a grammar's forbidden tokens (-inf) are no alternatives
    return {"logprob": float(chosen[0].item()),
            "top_logprobs": [(int(i), float(v)) for i, v in
                             zip(top_ids[0].tolist(), top_lp[0].tolist()) if v > -math.inf]}
