"""Gemma 4 text models (E2B / E4B with per-layer inputs and KV sharing, 31B with K=V full
layers, 26B-A4B with a mixture-of-experts block).

Facts (see the project's models.md): sliding layers use ``head_dim`` with plain RoPE (theta
1e4) over a ``sliding_window`` ring; full layers use ``global_head_dim`` with "proportional"
RoPE (theta 1e6, only the first quarter of the frequencies non-zero); attention scale 1.0
with weighted q/k RMSNorms and a weightless v norm; the last ``num_kv_shared_layers``
layers attend over the keys and values of the last earlier layer of their type; RMSNorms
multiply by ``w`` (not ``1 + w``); the embedding is scaled by sqrt(hidden) in the weight
dtype; logits are softcapped at 30.

A layer: ``h = x + post_attention_norm(attention(input_norm(x)))``, then
``h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))`` (with the MoE block: the
MLP's and the experts' outputs each normed and summed first), then, with per-layer inputs,
``h = h + post_per_layer_input_norm(projection(gelu(gate(h)) * per_layer_input))``, and
finally ``h * layer_scalar``. The MLP is ``down(gelu_tanh(gate(x)) * up(x))``.

Built from ``mlxrunner.nn``; the core traces the decode step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import (
    Cache,
    ConfigBound,
    Encoder,
    KVCache,
    Model,
    ModelFolderError,
    RingCache,
    topk_indices,
)

from .image import IMAGE_TOKEN_ID

SLIDING = "sliding_attention"
FULL = "full_attention"

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
           "rope_theta": 1_000_000.0},
}


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------
@dataclass
class Gemma4Config:
    """The text config with every per-layer fact resolved."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: list[str]
    head_dims: list[int]
    kv_heads: list[int]
    kv_source: list[int]  # the layer whose keys/values layer i attends over (itself if own)
    k_eq_v: list[bool]
    intermediate_sizes: list[int]
    rope: dict[str, dict[str, Any]]  # per layer type: its rope_parameters block
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    attention_bias: bool
    enable_moe_block: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    pad_token_id: int
    #: config.json's image / audio / video token ids, which Gemma4ForConditionalGeneration
    #: embeds as ``pad_token_id`` (media rows replace the image ones); empty for a text-only
    #: config (Gemma4ForCausalLM looks every id up)
    media_token_ids: tuple[int, ...]
    #: ``use_bidirectional_attention: "vision"`` (31B-style): in a prompt chunk holding
    #: media, the sliding layers let each run of image (or video) soft tokens attend to
    #: each other both ways (transformers' ``create_masks_for_vision_model``)
    bidirectional_vision: bool = False
    #: the ids whose runs are those blocks (the processor's mm_token_type_ids 1 and 2)
    vision_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Gemma4Config:
        try:
            return cls._from_dict(config)
        except (KeyError, TypeError, ValueError) as exc:
            missing = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ModelFolderError(f"Gemma 4 config: {missing}") from None

    @classmethod
    def _from_dict(cls, c: dict[str, Any]) -> Gemma4Config:
        activation = c.get("hidden_activation", "gelu_pytorch_tanh")
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {activation!r}")
        if c.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' is not a causal language model")
        n = int(c["num_hidden_layers"])
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        kv = int(c.get("num_key_value_heads") or heads)
        k_eq_v = bool(c.get("attention_k_eq_v", False))

        layer_types = c.get("layer_types")
        if layer_types is None:
            pattern = int(c.get("sliding_window_pattern", 6))
            layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        layer_types = list(layer_types)
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        for t in layer_types:
            if t not in (SLIDING, FULL):
                raise ValueError(f"unknown layer type {t!r}")
        layer_types[-1] = FULL  # transformers forces the last layer to full attention

        # Full layers' head dim and KV heads: Hub configs say global_head_dim and
        # num_global_key_value_heads; transformers' text configs per_layer_config.
        head_dims = [head_dim] * n
        kv_heads = [kv] * n
        per_layer = c.get("per_layer_config")
        if per_layer:
            for key, override in per_layer.items():
                i = int(key)
                if not 0 <= i < n:
                    raise ValueError(f"per_layer_config names layer {key!r} of {n}")
                head_dims[i] = int(override.get("head_dim", head_dims[i]))
                kv_heads[i] = int(override.get("num_key_value_heads", kv_heads[i]))
        else:
            global_dim = int(c.get("global_head_dim") or 512)
            global_kv = c.get("num_global_key_value_heads")
            for i, t in enumerate(layer_types):
                if t == FULL:
                    head_dims[i] = global_dim
                    if k_eq_v and global_kv is not None:
                        kv_heads[i] = int(global_kv)
        for i in range(n):
            if heads % kv_heads[i]:
                raise ValueError(f"layer {i}: {heads} heads do not group over "
                                 f"{kv_heads[i]} key/value heads")

        shared = int(c.get("num_kv_shared_layers") or 0)
        if not 0 <= shared < n:
            raise ValueError(f"num_kv_shared_layers {shared} must be below {n} layers")
        first_shared = n - shared
        kv_source = list(range(n))
        last_of_type = {t: i for i, t in enumerate(layer_types[:first_shared])}
        for j in range(first_shared, n):
            if layer_types[j] not in last_of_type:
                raise ValueError(f"layer {j} ({layer_types[j]}) shares keys and values but "
                                 "no earlier layer of its type has any")
            kv_source[j] = last_of_type[layer_types[j]]

        inter = c["intermediate_size"]
        inter = [int(x) for x in inter] if isinstance(inter, list) else [int(inter)] * n
        if len(inter) != n:
            raise ValueError(f"intermediate_size has {len(inter)} entries for {n} layers")
        if c.get("use_double_wide_mlp"):
            inter = [x * 2 if i >= first_shared else x for i, x in enumerate(inter)]

        rope_params = c.get("rope_parameters") or {}
        rope = {}
        for t in (SLIDING, FULL):
            rope[t] = dict(rope_params.get(t) or _DEFAULT_ROPE[t])
            dim = head_dims[layer_types.index(t)] if t in layer_types else head_dim
            mnn.RoPE.from_config(dim, {}, rope[t])  # a bad block is an error now

        moe = bool(c.get("enable_moe_block", False))
        softcap = c.get("final_logit_softcapping")
        pad = c.get("pad_token_id")
        media_ids = [c.get(key) for key in ("image_token_id", "audio_token_id",
                                            "video_token_id")]
        for value in (pad, *media_ids):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"token ids must be non-negative integers, got {value!r:.40}")
        pad = 0 if pad is None else pad
        table_rows = min(int(c["vocab_size"]),
                         int(c.get("vocab_size_per_layer_input") or c["vocab_size"]))
        if any(t is not None for t in media_ids) and pad >= table_rows:
            raise ValueError(f"pad_token_id {pad} is outside the vocabulary ({table_rows})")
        return cls(
            hidden_size=hidden,
            num_layers=n,
            vocab_size=int(c["vocab_size"]),
            num_heads=heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            sliding_window=int(c.get("sliding_window") or 512),
            layer_types=layer_types,
            head_dims=head_dims,
            kv_heads=kv_heads,
            kv_source=kv_source,
            k_eq_v=[k_eq_v and t == FULL for t in layer_types],
            intermediate_sizes=inter,
            rope=rope,
            final_logit_softcapping=float(softcap) if softcap else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            hidden_size_per_layer_input=int(c.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(c.get("vocab_size_per_layer_input")
                                           or c["vocab_size"]),
            attention_bias=bool(c.get("attention_bias", False)),
            enable_moe_block=moe,
            num_experts=int(c["num_experts"]) if moe else 0,
            top_k_experts=int(c["top_k_experts"]) if moe else 0,
            moe_intermediate_size=int(c["moe_intermediate_size"]) if moe else 0,
            pad_token_id=pad,
            media_token_ids=tuple(sorted({t for t in media_ids if t is not None})),
            bidirectional_vision=c.get("use_bidirectional_attention") == "vision",
            vision_token_ids=tuple(sorted({
                IMAGE_TOKEN_ID if media_ids[0] is None else media_ids[0],
                *([] if media_ids[2] is None else [media_ids[2]])})),
            raw=dict(c),
        )



# --------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, i: int) -> None:
        super().__init__()
        layer_type = cfg.layer_types[i]
        self.head_dim = d = cfg.head_dims[i]
        self.n_heads, self.n_kv_heads = cfg.num_heads, cfg.kv_heads[i]
        self.has_kv = cfg.kv_source[i] == i
        self.k_eq_v = cfg.k_eq_v[i]
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window if layer_type == SLIDING else None
        bias, hidden = cfg.attention_bias, cfg.hidden_size
        # tensor-parallel: heads split over the ranks (mlxrunner.nn.parallel)
        heads, kv_heads = mnn.Column(self.n_heads), mnn.Column(self.n_kv_heads)
        self.q_proj = mnn.Linear(hidden, self.n_heads * d, bias, heads)
        self.q_norm = mnn.RMSNorm(d, cfg.rms_norm_eps)
        if self.has_kv:
            self.k_proj = mnn.Linear(hidden, self.n_kv_heads * d, bias, kv_heads)
            if not self.k_eq_v:
                self.v_proj = mnn.Linear(hidden, self.n_kv_heads * d, bias, kv_heads)
            self.k_norm = mnn.RMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = mnn.Linear(self.n_heads * d, hidden, bias, mnn.Row())
        self.rope = mnn.RoPE.from_config(d, {}, cfg.rope[layer_type])

    def __call__(self, x: mx.array, cache: KVCache | RingCache | None, offset: int | mx.array,
                 shared: mnn.KV | None, blocks: mx.array | None = None, last_row: bool = False
                 ) -> tuple[mx.array, mnn.KV]:
        """The attention output and the keys and values it attended over (``shared``: a
        KV-sharing layer's, from the layer it shares them with; ``blocks``: the chunk's
        query/key pairs of one image that a sliding layer also lets attend, see
        :func:`vision_blocks`). ``last_row``: every row's keys and values are stored, the
        last row alone attends (its output ``[B, 1, hidden]``; the KV returned is that
        row's, see :func:`last_query`)."""
        B, L, _ = x.shape

        def heads(y: mx.array) -> mx.array:  # -1: this rank's heads when sharded
            return y.reshape(B, y.shape[1], -1, self.head_dim)

        if self.has_kv:
            if self.k_eq_v:  # the value is the raw key projection, normed like any value
                q, k = mnn.linears(x, self.q_proj, self.k_proj)
                v = k
            else:
                q, k, v = mnn.linears(x, self.q_proj, self.k_proj, self.v_proj)
            if last_row:
                k, v = mnn.attention_heads(offset, (heads(k), self.k_norm, self.rope),
                                           (heads(v), self.eps, None))
            else:
                q, k, v = mnn.attention_heads(offset, (heads(q), self.q_norm, self.rope),
                                              (heads(k), self.k_norm, self.rope),
                                              (heads(v), self.eps, None))
            shared = mnn.store(cache, k, v, self.window)
            if blocks is not None and self.window is not None:
                shared = shared._replace(mask=with_blocks(shared.mask, blocks,
                                                          shared.keys.shape[2]))
        else:
            q = self.q_proj(x)
        assert shared is not None
        if last_row:
            q, offset, shared = q[:, -1:], offset + L - 1, last_query(shared)
            assert shared is not None
        if last_row or not self.has_kv:
            q, = mnn.attention_heads(offset, (heads(q), self.q_norm, self.rope))
        out = mnn.attend(q, *shared, scale=1.0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, q.shape[2], -1)), shared


def last_query(kv: mnn.KV | None) -> mnn.KV | None:
    """``kv`` for the last of its block's queries alone: that row of its mask (a causal
    block's last query sees every key). None stays None (a pipeline stage's stand-in for a
    layer it does not hold)."""
    if kv is None:
        return None
    mask = kv.mask
    return kv._replace(mask=mask[..., -1:, :] if isinstance(mask, mx.array) else None)


def vision_blocks(ids: mx.array, vision_ids: tuple[int, ...], window: int) -> mx.array:
    """For a prompt chunk ``ids [B, L]``: ``[L, L]`` (``[B, 1, L, L]`` for B > 1) True where
    query ``i`` and key ``j`` are tokens of one run of consecutive vision tokens and ``j >
    i - window``: what transformers' ``blockwise_overlay`` adds to a sliding layer's causal
    mask, ANDed with its ``sliding_window_overlay``. An item prefilled whole keeps each
    image's run inside one chunk; a chunk resuming mid-image (a prefix-cache hit) holds its
    tail, whose earlier tokens are cached keys that causality already admits."""
    L = ids.shape[1]
    is_vision = (ids[..., None] == mnn.constant(vision_ids, ids.dtype)).any(axis=-1)
    starts = is_vision & ~mx.concatenate([mx.zeros_like(is_vision[:, :1]),
                                          is_vision[:, :-1]], axis=1)
    run = mx.where(is_vision, mx.cumsum(starts.astype(mx.int32), axis=1), -1)
    same = (run[:, :, None] == run[:, None, :]) & is_vision[:, :, None]
    rows = mnn.arange_constant(L)
    same = same & (rows[None] > rows[:, None] - window)[None]
    return same[0] if ids.shape[0] == 1 else same[:, None]


def with_blocks(mask: mx.array | str | None, blocks: mx.array, keys: int) -> mx.array:
    """A sliding layer's chunk mask over ``keys`` columns (the chunk's own keys are the
    last ``L``) ORed with :func:`vision_blocks` on those columns."""
    L = blocks.shape[-1]
    if not isinstance(mask, mx.array):  # "causal" (bottom-right aligned) or None
        rows = mnn.arange_constant(L)
        cols = mnn.arange_constant(keys)
        mask = cols[None] <= rows[:, None] + (keys - L) if mask is not None \
            else mx.ones((L, keys), dtype=mx.bool_)
    if keys > L:
        blocks = mx.concatenate([mx.zeros((*blocks.shape[:-1], keys - L), dtype=mx.bool_),
                                 blocks], axis=-1)
    return mask | blocks


class Router(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.proj = mnn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.root = cfg.hidden_size ** -0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = mnn.rms_norm(x, self.eps) * self.scale * self.root
        scores = self.proj(x)
        indices = topk_indices(scores, self.top_k)
        # softmax over the chosen scores == full softmax renormalised over them
        weights = mx.softmax(mx.take_along_axis(scores, indices, axis=-1).astype(mx.float32),
                             axis=-1)
        weights = weights * self.per_expert_scale[indices].astype(mx.float32)
        return indices, weights


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, i: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, i)
        self.mlp = mnn.GatedMLP(h, cfg.intermediate_sizes[i], "gelu_pytorch_tanh")
        self.input_layernorm = mnn.RMSNorm(h, eps)
        self.post_attention_layernorm = mnn.RMSNorm(h, eps)
        self.pre_feedforward_layernorm = mnn.RMSNorm(h, eps)
        self.post_feedforward_layernorm = mnn.RMSNorm(h, eps)
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(cfg)
            self.experts = mnn.GatedExperts(cfg.num_experts, cfg.hidden_size,
                                            cfg.moe_intermediate_size, mnn.gelu_tanh_mul)
            self.post_feedforward_layernorm_1 = mnn.RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = mnn.RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = mnn.RMSNorm(h, eps)
        self.per_layer = cfg.hidden_size_per_layer_input > 0
        if self.per_layer:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = mnn.Linear(h, p, bias=False)
            self.per_layer_projection = mnn.Linear(p, h, bias=False)
            self.post_per_layer_input_norm = mnn.RMSNorm(h, eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache: KVCache | RingCache | None, offset: int | mx.array,
                 shared: mnn.KV | None, per_layer_input: mx.array | None,
                 blocks: mx.array | None = None, last_row: bool = False
                 ) -> tuple[mx.array, mnn.KV]:
        """``last_row``: the chunk's keys and values are stored, the rest runs on its last
        row alone (``per_layer_input`` that row's; see :class:`Attention`)."""
        attn, kv = self.self_attn(self.input_layernorm(x), cache, offset, shared, blocks,
                                  last_row)
        h = self.post_attention_layernorm.add_normed(x[:, -1:] if last_row else x, attn)
        ff = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            indices, weights = self.router(h)
            moe = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
            ff = self.post_feedforward_layernorm_2.add_normed(
                self.post_feedforward_layernorm_1(ff), moe)
        if not self.per_layer:
            return self.post_feedforward_layernorm.add_normed(h, ff, self.layer_scalar), kv
        h = self.post_feedforward_layernorm.add_normed(h, ff)
        assert per_layer_input is not None  # the model gives one to every layer then
        gate = mnn.gelu_tanh_mul(self.per_layer_input_gate(h), per_layer_input)
        return self.post_per_layer_input_norm.add_normed(h, self.per_layer_projection(gate),
                                                         self.layer_scalar), kv

    @staticmethod
    def pipeline_passthrough(x: mx.array, cache: Any, offset: Any, shared: mnn.KV | None,
                             per_layer_input: Any, blocks: Any = None, last_row: bool = False
                             ) -> tuple[mx.array, mnn.KV | None]:
        """What stands for this layer on a pipeline stage that does not hold it (the shapes
        the layer returns: the stages exchange them)."""
        return (x[:, -1:], last_query(shared)) if last_row else (x, shared)


class TextModel(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                          scale=cfg.hidden_size ** 0.5)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.hidden_size_per_layer_input:
            p = cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = mnn.Embedding(cfg.vocab_size_per_layer_input,
                                                        cfg.num_layers * p, scale=p ** 0.5)
            self.per_layer_model_projection = mnn.Linear(cfg.hidden_size, cfg.num_layers * p,
                                                         bias=False)
            self.per_layer_projection_norm = mnn.RMSNorm(p, cfg.rms_norm_eps)

    def per_layer_inputs(self, ids: mx.array, h: mx.array, cfg: Gemma4Config) -> list[mx.array]:
        """Each layer's ``[B, L, P]`` input: the per-layer token table (times sqrt(P)) at
        ``ids`` (media tokens already read as padding) and the normed projection of the
        input embeddings ``h`` (media rows included), summed and scaled by 1/sqrt(2)."""
        p, n = cfg.hidden_size_per_layer_input, cfg.num_layers
        table = self.embed_tokens_per_layer(ids)
        proj = self.per_layer_model_projection(h) * (cfg.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.reshape(*h.shape[:-1], n, p))
        combined = (proj.reshape(table.shape) + table) * (2 ** -0.5)
        # (mx.split's stub says it returns an array: it returns a list)
        return mx.split(combined, n, axis=-1)  # type: ignore[return-value]


# --------------------------------------------------------------------------
# the target model
# --------------------------------------------------------------------------
_NON_TEXT = ("vision_tower", "audio_tower", "embed_vision", "embed_audio",
             "multi_modal_projector", "vision_embedder")


class _MadeCaches:
    """Weak references to the caches ``make_cache`` made last, kept outside the parameter
    tree (a generation's caches are freed with it)."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref[KVCache | RingCache]] = {}


class Gemma4Model(Model):
    """``Gemma4ForConditionalGeneration`` / ``Gemma4ForCausalLM`` (text part)."""

    default_renderer = "gemma4"
    default_parser = "gemma4"
    #: ``<eos>``, ``<turn|>``, ``<|tool_response>``
    eos_token_ids = (1, 106, 50)
    config_bounds = {
        "global_head_dim": ConfigBound(int, 1, 8192),
        "num_global_key_value_heads": ConfigBound(int, 1, 1024),
        "num_kv_shared_layers": ConfigBound(int, 0, 1024),
        "sliding_window_pattern": ConfigBound(int, 1, 1024),
        "hidden_size_per_layer_input": ConfigBound(int, 0, 2**17),
        "vocab_size_per_layer_input": ConfigBound(int, 1, 2**24),
        "top_k_experts": ConfigBound(int, 0, 2**14),
        "final_logit_softcapping": ConfigBound(float, 0, 1e6),
        "attention_k_eq_v": ConfigBound(bool),
        "enable_moe_block": ConfigBound(bool),
    }

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.args = Gemma4Config.from_dict(config)
        self.model = TextModel(self.args)
        if not self.args.tie_word_embeddings:
            self.lm_head = mnn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        self._made_caches = _MadeCaches()

    # -- facts ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def layer_kv_sources(self) -> list[int]:
        """For each layer, the layer whose keys and values it attends over (a pipeline split
        keeps them on one rank)."""
        return list(self.args.kv_source)

    # -- loading ---------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hub (``model.language_model.*``), transformers text-only (``model.*``) and
        mlx-lm (``language_model.model.*``) names to ours; drops vision/audio towers,
        rotary buffers, the tied head and the K/V weights of KV-sharing layers."""
        hub = any(k.startswith("model.language_model.") for k in weights)
        out: dict[str, mx.array] = {}
        pending: dict[str, dict[str, mx.array]] = {}
        for name, value in weights.items():
            key = self._text_name(name, hub)
            if key is None:
                continue
            if ".experts.switch_glu." in key:  # mlx-lm's split expert projections
                base, rest = key.split(".experts.switch_glu.")
                proj, _, part = rest.partition(".")
                if proj == "down_proj":
                    out[f"{base}.experts.down_proj.{part}"] = value
                else:
                    pending.setdefault(f"{base}.experts.gate_up_proj.{part}", {})[proj] = value
                continue
            if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                key += ".weight"
            out[key] = value
        for key, parts in pending.items():
            if set(parts) != {"gate_proj", "up_proj"}:
                raise ValueError(f"{key}: expected gate_proj and up_proj, got {sorted(parts)}")
            out[key] = mx.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
        return out

    def _text_name(self, name: str, hub: bool) -> str | None:
        if name.startswith("language_model."):  # mlx-lm's layout
            name = name[len("language_model."):]
        elif hub:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith("model."):
                return None  # towers and projectors of other modalities
        if name.startswith(_NON_TEXT) or name.startswith(tuple("model." + p for p in _NON_TEXT)):
            return None
        if "rotary_emb" in name or name.endswith(("input_max", "input_min", "output_max",
                                                  "output_min")):
            return None
        if name.startswith("lm_head.") and self.args.tie_word_embeddings:
            return None
        if name.startswith("model.layers.") and ".self_attn." in name:
            i = int(name.split(".")[2])
            part = name.split(".self_attn.")[1].split(".")[0]
            if part in ("k_proj", "v_proj", "k_norm", "v_norm") and self.args.kv_source[i] != i:
                return None
        return name

    def load_encoders(self, folder: Path) -> dict[str, Encoder]:
        """``{"image": ..., "audio": ...}``: an encoder for each tower the folder holds (in
        this model's dtype)."""
        from .encoder import load_audio_encoder, load_image_encoder

        encoders: dict[str, Encoder] = {}
        image = load_image_encoder(folder, self.args.raw, self.dtype)
        if image is not None:
            encoders["image"] = image
        audio = load_audio_encoder(folder, self.args.raw, self.dtype)
        if audio is not None:
            encoders["audio"] = audio
        return encoders

    # -- target interface ------------------------------------------------------
    def make_cache(self) -> list[Cache | None]:
        caches: list[Cache | None] = []
        refs: dict[int, weakref.ref[KVCache | RingCache]] = {}
        for i, t in enumerate(self.args.layer_types):
            if self.args.kv_source[i] != i:
                caches.append(None)
                continue
            cache: KVCache | RingCache
            if t == SLIDING:
                cache = RingCache(self.args.sliding_window)
            else:
                cache = KVCache()
            refs[i] = weakref.ref(cache)
            caches.append(cache)
        self._made_caches.refs = refs
        return caches

    def last_kv_layers(self) -> dict[str, int]:
        """Per attention type, the last layer that computes its own keys and values."""
        return {t: i for i, t in enumerate(self.args.layer_types) if self.args.kv_source[i] == i}

    def shared_caches(self) -> dict[str, KVCache | RingCache] | None:
        """Read-only: the caches of :meth:`last_kv_layers` from the list ``make_cache`` made
        last (the generation running now), which Gemma 4 assistant drafts attend over; None
        once that list is gone."""
        found = {}
        for layer_type, i in self.last_kv_layers().items():
            ref = self._made_caches.refs.get(i)
            cache = ref() if ref is not None else None
            if cache is None:
                return None
            found[layer_type] = cache
        return found

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The input embedding times sqrt(hidden) (the scale rounded to the weight dtype);
        media token ids embed as ``pad_token_id``."""
        return self.model.embed_tokens(self.text_ids(ids))

    def text_ids(self, ids: mx.array) -> mx.array:
        """``ids`` with every image, audio and video token id replaced by ``pad_token_id``:
        what Gemma4ForConditionalGeneration looks up in its token tables."""
        if not self.args.media_token_ids:
            return ids
        # (constants made once: a traced step does not rebuild them on every replay; the
        # few ids compared one by one: elementwise, one fused kernel in a traced step)
        first, *rest = self.args.media_token_ids
        is_media = ids == mnn.constant((first,), ids.dtype)
        for token in rest:
            is_media = is_media | (ids == mnn.constant((token,), ids.dtype))
        return mx.where(is_media, mnn.constant((self.args.pad_token_id,), ids.dtype), ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The tied (or own) output head on final-normed hidden states, before softcapping."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, ids: mx.array, cache: Sequence[Any] | None = None, *,
                 taps: Sequence[int] | None = None, embeddings: mx.array | None = None
                 ) -> mx.array | tuple[mx.array, mx.array]:
        """Logits for ``ids [B, L]`` (with ``taps``: and the tapped residual stream);
        ``embeddings [B, L, hidden]``: the input embeddings to run instead of
        ``embed_tokens(ids)`` (a prompt chunk whose image slots hold the encoder's rows)."""
        a = self.args
        tapped = mnn.Taps(taps, a.num_layers)
        if cache is not None and len(cache) != a.num_layers:
            raise ValueError(f"expected {a.num_layers} cache entries, got {len(cache)}")
        cache = [None] * a.num_layers if cache is None else cache
        offset = next((c.offset for c in cache if c is not None), 0)
        text_ids = self.text_ids(ids)
        if embeddings is None:
            h = self.model.embed_tokens(text_ids)
        elif embeddings.shape != (*ids.shape, a.hidden_size):
            raise ValueError(f"embeddings must be {[*ids.shape, a.hidden_size]}, got "
                             f"{list(embeddings.shape)}")
        else:
            h = embeddings
        # as transformers: the token table reads media tokens as padding, the projection
        # reads the embeddings with the media rows
        per_layer: list[mx.array | None] = [*self.model.per_layer_inputs(text_ids, h, a)] \
            if a.hidden_size_per_layer_input else [None] * a.num_layers
        # a prompt chunk holding media of a bidirectional-vision checkpoint: its images'
        # tokens attend to each other both ways in the sliding layers
        blocks = vision_blocks(ids, a.vision_token_ids, a.sliding_window) \
            if a.bidirectional_vision and embeddings is not None and ids.shape[1] > 1 else None
        kv_of: dict[int, mnn.KV | None] = {}  # (None: a pipeline stage without the layer)
        # After the last layer that writes a cache stores its keys and values, no row reads
        # another row's stream (the KV-sharing layers after it write none): where only the
        # last row's logits are wanted (the core's prefill) and no tap needs the rest, that
        # layer's attention and MLP and every layer after it run the last row alone; where
        # no row's are (a prompt's chunk before its last), the layers after it do not run.
        first_shared = next((i for i, s in enumerate(a.kv_source) if s != i), a.num_layers)
        last_writer = first_shared - 1
        wanted = mnn.head_rows(h).shape[1]
        cut = not any(t >= last_writer for t in tapped.requested or ()) and wanted < h.shape[1]
        for i, layer in enumerate(self.layers):
            if cut and not wanted and i > last_writer:
                break
            if cut and i == last_writer:
                per_layer = [p if p is None else p[:, -1:] for p in per_layer]
            elif cut and i == first_shared:
                offset = offset + ids.shape[1] - 1
                kv_of = {s: last_query(kv) for s, kv in kv_of.items()}
            source = a.kv_source[i]
            h, kv_of[source] = layer(h, cache[i], offset, kv_of.get(source), per_layer[i],
                                     blocks, cut and i == last_writer)
            tapped.after(i, h)
        logits = self.raw_logits(self.model.norm(mnn.head_rows(h)))
        return tapped.result(mnn.softcap(logits, a.final_logit_softcapping))
