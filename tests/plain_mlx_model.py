"""A model written in plain ``mlx.nn``, as a third party writes one: its attention calls
``mx.fast.scaled_dot_product_attention`` over the keys its ``KVCache``/``RingCache`` hands out
(masks "causal"/None, or a ring's own ``cache.mask``). Shared by the compiled-step and the
batching tests (importable as ``plain_mlx_model``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxrunner.plugin import KVCache, Model, RingCache


class PlainAttention(nn.Module):
    """Attention as a third party writes it in plain mlx.nn."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, window: int | None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.window = window
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.rope = nn.RoPE(self.head_dim, base=10000.0)

    def __call__(self, x, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if self.window is not None:
            mask = cache.mask(L)
            k, v = cache.update_and_fetch(k, v)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
            mask = "causal" if L > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5,
                                                   mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class PlainLayer(nn.Module):
    def __init__(self, hidden: int, window: int | None) -> None:
        super().__init__()
        self.attn = PlainAttention(hidden, 4, 2, window)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def __call__(self, x, cache):
        h = x + self.attn(self.norm1(x), cache)
        return h + self.down(nn.gelu(self.up(self.norm2(h))))


class PlainModel(Model):
    """Every other layer a sliding window (a ring) when ``window`` is set."""

    def __init__(self, window: int | None = None, vocab: int = 61, hidden: int = 32,
                 layers: int = 4) -> None:
        super().__init__({})
        self.windows = [window if window and i % 2 == 0 else None for i in range(layers)]
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = [PlainLayer(hidden, w) for w in self.windows]
        self.norm = nn.RMSNorm(hidden)
        self._vocab, self._hidden = vocab, hidden

    def make_cache(self):
        return [RingCache(w) if w else KVCache() for w in self.windows]

    def __call__(self, ids, cache=None, *, taps=None):
        cache = cache or [None] * len(self.layers)
        h, tapped = self.embed(ids), []
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, c)
            if taps and i in taps:
                tapped.append(h)
        logits = self.embed.as_linear(self.norm(h))
        if taps is None:
            return logits
        return logits, (mx.concatenate(tapped, axis=-1) if tapped else
                        mx.zeros((*ids.shape, 0), h.dtype))

    def embed_tokens(self, ids):
        return self.embed(ids)

    def raw_logits(self, hidden):
        return self.embed.as_linear(hidden)

    num_layers = property(lambda self: len(self.layers))
    vocab_size = property(lambda self: self._vocab)
    hidden_size = property(lambda self: self._hidden)
