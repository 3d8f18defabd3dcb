"""Speculative-decoding conformance checks, and test doubles for draft and target authors.

:func:`check_speculative_greedy` is the check an architecture plugin runs on its
target: greedy speculative output must equal plain greedy output token for
token (speculative.md: greedy is the point-mass case of the one round, so the
only allowed difference is many-row against one-row arithmetic, and in float32
on the CPU there is none). It runs

- a :class:`ScriptedDraft` that proposes the plain greedy continuation with its
  first wrong token cycling through every position, so every rollback length
  0..N runs on every cache kind; it also checks the loop's context
  bookkeeping (each commit carries exactly the rows of the committed tokens);
- random DFlash and DFlash2 drafts (:func:`random_draft`) when a plugin
  registers them, so that real drafts run on the target's real taps.

:func:`check_speculative_sampled` is the sampled counterpart: over many seeds, the
first tokens of speculative decoding must follow plain decoding's exact
distribution (:func:`exact_joint` enumerates it; :func:`chi_square` tests it).

:class:`ToyTarget` is a target small enough to enumerate: a draft author can
test a draft without any architecture plugin::

    from mlxrunner.testing.speculative import (ToyTarget, check_speculative_greedy,
                                               check_speculative_sampled, random_draft)

    target = ToyTarget({"vocab_size": 16, "hidden_size": 16})
    draft = random_draft(target, "DFlash2DraftModel", taps=[0], block_size=4)
    check_speculative_greedy(target, lambda t: draft, max_tokens=50)
    check_speculative_sampled(target, draft, SamplerOptions(temperature=1.0, top_k=0),
                              prompt=[1, 2, 3], runs=600)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..batch.generation import generate
from ..cache import Cache
from ..decode.options import SamplerOptions
from ..decode.sampler import Sampler
from ..decode.speculative import SpeculativeStats
from ..host import manager as plugins
from ..media import MediaPrompt
from ..model.draft import DraftModel, DraftProposal, DraftSession, build_draft
from ..model.interface import Model

__all__ = [
    "ScriptedDraft",
    "build_draft",
    "ToyTarget",
    "check_speculative_greedy",
    "check_speculative_sampled",
    "chi_square",
    "exact_joint",
    "plain_tokens",
    "random_draft",
    "random_draft_config",
    "randomize",
    "speculative_tokens",
]

GREEDY = SamplerOptions(temperature=0.0)


# -- running both ways -------------------------------------------------------------------


def _ids(prompt: Sequence[int]) -> Sequence[int]:
    """The prompt as generation takes it (a MediaPrompt keeps its media)."""
    return prompt if isinstance(prompt, MediaPrompt) else list(prompt)


def plain_tokens(model: Model, prompt: Sequence[int], max_tokens: int, *,
                 options: SamplerOptions = GREEDY,
                 eos_ids: Iterable[int] = ()) -> list[int]:
    """Plain decoding's tokens (``generate`` without a draft)."""
    return generate(model, _ids(prompt), options=options, max_tokens=max_tokens,
                    eos_ids=frozenset(eos_ids)).tokens


def speculative_tokens(model: Model, draft: DraftModel, prompt: Sequence[int],
                       max_tokens: int, *, options: SamplerOptions = GREEDY,
                       eos_ids: Iterable[int] = (), depth: int | None = None
                       ) -> tuple[list[int], SpeculativeStats]:
    """Speculative decoding's tokens and statistics (``depth``: drafts per round, fixed)."""
    result = generate(model, _ids(prompt), options=options, max_tokens=max_tokens,
                      eos_ids=frozenset(eos_ids), draft=draft,
                      draft_options=None if depth is None else {"depth": depth})
    stats = result.stats
    assert isinstance(stats, SpeculativeStats)  # a drafted generation's
    return result.tokens, stats


# -- a scripted draft ----------------------------------------------------------------------


class ScriptedDraft(DraftModel):
    """Proposes tokens from a known sequence (``script[p]`` is the token at position p).

    With ``wrong_every_round`` the first wrong proposal of round r sits at
    ``r % (n + 1)`` (``n``: no wrong one), so every accepted length occurs;
    without it the draft agrees with the script. Proposals are point masses (q
    one-hot), which is exact for any sampler settings. Sessions check that the
    loop keeps the context at ``pos`` rows (prefill + commits).
    """

    def __init__(self, config: dict[str, Any], target: Model) -> None:
        super().__init__(config, target)
        # private tuples: kept out of the parameter tree
        self._script: tuple[int, ...] = tuple(int(t) for t in config.get("script", ()))
        self._taps = tuple(int(t) for t in config.get("taps", (0,)))
        self._max_depth = int(config.get("block_size", 8)) - 1
        self.wrong_every_round = bool(config.get("wrong_every_round", True))
        self.vocab = target.vocab_size

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @classmethod
    def for_script(cls, target: Model, script: Sequence[int], *, block_size: int = 8,
                   wrong_every_round: bool = True) -> ScriptedDraft:
        """Drafts up to ``block_size - 1`` tokens a round, reading the target's layer 0."""
        config = {"architectures": ["ScriptedDraft"], "taps": [0], "block_size": block_size,
                  "script": list(script), "wrong_every_round": wrong_every_round}
        return build_draft(cls, config, target)

    def new_session(self, sampler: Sampler) -> DraftSession:
        return _ScriptedSession(self, sampler)


class _ScriptedSession(DraftSession):
    draft: ScriptedDraft

    def __init__(self, draft: ScriptedDraft, sampler: Sampler) -> None:
        super().__init__(draft, sampler)
        self.context_rows = 0
        self.rounds = 0
        self.width = len(draft.taps) * draft.target.hidden_size

    def _rows(self, tapped: mx.array) -> int:
        if tapped.ndim != 3 or tapped.shape[0] != 1 or tapped.shape[2] != self.width:
            raise AssertionError(f"tapped states of shape {tuple(tapped.shape)}, expected "
                                 f"[1, rows, {self.width}]")
        return int(tapped.shape[1])

    def prefill(self, tapped: mx.array) -> None:
        self.context_rows += self._rows(tapped)

    def commit(self, tapped: mx.array) -> None:
        self.context_rows += self._rows(tapped)

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        if pos != self.context_rows:
            raise AssertionError(f"round at position {pos} but the draft's context holds "
                                 f"{self.context_rows} rows (prefill + commits)")
        script = self.draft._script
        tokens = [script[pos + 1 + i] if pos + 1 + i < len(script) else 0 for i in range(n)]
        if self.draft.wrong_every_round:
            wrong = self.rounds % (n + 1)
            if wrong < n:
                tokens[wrong] = (tokens[wrong] + 1) % self.draft.vocab
        self.rounds += 1
        return DraftProposal.point_mass(mx.array(tokens, dtype=mx.int32))


# -- random DFlash / DFlash2 drafts -------------------------------------------------------------


def _group_size(hidden: int) -> int:
    for size in (16, 8, 4, 2):
        if hidden % size == 0 and hidden // size >= 2:
            return size
    return 1


def random_draft_config(target: Model, architecture: str = "DFlashDraftModel", *,
                        layers: int = 2, block_size: int = 8, heads: int = 4,
                        kv_heads: int = 2, head_dim: int = 8, intermediate: int | None = None,
                        taps: Sequence[int] | None = None,
                        layer_types: Sequence[str] | None = None,
                        sliding_window: int | None = None, **dflash: Any) -> dict[str, Any]:
    """A small draft config.json for ``target``: hidden = the target's, taps first/middle/last."""
    hidden = target.hidden_size
    n = target.num_layers
    chosen = sorted({0, n // 2, n - 1}) if taps is None else list(taps)
    section: dict[str, Any] = {"block_size": block_size, "mask_token_id": target.vocab_size - 1,
                               "target_layer_ids": chosen}
    if architecture == "DFlash2DraftModel":
        section.update(conv_kernel_size=2, conv_group_size=_group_size(hidden),
                       selector_rank=8, selector_top_k=min(8, target.vocab_size))
    section.update(dflash)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate or 2 * hidden,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": target.vocab_size,
        "is_causal": False,
        "dflash_config": section,
    }
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
    return config


def randomize(module: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights: norms near 1, matrices ~ N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    new = []
    for name, value in cast("list[tuple[str, mx.array]]", tree_flatten(module.parameters())):
        shape = tuple(value.shape)
        if name.endswith("norm.weight") or ".aux_hidden_norms." in f".{name}":
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("base_kernel"):
            arr = 0.5 * rng.standard_normal(shape)
        else:
            fan_in = shape[-1] if shape else 1
            arr = rng.standard_normal(shape) / np.sqrt(fan_in)
        new.append((name, mx.array(arr.astype(np.float32)).astype(value.dtype)))
    module.update(tree_unflatten(new))
    mx.eval(module.parameters())


def random_draft(target: Model, architecture: str = "DFlashDraftModel", *, seed: int = 0,
                 **config: Any) -> DraftModel:
    """A registered draft architecture with random weights, built for ``target``."""
    cls = plugins.lookup("drafts", architecture,
                         suggestion="try `pip install mlxrunner-dflash`").obj
    draft = build_draft(cls, random_draft_config(target, architecture, **config), target)
    randomize(draft, seed)
    draft.eval()
    return draft


def _registered_drafts() -> list[str]:
    return [name for name in ("DFlashDraftModel", "DFlash2DraftModel")
            if name in plugins.host().registry("drafts")]


# -- the check ---------------------------------------------------------------------------------


def _prompts(model: Model, prompt_ids: Any, seed: int, count: int, length: int) -> list[list[int]]:
    if prompt_ids is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, model.vocab_size, length).tolist() for _ in range(count)]
    arr = np.asarray(prompt_ids)
    if arr.ndim == 1:
        arr = arr[None]
    return [[int(t) for t in row] for row in arr]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_speculative_greedy(model: Model,
                             draft_factory: Callable[[Model], DraftModel] | None = None,
                             prompt_ids: Any = None, *, seed: int = 0, max_tokens: int = 200,
                             prompts: int = 3, prompt_len: int = 8, depth: int | None = None,
                             random_drafts: bool | None = None, scripted: bool = True,
                             every_draft_on_every_prompt: bool = False
                             ) -> list[SpeculativeStats]:
    """Greedy speculative output equals plain greedy output, token for token.

    For each prompt (rows of ``prompt_ids`` [B, L], else ``prompts`` random ones
    of ``prompt_len`` tokens drawn from ``seed``), plain greedy decoding of
    ``max_tokens`` tokens is compared with speculative decoding using:

    - ``draft_factory(model)`` when given;
    - random DFlash / DFlash2 drafts when registered (``random_drafts``: default
      True when no factory is given), one kind per prompt in turn unless
      ``every_draft_on_every_prompt``;
    - a :class:`ScriptedDraft` whose first wrong token cycles through every
      position of its block, so every rollback length runs (``scripted``).

    Returns the statistics of every speculative run; raises AssertionError at the
    first difference, naming the draft, the prompt and the position.
    """
    if random_drafts is None:
        random_drafts = draft_factory is None
    all_stats: list[SpeculativeStats] = []
    for p_index, prompt in enumerate(_prompts(model, prompt_ids, seed, prompts, prompt_len)):
        plain = plain_tokens(model, prompt, max_tokens)
        drafts: list[tuple[str, DraftModel]] = []
        if draft_factory is not None:
            made = draft_factory(model)
            drafts.append((type(made).__name__, made))
        if random_drafts:
            names = _registered_drafts()
            if not every_draft_on_every_prompt and names:
                names = [names[p_index % len(names)]]
            for name in names:
                drafts.append((f"random {name}",
                               random_draft(model, name, seed=seed + 100 * p_index)))
        if scripted:
            drafts.append(("ScriptedDraft", ScriptedDraft.for_script(model, prompt + plain)))
        for label, draft in drafts:
            # a fixed-depth draft drafts its whole block every round here (the loop would
            # pause it where plain steps are faster, and skip the rollbacks under test)
            rounds = depth if depth is not None or draft.adaptive_depth else draft.max_depth
            tokens, stats = speculative_tokens(model, draft, prompt, max_tokens, depth=rounds)
            where = _first_difference(tokens, plain)
            if where is not None:
                lo = max(0, where - 3)
                raise AssertionError(
                    f"{type(model).__name__} with {label} (prompt {p_index}): speculative "
                    f"greedy differs from plain greedy at generated token {where} of "
                    f"{len(plain)}: speculative {tokens[lo:where + 4]} vs plain "
                    f"{plain[lo:where + 4]} (from index {lo}); stats {stats.as_dict()}")
            if label == "ScriptedDraft" and len(plain) > 4 * draft.max_depth:
                seen = set(stats.accepted_lengths)
                wanted = set(range(draft.max_depth + 1))
                if not wanted <= seen:
                    raise AssertionError(f"{type(model).__name__}: the scripted draft did not "
                                         f"reach every accepted length: saw {sorted(seen)}")
            all_stats.append(stats)
    return all_stats


# -- sampled exactness: exact distributions and a chi-square test ------------------------------


def exact_joint(model: Model, prompt: Sequence[int], options: SamplerOptions,
                length: int) -> np.ndarray:
    """The exact joint distribution of the first ``length`` tokens plain decoding emits.

    Enumerates every prefix with the sampler's own steps 1-7 (penalty history =
    prompt + emitted tokens); shape ``[V] * length``. Cost: V**(length-1)
    forwards without cache, batched per level; meant for vocabularies of 16-64.
    """
    vocab = model.vocab_size
    sampler = Sampler(options, vocab)
    joint = np.ones((1,), dtype=np.float64)
    prefixes = np.zeros((1, 0), dtype=np.int32)
    for _ in range(length):
        ids = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(prefixes), 1)),
                              prefixes], axis=1)
        logits = cast(mx.array, model(mx.array(ids)))
        last = logits[:, -1, :].astype(mx.float32)
        histories = [list(prompt) + row.tolist() for row in prefixes]
        probs = np.array(sampler.distributions(last, histories).dense(vocab), dtype=np.float64)
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = np.concatenate([np.repeat(prefixes, vocab, axis=0),
                                   np.tile(np.arange(vocab, dtype=np.int32),
                                           len(prefixes))[:, None]], axis=1)
    return joint.reshape((vocab,) * length)


def _upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): series below a + 1, continued fraction above."""
    if x <= 0:
        return 1.0
    log_front = -x + a * np.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi_square(counts: Any, probs: Any, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness of fit of ``counts`` to ``probs`` (same shape, any).

    Cells expected below ``min_expected`` are pooled into one cell (dropped if still
    below); a count in a cell of probability zero fails outright (p = 0). Returns
    (statistic, degrees of freedom, p-value).
    """
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    if counts[probs <= 0].sum() > 0:
        return math.inf, 0, 0.0
    n = counts.sum()
    expected = probs / probs.sum() * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if expected[~big].sum() >= min_expected:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    if len(obs_a) < 2:
        return 0.0, 0, 1.0
    # rescale to the cells kept so that both sides sum alike
    exp_a = exp_a * obs_a.sum() / exp_a.sum()
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    dof = len(obs_a) - 1
    return stat, dof, _upper_gamma_regularized(dof / 2, stat / 2)


def check_speculative_sampled(model: Model, draft: DraftModel, options: SamplerOptions, *,
                              prompt: Sequence[int], runs: int = 1000, length: int = 4,
                              depth: int | None = None, alpha: float = 1e-3
                              ) -> dict[str, float]:
    """Sampled exactness: the first ``length`` tokens of speculative decoding follow plain
    decoding's exact distribution (:func:`exact_joint`).

    ``runs`` generations with seeds ``0 .. runs-1`` (deterministic); Pearson chi-square
    tests of each position's marginal after the first (the first token comes from the
    prefill, before any draft) and of each pair of neighbouring positions. Raises
    AssertionError when a p-value is below ``alpha``; returns the p-values by name.
    """
    if length < 2:
        raise ValueError("length must be at least 2 (the first token is never drafted)")
    vocab = model.vocab_size
    joint = exact_joint(model, prompt, options, length)
    samples = np.zeros((runs, length), dtype=np.int64)
    drafted = accepted = 0
    for seed in range(runs):
        seeded = SamplerOptions(**{**options.__dict__, "seed": seed})
        tokens, stats = speculative_tokens(model, draft, prompt, length + 1, options=seeded,
                                           depth=depth)
        samples[seed] = tokens[:length]
        drafted += stats.drafted
        accepted += stats.accepted
    results: dict[str, float] = {}
    for i in range(1, length):
        marginal = joint.sum(axis=tuple(a for a in range(length) if a != i))
        counts = np.bincount(samples[:, i], minlength=vocab)
        results[f"token {i + 1}"] = chi_square(counts, marginal)[2]
    for i in range(length - 1):
        pair = joint.sum(axis=tuple(a for a in range(length) if a not in (i, i + 1)))
        pair_counts = np.zeros((vocab, vocab))
        np.add.at(pair_counts, (samples[:, i], samples[:, i + 1]), 1)
        results[f"tokens {i + 1},{i + 2}"] = chi_square(pair_counts, pair)[2]
    results["acceptance_rate"] = accepted / drafted if drafted else 0.0
    failed = {k: v for k, v in results.items() if k != "acceptance_rate" and v < alpha}
    if failed:
        shown = ", ".join(f"{k}: p = {v:.2g}" for k, v in failed.items())
        raise AssertionError(f"{type(draft).__name__} on {type(model).__name__}: speculative "
                             f"samples do not follow plain decoding's distribution ({shown}; "
                             f"{runs} runs, options {options})")
    return results


# -- a target small enough to enumerate ----------------------------------------------------------


class TokenHistoryCache(Cache):
    """The cache of :class:`ToyTarget`: the token ids seen so far."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = mx.zeros((1, 0), dtype=mx.int32)

    def extend(self, ids: mx.array) -> mx.array:
        self.ids = mx.concatenate([self.ids, ids.astype(mx.int32)], axis=1)
        self.offset += ids.shape[1]
        return self.ids

    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        self.ids = self.ids[:, :offset]
        self.offset = offset
        self.discard_snapshots()

    @property
    def state(self) -> list[mx.array]:
        return [self.ids]


class ToyTarget(Model):
    """``h_t = E[x_t] + F[x_{t-1}] + G[x_{t-2}]``, logits ``h_t W``: each next-token
    distribution depends on the last three tokens, so exact distributions can be
    enumerated. One "layer"; tap 0 is ``h``. Config: ``vocab_size``, ``hidden_size``,
    ``seed``, ``scale`` (logit scale; larger is peakier)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        vocab = int(config.get("vocab_size", 16))
        hidden = int(config.get("hidden_size", 16))
        rng = np.random.default_rng(int(config.get("seed", 0)))
        scale = float(config.get("scale", 2.0))
        self._vocab, self._hidden = vocab, hidden

        def table(*shape: int) -> mx.array:
            return mx.array((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

        self.E = table(vocab, hidden)
        self.F = table(vocab, hidden)
        self.G = table(vocab, hidden)
        self.W = table(hidden, vocab) * scale

    def make_cache(self) -> list[Cache | None]:
        return [TokenHistoryCache()]

    def __call__(self, ids: mx.array, cache: Sequence[Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None) -> Any:
        ids = ids.astype(mx.int32)
        B, L = ids.shape
        if cache is not None and cache[0] is not None:
            history = cast(TokenHistoryCache, cache[0]).extend(ids)  # from make_cache
        else:
            history = ids
        start = history.shape[1] - L
        padded = mx.concatenate([mx.full((B, 2), -1, dtype=mx.int32), history], axis=1)
        prev1 = padded[:, start + 1:start + 1 + L]
        prev2 = padded[:, start:start + L]
        h = self.E[ids]
        h = h + mx.where((prev1 >= 0)[..., None], self.F[mx.maximum(prev1, 0)], 0.0)
        h = h + mx.where((prev2 >= 0)[..., None], self.G[mx.maximum(prev2, 0)], 0.0)
        logits = h @ self.W
        if taps is None:
            return logits
        if list(taps) != [0]:
            raise ValueError("ToyTarget has one layer: taps must be [0]")
        return logits, h

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.E[ids]

    def raw_logits(self, hidden: mx.array) -> mx.array:
        return hidden @ self.W

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def hidden_size(self) -> int:
        return self._hidden
