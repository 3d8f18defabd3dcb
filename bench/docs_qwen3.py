"""A Qwen3 decoder written as a plugin author writes one from ``docs/plugins.md``: layers from
``mlxrunner.nn`` (packed projections, norms, RoPE, the MLP), and attention through
``cache.update_and_fetch`` and ``mlxrunner.nn.attend`` with its own ``"causal"`` / None mask.
What the core's compiled step makes of that style (``bench/qwen3.py``); checkpoint names as
Hugging Face's Qwen3 (and mlx-lm's), so one set of weights serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import Cache, KVCache, Model


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any], rope: mnn.RoPE) -> None:
        super().__init__()
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = d = c.get("head_dim") or c["hidden_size"] // self.heads
        h, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.q_proj = mnn.Linear(h, self.heads * d, bias=False)
        self.k_proj = mnn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = mnn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = mnn.Linear(self.heads * d, h, bias=False)
        self.q_norm, self.k_norm = mnn.RMSNorm(d, eps), mnn.RMSNorm(d, eps)
        self.rope = rope

    def __call__(self, x: mx.array, cache: KVCache | None, residual: mx.array) -> mx.array:
        B, L, _ = x.shape
        q, k, v = mnn.linears(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, L, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mnn.attend(q, k, v, "causal" if L > 1 else None,
                         scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1), residual)


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any], rope: mnn.RoPE) -> None:
        super().__init__()
        eps = c.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(c, rope)
        self.mlp = mnn.GatedMLP(c["hidden_size"], c["intermediate_size"], "silu")
        self.input_layernorm = mnn.RMSNorm(c["hidden_size"], eps)
        self.post_attention_layernorm = mnn.RMSNorm(c["hidden_size"], eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), cache, x)
        return self.mlp(self.post_attention_layernorm(h), h)


class Backbone(nn.Module):
    def __init__(self, c: dict[str, Any], rope: mnn.RoPE) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = [Layer(c, rope) for _ in range(c["num_hidden_layers"])]
        self.norm = mnn.RMSNorm(c["hidden_size"], c.get("rms_norm_eps", 1e-6))


class DocsQwen3(Model):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.c = config
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.model = Backbone(config, mnn.RoPE.from_config(head_dim, config))
        if not config.get("tie_word_embeddings", False):
            self.lm_head = mnn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    @property
    def layers(self) -> list[Layer]:
        return self.model.layers

    def make_cache(self) -> list[Cache | None]:
        return [KVCache() for _ in self.layers]

    def __call__(self, ids: mx.array, cache: Sequence[Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        tapped = mnn.Taps(taps, self.num_layers)
        cache = [None] * self.num_layers if cache is None else cache
        h = self.model.embed_tokens(ids)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = tapped.after(i, layer(h, c))
        return tapped.result(self.raw_logits(self.model.norm(h)))

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        if self.c.get("tie_word_embeddings", False):
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.c["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.c["hidden_size"])
