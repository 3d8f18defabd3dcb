"""The Llama family: Llama 2 and 3.x, SmolLM2, and Mistral-style configs without a window.

Per layer, with ``x`` the residual stream::

    h = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms(x)
    x = h + down_proj(act(gate_proj(m)) * up_proj(m))                          m = rms(h)

Grouped-query attention (``num_key_value_heads`` key/value heads shared by the query heads),
scaled by ``head_dim ** -0.5``, causal, over one ``KVCache`` per layer. The output head is
``lm_head`` or the embedding table (``tie_word_embeddings``: SmolLM2, Llama 3.2 1B/3B).
Rotary embeddings as the config says (default, linear, llama3, yarn). Checkpoint names are
transformers' ``LlamaForCausalLM`` / ``MistralForCausalLM`` names, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import Cache, ConfigBound, KVCache, Model, ModelFolderError

#: transformers' default window of a MistralConfig that does not name one
MISTRAL_DEFAULT_WINDOW = 4096


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    activation: str
    tied: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> LlamaConfig:
        needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")
        missing = [key for key in needed if config.get(key) is None]
        if missing:
            raise ModelFolderError(f"config.json: llama needs {', '.join(missing)}")
        activation = config.get("hidden_act") or "silu"
        if activation not in mnn.ACTIVATIONS:
            raise ModelFolderError(f"config.json: hidden_act {activation!r} is not supported "
                                   f"(known: {', '.join(sorted(mnn.ACTIVATIONS))})")
        window = config.get("sliding_window",
                            MISTRAL_DEFAULT_WINDOW if config.get("model_type") == "mistral"
                            else None)
        context = config.get("max_position_embeddings")
        if window is not None and not (isinstance(context, int) and window >= context):
            raise ModelFolderError(
                f"config.json: sliding_window {window} is not supported by the llama "
                "architecture (full attention only: null, or at least max_position_embeddings)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            eps=float(config.get("rms_norm_eps") or 1e-6),
            activation=activation,
            tied=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, rope: mnn.RoPE) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q_width, kv_width = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        # tensor-parallel: heads split over the ranks (mlxrunner.nn.parallel)
        self.q_proj = mnn.Linear(cfg.hidden_size, q_width, bias, mnn.Column(cfg.heads))
        self.k_proj = mnn.Linear(cfg.hidden_size, kv_width, bias, mnn.Column(cfg.kv_heads))
        self.v_proj = mnn.Linear(cfg.hidden_size, kv_width, bias, mnn.Column(cfg.kv_heads))
        self.o_proj = mnn.Linear(q_width, cfg.hidden_size, bias, mnn.Row())
        self.rope = rope

    def __call__(self, n: mx.array, cache: KVCache | None, residual: mx.array) -> mx.array:
        B, L, _ = n.shape

        def heads(x: mx.array) -> mx.array:  # [B, L, H*D] -> [B, L, H, D]
            return x.reshape(B, L, -1, self.head_dim)

        q, k, v = mnn.linears(n, self.q_proj, self.k_proj, self.v_proj)
        position = 0 if cache is None else cache.offset
        q, k = mnn.attention_heads(position, (heads(q), None, self.rope),
                                   (heads(k), None, self.rope))
        keys, values, mask = mnn.store(cache, k, heads(v).swapaxes(1, 2))
        out = mnn.attend(q, keys, values, mask, scale=self.scale)
        return self.o_proj(out.swapaxes(1, 2).reshape(B, L, -1), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, rope: mnn.RoPE) -> None:
        super().__init__()
        self.input_layernorm = mnn.RMSNorm(cfg.hidden_size, cfg.eps)
        self.self_attn = LlamaAttention(cfg, rope)
        self.post_attention_layernorm = mnn.RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = mnn.GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation,
                                cfg.mlp_bias)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), cache, residual=x)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class LlamaModel(nn.Module):
    """transformers' ``LlamaModel`` (held as ``model``): embedding, layers, final norm."""

    def __init__(self, cfg: LlamaConfig, rope: mnn.RoPE) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [LlamaDecoderLayer(cfg, rope) for _ in range(cfg.num_layers)]
        self.norm = mnn.RMSNorm(cfg.hidden_size, cfg.eps)


class Llama(Model):
    """``LlamaForCausalLM``, ``MistralForCausalLM`` (model types ``llama``, ``mistral``)."""

    config_bounds = {
        "pretraining_tp": ConfigBound(int, 1, 1024),  # a training detail: same math for any
    }

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.cfg = LlamaConfig.from_dict(config)
        try:
            rope = mnn.RoPE.from_config(self.cfg.head_dim, config)
        except mnn.RopeConfigError as exc:
            raise ModelFolderError(f"config.json: {exc}") from None
        self.model = LlamaModel(self.cfg, rope)
        if not self.cfg.tied:
            self.lm_head = mnn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensors: dict[str, mx.array]
                  ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """(config.json, checkpoint tensors) of a llama.cpp GGUF file."""
        from .gguf import from_gguf

        return from_gguf(metadata, tensors)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Older exports store RoPE's inverse frequencies (computed here, never loaded); tied
        # Llama 3.2 folders carry lm_head.weight, a copy of the embedding table.
        drop = ("lm_head.",) if self.cfg.tied else ()
        return {name: w for name, w in weights.items()
                if not name.endswith("rotary_emb.inv_freq") and not name.startswith(drop)}

    @property
    def layers(self) -> list[LlamaDecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[Cache | None]:
        return [KVCache() for _ in self.layers]

    def __call__(self, ids: mx.array, cache: Sequence[Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        tapped = mnn.Taps(taps, self.num_layers)  # the residual stream, before the final norm
        caches = cache if cache is not None else [None] * self.num_layers
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            # a KVCache, or the core's traced stand-in of one
            x = tapped.after(i, layer(x, cast("KVCache | None", caches[i])))
        return tapped.result(self.raw_logits(self.model.norm(mnn.head_rows(x))))

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)  # unscaled, as Llama applies it

    def raw_logits(self, hidden: mx.array) -> mx.array:
        if self.cfg.tied:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size
