"""A Llama-style decoder: the example architecture of the plugin tutorial.

RMSNorm, rotary position embeddings (plain, linear, llama3 or yarn scaling, as the config
says), grouped-query attention over one ``mlxrunner.KVCache`` per layer, a SwiGLU MLP, and
an output head that is its own matrix or the embedding table (``tie_word_embeddings``). It
reads a Hugging Face ``LlamaForCausalLM`` config.json and loads its checkpoint names
unchanged.

Built from ``mlxrunner.nn``: the layers pick MLX's operations or fused kernels per device,
and the core traces the decode step. Written only against mlxrunner's public API, as a
third-party plugin must be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import (
    Cache,
    ConfigFields,
    KVCache,
    Model,
    ModelFolderError,
    config_field,
)


class ExampleLlamaConfig(ConfigFields):
    """The config.json fields this architecture reads (transformers' Llama names), each with
    its default and bounds: a missing or out-of-bounds value is one clear error."""

    vocab_size: int = config_field(low=1, high=2**24)
    hidden_size: int = config_field(low=1, high=2**17)
    intermediate_size: int = config_field(low=1, high=2**20)
    num_hidden_layers: int = config_field(low=1, high=1024)
    num_attention_heads: int = config_field(low=1, high=1024)
    num_key_value_heads: int | None = config_field(None, low=1, high=1024)  # None: all heads
    head_dim: int | None = config_field(None, low=1, high=8192)  # None: hidden / heads
    rms_norm_eps: float = config_field(1e-6, low=0, above_low=True, high=1)
    tie_word_embeddings: bool = config_field(False)
    attention_bias: bool = config_field(False)
    mlp_bias: bool = config_field(False)
    hidden_act: str = config_field("silu")

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg: ExampleLlamaConfig, rope: mnn.RoPE) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                     cfg.kv_heads, cfg.head_size)
        self.scale = cfg.head_size ** -0.5
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = mnn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = mnn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = mnn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = mnn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.rope = rope

    def __call__(self, x: mx.array, cache: KVCache | None, residual: mx.array) -> mx.array:
        """``residual + attention(x)``."""
        B, L, _ = x.shape
        q, k, v = mnn.linears(x, self.q_proj, self.k_proj, self.v_proj)
        offset = cache.offset if cache is not None else 0
        # [B, L, H, D] heads to [B, H, L, D], rotated (one kernel for both on CUDA)
        q, k = mnn.attention_heads(offset, (q.reshape(B, L, self.heads, -1), None, self.rope),
                                   (k.reshape(B, L, self.kv_heads, -1), None, self.rope))
        v = v.reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        out = mnn.attend(q, *mnn.store(cache, k, v), scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1), residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ExampleLlamaConfig, rope: mnn.RoPE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        self.mlp = mnn.GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", cfg.mlp_bias)
        self.input_layernorm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), cache, x)
        return self.mlp(self.post_attention_layernorm(h), h)


class Backbone(nn.Module):
    """Held as ``model`` by the parent, so checkpoint names (``model.layers.0...``) fit as-is."""

    def __init__(self, cfg: ExampleLlamaConfig, rope: mnn.RoPE) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers)]
        self.norm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ExampleLlama(Model):
    """Registered as ``ExampleLlamaForCausalLM`` and ``example_llama``."""

    # config.json's common keys (and hidden_size // num_attention_heads as the default
    # head_dim) are checked by the core; name your own in config_bounds / config_multiples.

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.cfg = ExampleLlamaConfig.from_config(config)
        if self.cfg.hidden_act != "silu":
            raise ModelFolderError(f"example_llama supports hidden_act 'silu' only, got "
                                   f"{self.cfg.hidden_act!r:.40}")
        try:
            rope = mnn.RoPE.from_config(self.cfg.head_size, config)
        except mnn.RopeConfigError as exc:
            raise ModelFolderError(f"example_llama: {exc}") from None
        self.model = Backbone(self.cfg, rope)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = mnn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)

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

    def make_cache(self) -> list[Cache | None]:
        return [KVCache() for _ in range(self.cfg.num_hidden_layers)]

    def __call__(self, ids: mx.array, cache: Sequence[Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None, embeddings: mx.array | None = None
                 ) -> mx.array | tuple[mx.array, mx.array]:
        tapped = mnn.Taps(taps, self.num_layers)  # residual stream before the final norm
        cache = [None] * self.num_layers if cache is None else cache
        # embeddings: a prompt chunk holding media, placed by the core (see load_encoders)
        h = self.embed_tokens(ids) if embeddings is None else embeddings
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            # make_cache gives every layer a KVCache
            h = tapped.after(i, layer(h, cast("KVCache | None", layer_cache)))
        return tapped.result(self.raw_logits(self.model.norm(mnn.head_rows(h))))

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
