"""A small decoder whose layers each write attention one documented way, as a third party
would, against the public API only (``mlxrunner``, ``mlxrunner.plugin``, ``mlxrunner.nn``).
Shared by the compiled-step tests (importable as ``attention_styles``).

Styles (one per layer, cycled):

- ``store``: ``mnn.store(cache, k, v)`` then ``mnn.attend(q, *kv)`` (the mask comes from the
  cache).
- ``attend-causal``: ``cache.update_and_fetch`` then ``mlxrunner.attend`` with ``"causal"``
  for every block, one-token steps included.
- ``attend-none``: ``mlxrunner.nn.attend`` with ``None`` for one token and ``"causal"`` for
  longer blocks (what ``KVCache.mask`` says).
- ``attend-array``: ``mlxrunner.attend`` with a boolean mask the layer builds itself from
  absolute positions (``cache.offset`` kept opaque).
- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` called directly with ``"causal"`` /
  None.
- ``sdpa-window``: the same over a sliding window (``RingCache``), the mask from
  ``cache.mask(L)``.
- ``end-aligned`` (not a documented style: a test of the fallback): a boolean causal mask
  aligned to the last key, which a trace over a whole buffer cannot reproduce for blocks.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

import mlxrunner
import mlxrunner.nn as mnn
from mlxrunner.plugin import KVCache, Model, RingCache

STYLES = ("store", "attend-causal", "attend-none", "attend-array", "sdpa", "sdpa-window")
WINDOW = 5


class StyledAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, style: str) -> None:
        super().__init__()
        self.style, self.heads, self.kv_heads = style, heads, kv_heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.rope = nn.RoPE(self.head_dim, base=10000.0)

    def __call__(self, x: mx.array, cache: KVCache | RingCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        out = self.attend(q, k, v, cache, offset)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def attend(self, q: mx.array, k: mx.array, v: mx.array,
               cache: KVCache | RingCache | None, offset: mx.array | int) -> mx.array:
        L, style = q.shape[2], self.style
        if style == "store":
            return mnn.attend(q, *mnn.store(cache, k, v), scale=self.scale)
        if style == "sdpa-window":
            if cache is None:
                rows = mx.arange(L)
                mask = (rows[None] <= rows[:, None]) & (rows[None] > rows[:, None] - WINDOW)
            else:
                mask = cache.mask(L)
                k, v = cache.update_and_fetch(k, v)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if style == "attend-causal":
            return mlxrunner.attend(q, k, v, "causal", scale=self.scale)
        if style == "attend-none":
            return mnn.attend(q, k, v, None if L == 1 else "causal", scale=self.scale)
        if style == "attend-array":
            queries = offset + mx.arange(L)
            mask = mx.arange(k.shape[2])[None] <= queries[:, None]
            return mlxrunner.attend(q, k, v, mask, scale=self.scale)
        if style == "end-aligned":
            S = k.shape[2]
            mask = mx.arange(S)[None] <= (S - L + mx.arange(L))[:, None]
            return mlxrunner.attend(q, k, v, mask, scale=self.scale)
        assert style == "sdpa", style
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale,
                                                    mask="causal" if L > 1 else None)


class StyledLayer(nn.Module):
    def __init__(self, hidden: int, style: str) -> None:
        super().__init__()
        self.attn = StyledAttention(hidden, 4, 2, style)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def __call__(self, x: mx.array, cache: KVCache | RingCache | None) -> mx.array:
        h = x + self.attn(self.norm1(x), cache)
        y = self.norm2(h)
        return h + self.down(nn.silu(self.gate(y)) * self.up(y))


class StyledModel(Model):
    """``styles``: each layer's way of writing attention (see the module)."""

    def __init__(self, styles: tuple[str, ...], vocab: int = 67, hidden: int = 32) -> None:
        super().__init__({})
        self.styles = styles
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = [StyledLayer(hidden, s) for s in styles]
        self.norm = nn.RMSNorm(hidden)
        self._vocab, self._hidden = vocab, hidden

    def make_cache(self) -> list[KVCache | RingCache]:
        return [RingCache(WINDOW) if s == "sdpa-window" else KVCache() for s in self.styles]

    def __call__(self, ids: mx.array, cache: list | None = None, *,
                 taps: list[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        cache = cache or [None] * len(self.layers)
        h, tapped = self.embed(ids), []
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, c)
            if taps and i in taps:
                tapped.append(h)
        logits = self.raw_logits(self.norm(h))
        if taps is None:
            return logits
        return logits, (mx.concatenate(tapped, axis=-1) if tapped else
                        mx.zeros((*ids.shape, 0), h.dtype))

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.embed(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        return self.embed.as_linear(hidden)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def hidden_size(self) -> int:
        return self._hidden


def styled_model(*styles: str, seed: int = 0) -> StyledModel:
    """A random float32 model, one layer per style (two of each when one is named)."""
    mx.random.seed(seed)
    model = StyledModel(styles if len(styles) > 1 else styles * 2)
    mx.eval(model.parameters())
    return model
