"""``generate``: one sequence, plain or speculative, decoded by the
:class:`~.scheduler.Scheduler` with one row (its own caches: :class:`mlxrunner.cache.
SoloCaches`), so that decoding is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from ..cache.prefix import PrefixCache
from ..decode import (
    GenerationResult,
    GenerationStats,
    SamplerOptions,
    SpeculativeStats,
    can_speculate,
)
from ..decode.grammar import Constraint
from ..decode.speculative import draft_name
from ..errors import PromptError
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
    What fails (the grammar, the token callback) is raised here.
    """
    options = options or SamplerOptions()
    if not prompt:
        raise PromptError("the prompt must hold at least one token")
    if max_tokens <= 0:  # nothing to decode (a draft's stats say so)
        stats = GenerationStats(prompt_tokens=len(prompt)) \
            if draft is None or not can_speculate(options) else \
            SpeculativeStats(draft=draft_name(draft), prompt_tokens=len(prompt))
        return GenerationResult(tokens=[], finish_reason="length", stats=stats)
    unknown = set(draft_options or {}) - {"depth"}
    if unknown:
        raise TypeError(f"unknown draft option {sorted(unknown)[0]!r} (takes: depth)")
    if not can_speculate(options):
        draft = None  # logprobs: plain decoding's own
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
        frozenset(eos_ids), callback, draft=draft, depth=(draft_options or {}).get("depth"),
        constraint=constraint, prefix_cache=prefix_cache, strict_draft=True))
    scheduler.run_until_idle()
    if raised or request.error is not None:
        raise raised[0] if raised else cast(Exception, request.error)
    return request.result()
