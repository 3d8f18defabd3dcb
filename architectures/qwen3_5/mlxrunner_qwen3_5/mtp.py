"""Qwen3.5's multi-token-prediction head (``mtp.*`` in the Hub checkpoints) as a draft.

The head predicts the token after ``t + 1`` from the target's state at ``t`` and the token
at ``t + 1``::

    x = fc(concat(pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)))
    x = layer(x)                   one full-attention decoder layer, its own KV cache
    logits = lm_head(norm(x))      the target's embedding and head

``h_t`` is the target's last hidden state before its final norm (the tap of its last layer);
the layer is the target's own full-attention decoder layer (gated attention, then its
feed-forward block: dense, or the experts of a ``qwen3_5_moe`` target); every norm is
zero-centred (``1 + w``) like the target's. Chained, each step feeds its own ``x`` (before
the final norm) forward as the next step's ``h``, with the token it drafted.

Checkpoint names: ``mtp.fc.weight [hidden, 2 * hidden]``, ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight`` ``[hidden]``, and ``mtp.layers.0.*``
named as a target layer is; the layer's tensors go through the target's own ``sanitize``
(so a mixture-of-experts head's experts are packed as the target's are). The released
configs say ``mtp_num_hidden_layers: 1``; that is the shape supported.

The head's cache: row ``t`` (rotary position ``t``) pairs ``h_t`` with ``token_{t+1}``, so it
runs one token behind the target. A round at ``pos`` starts from the head's output at row
``pos - 1`` (computed when that row's token became known), drafts ``d_0`` from it, and each
further draft writes a speculative row that the round takes back before it ends; the
committed rows are computed again from the target's own states at the next commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

import mlxrunner.nn as mnn
from mlxrunner.plugin import (
    ConfigBound,
    DraftConfigError,
    DraftModel,
    DraftProposal,
    DraftSession,
    KVCache,
)

from .model import FULL, DecoderLayer, Qwen3_5

#: most tokens one round drafts (each costs one head step; acceptance falls with depth)
MAX_DEPTH = 3


class Qwen3_5MTP(DraftModel):
    """The MTP head of a Qwen3.5 checkpoint (dense or mixture of experts)."""

    #: the round's depth follows the core's depth controller (measured round costs)
    adaptive_depth = True
    checkpoint_kind = "mtp"
    checkpoint_prefixes = ("mtp.", "model.mtp.", "language_model.mtp.",
                           "model.language_model.mtp.")
    config_bounds = {"mtp_num_hidden_layers": ConfigBound(int, 0, 64)}

    def __init__(self, config: dict[str, Any], target: Any) -> None:
        super().__init__(config, target)
        if not isinstance(target, Qwen3_5):
            raise DraftConfigError(f"Qwen3_5MTP drafts for a Qwen3.5 target, not "
                                   f"{type(target).__name__}")
        layers = config.get("num_hidden_layers")
        if type(layers) is not int or layers < 1:
            raise DraftConfigError(f"Qwen3_5MTP: num_hidden_layers {layers!r} is not a layer "
                                   "count")
        #: the head reads the target's last layer (its state before the final norm)
        self._taps = (layers - 1,)
        count = config.get("mtp_num_hidden_layers", 1)
        if count != 1:
            raise DraftConfigError(f"Qwen3_5MTP supports mtp_num_hidden_layers 1 (the released "
                                   f"checkpoints'), this config says {count!r}")
        if config.get("mtp_use_dedicated_embeddings"):
            raise DraftConfigError("Qwen3_5MTP reads the target's embedding; this config asks "
                                   "for a dedicated one (mtp_use_dedicated_embeddings)")
        cfg = target.config
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = mnn.RMSNorm(hidden, eps, offset=1.0)
        self.pre_fc_norm_hidden = mnn.RMSNorm(hidden, eps, offset=1.0)
        self.fc = mnn.Linear(2 * hidden, hidden, bias=False)
        # the head is a one-layer model of the target's kind: its feed-forward block is what
        # the target would give its layer 0 (a mixture of experts for qwen3_5_moe)
        # (passed in: a mixture-of-experts config may have no dense intermediate_size)
        feed_forward = getattr(target, "layer_mlp", lambda index: None)(0)
        self.layers = [DecoderLayer(cfg, FULL, feed_forward)]
        self.norm = mnn.RMSNorm(hidden, eps, offset=1.0)

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    @property
    def max_depth(self) -> int:
        return MAX_DEPTH

    # -- loading -------------------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Strip the ``mtp.`` prefix; the layer's tensors are converted by the target's own
        ``sanitize`` under the name of one of its full-attention layers."""
        target = self.target
        stand_in = next((i for i, layer in enumerate(target.layers) if not layer.is_linear), 0)
        as_target = f"model.layers.{stand_in}."
        own: dict[str, mx.array] = {}
        layer_tensors: dict[str, mx.array] = {}
        for name, value in weights.items():
            prefix = next((p for p in self.checkpoint_prefixes if name.startswith(p)), None)
            if prefix is None:
                continue
            rest = name[len(prefix):]
            if rest.startswith("layers.0."):
                layer_tensors[as_target + rest[len("layers.0."):]] = value
            else:
                own[rest] = value
        for name, value in target.sanitize(layer_tensors).items():
            if not name.startswith(as_target):
                raise ValueError(f"the target's sanitize renamed an MTP layer tensor to {name}")
            own["layers.0." + name[len(as_target):]] = value
        return own

    # -- the head's math -----------------------------------------------------------------
    def step(self, hidden: mx.array, ids: mx.array, caches: Sequence[KVCache]) -> mx.array:
        """The head over rows ``[1, R]``: states ``hidden [1, R, H]`` each paired with the
        next token ``ids [1, R]``, appended to ``caches``; returns the layer's output (before
        the final norm) ``[1, R, H]``."""
        embedded = self.pre_fc_norm_embedding(self.embed_tokens(ids))
        x = self.fc(mx.concatenate([embedded, self.pre_fc_norm_hidden(hidden)], axis=-1))
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return x

    def logits(self, out: mx.array) -> mx.array:
        """Logits of the head's outputs (the target's head after the head's final norm)."""
        return self.raw_logits(self.norm(out))

    def new_session(self, sampler: Any) -> MTPSession:
        return MTPSession(self, sampler)


class MTPSession(DraftSession):
    """One generation's head cache, the target states waiting for their next token, and the
    head's output at its last committed row."""

    draft: Qwen3_5MTP

    def __init__(self, draft: Qwen3_5MTP, sampler: Any) -> None:
        super().__init__(draft, sampler)
        self.caches = [KVCache() for _ in draft.layers]
        self.tokens: list[int] = []
        self.waiting: mx.array | None = None  # target states of rows not yet run [1, R, H]
        self.last: mx.array | None = None  # the head's output at row rows - 1 [1, 1, H]

    @property
    def rows(self) -> int:
        """Rows the head's cache holds (committed ones: row t pairs h_t and token t+1)."""
        return self.caches[0].offset

    @property
    def state(self) -> list[mx.array]:
        arrays = [a for cache in self.caches for a in cache.state]
        return arrays + [a for a in (self.waiting, self.last) if a is not None]

    def extend_tokens(self, ids: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in ids)

    def prefill(self, tapped: mx.array) -> None:
        self._queue(tapped)

    def commit(self, tapped: mx.array) -> None:
        self._queue(tapped)

    def _queue(self, tapped: mx.array) -> None:
        self.waiting = tapped if self.waiting is None else mx.concatenate(
            [self.waiting, tapped], axis=1)
        self._run_ready()

    def _run_ready(self) -> None:
        """Run the head over every waiting state whose next token is known."""
        if self.waiting is None:
            return
        ready = min(int(self.waiting.shape[1]), len(self.tokens) - 1 - self.rows)
        if ready <= 0:
            return
        start = self.rows
        ids = mx.array(self.tokens[start + 1:start + 1 + ready], dtype=mx.int32)[None]
        out = self.draft.step(self.waiting[:, :ready], ids, self.caches)
        self.last = out[:, -1:]
        self.waiting = self.waiting[:, ready:] if ready < self.waiting.shape[1] else None

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        self._run_ready()  # the state of pos - 1 waited for the token at pos (current)
        if self.rows != pos or self.last is None or len(self.tokens) != pos + 1 \
                or self.tokens[pos] != current:
            raise ValueError(f"MTP session holds {self.rows} rows and {len(self.tokens)} "
                             f"tokens; the round is at {pos} with token {current}")
        if not 1 <= n <= self.draft.max_depth:
            raise ValueError(f"the MTP head drafts 1..{self.draft.max_depth} tokens, asked "
                             f"for {n}")
        greedy = self.temperature <= 0
        out = self.last
        drafts: list[mx.array] = []
        probs: list[mx.array] = []
        for i in range(n):
            if i:
                out = self.draft.step(out, drafts[-1].reshape(1, 1), self.caches)
            logits = self.draft.logits(out)[0, -1].astype(mx.float32)
            if greedy:
                drafts.append(mx.argmax(logits).astype(mx.int32).reshape(1))
            else:
                row = mx.softmax(logits / self.temperature, axis=-1)
                drafts.append(self.draw(row))
                probs.append(row)
        if n > 1:  # the speculative rows pos .. pos+n-2 leave the cache
            for cache in self.caches:
                cache.schedule_snapshots([pos])
                cache.restore(pos)
        tokens = mx.concatenate(drafts)
        if greedy:
            return DraftProposal.point_mass(tokens)
        return DraftProposal(tokens, mx.stack(probs))
