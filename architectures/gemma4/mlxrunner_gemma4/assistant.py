"""Gemma 4 assistant drafts (``Gemma4AssistantForCausalLM``, e.g. gemma-4-E2B-it-assistant).

Facts (the project's models-more.md; transformers' ``gemma4_assistant``): a small Gemma 4
text model whose layers all share keys and values: each has ``q_proj``, ``q_norm`` and
``o_proj`` only and attends over the *target's* keys and values of its layer type, those of
the target's last sliding and last full-attention layer that compute their own. A step reads
one token and one state of the target's width: ``x = pre_projection(concat(
target.embed_tokens(token), state))`` runs through the layers at one position, the one the
target's full cache ends at (every step of a round sits there); the output ``norm(h)`` gives
the logits through the tied head (no softcap), and ``post_projection(norm(h))`` is the next
step's state. The first state of a round is the target's final-normed hidden state of the
last committed token, the first token ``current``.

With ``use_ordered_embeddings`` the head scores only the tokens of the
``centroid_intermediate_top_k`` centroids that ``masked_embedding.centroids`` ranks highest
(``masked_embedding.token_ordering`` lists each centroid's ``vocab / num_centroids`` tokens);
every other token's logit is -inf, so proposals are drawn from those candidates only (q is
sparse over them).

A round chains ``n`` steps; each row's distribution q_i (softmax at the request's
temperature) is recorded for the exact acceptance test. The draft keeps no context of its
own: the target's caches are read, never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import (
    ConfigBound,
    DraftConfigError,
    DraftModel,
    DraftProposal,
    DraftSession,
    KVCache,
    Model,
    RingCache,
    topk_indices,
)

from .model import FULL, SLIDING, DecoderLayer, Gemma4Config, Gemma4Model

#: drafts per round at most, unless the config's ``num_assistant_tokens`` says otherwise
DEFAULT_DEPTH = 4


@dataclass(frozen=True)
class AssistantSettings:
    backbone_hidden_size: int
    ordered: bool
    num_centroids: int
    top_centroids: int
    depth: int


def _settings(config: dict[str, Any]) -> AssistantSettings:
    try:
        return AssistantSettings(
            backbone_hidden_size=int(config["backbone_hidden_size"]),
            ordered=bool(config.get("use_ordered_embeddings", False)),
            num_centroids=int(config.get("num_centroids") or 2048),
            top_centroids=int(config.get("centroid_intermediate_top_k") or 32),
            depth=int(config.get("num_assistant_tokens") or DEFAULT_DEPTH),
        )
    except KeyError as exc:
        raise DraftConfigError(f"Gemma 4 assistant config: missing key {exc}") from None


def _text_config(config: dict[str, Any]) -> Gemma4Config:
    """The assistant's own layers: its text config with every layer reading the target's
    keys and values (``kv_source`` -1: no layer of the draft computes any)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DraftConfigError("Gemma 4 assistant config has no text_config")
    for key, value in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                       ("use_double_wide_mlp", False)):
        if text.get(key) not in (None, value):
            raise DraftConfigError(f"Gemma 4 assistant text_config: {key} must be {value!r}")
    # Parsed as a model without sharing; the draft's layers then read the target's instead.
    cfg = Gemma4Config.from_dict({**text, "num_kv_shared_layers": 0})
    return replace(cfg, kv_source=[-1] * cfg.num_layers)


class AssistantTextModel(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(cfg.vocab_size, cfg.hidden_size)  # the tied head
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MaskedEmbedding(nn.Module):
    """The centroid head: which tokens are scored at all."""

    def __init__(self, hidden: int, vocab: int, settings: AssistantSettings) -> None:
        super().__init__()
        self.centroids = mnn.Linear(hidden, settings.num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.top = settings.top_centroids
        self.groups = settings.num_centroids

    def candidates(self, hidden: mx.array) -> mx.array:
        """[R, top * vocab / num_centroids] token ids of the top centroids of each row."""
        top = topk_indices(self.centroids(hidden), self.top)
        ordering = self.token_ordering.reshape(self.groups, -1)
        return ordering[top].reshape(hidden.shape[0], -1)


class Gemma4AssistantDraft(DraftModel):
    """``Gemma4AssistantForCausalLM`` as a draft of a Gemma 4 target (see the module)."""

    adaptive_depth = True
    reads_target_caches = True  # the target's last full and sliding layers' keys and values
    config_bounds = {
        "backbone_hidden_size": ConfigBound(int, 1, 2**17),
        "num_centroids": ConfigBound(int, 1, 2**20),
        "centroid_intermediate_top_k": ConfigBound(int, 1, 2**20),
        "num_assistant_tokens": ConfigBound(int, 1, 64),
        "use_ordered_embeddings": ConfigBound(bool),
    }

    def __init__(self, config: dict[str, Any], target: Model) -> None:
        settings = _settings(config)
        cfg = _text_config(config)
        super().__init__(config, target)
        #: the target's last layer is tapped (its final-normed state seeds a round)
        self._taps = (target.num_layers - 1,)
        self.assistant = settings
        self.args = cfg
        backbone, hidden = settings.backbone_hidden_size, cfg.hidden_size
        self.model = AssistantTextModel(cfg)
        self.pre_projection = mnn.Linear(2 * backbone, hidden, bias=False)
        self.post_projection = mnn.Linear(hidden, backbone, bias=False)
        if settings.ordered:
            self.masked_embedding = MaskedEmbedding(hidden, cfg.vocab_size, settings)

    # -- loading -----------------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' names are ours; the tied head is dropped; the token ordering must
        be a permutation of the vocabulary."""
        out = {k: v for k, v in weights.items()
               if not k.startswith("lm_head.") and "rotary_emb" not in k}
        key = "masked_embedding.token_ordering"
        if key in out:
            ordering = out[key].astype(mx.int32)
            vocab = self.args.vocab_size
            if ordering.shape != (vocab,) or not mx.array_equal(
                    mx.sort(ordering), mx.arange(vocab, dtype=mx.int32)).item():
                raise ValueError(f"{key} is not an ordering of the {vocab} tokens")
            out[key] = ordering
        return out

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    @property
    def max_depth(self) -> int:
        """Up to ``num_assistant_tokens`` drafts a round."""
        return self.assistant.depth

    def validate(self, target: Model) -> None:
        super().validate(target)
        name = "Gemma 4 assistant"
        if not isinstance(target, Gemma4Model):
            raise DraftConfigError(f"{name}: the target must be a Gemma 4 model, not "
                                   f"{type(target).__name__}")
        cfg, t = self.args, target.args
        if cfg.vocab_size != target.vocab_size:
            raise DraftConfigError(f"{name}: vocabulary {cfg.vocab_size} differs from the "
                                   f"target's {target.vocab_size}")
        if self.assistant.backbone_hidden_size != target.hidden_size:
            raise DraftConfigError(f"{name}: its backbone's hidden size "
                                   f"{self.assistant.backbone_hidden_size} differs from the "
                                   f"target's {target.hidden_size} (backbone_hidden_size)")
        sources = target.last_kv_layers()
        for i, layer_type in enumerate(cfg.layer_types):
            source = sources.get(layer_type)
            if source is None:
                raise DraftConfigError(f"{name}: layer {i} reads {layer_type} keys and values "
                                       "but the target has no such layer")
            if cfg.head_dims[i] != t.head_dims[source]:
                raise DraftConfigError(f"{name}: layer {i} has head dim {cfg.head_dims[i]}, "
                                       f"the target's {layer_type} keys {t.head_dims[source]}")
            if cfg.num_heads % t.kv_heads[source]:
                raise DraftConfigError(f"{name}: {cfg.num_heads} heads do not group over the "
                                       f"target's {t.kv_heads[source]} key/value heads")
        if SLIDING in cfg.layer_types and cfg.sliding_window != t.sliding_window:
            raise DraftConfigError(f"{name}: sliding window {cfg.sliding_window} differs from "
                                   f"the target's {t.sliding_window}")
        s = self.assistant
        if s.ordered and (cfg.vocab_size % s.num_centroids or s.top_centroids > s.num_centroids):
            raise DraftConfigError(f"{name}: {s.num_centroids} centroids must divide the "
                                   f"vocabulary of {cfg.vocab_size} and be at least "
                                   f"centroid_intermediate_top_k ({s.top_centroids})")

    # -- the step ------------------------------------------------------------------------
    @property
    def gemma_target(self) -> Gemma4Model:
        target = self.target
        assert isinstance(target, Gemma4Model)  # validate checked it
        return target

    def seed_state(self, tapped: mx.array) -> mx.array:
        """The first state of a round from the target's last-layer tap of the last committed
        row ([1, rows, hidden]): its final-normed hidden state, [1, 1, hidden]."""
        return self.gemma_target.model.norm(tapped[:, -1:])

    def target_kv(self, caches: dict[str, KVCache | RingCache], pos: int,
                  dtype: mx.Dtype) -> dict[str, mnn.KV]:
        """The keys and values each layer type attends over: every position before ``pos``
        in the full cache, the ring's ``window`` positions before it (slot order: one query
        sees keys as a set). The ring is what the target keeps; transformers' assistant,
        handed a longer sliding history, would reach one position further (its
        bidirectional window counts distance inclusively)."""
        kv = {}
        for layer_type, cache in caches.items():
            if cache.keys is None or cache.values is None or cache.offset != pos:
                raise ValueError(f"the target's {layer_type} cache is not at position {pos}")
            filled = min(cache.offset, cache.window) if isinstance(cache, RingCache) \
                else cache.offset
            keys, values = cache.keys[..., :filled, :], cache.values[..., :filled, :]
            if keys.dtype != dtype:
                keys, values = keys.astype(dtype), values.astype(dtype)
            kv[layer_type] = mnn.KV(keys, values, None)
        return kv

    def step(self, token: mx.array, state: mx.array, pos: int,
             kv: dict[str, mnn.KV]) -> tuple[mx.array, mx.array]:
        """One step at ``pos``: ``token`` [1] int32 and ``state`` [1, 1, backbone] to the
        final-normed output [1, 1, hidden] and the next state [1, 1, backbone]."""
        embedded = self.gemma_target.embed_tokens(token[None]).astype(state.dtype)
        h = self.pre_projection(mx.concatenate([embedded, state], axis=-1))
        for layer, layer_type in zip(self.model.layers, self.args.layer_types):
            h, _ = layer(h, None, pos, kv[layer_type], None)
        out = self.model.norm(h)
        return out, self.post_projection(out)

    def scores(self, out: mx.array) -> tuple[mx.array, mx.array | None]:
        """Logits of one step's output [1, 1, hidden]: ``([1, V], None)`` through the tied
        head, or with ordered embeddings ``([1, K], ids [1, K])`` over the candidates."""
        row = out.reshape(1, -1)
        if not self.assistant.ordered:
            return self.model.embed_tokens.as_linear(row), None
        ids = self.masked_embedding.candidates(row)
        rows = self.model.embed_tokens(ids)  # [1, K, hidden] (dequantized when quantized)
        return (rows @ row[..., None])[..., 0], ids

    def logits(self, out: mx.array) -> mx.array:
        """Dense logits [1, V] of one step's output (-inf outside the candidates)."""
        scores, ids = self.scores(out)
        if ids is None:
            return scores
        dense = mx.full((1, self.args.vocab_size), -mx.inf, dtype=scores.dtype)
        return mx.put_along_axis(dense, ids, scores, axis=-1)

    def new_session(self, sampler: Any) -> AssistantSession:
        return AssistantSession(self, sampler)


class AssistantSession(DraftSession):
    """A generation's draft state: the seed state of the next round and the target's
    caches (read-only)."""

    draft: Gemma4AssistantDraft

    def __init__(self, draft: Gemma4AssistantDraft, sampler: Any) -> None:
        super().__init__(draft, sampler)
        self.seed: mx.array | None = None
        self.caches: dict[str, KVCache | RingCache] | None = None
        self.rows = 0
        self.dtype = draft.dtype

    def bind_target_caches(self, caches: Sequence[Any] | None) -> None:
        if caches is None:
            self.caches = None
            return
        self.caches = {t: caches[i] for t, i in self.draft.gemma_target.last_kv_layers().items()}

    def prefill(self, tapped: mx.array) -> None:
        if self.caches is None:
            # none bound: the caches the target made last (a session used on its own)
            self.caches = self.draft.gemma_target.shared_caches()
        self.rows += int(tapped.shape[1])
        self._check_caches(self.rows)
        self.seed = self.draft.seed_state(tapped)

    def commit(self, tapped: mx.array) -> None:
        self.rows += int(tapped.shape[1])
        self.seed = self.draft.seed_state(tapped)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.seed is None else [self.seed]

    def _check_caches(self, pos: int) -> dict[str, KVCache | RingCache]:
        caches = self.caches
        full = caches.get(FULL) if caches is not None else None
        if caches is None or full is None or full.offset != pos:
            raise RuntimeError(f"the Gemma 4 assistant reads the target's caches at position "
                               f"{pos}, but they are not this generation's (made with "
                               f"make_cache before the draft session?)")
        return caches

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        if self.seed is None or pos != self.rows:
            raise ValueError(f"draft state is at {self.rows} rows, round is at {pos}")
        if not 1 <= n <= self.draft.max_depth:
            raise ValueError(f"the assistant drafts 1..{self.draft.max_depth} tokens, asked "
                             f"for {n}")
        draft = self.draft
        state = self.seed.astype(self.dtype)
        kv = draft.target_kv(self._check_caches(pos), pos, self.dtype)
        token = mx.array([current], dtype=mx.int32)
        greedy = self.temperature <= 0
        tokens, probs, cands = [], [], []
        for _ in range(n):
            out, state = draft.step(token, state, pos, kv)
            scores, ids = draft.scores(out)
            if greedy:
                best = mx.argmax(scores, axis=-1)
                token = (best if ids is None else mx.take_along_axis(
                    ids, best[:, None], axis=-1)[:, 0]).astype(mx.int32)
            else:
                q = mx.softmax(scores.astype(mx.float32) / self.temperature, axis=-1,
                               precise=True)
                token = self.draw(q, ids).astype(mx.int32)
                probs.append(q)
                if ids is not None:
                    cands.append(ids)
            tokens.append(token)
        drafted = mx.concatenate(tokens)
        if greedy:
            return DraftProposal.point_mass(drafted)
        return DraftProposal(drafted, mx.concatenate(probs),
                             mx.concatenate(cands).astype(mx.int32) if cands else None)
