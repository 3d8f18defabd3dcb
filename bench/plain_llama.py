"""A Llama written in plain ``mlx.nn`` against mlxrunner's documented Model contract, the
way a third party writes one from the docs without ``mlxrunner.nn``: what the core's
compiled step alone makes of it (``bench/llama.py``'s "plain" row).

Projections one by one, MLX's own RoPE (default or llama3 frequencies) and
``mx.fast.scaled_dot_product_attention`` over the keys its ``KVCache`` returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxrunner.plugin import KVCache, Model


def _llama3_freqs(dims: int, rope: dict[str, Any]) -> mx.array:
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    freqs = base ** (mx.arange(0, dims, 2) / dims)  # periods
    wavelengths = 2 * math.pi * freqs
    smooth = (original / wavelengths - low) / (high - low)
    scaled = freqs / ((1 - smooth) / factor + smooth)
    freqs = mx.where(wavelengths > original / low, freqs * factor, freqs)
    return mx.where((wavelengths <= original / low) & (wavelengths >= original / high),
                    scaled, freqs)


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        h, d = c["hidden_size"], self.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        rope = c.get("rope_parameters") or {}
        self._freqs = _llama3_freqs(d, rope) if rope.get("rope_type") == "llama3" else None
        self.base = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))

    def rope(self, x: mx.array, offset: Any) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=False,
                            base=None if self._freqs is not None else self.base, scale=1.0,
                            offset=offset, freqs=self._freqs)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5,
                                                   mask="causal" if L > 1 else None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-5)
        self.self_attn = Attention(c)
        self.mlp = MLP(h, c["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Backbone(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = [Layer(c) for _ in range(c["num_hidden_layers"])]
        self.norm = nn.RMSNorm(c["hidden_size"], eps=c.get("rms_norm_eps", 1e-5))


class PlainLlama(Model):
    """Tied embeddings only (Llama 3.2 1B's layout)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.n, self.vocab, self.hidden = (config["num_hidden_layers"], config["vocab_size"],
                                           config["hidden_size"])
        self.model = Backbone(config)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in range(self.n)]

    def __call__(self, ids: mx.array, cache: Sequence[Any] | None = None, *,
                 taps: Sequence[int] | None = None) -> Any:
        cache = cache or [None] * self.n
        h, tapped = self.model.embed_tokens(ids), []
        for i, (layer, c) in enumerate(zip(self.model.layers, cache)):
            h = layer(h, c)
            if taps and i in taps:
                tapped.append(h)
        logits = self.model.embed_tokens.as_linear(self.model.norm(h))
        return logits if taps is None else (logits, mx.concatenate(tapped, axis=-1))

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        return self.model.embed_tokens.as_linear(hidden)

    num_layers = property(lambda self: self.n)
    vocab_size = property(lambda self: self.vocab)
    hidden_size = property(lambda self: self.hidden)
