"""``generate``: one entry point for plain and speculative decoding, one sequence alone
(:func:`mlxrunner.decode.plain.stream_plain`, :func:`mlxrunner.decode.speculative.
speculative_stream`: its own caches, its scalar offset, the shortest step or round).

(The scheduler with one row runs drafts exactly too, but on the H200 the demo pair drafted
alone at 2,216-2,631 tok/s through it against 3,235-3,385 through the solo loop: its
verify shapes vary with the batch's depth policy and its greedy block drafts go through the
shared context.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..cache.prefix import PrefixCache
from ..decode import GenerationResult, GenerationStats, Sampler, SamplerOptions, can_speculate
from ..decode.grammar import Constraint
from ..decode.plain import stream_plain
from ..decode.speculative import speculative_generate
from ..model.interface import Model


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
    sampler = Sampler(options, model.vocab_size)
    if draft is not None and can_speculate(options):
        return speculative_generate(model, draft, prompt, sampler=sampler,
                                    max_tokens=max_tokens, eos_ids=eos_ids, on_token=on_token,
                                    constraint=constraint, prefix_cache=prefix_cache,
                                    **(draft_options or {}))
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

