"""What every generation shares: the chunked prefill, the statistics and the result (the
steps themselves are :class:`mlxrunner.batch.Scheduler`'s)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from ..errors import PromptError
from ..media import MediaPrompt
from ..model.interface import Model
from ..nn import caches_only, last_logits_only
from .step import eager_forward

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
        raise PromptError("the prompt must hold at least one token")
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
        # the last row's logits are all a prefill reads, and only the last chunk's
        with last_logits_only() if end >= total else caches_only():
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
