"""Continuous batching: many sequences decoded together, joining and leaving between steps.

A :class:`Scheduler` holds the requests waiting (FIFO), the ones whose prompts are being
prefilled, and the running set, whose rows share one batch of caches
(:class:`mlxrunner.cache.BatchCaches`). Each :meth:`Scheduler.step`:

1. drops cancelled requests; admits waiting ones while the running set and the memory
   budget allow (first come, first served: a request that does not fit blocks the ones
   behind it, so none is starved);
2. prefills up to one chunk's tokens of the admitted prompts, one chunk each, those with the
   fewest chunks so far first (batch 1 each, through the same prefill as
   :func:`mlxrunner.generate`, at the same chunk boundaries): short prompts start together, a
   long prompt takes several steps while the running streams go on and a short prompt sent
   after it starts within a step; a finished prompt samples its first token and its caches
   are copied into a free row;
3. runs one batched forward over every running row (one token each, through the core's
   compiled step) and samples each row with its own sampler, stop ids and token budget.

Each sequence has its own :class:`mlxrunner.decode.Sampler` (its counter-based keys make a
row's draws those it would make alone), so a sequence's output is what
:func:`mlxrunner.generate` gives it alone, greedy or seeded.

A sequence with a draft decodes speculatively inside the batch: while one runs, each step is
a round (:meth:`Scheduler._round`) whose one batched target forward verifies every drafted
row's block, each row accepting and rolling back on its own (docs/batching.md). The greedy
sequences of one block draft share its context (:class:`mlxrunner.model.block_draft.
BlockDraftBatch`): their blocks are one draft forward, their acceptance one comparison, their
commits one more forward, whatever the number of rows.

The synchronous API (:meth:`Scheduler.submit`, :meth:`Scheduler.step`,
:meth:`Scheduler.run_until_idle`) is meant to be driven by one worker thread; ``submit``
and :meth:`BatchRequest.cancel` may be called from others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from .. import settings
from ..cache import BatchCaches, Cache, SoloCaches, scaled_budget
from ..cache.prefix import PrefixHit
from ..decode import (
    PREFILL_CHUNK,
    DepthController,
    GenerationResult,
    GenerationStats,
    Sampler,
    SamplerOptions,
    allowed_rows,
    can_speculate,
    forward,
    logprob_entry,
    penalties_active,
    prefill,
    topk_indices,
)
from ..decode.speculative import (
    GrammarPause,
    RowProposal,
    SpeculativeStats,
    TapRows,
    decide_row,
    draft_name,
    propose_row,
    read_row,
)
from ..errors import PromptError
from ..media import MediaPrompt, history_key
from ..model.block_draft import BlockDraft, BlockDraftBatch, BlockDraftSession
from ..model.draft import DraftSession
from ..model.interface import Model

log = logging.getLogger("mlxrunner.batch")

#: a drafted batch's depth controller tries one depth deeper than its best every this many
#: steps, or where one sequence runs, every SOLO_PROBE_EVERY
BATCH_PROBE_EVERY = 64
SOLO_PROBE_EVERY = 16
#: what a per-token callback gets: the token and its logprob entry (None unless asked for);
#: returning True ends the sequence after that token (finish reason "stop")
TokenCallback = Callable[[int, "dict[str, Any] | None"], "bool | None"]


#: steps a prompt being prefilled may be passed over (for prompts with fewer chunks) before
#: it goes first
PREFILL_PATIENCE = 2


@dataclass(eq=False)
class BatchRequest:
    """One sequence to generate: its prompt (token ids), sampler options, token budget,
    stop ids and callback; the scheduler fills in the result fields."""

    prompt: Sequence[int]
    options: SamplerOptions = field(default_factory=SamplerOptions)
    max_tokens: int = 256
    eos_ids: frozenset[int] = frozenset()
    on_token: TokenCallback | None = None
    #: a draft model (mlxrunner.plugin.DraftModel): the sequence decodes speculatively, its
    #: blocks verified in the batch's forwards (no logprobs with a draft)
    draft: Any = None
    #: drafts per round, fixed (clipped to the draft's ``max_depth`` and to the budget);
    #: None: chosen as docs/batching.md says
    depth: int | None = None
    #: a draft that raises ends the sequence with its error ("error", :attr:`error`), as
    #: ``generate`` raises it, rather than the sequence decoding on without the draft; the
    #: caller raises what ends the sequence, so it is not logged
    strict_draft: bool = False
    #: structured output (:class:`mlxrunner.decode.grammar.Constraint`, one per request):
    #: every token is drawn under its mask, and the sequence ends once it is complete
    constraint: Any = None
    #: a :class:`mlxrunner.cache.PrefixCache` of this model: the prompt's longest cached
    #: prefix is not prefilled again, and the prompt's chunks are stored as generate does
    prefix_cache: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    #: None while running, then "stop" (a stop id or the callback), "length", "cancel" or
    #: "error" (this request's own structured output failed: :attr:`error`; the other rows
    #: went on)
    finish_reason: str | None = None
    error: Exception | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: bool = False

    def cancel(self) -> None:
        """Ask the scheduler to drop this sequence before its next step (any thread)."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        if self.finish_reason is None:
            raise ValueError("the request has not finished")
        return GenerationResult(tokens=list(self.tokens), finish_reason=self.finish_reason,
                                stats=self.stats, logprobs=list(self.logprobs))


class _Sequence:
    """A request's decoding state inside the scheduler."""

    def __init__(self, request: BatchRequest, model: Model, admitted: float) -> None:
        self.request = request
        self.sampler = Sampler(request.options, model.vocab_size)
        self.history = list(request.prompt)
        self.want_logprobs = bool(request.options.logprobs or request.options.top_logprobs)
        # the row argmax alone decides: one reduction over such rows together
        self.penalised = penalties_active(request.options)
        self.constraint = request.constraint
        # its next step needs this one's token on the host (a penalty's history, a mask)
        self.needs_host = self.penalised or self.constraint is not None
        self.plain_greedy = self.sampler.greedy and not self.needs_host
        #: its draws do not depend on the depths its rounds draft (greedy, or sampled without
        #: a seed): the batch may choose them from measured rounds' times, as alone
        self.timed = self.sampler.greedy or request.options.seed is None
        self.prefilled = 0
        #: prompt chunks prefilled so far (those with fewer go first), and steps since its last
        self.chunks = 0
        self.waited = 0
        #: the whole prompt's logits, where the prefix cache held all of it
        self.cached_logits: mx.array | None = None
        draft = request.draft
        self.taps: tuple[int, ...] = () if draft is None else tuple(draft.taps)
        self.caches: list[Cache | None] | None = None
        #: a drafted sequence's tapped states of every position its caches hold, stored with
        #: them in the prefix cache
        self.kept: TapRows | None = None
        hit = self._look_up(model)
        #: drafting paused after the grammar cut proposals to nothing (as alone)
        self.pause = GrammarPause()
        #: a seeded sampled sequence's own depth where its draft adapts it: from its
        #: acceptance alone (the fixed cost model), so that its draws are those of its solo run
        self.depths: DepthController | None = None
        self.session: DraftSession | None = None
        #: a greedy sequence of a block draft: it drafts through the batch's shared context
        #: of that draft (its session's context is handed over when it joins)
        self.shared = isinstance(draft, BlockDraft) and self.plain_greedy
        #: the target's tapped states of the tokens decoded while drafting paused, which
        #: the draft's session takes in one commit when drafting resumes (not shared ones:
        #: their shared context takes each step's)
        self.unsent_taps: list[mx.array] = []
        if draft is not None:
            self._start_draft(draft, hit)
        self.row = -1
        self.admitted = admitted
        self.decode_start = 0.0
        #: when its last token was handed out (a paused drafted step's time runs from it)
        self.delivered_at = 0.0
        #: this sequence's own failure (its grammar), which ends it at its next token
        self.error: Exception | None = None

    def _look_up(self, model: Model) -> PrefixHit | None:
        """Fresh caches, or those of the prompt's longest prefix the prefix cache holds (a
        drafted sequence's hit with the tapped states its draft is rebuilt from)."""
        request = self.request
        if request.prefix_cache is None:
            self.caches = model.make_cache()
            return None
        drafted = request.draft is not None
        hit = request.prefix_cache.lookup(request.prompt, self.taps if drafted else None)
        self.caches, self.prefilled = hit.caches, hit.length
        self.cached_logits = hit.logits
        request.stats.cached_tokens = hit.length
        self.kept = TapRows(self.taps) if drafted else None
        return hit

    def _start_draft(self, draft: Any, hit: PrefixHit | None) -> None:
        """The draft's session over the prompt (a prefix hit's part from its kept taps)."""
        stats = self.request.stats
        if not isinstance(stats, SpeculativeStats):
            self.request.stats = SpeculativeStats(
                draft=draft_name(draft), prompt_tokens=stats.prompt_tokens,
                cached_tokens=stats.cached_tokens)
        if draft.adaptive_depth and self.request.depth is None and (
                not self.timed or settings.current().lockstep):
            # its own depth from acceptance alone: seeded draws, or a distributed rank,
            # whose choices must not rest on its own timings
            self.depths = DepthController(draft.max_depth, measured=False)
        try:
            session = draft.new_session(self.sampler)
            session.bind_target_caches(self.caches)  # its own, whatever make_cache made since
            session.extend_tokens(self.history)
            if hit is not None and hit.length:
                assert hit.tapped is not None  # asked for
                session.prefill(hit.tapped)
                mx.eval(*session.state)
                self.keep_taps(hit.tapped, own=True)
        except Exception as exc:  # it decodes without its draft
            self.without_draft(exc)
            return
        self.session = session

    def without_draft(self, exc: Exception) -> None:
        """The draft failed: the sequence decodes on without it (plain decoding's output,
        which a draft only speeds up), or with a strict draft ends with its error."""
        if self.request.strict_draft:
            self.error = self.error or exc
        else:
            log.warning("mlxrunner: a draft failed (%s: %s); its sequence goes on without it",
                        type(exc).__name__, exc)
        self.session, self.shared, self.taps = None, False, ()
        self.kept, self.depths, self.unsent_taps = None, None, []

    @property
    def prompt(self) -> Sequence[int]:
        return self.request.prompt

    def keep_taps(self, tapped: mx.array, *, own: bool = False) -> None:
        """Keep the draft's tapped states of positions the caches now hold (where the
        prefix cache keeps them)."""
        if self.kept is not None:
            self.kept.add(tapped, own=own)

    def tapped(self, length: int) -> tuple[tuple[int, ...], mx.array] | None:
        """What the prefix cache keeps with ``length`` positions (None: no taps)."""
        return None if self.kept is None else self.kept.first(length)

    def allowed(self, vocab_size: int) -> mx.array | None:
        """The constraint's mask of the next token ([1, V]), or None."""
        if self.constraint is None or self.error is not None:
            return None
        try:
            words = self.constraint.words()
        except Exception as exc:  # this request's own failure: the batch goes on
            self.error = exc
            return None  # (this row's token is drawn unmasked and dropped: see _deliver)
        return allowed_rows([words], vocab_size)


@dataclass
class _Step:
    """A queued batched step: (row, sequence, index in ``tokens``) per row it sampled, the
    tokens (lazy) and, by index in ``tokens``, the logprob arrays of the rows that asked for
    them."""

    rows: list[tuple[int, _Sequence, int]]
    tokens: mx.array
    infos: dict[int, tuple[mx.array, mx.array, mx.array]]
    #: a drafted row's tapped states of its input token ([1, 1, ...], its draft's taps),
    #: where drafting paused for the step (sequences without a shared context)
    taps: dict[int, mx.array] = field(default_factory=dict)
    #: the step's tapped states of every row ([B, 1, ...], the layers ``tap_layers``) and,
    #: by index in ``tokens``, the row each token's input was in (for shared contexts)
    tapped: mx.array | None = None
    tap_layers: list[int] = field(default_factory=list)
    launch_rows: list[int] = field(default_factory=list)


def verify_width(tokens: int, longest: int | None = None) -> int:
    """The width of a round's verify forward for blocks of up to ``tokens`` tokens: the next
    power of two, or ``longest`` (a sliding window) if less (rows pad past their block, as
    shorter rows always do). A server's rounds then trace 1, 2, 4, 8 and 16 tokens, not
    every depth a controller picks (each width is a trace of its own at each row count and
    buffer size, and on CUDA graphs of its own)."""
    width = 1 << max(0, tokens - 1).bit_length()
    return width if longest is None else max(tokens, min(width, longest))


class _RoundPlan:
    """One speculative round's rows: their depths and inputs, then their proposals, the
    verified block's drafts, the drafts' taps and the logprob arrays of rows without one."""

    def __init__(self, running: list[tuple[int, _Sequence]], depth: dict[int, int],
                 rows: int, longest: int | None, pads: bool) -> None:
        self.running, self.depth, self.rows = running, depth, rows
        tokens = 1 + max(depth.values())
        self.length = verify_width(tokens, longest) if pads else tokens
        self.last = [0] * rows
        for row, seq in running:
            self.last[row] = seq.history[-1]
        #: the greedy rows of each block draft's shared context, by draft (id)
        self.groups: dict[int, list[int]] = {}
        for row, seq in running:
            if seq.shared:
                self.groups.setdefault(id(seq.request.draft), []).append(row)
        self.proposals: dict[int, RowProposal] = {}
        self.body = mx.zeros((rows, 0), dtype=mx.int32)
        self.taps: list[int] = []
        self.tapped: mx.array | None = None
        self.infos: dict[int, tuple[mx.array, mx.array, mx.array]] = {}


def _check(request: BatchRequest, vocab_size: int) -> None:
    if not request.prompt:
        raise PromptError("the prompt must hold at least one token")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if request.draft is not None and not can_speculate(request.options):
        raise ValueError("logprob requests decode without a draft: pass draft=None")
    if request.depth is not None and request.depth < 0:
        raise ValueError(f"depth must be at least 0, got {request.depth}")
    bad = [t for t in request.prompt if not 0 <= int(t) < vocab_size]
    if bad:
        raise PromptError(f"prompt token {bad[0]} is outside the vocabulary "
                          f"(0..{vocab_size - 1}): is the tokenizer this model's?")


#: the batch's caches a server lets a model take by default (see batch_budget)
BATCH_BUDGET_MIN = 512 << 20
BATCH_BUDGET_MAX = 4096 << 20


def batch_budget(weights_bytes: int | None) -> int:
    """Bytes of batch caches ``serve`` gives a model of ``weights_bytes`` (None: not known):
    ``MLXRUNNER_BATCH_MIB``, else four times its weights, at least 512 MiB, at most 4 GiB and
    an eighth of this machine's memory. Requests past it wait for rows to end."""
    chosen = settings.current().batch_mib
    if chosen is not None:
        return chosen << 20
    return scaled_budget(weights_bytes, BATCH_BUDGET_MIN, BATCH_BUDGET_MAX)


class Scheduler:
    """Continuous batching over one model (see the module).

    ``max_sequences`` bounds the sequences admitted at once (prefilling or running);
    ``memory_budget`` (bytes, None: no bound; see :func:`batch_budget`) bounds what their
    caches take at their longest (prompt + max_tokens each, every row as long as the
    longest, as the batch's buffers are, rows and lengths as the batch allocates them);
    ``prefill_chunk`` is how many prompt tokens one step prefills (the same as
    :func:`mlxrunner.generate`'s chunks by default, which keeps each sequence's output
    exactly its solo output). With ``max_sequences`` 1 the row is the sequence's own caches
    (:class:`mlxrunner.cache.SoloCaches`: what ``generate`` with a draft runs on).
    """

    def __init__(self, model: Model, *, max_sequences: int = 32,
                 memory_budget: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be at least 1, got {max_sequences}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.model = model
        self.max_sequences = max_sequences
        self.memory_budget = memory_budget
        self.prefill_chunk = prefill_chunk
        self._waiting: deque[BatchRequest] = deque()
        self._lock = threading.Lock()
        self._prefilling: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # row -> sequence
        self._pending: _Step | None = None  # queued, its tokens not handed out yet
        # one row: the sequence's own caches (its solo forwards; any cache kind)
        self.batch: BatchCaches | SoloCaches = SoloCaches()
        if max_sequences > 1:
            try:
                self.batch = BatchCaches(model.make_cache())
            except TypeError as exc:  # a cache kind with no batched form: one at a time
                log.warning("mlxrunner: %s; this model's sequences decode one at a time", exc)
                self.max_sequences = 1
        self.steps = 0
        #: the drafted rounds' depth while every drafted sequence is greedy (see _round)
        self._depth: DepthController | None = None
        #: rounds run at each depth (a drafted batch's statistics)
        self.round_depths: dict[int, int] = {}
        #: the shared contexts of block drafts' greedy sequences, by draft (id)
        self._contexts: dict[int, BlockDraftBatch] = {}

    # -- the API -------------------------------------------------------------------------
    def submit(self, request: BatchRequest) -> BatchRequest:
        """Queue a request (FIFO); it runs from a later :meth:`step`."""
        _check(request, self.model.vocab_size)
        with self._lock:
            self._waiting.append(request)
        return request

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._running or self._pending)

    @property
    def running(self) -> int:
        """Sequences decoding now (rows in use)."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefilling(self) -> int:
        """Sequences admitted whose prompts are not all prefilled yet."""
        return len(self._prefilling)

    def step(self) -> bool:
        """Admit, prefill up to one chunk's prompt tokens, decode one token per running
        sequence; returns whether work remains."""
        self._drop_cancelled()
        self._admit()
        # prompt chunks, up to one chunk's tokens a step, one chunk a sequence, those that
        # had the fewest chunks first (then the oldest): a short prompt sent after a long one
        # starts within a step, not after all of the long one; one passed over for
        # PREFILL_PATIENCE steps goes first, so a stream of new prompts cannot starve it (a
        # chunk is at most that long, or an item prefilled whole makes it longer: a step's
        # first always runs)
        budget = self.prefill_chunk
        order = sorted(self._prefilling, key=lambda s: (s.waited < PREFILL_PATIENCE, s.chunks))
        for seq in order:
            size = self._chunk_size(seq)
            if size > max(budget, 0) and budget < self.prefill_chunk:
                seq.waited += 1
                continue
            self._prefill_chunk(seq)
            seq.chunks += 1
            seq.waited = 0
            budget -= size
        if self._running or self._pending:
            self._decode_step()
        self.steps += 1
        return not self.idle

    def run_until_idle(self) -> None:
        while self.step():
            pass

    # -- admission -----------------------------------------------------------------------
    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                request = self._waiting[0]
                if request.cancelled:
                    self._waiting.popleft()
                    self._finish_unstarted(request)
                    continue
                if not self._fits(request):
                    return
                self._waiting.popleft()
            self._prefilling.append(_Sequence(request, self.model, time.perf_counter()))

    def _admitted(self) -> list[_Sequence]:
        return [*self._prefilling, *self._running.values()]

    def _fits(self, request: BatchRequest) -> bool:
        admitted = self._admitted()
        if len(admitted) >= self.max_sequences:
            return False
        if self.memory_budget is None or not admitted:
            return True  # one sequence always runs, whatever its size
        if not (self.batch.bytes_per_token() or self.batch.bytes_per_row()):
            return False  # not known before a first sequence has its row
        longest = max(len(s.prompt) + s.request.max_tokens for s in admitted)
        longest = max(longest, len(request.prompt) + request.max_tokens)
        return self.batch.bytes_for(len(admitted) + 1, longest) <= self.memory_budget

    def _drop_cancelled(self) -> None:
        with self._lock:
            dropped = [r for r in self._waiting if r.cancelled]
            for request in dropped:
                self._waiting.remove(request)
                self._finish_unstarted(request)
        for seq in [s for s in self._prefilling if s.request.cancelled]:
            self._prefilling.remove(seq)
            self._finish(seq, "cancel")
        for seq in list(self._running.values()):
            if seq.request.cancelled:
                self._finish(seq, "cancel")

    # -- prefill -------------------------------------------------------------------------
    def _chunk_end(self, seq: _Sequence) -> int:
        """Where ``seq``'s next prompt chunk ends: chunks end at multiples of the chunk, as
        generate's prefill after a prefix hit."""
        start = seq.prefilled
        end = min(len(seq.prompt), (start // self.prefill_chunk + 1) * self.prefill_chunk)
        return seq.prompt.chunk_end(end) if isinstance(seq.prompt, MediaPrompt) else end

    def _chunk_size(self, seq: _Sequence) -> int:
        """The prompt tokens ``seq``'s next chunk computes (none where all were cached)."""
        return 0 if seq.cached_logits is not None else self._chunk_end(seq) - seq.prefilled

    def _prefill_chunk(self, seq: _Sequence) -> None:
        assert seq.caches is not None
        start = seq.prefilled
        end = self._chunk_end(seq)
        cache = seq.request.prefix_cache
        if seq.cached_logits is not None:  # the whole prompt was cached
            logits, end = seq.cached_logits, len(seq.prompt)
        elif seq.session is None:
            # (the prompt up to the chunk's end, from start: a prompt's media keep their places)
            logits, _ = prefill(self.model, seq.prompt[:end], seq.caches, start=start,
                                chunk=end)
        else:
            def to_draft(tapped: mx.array) -> list[mx.array]:
                if seq.session is None:  # it failed on an earlier chunk
                    return []
                try:
                    seq.session.prefill(tapped)
                    seq.keep_taps(tapped, own=True)
                    return list(seq.session.state)
                except Exception as exc:
                    self._drop_draft(seq, exc)
                    return []

            logits, _ = prefill(self.model, seq.prompt[:end], seq.caches, taps=seq.taps,
                                on_taps=to_draft, start=start, chunk=end)
        seq.prefilled = end
        if cache is not None and seq.cached_logits is None:
            cache.store(seq.prompt[:end], seq.caches, seq.tapped(end),
                        logits=logits if end == len(seq.prompt) else None)
        if end < len(seq.prompt):
            return
        self._prefilling.remove(seq)
        stats = seq.request.stats
        stats.prompt_tokens = len(seq.prompt)
        stats.target_forwards += 1
        allowed = seq.allowed(self.model.vocab_size)
        token = seq.sampler.sample(logits, seq.history, allowed)
        info = seq.sampler.logprobs(logits.reshape(1, -1), token.reshape(1), allowed) \
            if seq.want_logprobs else None
        mx.eval(token, *(info or ()))
        stats.prefill_seconds = time.perf_counter() - seq.admitted
        seq.decode_start = time.perf_counter()
        self._drafting(seq, "extend_tokens", [int(token)])
        if self._deliver(seq, int(token), info):
            row = self.batch.add(seq.caches)
            # its caches are the batch's row now (bound per round)
            self._drafting(seq, "bind_target_caches", None)
            for shared in self._contexts.values():  # a row for every row of the batch
                shared.set_rows(self.batch.rows)
            seq.caches = None
            seq.row = row
            self._running[row] = seq
            if seq.shared:
                assert isinstance(seq.session, BlockDraftSession)  # a block draft's session
                try:
                    self._context(seq).add(row, seq.session)
                except Exception as exc:
                    self._drop_draft(seq, exc)

    def _context(self, seq: _Sequence) -> BlockDraftBatch:
        """The shared context of ``seq``'s draft, with a row for every row of the batch."""
        draft = seq.request.draft
        shared = self._contexts.get(id(draft))
        if shared is None:
            shared = self._contexts[id(draft)] = draft.new_batch()
        shared.set_rows(self.batch.rows)
        return shared

    # -- decoding ------------------------------------------------------------------------
    def _decode_step(self) -> None:
        """Queue the next batched step, then hand out the tokens of the step queued before
        (read while the new one runs). A step is queued from the previous one's tokens
        still on the device unless a running row applies penalties (its history must be
        on the host first)."""
        pending, self._pending = self._pending, None
        running = sorted(self._running.items())
        controller = self._depth_controller(running)
        depth = None if controller is None else controller.choose(controller.max_depth)
        drafted = any(seq.session is not None for _, seq in running)
        started = time.perf_counter()
        if drafted and depth != 0:
            if pending is not None:
                self._collect(pending)
            if self._running:
                self._round(depth)
        elif pending is not None and self._running and \
                not any(s.needs_host for s in self._running.values()) and \
                not self._budgets_end(pending):
            self._pending = self._launch(pending)
            self._collect(pending)
        else:
            if pending is not None:
                self._collect(pending)
            if self._running:
                self._pending = self._launch(None)
        if controller is not None and depth == 0:
            # a plain step: drafting paused (its time is what depth 0 costs)
            self.round_depths[0] = self.round_depths.get(0, 0) + 1
            controller.update_rows(0, [], time.perf_counter() - started)
        self._maybe_compact()

    def _carries_all(self, previous: _Step) -> bool:
        """Whether ``previous`` sampled every running row's next input, each at its own row's
        index, over the batch's current rows."""
        return previous.tokens.shape[0] == self.batch.rows \
            and len(previous.rows) == len(self._running) \
            and all(at == row and self._running.get(row) is seq for row, seq, at in previous.rows)

    def _budgets_end(self, pending: _Step) -> bool:
        """Whether ``pending``'s tokens end every running sequence by its token budget (a
        step queued after them would be computed for nothing)."""
        covered = {row for row, seq, _ in pending.rows if self._running.get(row) is seq}
        return all(row in covered and len(seq.request.tokens) + 1 >= seq.request.max_tokens
                   for row, seq in self._running.items())

    def _launch(self, previous: _Step | None) -> _Step | None:
        """One batched forward over the running rows, sampled lazily; a row's input is its
        last token, taken from ``previous`` (still lazy) where that step covered it."""
        if previous is not None and self._carries_all(previous):
            # the steady state: every row's input is its own token of the step before, at
            # its own index (no host arrays, gather or scatter: a step's fewest launches)
            ids = previous.tokens.astype(mx.int32)
        else:
            last = [0] * self.batch.rows
            for row, seq in self._running.items():
                last[row] = seq.history[-1]
            ids = mx.array(last, dtype=mx.int32)
            if previous is not None:
                carried = [(row, at) for row, seq, at in previous.rows
                           if self._running.get(row) is seq]
                if carried:
                    ids[mx.array([r for r, _ in carried], dtype=mx.int32)] = \
                        previous.tokens[mx.array([a for _, a in carried], dtype=mx.int32)]
        taps = sorted({t for seq in self._running.values() for t in seq.taps})
        tapped = None
        if taps:  # drafted rows whose drafting paused: their drafts get these states later
            logits, tapped = forward(self.model, ids[:, None], self.batch.caches, taps)
            logits = logits[:, -1, :]
        else:
            logits = forward(self.model, ids[:, None], self.batch.caches)[:, -1, :]
        greedy = sorted(r for r, s in self._running.items() if s.plain_greedy)
        infos: dict[int, tuple[mx.array, mx.array, mx.array]] = {}
        if greedy and len(greedy) == len(self._running) and not any(
                s.want_logprobs for s in self._running.values()):
            # every row greedy: one argmax over the whole batch (free rows' tokens unused),
            # not a gather and a stack of an op per row; a row's token at its own index
            tokens = topk_indices(logits, 1)[:, 0]
            for seq in self._running.values():
                seq.sampler.skip(1)  # the key a point mass consumes
            order, launch_rows = greedy, list(range(self.batch.rows))
            index = {row: row for row in order}
        else:
            chosen: dict[int, mx.array] = {}
            if greedy:
                picked = topk_indices(logits[mx.array(greedy, dtype=mx.int32)], 1)[:, 0]
                for i, row in enumerate(greedy):
                    self._running[row].sampler.skip(1)
                    chosen[row] = picked[i]
            for row, seq in self._running.items():
                allowed = seq.allowed(self.model.vocab_size)
                if row not in chosen:
                    chosen[row] = seq.sampler.sample(logits[row], seq.history, allowed)
                if seq.want_logprobs:
                    infos[row] = seq.sampler.logprobs(logits[row:row + 1],
                                                      chosen[row].reshape(1), allowed)
            order = launch_rows = sorted(chosen)
            if not order:
                return None
            tokens = mx.stack([chosen[r] for r in order])
            index = {row: i for i, row in enumerate(order)}
        row_taps = {} if tapped is None else {
            index[row]: self._own_taps(tapped[row:row + 1], taps, self._running[row].taps)
            for row in order
            if self._running[row].session is not None and not self._running[row].shared}
        shared = tapped is not None and any(self._running[row].shared for row in order)
        mx.async_eval(tokens, *[a for info in infos.values() for a in info],
                      *row_taps.values(), *([tapped] if shared else []), *self.batch.state)
        # (keyed by their index in `tokens`: a compaction renumbers rows, not that)
        return _Step([(row, self._running[row], index[row]) for row in order], tokens,
                     {index[row]: info for row, info in infos.items()}, row_taps,
                     tapped if shared else None, taps, launch_rows)

    def _round(self, chosen: int | None) -> None:
        """A speculative round over the batch: each sequence with a draft proposes a block,
        one target forward verifies every block (rows padded to the longest; a row without
        a draft decodes its one token), each row accepts with its own sampler
        (:func:`mlxrunner.decode.speculative.decide_row`), and each row rolls back to what it
        committed. ``chosen``: the depth the batch's controller chose (None: each
        draft's full depth).

        The sequences of a shared context propose in one block forward and accept in one
        comparison (greedy: a draft is accepted while it is the target's argmax); the
        others propose and decide one by one."""
        started = time.perf_counter()
        running = sorted(self._running.items())
        controller = self._depth_controller(running)
        for _, seq in running:
            if seq.unsent_taps:
                unsent = mx.concatenate(seq.unsent_taps, axis=1)
                seq.unsent_taps = []
                self._drafting(seq, "commit", unsent)
        plan = _RoundPlan(running, {row: self._round_depth(seq, chosen) for row, seq in running},
                          self.batch.rows, self.batch.longest_forward, self.batch.pads_verify)
        self._round_propose(plan)
        starts = self.batch.row_offsets
        logits = self._round_verify(plan)
        emitted = self._round_decide(plan, logits)
        self.batch.restore_rows([start + 1 + emitted[row][1] if row in emitted else start
                                 for row, start in enumerate(starts)])
        top = max(plan.depth.values())
        self.round_depths[top] = self.round_depths.get(top, 0) + 1
        seconds = time.perf_counter() - started
        if controller is not None and chosen is not None:
            controller.update_rows(chosen, [emitted[row][1] for row, _ in running
                                            if plan.depth[row] == chosen and chosen], seconds)
        self._round_commit(plan, emitted, seconds)

    def _round_depth(self, seq: _Sequence, chosen: int | None) -> int:
        """How many drafts ``seq`` proposes this round (0 without a draft)."""
        draft = seq.request.draft
        if seq.session is None:
            return 0
        left = seq.request.max_tokens - len(seq.request.tokens)
        fixed = seq.request.depth if seq.request.depth is not None else chosen
        top = draft.max_depth if fixed is None else min(fixed, draft.max_depth)
        n = max(0, min(top, left - 1))
        if seq.depths is not None:
            n = seq.depths.choose(n)
        return seq.pause.depth(n) if seq.constraint is not None else n

    def _round_propose(self, plan: _RoundPlan) -> None:
        """The verified block's drafts (``plan.body``, [rows, length - 1]): a shared
        context's rows all take its proposals (past a row's depth, or in a row not its own,
        they are verified and rolled back unread); the others propose one by one."""
        rows, length = plan.rows, plan.length
        body = mx.zeros((rows, length - 1), dtype=mx.int32)
        for key, members in list(plan.groups.items()):
            n = max(plan.depth[row] for row in members)
            if n == 0:
                continue
            try:
                proposed = self._contexts[key].propose(plan.last, n)
            except Exception as exc:  # its rows go on without their draft
                for row in members:
                    self._drop_draft(self._running[row], exc)
                del plan.groups[key]
                continue
            if n < length - 1:
                proposed = mx.pad(proposed, [(0, 0), (0, length - 1 - n)])
            if len(plan.groups) == 1:
                body = proposed
            else:
                mine = mx.array([r in members for r in range(rows)], dtype=mx.bool_)
                body = mx.where(mine[:, None], proposed, body)
        plan.proposals = {row: self._propose(row, seq, plan.depth[row])
                          for row, seq in plan.running
                          if seq.session is not None and not seq.shared}
        for row, proposal in plan.proposals.items():
            if proposal.drafts is not None:
                body[row:row + 1, :proposal.n] = proposal.drafts[None]
        plan.body = body

    def _round_verify(self, plan: _RoundPlan) -> mx.array:
        """The one target forward over every row's block (logits [rows, length, V]; the
        drafts' taps in ``plan.tapped``), the caches kept for the rows' restores."""
        ids = mx.concatenate([mx.array(plan.last, dtype=mx.int32)[:, None], plan.body],
                             axis=1)
        plan.taps = sorted({t for _, seq in plan.running for t in seq.taps})
        self.batch.keep_for_restore(plan.length)
        out = forward(self.model, ids, self.batch.caches, plan.taps or None)
        logits, plan.tapped = (out, None) if not plan.taps else out
        mx.async_eval(logits, *([] if plan.tapped is None else [plan.tapped]))
        return logits

    def _round_decide(self, plan: _RoundPlan, logits: mx.array
                      ) -> dict[int, tuple[list[int], int]]:
        """Each row's decision, read on the host at once: row -> (tokens it emits, drafts
        accepted)."""
        rows, length = plan.rows, plan.length
        reads: list[mx.array] = []
        if plan.groups:  # the shared rows' acceptance, all rows at once
            target = topk_indices(logits, 1)[..., 0]  # [rows, length]
            deep = mx.array([plan.depth.get(r, 0) for r in range(rows)], dtype=mx.int32)
            within = mx.arange(length - 1, dtype=mx.int32)[None] < deep[:, None]
            hits = ((target[:, :-1] == plan.body) & within).astype(mx.int32)
            reads += [mx.sum(mx.cumprod(hits, axis=1), axis=1).astype(mx.int32),
                      target.reshape(-1)]
        spans: dict[int, tuple[int, int]] = {}
        at = rows + rows * length if plan.groups else 0
        for row, seq in plan.running:
            if seq.shared:
                seq.sampler.skip(2 * plan.depth[row] + 1)  # the keys decide's greedy path uses
                continue
            joined = None
            if seq.session is not None:
                proposal = plan.proposals[row]
                try:
                    joined = decide_row(seq.sampler, logits[row, :proposal.n + 1], proposal,
                                        seq.history)
                except Exception as exc:  # a proposal the round cannot take: no draft
                    self._drop_draft(seq, exc)
            if joined is None:
                allowed = seq.allowed(self.model.vocab_size)
                joined = seq.sampler.sample(logits[row, 0], seq.history, allowed).reshape(1)
                if seq.want_logprobs:
                    plan.infos[row] = seq.sampler.logprobs(logits[row, 0:1], joined, allowed)
            reads.append(joined)
            spans[row] = (at, joined.shape[0])
            at += joined.shape[0]
        values = cast("list[int]", mx.concatenate(reads).tolist())
        emitted: dict[int, tuple[list[int], int]] = {}
        for row, seq in plan.running:
            if seq.shared:
                accepted = values[row]
                first = rows + row * length
                emitted[row] = (values[first:first + accepted + 1], accepted)
            elif seq.session is None:
                emitted[row] = ([values[spans[row][0]]], 0)
            else:
                n = plan.proposals[row].n
                drafts, accepted, fix = read_row(values[spans[row][0]:sum(spans[row])], n)
                emitted[row] = (drafts[:accepted] + [fix], accepted)
                if seq.constraint is not None:
                    seq.pause.update(plan.depth[row], n)
        return emitted

    def _round_commit(self, plan: _RoundPlan, emitted: dict[int, tuple[list[int], int]],
                      seconds: float) -> None:
        """Hand out each row's tokens; each draft that goes on commits its accepted states."""
        tapped, taps = plan.tapped, plan.taps
        counts: dict[int, list[int]] = {key: [0] * plan.rows for key in plan.groups}
        for row, seq in plan.running:
            tokens, accepted = emitted[row]
            stats = seq.request.stats
            if isinstance(stats, SpeculativeStats):
                verified = plan.proposals[row].n if row in plan.proposals else plan.depth[row]
                stats.record_round(verified, accepted, len(tokens), seconds)
                if seq.depths is not None:
                    seq.depths.update(verified, accepted, seconds)
            else:
                stats.target_forwards += 1
            mine = None if tapped is None or seq.session is None else \
                self._own_taps(tapped[row:row + 1, :accepted + 1], taps, seq.taps)
            if mine is not None:
                seq.keep_taps(mine)
            going = True
            for token in tokens:
                going = self._deliver(seq, token, plan.infos.get(row))
                if not going:
                    break
            if going and seq.session is not None:
                assert mine is not None  # the drafted rows asked for taps
                if self._drafting(seq, "extend_tokens", tokens):
                    if seq.shared:
                        counts[id(seq.request.draft)][row] = accepted + 1
                    else:
                        self._drafting(seq, "commit", mine)
        for key, committed in counts.items():
            assert tapped is not None  # the drafted rows asked for taps
            own = self._own_taps(tapped, taps, tuple(self._contexts[key].draft.taps))
            self._shared_commit(key, own, committed)

    def _depth_controller(self, running: list[tuple[int, _Sequence]]
                          ) -> DepthController | None:
        """The batch's depth controller where no drafted sequence's draws depend on its
        depths (greedy ones, whose tokens are the same at any depth, and sampled ones
        without a seed): it drafts the depth that commits the most tokens per second of
        measured rounds, none where drafting does not pay (a large batch, whose verify block
        costs more than its drafts save; a small model on a machine where verifying a block
        costs several steps). Seeded sampled sequences draft their draft's full depth (or
        their own controller's, from acceptance alone), so that their draws never depend on
        timings; a request's fixed ``depth`` is its depth. None then."""
        drafted = [seq for _, seq in running if seq.session is not None]
        free = all(seq.timed and seq.request.depth is None for seq in drafted)
        if not drafted or not free or settings.current().lockstep:
            return None
        deepest = max(seq.request.draft.max_depth for seq in drafted)
        # a draft of fixed depth (DFlash2) costs its whole block at any depth: the whole
        # block or none, as alone (two widths to trace, not every depth)
        full_only = not any(seq.request.draft.adaptive_depth for seq in drafted)
        if self._depth is None or self._depth.max_depth != deepest \
                or self._depth.full_only != full_only:
            self._depth = DepthController(deepest, full_only=full_only)
        # probing costs a round, several plain steps where drafting paused: rarer in a
        # batch than for one sequence
        self._depth.probe_every = SOLO_PROBE_EVERY if len(running) == 1 else BATCH_PROBE_EVERY
        return self._depth

    def _propose(self, row: int, seq: _Sequence, n: int) -> RowProposal:
        """A drafted sequence's proposal for this round (its grammar's masks included). A
        draft that fails leaves its sequence decoding without it; a grammar that fails ends
        its sequence (it verifies nothing: see _deliver)."""
        session, draft = seq.session, seq.request.draft
        assert session is not None and draft is not None  # drafted
        proposal = None
        if n > 0:
            bound = draft.reads_target_caches
            if bound:  # its row of the batch's caches, as views, for this round's proposals
                session.bind_target_caches(self._row_caches(row, copy=False))
            try:
                proposal = session.propose(seq.history[-1], len(seq.history) - 1, n)
            except Exception as exc:
                self._drop_draft(seq, exc)
            finally:
                if bound:  # (a view kept past the verify forward would stop its writing)
                    session.bind_target_caches(None)
        constraint = seq.constraint if seq.error is None else None
        vocab = self.model.vocab_size
        try:
            return propose_row(proposal, seq.sampler, constraint, vocab)
        except Exception as exc:
            if proposal is None:  # the grammar's own failure: it ends this request alone
                seq.error = exc
                return RowProposal(0)
            self._drop_draft(seq, exc)  # a proposal the round cannot take
        try:
            return propose_row(None, seq.sampler, constraint, vocab)
        except Exception as exc:
            seq.error = exc
            return RowProposal(0)

    def _drop_draft(self, seq: _Sequence, exc: Exception) -> None:
        """``seq``'s draft failed: it decodes on without drafting; the batch's other rows
        go on."""
        if seq.shared and seq.row >= 0:
            try:
                self._contexts[id(seq.request.draft)].remove(seq.row)
            except Exception:  # (the context is what failed: its row goes unused)
                log.debug("mlxrunner: a failed draft's row stays in its shared context")
        seq.without_draft(exc)

    def _drafting(self, seq: _Sequence, method: str, *args: Any) -> bool:
        """``seq``'s session's ``method(*args)`` where it drafts; a draft that raises is
        dropped (see :meth:`_drop_draft`). Returns whether the sequence still drafts."""
        if seq.session is None:
            return False
        try:
            getattr(seq.session, method)(*args)
        except Exception as exc:
            self._drop_draft(seq, exc)
            return False
        return True

    def _shared_commit(self, key: int, tapped: mx.array, counts: Sequence[int]) -> None:
        """A shared context's commit (``tapped``: its draft's taps of every row); one that
        raises leaves its rows without their draft."""
        try:
            self._contexts[key].commit(tapped, counts)
        except Exception as exc:
            for seq in self._running.values():
                if seq.shared and id(seq.request.draft) == key:
                    self._drop_draft(seq, exc)

    def _own_taps(self, tapped: mx.array, taps: list[int], own: tuple[int, ...]) -> mx.array:
        """A draft's taps out of the batch's (the union of its drafts' taps)."""
        if list(own) == taps:
            return tapped
        hidden = tapped.shape[-1] // len(taps)
        return mx.concatenate([tapped[..., taps.index(t) * hidden:(taps.index(t) + 1) * hidden]
                               for t in own], axis=-1)

    def _collect(self, step: _Step) -> None:
        """Hand out a step's tokens to the sequences still running in its rows."""
        values = cast("list[int]", step.tokens.tolist())
        committed: dict[int, dict[int, int]] = {}  # draft -> row now -> row in the step
        for row, seq, at in step.rows:
            if self._running.get(row) is not seq:
                continue  # finished or cancelled since the step was queued
            stats = seq.request.stats
            if seq.session is not None and isinstance(stats, SpeculativeStats):
                # drafting paused: a round of depth 0, as the depth controller sees it
                now = time.perf_counter()
                stats.record_round(0, 0, 1, now - (seq.delivered_at or seq.decode_start))
            else:
                stats.target_forwards += 1
            self._keep_step_taps(seq, step, at)
            going = self._deliver(seq, values[at], step.infos.get(at))
            if going and seq.session is not None:
                if at in step.taps:
                    if self._drafting(seq, "extend_tokens", [values[at]]):
                        seq.unsent_taps.append(step.taps[at])
                elif seq.shared and step.tapped is not None:
                    if self._drafting(seq, "extend_tokens", [values[at]]) and seq.shared:
                        committed.setdefault(id(seq.request.draft), {})[seq.row] = \
                            step.launch_rows[at]
        for key, rows in committed.items():
            # each row's input token's states, from the step's rows to the rows now
            assert step.tapped is not None  # shared rows were in the step
            shared = self._contexts[key]
            source = [rows.get(r, 0) for r in range(shared.rows)]
            tapped = self._own_taps(step.tapped[mx.array(source, dtype=mx.int32)],
                                    step.tap_layers, tuple(shared.draft.taps))
            self._shared_commit(key, tapped, [int(r in rows) for r in range(shared.rows)])

    def _keep_step_taps(self, seq: _Sequence, step: _Step, at: int) -> None:
        """Keep (for the prefix cache) the tapped states of ``seq``'s input token to
        ``step``, where it is the ``at``-th token."""
        if at in step.taps:
            seq.keep_taps(step.taps[at])
        elif seq.shared and step.tapped is not None and seq.kept is not None:
            r = step.launch_rows[at]
            seq.keep_taps(self._own_taps(step.tapped[r:r + 1], step.tap_layers, seq.taps))

    def _deliver(self, seq: _Sequence, token: int, info: Any) -> bool:
        """Hand a sampled token to its request; returns whether the sequence goes on (else
        it is finished and its row freed)."""
        request = seq.request
        seq.delivered_at = time.perf_counter()
        if seq.error is not None:
            self._fail(seq, seq.error)
            return False
        seq.history.append(token)
        request.tokens.append(token)
        request.stats.generated_tokens += 1
        entry = logprob_entry(info)
        if entry is not None:
            request.logprobs.append(entry)
        stop = False
        if request.on_token is not None:
            try:
                stop = bool(request.on_token(token, entry))
            except Exception:
                log.exception("a token callback failed; its sequence is cancelled")
                self._finish(seq, "cancel")
                return False
        if stop or token in request.eos_ids:
            self._finish(seq, "stop")
            return False
        if seq.constraint is not None:
            try:
                seq.constraint.advance(token)
            except Exception as exc:
                self._fail(seq, exc)
                return False
            if seq.constraint.complete:
                self._finish(seq, "stop")
                return False
        if len(request.tokens) >= request.max_tokens:
            self._finish(seq, "length")
            return False
        return True

    def _fail(self, seq: _Sequence, exc: Exception) -> None:
        """End one sequence on its own failure; the batch's other rows go on. (A strict
        request's caller, ``generate``, raises the error: no warning then.)"""
        if not seq.request.strict_draft:
            log.warning("mlxrunner: a request failed (%s: %s); it ends alone",
                        type(exc).__name__, exc)
        seq.request.error = exc
        self._finish(seq, "error")

    def _finish(self, seq: _Sequence, reason: str) -> None:
        request = seq.request
        if seq.decode_start:
            request.stats.decode_seconds = max(time.perf_counter() - seq.decode_start, 1e-9)
        request.finish_reason = reason
        seq.caches = None
        if seq.row >= 0 and self._running.get(seq.row) is seq:
            if request.prefix_cache is not None and reason not in ("cancel", "error"):
                # what the row was fed (a queued step's token included), as generate keeps;
                # a round that ended inside its accepted drafts fed more than was kept: full
                # keys and values are cut back to the tokens kept (other kinds cannot be)
                queued = self._pending
                for _, fed, at in [] if queued is None else queued.rows:
                    if fed is seq and queued is not None:
                        self._keep_step_taps(seq, queued, at)  # the token it fed
                kept = min(self.batch.row_offsets[seq.row], len(seq.history))
                solo = self._row_caches(seq.row, length=kept)
                if solo is not None:
                    request.prefix_cache.store(history_key(request.prompt, seq.history[:kept]),
                                               solo, seq.tapped(kept))
            del self._running[seq.row]
            self.batch.remove(seq.row)
            if seq.shared:
                self._contexts[id(request.draft)].remove(seq.row)
            seq.row = -1

    def _row_caches(self, row: int, copy: bool = True, length: int | None = None
                    ) -> list[Cache | None] | None:
        """One row's caches as a solo sequence's (see :meth:`BatchCaches.row_caches`)."""
        return self.batch.row_caches(row, self.model.make_cache, copy, length)

    def _finish_unstarted(self, request: BatchRequest) -> None:
        request.finish_reason = "cancel"

    def _maybe_compact(self) -> None:
        """Shrink the batch once few of its rows are in use (a copy of the live rows; the
        row count only halves after it has been used at a quarter)."""
        rows = self.batch.rows
        if rows < 8 or 4 * len(self._running) > rows:
            return
        moved = self.batch.compact()
        for shared in self._contexts.values():
            shared.compact(moved, self.batch.rows)
        self._running = {moved[row]: seq for row, seq in self._running.items()}
        for row, seq in self._running.items():
            seq.row = row
        if self._pending is not None:  # its rows, where they are now
            self._pending.rows = [(moved[row], seq, at) for row, seq, at in self._pending.rows
                                  if row in moved]


def _per_prompt(value: Any, n: int, one: Callable[[Any], bool], name: str) -> list[Any]:
    """``value`` for each of ``n`` prompts: the same for all where ``one(value)``, else one
    each."""
    if one(value):
        return [value] * n
    each = list(value)
    if len(each) != n:
        raise ValueError(f"{n} prompts need one {name} each (or one for all), got {len(each)}")
    return each


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], *,
                   options: SamplerOptions | Sequence[SamplerOptions] | None = None,
                   max_tokens: int | Sequence[int] = 256,
                   eos_ids: frozenset[int] | set[int] = frozenset(),
                   on_token: Callable[[int, int], bool | None] | None = None,
                   draft: Any = None, constraints: Sequence[Any] | None = None,
                   prefix_cache: Any = None,
                   max_sequences: int = 32, memory_budget: int | None = None
                   ) -> list[GenerationResult]:
    """Generate after each of ``prompts`` (token ids) in one continuous batch; each result
    is what :func:`mlxrunner.generate` gives that prompt alone with the same arguments.

    ``options``, ``max_tokens`` and ``draft`` (a draft model, or None): one for all, or one
    per prompt; a prompt asking for logprobs decodes without its draft, as alone.
    ``constraints``: one structured-output constraint (or None) per prompt.
    ``on_token(i, token)`` sees prompt ``i``'s tokens as they are decided; returning True
    ends that one. ``prefix_cache``: one :class:`mlxrunner.cache.PrefixCache` for all.
    """
    n = len(prompts)
    per_options = _per_prompt(options or SamplerOptions(), n,
                              lambda v: isinstance(v, SamplerOptions), "options")
    per_max = _per_prompt(max_tokens, n, lambda v: isinstance(v, int), "max_tokens")
    per_draft = _per_prompt(draft, n, lambda v: not isinstance(v, (list, tuple)), "draft")
    per_constraint = _per_prompt(constraints, n, lambda v: v is None, "constraint")
    scheduler = Scheduler(model, max_sequences=max_sequences, memory_budget=memory_budget)

    def callback(i: int) -> TokenCallback | None:
        if on_token is None:
            return None
        return lambda token, _: on_token(i, token)

    requests = [scheduler.submit(BatchRequest(
        p if isinstance(p, MediaPrompt) else list(p), o, m, frozenset(eos_ids), callback(i),
        draft=d if can_speculate(o) else None, constraint=c, prefix_cache=prefix_cache))
        for i, (p, o, m, d, c) in enumerate(zip(prompts, per_options, per_max, per_draft,
                                                per_constraint))]
    scheduler.run_until_idle()
    return [r.result() for r in requests]
