"""``generate``: one entry point for plain and speculative decoding.

Plain decoding runs its own loop (:func:`mlxrunner.decode.plain.stream_plain`: one
sequence's caches, its scalar offset, the shortest step); a draft's rounds run in the
:class:`~.scheduler.Scheduler` with one row, the one place speculative rounds are written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from ..cache.prefix import PrefixCache
from ..decode import (
    GenerationResult,
    GenerationStats,
    Sampler,
    SamplerOptions,
    SpeculativeStats,
    can_speculate,
)
from ..decode.grammar import Constraint
from ..decode.plain import stream_plain
from ..decode.speculative import draft_name
from ..media import MediaPrompt
from ..model.interface import Model
from .scheduler import BatchRequest, Scheduler


def generate(model: Model, prompt: Sequence[int], *, options: SamplerOptions | None = None,
             max_tokens: int = 256, eos_ids: frozenset[int] | set[int] = frozenset(),
             on_token: Callable[[int], bool | None] | None = None, draft: Any = None,
             draft_options: dict[str, Any] | None = None,
             constraint: Constraint | None = None,
             prefix_cache: PrefixCache | None = None) -> GenerationResult:
    """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids).

    ``on_token`` sees each token as it is decided; returning True ends generation after
    that token (finish reason "stop": e.g. a stop string has appeared), with the tokens,
    logprobs and stats so far. With a ``draft`` (and no logprobs requested) generation is
    speculative: its output equals what plain decoding would give (greedy: its very
    tokens), its stats (:class:`mlxrunner.decode.SpeculativeStats`) say how it went, and
    ``draft_options`` may fix the drafts per round (``{"depth": n}``). A ``constraint``
    (structured output, :meth:`mlxrunner.decode.grammar.Grammar.constraint`; one per
    generation) masks every token, the draft's proposals included, and generation ends once
    it is complete. A ``prefix_cache`` (:class:`mlxrunner.cache.PrefixCache` of this model)
    skips the prefill of the prompt's longest cached prefix and keeps this generation's
    state for the next (``stats.cached_tokens`` says how many prompt tokens it held).
    """
    options = options or SamplerOptions()
    if draft is not None and can_speculate(options):
        unknown = set(draft_options or {}) - {"depth"}
        if unknown:
            raise TypeError(f"unknown draft option {sorted(unknown)[0]!r} (takes: depth)")
        if max_tokens <= 0:  # nothing to draft: its stats say so
            return GenerationResult(tokens=[], finish_reason="length",
                                    stats=SpeculativeStats(draft=draft_name(draft),
                                                           prompt_tokens=len(prompt)))
        return _drafted(model, prompt, options, max_tokens, eos_ids, on_token, draft,
                        (draft_options or {}).get("depth"), constraint, prefix_cache)
    sampler = Sampler(options, model.vocab_size)
    want_logprobs = bool(options.logprobs or options.top_logprobs)
    tokens: list[int] = []
    logprobs: list[dict[str, Any]] = []
    stats = GenerationStats()
    stopped = False
    for token, info in stream_plain(model, prompt, sampler, max_tokens, eos_ids, stats,
                                    want_logprobs, constraint, prefix_cache):
        tokens.append(token)
        if info is not None:
            logprobs.append(info)
        if on_token is not None and on_token(token):
            stopped = True
            break
    finish = "stop" if stopped or (tokens and tokens[-1] in eos_ids) or (
        constraint is not None and constraint.complete) else "length"
    return GenerationResult(tokens=tokens, finish_reason=finish, stats=stats, logprobs=logprobs)


def _drafted(model: Model, prompt: Sequence[int], options: SamplerOptions, max_tokens: int,
             eos_ids: frozenset[int] | set[int], on_token: Callable[[int], bool | None] | None,
             draft: Any, depth: int | None, constraint: Constraint | None,
             prefix_cache: PrefixCache | None) -> GenerationResult:
    """A drafted generation: the scheduler with one row. What fails is raised here, as
    plain decoding raises it (the batch ends a failing row alone and goes on)."""
    raised: list[Exception] = []

    def callback(token: int, _: Any) -> bool | None:
        try:
            return on_token(token) if on_token is not None else None
        except Exception as exc:
            raised.append(exc)
            return True

    scheduler = Scheduler(model, max_sequences=1)
    request = scheduler.submit(BatchRequest(
        prompt if isinstance(prompt, MediaPrompt) else list(prompt), options, max_tokens,
        frozenset(eos_ids), callback, draft=draft, depth=depth, constraint=constraint,
        prefix_cache=prefix_cache, strict_draft=True))
    scheduler.run_until_idle()
    if raised or request.error is not None:
        raise raised[0] if raised else cast(Exception, request.error)
    return request.result()
