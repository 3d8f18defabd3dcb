"""Qwen3.5 (dense) text decoder: Gated DeltaNet and gated full-attention layers.

Layer ``i`` is a Gated DeltaNet (linear attention) layer or a full-attention layer as
``layer_types`` says (else every ``full_attention_interval``-th layer is full attention).
Each layer is ``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``
with ``mlp = down(silu(gate(x)) * up(x))``.

- Gated DeltaNet (``mlxrunner.nn.GatedDeltaNet``): a causal depthwise convolution over the
  q/k/v channels, then per value head with a float32 state ``S [Dv, Dk]``:
  ``S = exp(g) S; d = beta (v - S k); S = S + d k^T; o = S q``, q and k L2-normalised (q
  also times ``Dk^-0.5``), ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``;
  output ``out_proj(rmsnorm(o) * w * silu(z))``.
- Full attention: ``q_proj`` gives each head's query and output gate side by side; q and k
  are RMS-normed per head, RoPE rotates the first ``partial_rotary_factor`` of each head;
  grouped-query heads; output ``o_proj(attention * sigmoid(gate))``. While a prompt holding
  images is prefilled, ``positions`` (temporal, height, width per token) turn the rotary
  frequencies as ``mrope_section`` interleaves them (:mod:`.mrope`); otherwise the cache's
  offset onward.
- The RMSNorms of the layers, the q/k norms and the final norm are zero-centred (they
  multiply by ``1 + w``); the DeltaNet output norm is not.

Checkpoints: Hub (transformers) folders store ``w`` and the convolution as ``[C, 1, K]``;
MLX-converted folders (mlx-lm's layout, ``language_model.*`` names) store ``1 + w`` and
``[C, K, 1]``. ``sanitize`` brings both to this module's layout (``w`` and ``[C, K, 1]``).

Images: ``load_encoders`` gives the checkpoint's vision tower as an image encoder
(:mod:`.encoder`); prefill then passes ``embeddings`` (the tower's rows at the image slots)
and ``positions``.

Written against mlxrunner's public API only; the core traces its decode steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import (
    Cache,
    ConfigBound,
    ConfigMultiple,
    Encoder,
    KVCache,
    Model,
    ModelFolderError,
    RecurrentCache,
)

from .mrope import DEFAULT_SECTION, MRoPE, rotate

#: what a full-attention layer rotates by while a prompt holding images is prefilled:
#: (cos, sin) of :meth:`MRoPE.tables`; None: the cache's offset onward
RopeTables = tuple[mx.array, mx.array] | None

LINEAR = "linear_attention"
FULL = "full_attention"

# Norms whose Hub weights are zero-centred (the model multiplies by 1 + w).
_ZERO_CENTRED_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                          ".q_norm.weight", ".k_norm.weight")
_DROPPED_PREFIXES = ("mtp.", "model.mtp.", "model.visual.", "visual.", "vision_tower.",
                     "model.vision_tower.", "language_model.mtp.")


@dataclass(frozen=True)
class Qwen3_5Config:
    """The config.json fields (text part) this architecture reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mrope_section: tuple[int, int, int] = DEFAULT_SECTION
    #: the token a chat template writes per image (``<|image_pad|>``); config.json's top level
    image_token_id: int = 248056

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen3_5Config:
        if config.get("num_experts"):
            raise ModelFolderError("qwen3_5 is the dense model: a config with num_experts is "
                                   "a qwen3_5_moe one")
        return cls(**cls.fields(config, required=("intermediate_size",)))

    @classmethod
    def fields(cls, config: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
        """The fields dense and mixture-of-experts configs share, checked; ``required``: more
        keys that must be present."""
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    *required)
        missing = [key for key in required if key not in config]
        if missing:
            raise ModelFolderError(f"config.json lacks {', '.join(map(repr, missing))} "
                                   "needed by the qwen3_5 architecture")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFolderError(f"qwen3_5 supports hidden_act 'silu' only, got {act!r}")
        layers = int(config["num_hidden_layers"])
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = int(config.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) < layers or any(t not in (LINEAR, FULL) for t in layer_types):
            raise ModelFolderError(f"qwen3_5 layer_types must list {layers} entries of "
                                   f"{LINEAR!r} / {FULL!r}, got {list(layer_types)}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelFolderError(f"qwen3_5 supports rope_type 'default' only, got {rope_type!r}")
        section = rope.get("mrope_section")
        section = DEFAULT_SECTION if section is None else section
        if not isinstance(section, (list, tuple)) or len(section) != 3 or not all(
                type(v) is int and 0 <= v <= 4096 for v in section):
            raise ModelFolderError(f"qwen3_5 rope_parameters.mrope_section must list 3 "
                                   f"frequency counts, got {str(section)[:60]}")
        heads = int(config["num_attention_heads"])
        value_heads = int(config.get("linear_num_value_heads", 32))
        key_heads = int(config.get("linear_num_key_heads", 16))
        if value_heads % key_heads:
            raise ModelFolderError(f"qwen3_5 needs linear_num_value_heads ({value_heads}) to be "
                                   f"a multiple of linear_num_key_heads ({key_heads})")
        return dict(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config.get("intermediate_size") or 0),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or 256),
            layer_types=layer_types[:layers],
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=int(config.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(config.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(config.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 config.get("partial_rotary_factor", 0.25))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mrope_section=(section[0], section[1], section[2]),
            image_token_id=int(_or(config.get("image_token_id"), 248056)),
        )


def _or(value: Any, default: Any) -> Any:
    """``value``, or ``default`` where config.json leaves it out or null."""
    return default if value is None else value


class Attention(nn.Module):
    """Full attention: gated output, q/k RMSNorm, partial RoPE, grouped-query heads."""

    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        self.scale = d ** -0.5
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        # tensor-parallel: heads split over the ranks (mlxrunner.nn.parallel)
        heads, kv_heads = mnn.Column(self.heads), mnn.Column(self.kv_heads)
        self.q_proj = mnn.Linear(hidden, self.heads * d * 2, bias, heads)  # query and gate
        self.k_proj = mnn.Linear(hidden, self.kv_heads * d, bias, kv_heads)
        self.v_proj = mnn.Linear(hidden, self.kv_heads * d, bias, kv_heads)
        self.o_proj = mnn.Linear(self.heads * d, hidden, bias, mnn.Row())
        self.q_norm = mnn.RMSNorm(d, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = mnn.RMSNorm(d, cfg.rms_norm_eps, offset=1.0)
        self.rope = mnn.RoPE(cfg.rotary_dims, base=cfg.rope_theta)

    def __call__(self, x: mx.array, cache: KVCache | None, residual: mx.array,
                 rope: RopeTables = None) -> mx.array:
        """``residual + attention(x)``; ``rope``: the multimodal rotation tables, while a
        prompt holding images is prefilled."""
        B, L, _ = x.shape
        q_gate, k, v = mnn.linears(x, self.q_proj, self.k_proj, self.v_proj)
        d = self.head_dim
        q_gate = q_gate.reshape(B, L, -1, 2 * d)  # each head: its query, then its gate
        k = k.reshape(B, L, -1, d)
        if rope is None:
            offset = cache.offset if cache is not None else 0
            q, k, gate = mnn.attention_heads(offset, (q_gate, self.q_norm, self.rope, d),
                                             (k, self.k_norm, self.rope),
                                             (q_gate, None, None, slice(d, None)))
        else:
            q, gate = mx.split(q_gate, 2, axis=-1)
            q = rotate(self.q_norm(q).transpose(0, 2, 1, 3), rope)
            k = rotate(self.k_norm(k).transpose(0, 2, 1, 3), rope)
            gate = gate.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, -1, d).transpose(0, 2, 1, 3)
        out = mnn.attend(q, *mnn.store(cache, k, v), scale=self.scale, gate=gate)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1), residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5Config, layer_type: str,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.is_linear = layer_type == LINEAR
        if self.is_linear:
            self.linear_attn = mnn.GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        else:
            self.self_attn = Attention(cfg)
        self.input_layernorm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                    offset=1.0)
        # called as mlp(x, residual): residual + feed-forward(x)
        self.mlp = mlp if mlp is not None else mnn.GatedMLP(cfg.hidden_size,
                                                            cfg.intermediate_size)

    def __call__(self, x: mx.array, cache: KVCache | RecurrentCache | None,
                 rope: RopeTables = None) -> mx.array:
        # the model's caches match its layers: recurrent for linear attention (no positions),
        # KV otherwise
        if self.is_linear:
            h = self.linear_attn(self.input_layernorm(x), cast("RecurrentCache | None", cache), x)
        else:
            h = self.self_attn(self.input_layernorm(x), cast("KVCache | None", cache), x, rope)
        return self.mlp(self.post_attention_layernorm(h), h)


class TextModel(nn.Module):
    def __init__(self, cfg: Qwen3_5Config,
                 layer_mlp: Callable[[int], nn.Module | None] | None = None) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, t, layer_mlp(i) if layer_mlp else None)
                       for i, t in enumerate(cfg.layer_types)]
        self.norm = mnn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        # the multimodal rotation's tables, computed once per forward for every layer
        self.mrope = MRoPE(cfg.rotary_dims, cfg.rope_theta, cfg.mrope_section)


class Qwen3_5(Model):
    """Qwen3.5 dense text model (``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5ForCausalLM``)."""

    # The chat format these checkpoints were trained on (used when the user names none and
    # the renderer plugin is installed).
    default_renderer = "qwen3.5"
    default_parser = "qwen3.5"
    # The MTP head its Hub checkpoints carry (mtp.*, dropped by sanitize) is a draft of its
    # own (mtp.py), loaded from the same files.
    checkpoint_draft = "Qwen3_5MTP"
    config_bounds = {
        "linear_num_key_heads": ConfigBound(int, 1, 1024),
        "linear_num_value_heads": ConfigBound(int, 1, 1024),
        "linear_key_head_dim": ConfigBound(int, 1, 8192),
        "linear_value_head_dim": ConfigBound(int, 1, 8192),
        "linear_conv_kernel_dim": ConfigBound(int, 1, 64),
        "full_attention_interval": ConfigBound(int, 1, 1024),
        "image_token_id": ConfigBound(int, 0, 2**24),
    }
    config_multiples = (ConfigMultiple("linear_num_value_heads", "linear_num_key_heads"),)
    config_type: type[Qwen3_5Config] = Qwen3_5Config

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.config = self.config_type.from_dict(config)
        self.model = TextModel(self.config, self.layer_mlp)
        if not self.config.tie_word_embeddings:
            self.lm_head = mnn.Linear(self.config.hidden_size, self.config.vocab_size,
                                      bias=False)

    def layer_mlp(self, index: int) -> nn.Module | None:
        """Layer ``index``'s feed-forward block (None: the dense ``GatedMLP``)."""
        return None

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map Hub (composite or text-only) and MLX-converted names to this module's names.

        Drops the vision tower and the MTP head; converts Hub conv weights ``[C, 1, K]`` to
        ``[C, K, 1]`` and MLX-converted zero-centred norm weights ``1 + w`` back to ``w``
        (exactly: ``1 + w`` and ``w`` differ by a power of two's multiples)."""
        conv_shapes = [v.shape for k, v in weights.items() if k.endswith("conv1d.weight")]
        if conv_shapes:
            hub_layout = any(shape[-1] != 1 for shape in conv_shapes)
        else:  # no DeltaNet layer: mlx-lm names its text weights language_model.*
            hub_layout = not any(k.startswith("language_model.") for k in weights)
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            if name.startswith(_DROPPED_PREFIXES):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith("language_model."):
                name = name[len("language_model."):]
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue
            if hub_layout and name.endswith("conv1d.weight") and value.ndim == 3:
                value = value.swapaxes(1, 2)
            if not hub_layout and (name == "model.norm.weight"
                                   or name.endswith(_ZERO_CENTRED_SUFFIXES)):
                value = (value.astype(mx.float32) - 1.0).astype(value.dtype)
            out[name] = value
        return out

    # -- running -----------------------------------------------------------
    def make_cache(self) -> list[Cache | None]:
        return [RecurrentCache() if layer.is_linear else KVCache() for layer in self.layers]

    def load_encoders(self, folder: Path) -> dict[str, Encoder]:
        """``{"image": ...}`` where the folder holds a vision tower (in this model's dtype),
        else none."""
        from .encoder import load_image_encoder

        encoder = load_image_encoder(folder, self.config, self.dtype)
        return {} if encoder is None else {"image": encoder}

    def __call__(self, ids: mx.array, cache: Sequence[Any] | None = None, *,
                 taps: Sequence[int] | None = None, embeddings: mx.array | None = None,
                 positions: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """Logits for ``ids [B, L]`` (with ``taps``: and the tapped residual stream).
        ``embeddings [B, L, hidden]``: the input embeddings to run instead of
        ``embed_tokens(ids)`` (a prompt chunk whose image slots hold the encoder's rows);
        ``positions [3, B, L]``: each token's temporal, height and width position, for the
        full-attention layers' multimodal rotation in place of the cache's offset."""
        tapped = mnn.Taps(taps, len(self.layers))
        cache = [None] * len(self.layers) if cache is None else cache
        if embeddings is None:
            h = self.model.embed_tokens(ids)
        elif embeddings.shape != (*ids.shape, self.hidden_size):
            raise ValueError(f"embeddings must be {[*ids.shape, self.hidden_size]}, got "
                             f"{list(embeddings.shape)}")
        else:
            h = embeddings
        rope: RopeTables = None
        if positions is not None:
            if positions.shape != (3, *ids.shape):
                raise ValueError(f"positions must be {[3, *ids.shape]}, got "
                                 f"{list(positions.shape)}")
            rope = self.model.mrope.tables(positions)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = tapped.after(i, layer(h, layer_cache, rope))
        return tapped.result(self.raw_logits(self.model.norm(mnn.head_rows(h))))

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    # -- facts -------------------------------------------------------------
    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size
