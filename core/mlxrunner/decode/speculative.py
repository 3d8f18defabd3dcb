"""Exact speculative decoding: a round's decision, the depth controller, the statistics.

The rounds run in :class:`mlxrunner.batch.Scheduler` (``generate`` with a draft is the
scheduler with one row). A round (speculative.md, "The speculative round"), with ``pos`` the
slot of ``current`` (the last emitted token, not yet run through the target):

1. the draft session proposes ``d_0 .. d_{N-1}`` and the q_i each was drawn from;
2. the target caches keep what rolling back to any of ``pos+1 .. pos+N+1`` needs;
3. one target forward over ``[current, d_0 .. d_{N-1}]`` gives logits and taps;
4. p_i from the very sampler pipeline of plain decoding (penalty history:
   committed tokens + ``d[:i]``); greedy is its point-mass case;
5. accept d_i with probability ``min(1, p_i(d_i) / q_i(d_i))`` in order; the
   residual ``normalise(max(p_i - q_i, 0))`` of every row and the bonus from
   p_N are drawn before the round's one host sync, which then picks one
   (:func:`decide_row`);
6. an accepted EOS ends generation (so does a structured-output grammar once complete);
7. every cache rolls back to ``pos + 1 + accepted``; the taps of the committed
   rows become the draft's context.

Under a grammar (structured output) the proposals are masked on the host before the verify
forward: row i keeps the draft's d_i when the grammar allows it after ``d[:i]``, else
redraws from q_i restricted to the allowed tokens (so d_i ~ q_i | allowed either way), and
drafting stops at a row whose q_i has no allowed token; the target's p_i are the sampler's
distributions under the same masks, so verification stays exact, and the grammar is
rolled back to the committed prefix after the round.

Only the Model, Cache and DraftSession interfaces are used: any target with
taps and restorable caches gets speculative decoding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from ..model.builtin_draft import describe_checkpoint_draft
from ..model.distribution import Distribution
from .grammar import Constraint, allowed_rows
from .options import SamplerOptions
from .plain import GenerationStats
from .sampler import Sampler, penalties_active

if TYPE_CHECKING:  # pragma: no cover
    from ..model.draft import DraftModel, DraftProposal


def draft_name(draft: DraftModel) -> str:
    """What the statistics call a draft: ``mtp (built into the checkpoint)`` for a
    checkpoint's own, else its class name."""
    return describe_checkpoint_draft(draft) or type(draft).__name__


def can_speculate(options: SamplerOptions) -> bool:
    """Whether a request may draft: logprob requests decode without drafting."""
    return not (options.logprobs or options.top_logprobs)


# -- statistics ----------------------------------------------------------------------


@dataclass
class SpeculativeStats(GenerationStats):
    """What a speculative run reports (``--json`` prints :meth:`as_dict`, which ``--stats``
    formats). A round is one verify forward after the first token."""

    draft: str = ""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed_in_rounds: int = 0
    depths: dict[int, int] = field(default_factory=dict)
    accepted_lengths: dict[int, int] = field(default_factory=dict)
    seconds_by_depth: dict[int, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean committed tokens per round, the residual or bonus token included."""
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    def round_ms(self) -> dict[int, float]:
        """Mean wall time of a round per depth, in milliseconds (draft + verify + sync)."""
        return {d: 1e3 * self.seconds_by_depth.get(d, 0.0) / n for d, n in self.depths.items()}

    def record_round(self, depth: int, accepted: int, committed: int,
                     seconds: float = 0.0) -> None:
        self.rounds += 1
        self.seconds_by_depth[depth] = self.seconds_by_depth.get(depth, 0.0) + seconds
        self.target_forwards += 1
        self.drafted += depth
        self.accepted += accepted
        self.committed_in_rounds += committed
        self.depths[depth] = self.depths.get(depth, 0) + 1
        self.accepted_lengths[accepted] = self.accepted_lengths.get(accepted, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": "speculative",
            "draft": self.draft,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tau": round(self.tau, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "prefill_tokens_per_second": round(self.prefill_tokens_per_second, 2),
            "decode_seconds": round(self.decode_seconds, 4),
            "depths": {str(k): v for k, v in sorted(self.depths.items())},
            "accepted_lengths": {str(k): v for k, v in sorted(self.accepted_lengths.items())},
            "round_ms_by_depth": {str(k): round(v, 3) for k, v in sorted(self.round_ms().items())},
        }


# -- the depth controller (DFlash v1 sessions) ------------------------------------------


class DepthController:
    """Chooses how many tokens to draft so as to maximise expected committed tokens per second.

    Acceptance is tracked per draft position as a conditional rate a_i = P(d_i
    accepted | d_0..d_{i-1} accepted), with slow forgetting; drafting ``d`` then
    commits ``E(d) = 1 + sum_{k=1..d} prod_{i<k} a_i`` tokens (bonus included).
    Round time T(d) is the median of the depth's last ``window`` measured rounds (a
    least-squares line through the measured depths stands in for the others). The first
    rounds visit the deepest, the shallowest, a middle depth, no draft and the deepest
    again to measure them; afterwards every ``probe_every`` rounds one round tries the
    next deeper depth (the deepest where drafting paused), so that acceptance beyond the
    chosen depth keeps being observed.

    With ``measured=False`` T(d) is the fixed model ``1 + draft_cost * d``: the
    choice then depends only on acceptance (seeded sampling stays reproducible).

    ``full_only``: the choice is the whole block or no draft (a draft whose depth is fixed,
    DFlash2): drafting pauses where plain steps commit tokens faster than its rounds (a
    weak draft, or a machine where verifying a block costs several steps), and a probe
    every ``probe_every`` rounds drafts again. Its warm-up is the deepest, none, the deepest.
    """

    def __init__(self, max_depth: int, *, measured: bool = True, draft_cost: float = 0.15,
                 probe_every: int = 16, forget: float = 0.98, window: int = 5,
                 full_only: bool = False) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        self.max_depth = max_depth
        self.measured = measured
        self.draft_cost = draft_cost
        self.probe_every = probe_every
        self.forget = forget
        self.window = window
        # Beta(1, 1)-like pseudo-counts: a prior rate of 0.5 worth two rounds
        self.hits = [1.0] * max_depth
        self.tries = [2.0] * max_depth
        self.seconds: dict[int, float] = {}
        self._recent: dict[int, deque[float]] = {}
        self.rounds = 0
        self.full_only = full_only
        # the deepest depth twice: a first round's time may hold one-off costs (a trace)
        warm = [max_depth, 0] if full_only else [max_depth, 1, (max_depth + 1) // 2, 0]
        self._warmup = [*dict.fromkeys(warm), max_depth]

    def rates(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.tries)]

    def expected_tokens(self, depth: int) -> float:
        total, run = 1.0, 1.0
        for a in self.rates()[:depth]:
            run *= a
            total += run
        return total

    def round_seconds(self, depth: int) -> float:
        if not self.measured:
            return 1.0 + self.draft_cost * depth
        if depth in self.seconds:
            return self.seconds[depth]
        if not self.seconds:
            return 1.0
        xs = list(self.seconds)
        ys = [self.seconds[x] for x in xs]
        if len(xs) == 1:
            return ys[0]
        mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx_) ** 2 for x in xs)
        slope = max(sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var, 0.0)
        return max(my + slope * (depth - mx_), 1e-9)

    def best(self, limit: int) -> int:
        top = min(self.max_depth, limit)
        if top <= 0:
            return 0
        depths = (0, top) if self.full_only else range(top + 1)
        scores = [(self.expected_tokens(d) / self.round_seconds(d), d) for d in depths]
        return max(scores)[1]

    def choose(self, limit: int) -> int:
        """The depth for the next round; ``limit`` caps it (remaining budget - 1)."""
        top = min(self.max_depth, limit)
        if top <= 0:
            return 0
        if self.measured and self._warmup:
            return min(self._warmup[0], top)
        best = self.best(top)
        if self.rounds % self.probe_every == self.probe_every - 1 and best < top:
            # paused, a probe drafts the deepest: its round observes every position
            return best + 1 if best else top
        return best

    def update(self, depth: int, accepted: int, seconds: float | None = None) -> None:
        self.update_rows(depth, [accepted], seconds)

    def update_rows(self, depth: int, accepted: Sequence[int],
                    seconds: float | None = None) -> None:
        """One round in which several sequences drafted ``depth`` tokens each (a batch's
        round): each one's acceptance counts, and the round's time once."""
        self.rounds += 1
        if self._warmup:
            self._warmup.pop(0)
        for i in range(self.max_depth):
            self.hits[i] *= self.forget
            self.tries[i] *= self.forget
        for taken in accepted:
            for i in range(min(depth, taken + 1)):
                self.tries[i] += 1.0
                if i < taken:
                    self.hits[i] += 1.0
        if seconds is not None and self.measured:
            # the median of the depth's last rounds (the lower one of an even count): one
            # round delayed once (a trace, a collection) or cut short does not move it
            recent = self._recent.setdefault(depth, deque(maxlen=self.window))
            recent.append(seconds)
            self.seconds[depth] = sorted(recent)[(len(recent) - 1) // 2]


# -- one round ----------------------------------------------------------------------------


@dataclass
class RoundDecision:
    """The lazily built outcome of step 5: how many drafts are accepted, and for each
    possible stopping point the token drawn there (residual rows, then the bonus)."""

    accepted: mx.array  # scalar int32
    fix_tokens: mx.array  # [N + 1] int32: residual draws for rows 0..N-1, bonus for row N


def decide(sampler: Sampler, p: Distribution, q: Distribution | None,
           drafts: mx.array | None) -> RoundDecision:
    """Step 5 for one round, lazily: acceptance tests, residual draws and the bonus draw.

    ``p`` has N + 1 rows (row N is the bonus row), ``q`` and ``drafts`` N rows.
    Keys consumed: N uniforms, N residual draws, one bonus draw.
    """
    n = 0 if drafts is None else int(drafts.shape[0])
    if sampler.greedy and p.ids is not None and p.ids.shape[-1] == 1:
        # p is a point mass on each row's argmax t: d_i is accepted iff d_i == t_i (p/q >= 1
        # there, 0 elsewhere) and the residual of a rejected row is the point mass on t_i.
        sampler.skip(2 * n + 1)  # the keys the general path draws: the stream stays aligned
        target = p.ids[:, 0].astype(mx.int32)
        if n == 0 or drafts is None:
            return RoundDecision(mx.array(0, dtype=mx.int32), target)
        hits = (target[:n] == drafts).astype(mx.int32)
        return RoundDecision(mx.sum(mx.cumprod(hits), axis=0).astype(mx.int32), target)
    bonus = sampler.draw(p[n:n + 1])
    if n == 0 or q is None or drafts is None:
        return RoundDecision(mx.array(0, dtype=mx.int32), bonus)
    p_rows = p[0:n]
    p_at = p_rows.prob_of(drafts)
    q_at = q.prob_of(drafts)
    u = sampler.uniform(n)
    # u < p/q  <=>  u * q < p  (q > 0 for a token drawn from q); p >= q always accepts
    ok = (u * q_at < p_at).astype(mx.int32)
    accepted = mx.sum(mx.cumprod(ok), axis=0).astype(mx.int32)
    residual = sampler.draw(sampler.residual(p_rows, q))
    return RoundDecision(accepted, mx.concatenate([residual, bonus]).astype(mx.int32))


def _bit_set(words: np.ndarray, token: int) -> bool:
    return bool((int(words.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def _dense_bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def constrain_proposal(sampler: Sampler, constraint: Constraint, proposal: DraftProposal
                       ) -> tuple[list[int], Distribution | None, list[np.ndarray]]:
    """Mask a proposal with ``constraint`` (left as it was): the drafts kept (row i: d_i if
    allowed after the kept ``d[:i]``, else a draw from q_i restricted to the allowed tokens;
    rows stop at one whose q_i allows nothing, or once the grammar is complete), the q rows
    they follow (restricted and renormalised) and the allowed-token words of every verify
    row (one more than the drafts: the bonus row)."""
    tokens = [int(t) for t in cast("list[int]", proposal.tokens.reshape(-1).tolist())]
    q = proposal.distribution()
    probs = np.array(q.probs, dtype=np.float32)
    ids = None if q.ids is None else np.array(q.ids, dtype=np.int64)
    vocab = constraint.vocab_size
    kept: list[int] = []
    rows: list[np.ndarray] = []
    words: list[np.ndarray] = []
    try:  # (the grammar is left as it was, whatever raises)
        for i, token in enumerate(tokens):
            allowed = constraint.words()
            words.append(allowed)
            if ids is None:
                ok = _dense_bits(allowed, probs.shape[-1] if probs.shape[-1] <= vocab else vocab)
                row = np.where(ok, probs[i, :ok.shape[0]], 0.0)
                row = np.concatenate([row, np.zeros(probs.shape[-1] - row.shape[0], np.float32)])
            else:
                ok = np.array([0 <= t < vocab and _bit_set(allowed, int(t)) for t in ids[i]])
                row = np.where(ok, probs[i], 0.0)
            mass = float(row.sum())
            if mass <= 0.0:
                # q_i allows nothing (a greedy draft's point mass, often): propose the token the
                # grammar forces, if it forces one, as a point mass; else stop drafting here
                forced = constraint.forced_token()
                if forced is None or not (0 <= forced < vocab and _bit_set(allowed, forced)):
                    words.pop()  # this row becomes the bonus row, whose words follow the loop
                    break
                token = forced
                row = np.zeros_like(row)
                if ids is None:
                    row[token] = 1.0
                else:
                    # in the row's own slots (ids stay unique): where it is listed, else slot 0
                    slot = int(np.flatnonzero(ids[i] == token)[0]) if (ids[i] == token).any() \
                        else 0
                    ids[i, slot] = token
                    row[slot] = 1.0
            elif not (0 <= token < vocab and _bit_set(allowed, token)):
                # q_i given "allowed": keeping an allowed d_i and redrawing a forbidden one from
                # the restricted q_i gives q_i(t) + (1 - mass) * q_i(t) / mass = q_i(t) / mass
                row = (row / mass).astype(np.float32)
                u = cast("list[float]", sampler.uniform(1).tolist())[0]
                slot = min(int(np.searchsorted(np.cumsum(row), u * float(row.sum()), "right")),
                           int(np.flatnonzero(row > 0)[-1]))
                token = int(slot if ids is None else ids[i, slot])
            else:
                row = (row / mass).astype(np.float32)
            constraint.advance(token)
            kept.append(token)
            rows.append(row)
            if constraint.complete:
                break
        words.append(constraint.words())
    finally:
        constraint.rollback(len(kept))
    if not kept:
        return [], None, words
    q_kept = Distribution(mx.array(np.stack(rows)),
                          None if ids is None else mx.array(ids[:len(kept)], dtype=mx.int32))
    return kept, q_kept, words


#: the most rounds in a row that a grammar makes skip drafting
_MAX_IDLE_ROUNDS = 15


@dataclass
class RowProposal:
    """What a round verifies in one row: the drafts (``[n]``, None for none), the q rows
    they were drawn from and, under a grammar, the allowed tokens of each of the ``n + 1``
    verify rows (``[n + 1, words]``)."""

    n: int
    drafts: mx.array | None = None
    q: Distribution | None = None
    allowed: mx.array | None = None


def propose_row(proposal: DraftProposal | None, sampler: Sampler,
                constraint: Constraint | None, vocab_size: int) -> RowProposal:
    """Step 1 of a round for one sequence, from its draft's ``proposal`` (None: no drafts),
    masked by ``constraint`` (at the round's current token, which it has committed; left as
    it was)."""
    if constraint is not None:
        words = [constraint.words()]
        if proposal is None:
            return RowProposal(0, allowed=allowed_rows(words, vocab_size))
        kept, q, words = constrain_proposal(sampler, constraint, proposal)
        return RowProposal(len(kept), mx.array(kept, dtype=mx.int32) if kept else None, q,
                           allowed_rows(words, vocab_size))
    if proposal is None:
        return RowProposal(0)
    # the device runs the draft while the host builds the verify forward
    mx.async_eval(proposal.tokens)
    drafts = proposal.tokens.reshape(-1).astype(mx.int32)
    return RowProposal(drafts.shape[0], drafts, proposal.distribution())


def penalty_histories(options: SamplerOptions, history: Sequence[int],
                      drafts: mx.array | None, n: int) -> list[list[int]]:
    """The penalty history of each of a round's ``n + 1`` verify rows: p_i's penalties see
    the committed tokens and ``d[:i]`` (the drafts reach the host first: a sync only where
    penalties are on)."""
    keep = options.repeat_last_n  # (-1: all of it)
    base = list(history) if keep < 0 else list(history[-keep:]) if keep else []
    if drafts is not None and penalties_active(options):
        draft_list = [int(t) for t in cast("list[int]", drafts.tolist())]
        return [base + draft_list[:i] for i in range(n + 1)]
    return [base] * (n + 1)


def decide_row(sampler: Sampler, logits: mx.array, row: RowProposal,
               history: Sequence[int]) -> mx.array:
    """Steps 4-5 for one sequence, from its verify rows' logits (``[n + 1, V]``): lazily,
    ``[accepted, fix tokens..., drafts...]``, which :func:`read_row` reads."""
    p = sampler.distributions(logits, penalty_histories(sampler.options, history, row.drafts,
                                                        row.n), row.allowed)
    decision = decide(sampler, p, row.q, row.drafts)
    parts = [decision.accepted.reshape(1), decision.fix_tokens]
    return mx.concatenate(parts + ([row.drafts] if row.drafts is not None else []))


def read_row(values: Sequence[int], n: int) -> tuple[list[int], int, int]:
    """(drafts, accepted, fix) from a :func:`decide_row` read on the host."""
    accepted = int(values[0])
    return [int(t) for t in values[2 + n:]], accepted, int(values[1 + accepted])


class GrammarPause:
    """Rounds without drafting after a grammar cut a proposal to nothing (a greedy draft
    whose choice the grammar forbids costs a draft forward for no token), longer each time
    in a row, at most ``_MAX_IDLE_ROUNDS``."""

    def __init__(self) -> None:
        self.idle = self.backoff = 0

    def depth(self, n: int) -> int:
        """This round's depth where ``n`` was chosen."""
        if self.idle > 0:
            self.idle -= 1
            return 0
        return n

    def update(self, asked: int, kept: int) -> None:
        """A round asked for ``asked`` drafts and the grammar kept ``kept``."""
        if asked > 0:
            self.backoff = 0 if kept else min(2 * self.backoff + 1, _MAX_IDLE_ROUNDS)
            self.idle = self.backoff


class TapRows:
    """The draft's tapped states of every position a sequence's caches hold, which the
    prefix cache keeps with them (a hit rebuilds the draft's session from them). Each part
    is an array of its own: a slice would keep a whole verify block's taps alive."""

    def __init__(self, taps: Sequence[int]) -> None:
        self.taps = tuple(taps)
        self.parts: list[mx.array] = []

    def add(self, tapped: mx.array, *, own: bool = False) -> None:
        """Positions' states ``[1, n, ...]`` after those kept (``own``: not a view)."""
        if not own:
            tapped = mx.array(tapped)
            mx.async_eval(tapped)
        self.parts.append(tapped)

    def first(self, length: int) -> tuple[tuple[int, ...], mx.array] | None:
        """The first ``length`` positions' states, with the taps they are of (None where
        fewer are kept)."""
        if not self.parts or sum(a.shape[1] for a in self.parts) < length:
            return None
        if len(self.parts) > 1:
            self.parts = [mx.concatenate(self.parts, axis=1)]
        return self.taps, self.parts[0][:, :length]
