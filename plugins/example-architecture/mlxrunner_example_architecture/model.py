"""A small Llama-style decoder: the example architecture of the plugin tutorial.

RMSNorm, rotary position embeddings, grouped-query attention over one
``mlxrunner.KVCache`` per layer, a SwiGLU MLP, and an output head that is its
own matrix or the embedding table (``tie_word_embeddings``). It reads the
fields of a Hugging Face ``LlamaForCausalLM`` config.json and loads its
checkpoint names unchanged.

Written only against mlxrunner's public API, as a third-party plugin must be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner
from mlxrunner import KVCache, Model, ModelFolderError


@dataclass(frozen=True)
class ExampleLlamaConfig:
    """The config.json fields this architecture reads (transformers' Llama names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ExampleLlamaConfig:
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [key for key in required if key not in config]
        if missing:
            raise ModelFolderError(f"config.json lacks {', '.join(map(repr, missing))} "
                                   "needed by the example_llama architecture")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFolderError(f"example_llama supports hidden_act 'silu' only, got {act!r}")
        # transformers >= 5 nests rope settings in rope_parameters; older configs keep
        # rope_theta / rope_scaling at the top level.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelFolderError(f"example_llama supports rope_type 'default' only, "
                                   f"got {rope_type!r}")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


class Attention(nn.Module):
    def __init__(self, cfg: ExampleLlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        # Hugging Face Llama rotates the two halves of each head (not interleaved pairs).
        self.rope = nn.RoPE(self.head_dim, traditional=False, base=cfg.rope_theta)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        # "causal" aligns the mask to the last key, so new rows see every cached position.
        mask = "causal" if L > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ExampleLlamaConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ExampleLlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Held as ``model`` by the parent, so checkpoint names (``model.layers.0...``) fit as-is."""

    def __init__(self, cfg: ExampleLlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class ExampleLlama(Model):
    """Registered as ``ExampleLlamaForCausalLM`` and ``example_llama``."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.cfg = ExampleLlamaConfig.from_dict(config)
        self.model = Backbone(self.cfg)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Old Llama checkpoints store the rotary frequencies; RoPE computes them itself.
        kept = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.cfg.tie_word_embeddings:
            # The head is the embedding table; some checkpoints store a copy anyway.
            kept.pop("lm_head.weight", None)
        return kept

    # -- running -----------------------------------------------------------
    @property
    def layers(self) -> list[DecoderLayer]:
        """The decoder layers (``mlxrunner.testing`` perturbs them to check the tap index)."""
        return self.model.layers

    def make_cache(self) -> list[mlxrunner.Cache | None]:
        return [KVCache() for _ in range(self.cfg.num_hidden_layers)]

    def __call__(self, ids: mx.array, cache: Sequence[mlxrunner.Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        n = self.cfg.num_hidden_layers
        if taps is not None:
            bad = [t for t in taps if not 0 <= t < n]
            if bad:
                raise ValueError(f"tap layers {bad} are outside 0..{n - 1}")
        if cache is None:
            cache = [None] * n
        wanted = set(taps or ())
        after_layer: dict[int, mx.array] = {}
        h = self.embed_tokens(ids)
        for i, (layer, layer_cache) in enumerate(zip(self.model.layers, cache)):
            h = layer(h, layer_cache)
            if i in wanted:
                after_layer[i] = h  # residual stream before the final norm
        logits = self.raw_logits(self.model.norm(h))
        if taps is None:
            return logits
        if not taps:
            return logits, mx.zeros((*h.shape[:2], 0), h.dtype)
        return logits, mx.concatenate([after_layer[t] for t in taps], axis=-1)

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    # -- facts -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size
