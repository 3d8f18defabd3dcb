"""Gemma 4 audio tower and ``embed_audio``: one clip's log-mel frames to soft tokens in the
text width.

The checkpoint's ``model.audio_tower.*`` and ``model.embed_audio.*`` tensors and
config.json's ``audio_config`` (transformers' ``Gemma4AudioModel``, a USM conformer). Input:
one clip's valid frames from :mod:`.audio_features`, ``[T, feature_size]``. transformers runs
a batch padded to its longest clip and masks the padding; every step below reads only
earlier frames or the frames inside a convolution's reach, whose padded neighbours it zeroes,
so one clip's frames alone give the same valid outputs, which are all it keeps.

- Subsampling: twice a 3 x 3 convolution of stride 2 and padding 1 over (time, mel) without
  bias, a LayerNorm over its channels (scale, no bias, eps ``rms_norm_eps``) and ReLU (1 ->
  ``subsampling_conv_channels[0]`` -> ``[1]`` channels); then each time step's (mel, channel)
  values, flattened in that order, through ``input_proj_linear`` to ``hidden_size``. ``T``
  frames become ``ceil(ceil(T / 2) / 2)`` steps.
- ``num_hidden_layers`` conformer layers: ``x = ff1(x)``; ``x += norm_post_attn(clip(attn(
  norm_pre_attn(clip(x)))))``; ``x = lconv(x)``; ``x = norm_out(clip(ff2(x)))``, where clip
  clamps to ``±gradient_clipping`` and the RMSNorms (``x * weight``) use eps 1e-6 (the
  light convolution's own two use ``rms_norm_eps``).
  - feed-forward: ``x + residual_weight * post_norm(clip(l2(silu(l1(pre_norm(clip(x)))))))``
    (widths ``4 * hidden_size``);
  - attention, local and unscaled: each step attends to itself and the ``context_left - 2``
    steps before it (and ``context_right - 1`` after), in float32; ``q = q_proj(x) *
    hidden_per_head^-0.5 / ln 2 * softplus(per_dim_scale)``, ``k = k_proj(x) * ln(1 + e) /
    ln 2``; the logit of key ``j`` for query ``i`` is ``q_i . (k_j + r[P + j - i])``, ``P =
    context_left - 1``, ``r = relative_k_proj(e)`` of sinusoidal embeddings ``e[c] = [sin(p
    w), cos(p w)]`` at relative positions ``p = (chunk + P + context_right) // 2 - c``
    (``w`` from 1 to 1/10000 in geometric steps), zero where ``c`` runs past them; then
    ``cap * tanh(logit / cap)`` (``attention_logit_cap``), softmax, ``post`` projection;
  - light convolution: ``x + linear_end(silu(conv_norm(clip(depthwise(glu(linear_start(
    pre_norm(x))))))))``, the depthwise convolution causal (``conv_kernel_size`` taps, the
    last on the current step), ``glu(a, b) = a * sigmoid(b)``.
  Every linear but ``relative_k_proj`` is a ``ClippableLinear`` (``*.linear.weight``;
  with ``use_clipped_linears``, its input and output clamped to the checkpoint's bounds).
- ``output_proj`` (with bias) to ``output_proj_dims``: the tower's output.
- ``embed_audio``: RMSNorm without scale (eps ``rms_norm_eps``), then
  ``embedding_projection`` (no bias) to the text model's ``hidden_size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxrunner.plugin import ConfigBound, ModelFolderError, check_config, load_part

from .audio_features import subsampled_length
from .vision import _ACTIVATIONS, ClippableLinear, RMSNorm

#: tensor name prefixes of the tower and its projection: Hub checkpoints, then MLX layouts
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.", "audio_tower.", "embed_audio.")
#: transformers' Gemma4TextConfig.hidden_size default (the projection's output width)
_TEXT_HIDDEN_DEFAULT = 2304
#: the eps of the RMSNorms transformers builds without passing the config's
_DEFAULT_EPS = 1e-6
#: the ``audio_config`` keys read as they are, by type (``check_config`` bounds them)
_FIELDS: dict[type, tuple[str, ...]] = {
    int: ("hidden_size", "num_hidden_layers", "num_attention_heads", "conv_kernel_size",
          "attention_chunk_size", "attention_context_left", "attention_context_right",
          "output_proj_dims"),
    float: ("residual_weight", "attention_logit_cap", "attention_invalid_logits_value",
            "rms_norm_eps", "gradient_clipping"),
    bool: ("use_clipped_linears",),
}


@dataclass(frozen=True)
class AudioConfig:
    """The ``audio_config`` fields the tower reads (transformers' ``Gemma4AudioConfig``
    defaults where a key is absent), and the text model's width."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    text_hidden_size: int = _TEXT_HIDDEN_DEFAULT

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def relative_positions(self) -> int:
        """How many relative position embeddings there are: ``context // 2 + 1``."""
        context = (self.attention_chunk_size + self.attention_context_left - 1
                   + self.attention_context_right)
        return context // 2 + 1

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], text_hidden_size: Any = None
                  ) -> AudioConfig:
        where = "config.json audio_config"
        check_config(config, Gemma4Audio, where)
        if text_hidden_size is not None:
            check_config({"hidden_size": text_hidden_size}, None, "config.json text_config")
        act = config.get("hidden_act", cls.hidden_act)
        if not isinstance(act, str) or act not in _ACTIVATIONS:
            raise ModelFolderError(f"{where}: hidden_act {act!r:.40} is not supported "
                                   f"({', '.join(_ACTIVATIONS)})")
        channels = config.get("subsampling_conv_channels", cls.subsampling_conv_channels)
        if not isinstance(channels, (list, tuple)) or len(channels) != 2 or not all(
                type(c) is int and 1 <= c <= 4096 for c in channels):
            raise ModelFolderError(f"{where}: subsampling_conv_channels must be 2 integers "
                                   f"from 1 to 4096, got {channels!r:.40}")
        values: dict[str, Any] = {}
        for kind, keys in _FIELDS.items():
            for key in keys:
                if config.get(key) is not None:  # check_config bounded it
                    values[key] = kind(config[key])
        cfg = cls(hidden_act=act, subsampling_conv_channels=(channels[0], channels[1]),
                  text_hidden_size=(int(text_hidden_size) if text_hidden_size is not None
                                    else _TEXT_HIDDEN_DEFAULT), **values)
        if cfg.hidden_size % cfg.num_attention_heads or cfg.hidden_size % 2:
            raise ModelFolderError(f"{where}: hidden_size ({cfg.hidden_size}) must be even and "
                                   "a multiple of num_attention_heads "
                                   f"({cfg.num_attention_heads})")
        # masked keys must get no weight after the softmax (exp underflows to 0), as the
        # padding of transformers' blocks gets none
        if cfg.attention_invalid_logits_value > -(cfg.attention_logit_cap + 200):
            raise ModelFolderError(f"{where}: attention_invalid_logits_value must lie far "
                                   "below -attention_logit_cap")
        return cfg


class SubsampleLayer(nn.Module):
    """A 3 x 3 convolution of stride 2 over (time, mel), LayerNorm over channels, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return nn.relu(self.norm(self.conv(x)))


class SubsampleProjection(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        first, second = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, first, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(first, second, cfg.rms_norm_eps)
        # transformers sizes the projection by the first layer's channels
        self.input_proj_linear = nn.Linear((first // 4) * second, cfg.hidden_size, bias=False)

    def __call__(self, features: mx.array) -> mx.array:
        """``[T, mel]`` -> ``[ceil(ceil(T / 2) / 2), hidden]``."""
        dtype = self.input_proj_linear.weight.dtype
        x = self.layer1(self.layer0(features.astype(dtype)[None, :, :, None]))
        return self.input_proj_linear(x.reshape(x.shape[1], -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        clipped, width = cfg.use_clipped_linears, cfg.hidden_size
        self.ffw_layer_1 = ClippableLinear(width, 4 * width, clipped)
        self.ffw_layer_2 = ClippableLinear(4 * width, width, clipped)
        self.pre_layer_norm = RMSNorm(width, _DEFAULT_EPS)
        self.post_layer_norm = RMSNorm(width, _DEFAULT_EPS)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.residual_weight = cfg.residual_weight

    def __call__(self, x: mx.array, clip: Callable[[mx.array], mx.array]) -> mx.array:
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(clip(x)))))
        return self.post_layer_norm(clip(h)) * self.residual_weight + x


class Attention(nn.Module):
    """Local attention with relative position logits (see the module's notes)."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        clipped, width = cfg.use_clipped_linears, cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = ClippableLinear(width, width, clipped)
        self.k_proj = ClippableLinear(width, width, clipped)
        self.v_proj = ClippableLinear(width, width, clipped)
        self.post = ClippableLinear(width, width, clipped)
        self.relative_k_proj = nn.Linear(width, width, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_scale = self.head_dim ** -0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.cap = cfg.attention_logit_cap
        self.masked_logit = cfg.attention_invalid_logits_value
        self.past = cfg.attention_context_left - 1  # P: key j reads r[P + j - i]

    def __call__(self, x: mx.array, positions: mx.array, band: mx.array, relative: mx.array
                 ) -> mx.array:
        """``x [T, hidden]``; ``positions``: the sinusoidal embeddings ``[R, hidden]``;
        ``band [T, T]``: which keys each query attends to; ``relative [T, T]``: the index
        ``P + j - i`` into them (clamped; ``R`` where none applies, a zero row)."""
        t = x.shape[0]

        def heads(y: mx.array) -> mx.array:
            return y.astype(mx.float32).reshape(t, self.heads, self.head_dim).transpose(1, 0, 2)

        # (softplus in the parameter's dtype, as transformers takes it)
        q = heads(self.q_proj(x)) * self.q_scale * nn.softplus(self.per_dim_scale)
        k = heads(self.k_proj(x)) * self.k_scale
        v = heads(self.v_proj(x))
        r = self.relative_k_proj(positions).astype(mx.float32)
        r = r.reshape(-1, self.heads, self.head_dim).transpose(1, 0, 2)
        r = mx.concatenate([r, mx.zeros_like(r[:, :1])], axis=1)  # the zero row R
        by_position = q @ r.transpose(0, 2, 1)  # [heads, T, R + 1]
        logits = q @ k.transpose(0, 2, 1) + mx.take_along_axis(
            by_position, mx.broadcast_to(relative[None], (self.heads, t, t)), axis=-1)
        logits = mx.tanh(logits / self.cap) * self.cap
        logits = mx.where(band[None], logits, mx.array(self.masked_logit, mx.float32))
        weights = mx.softmax(logits, axis=-1)
        out = (weights @ v).transpose(1, 0, 2).reshape(t, -1)
        return self.post(out.astype(x.dtype))


class DepthwiseConv1d(nn.Module):
    """A causal depthwise convolution over time: output ``t`` of channel ``c`` is
    ``sum_k weight[c, k] x[t - K + 1 + k, c]`` (zero before the first step)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, kernel))

    def __call__(self, x: mx.array) -> mx.array:
        kernel, t = self.weight.shape[1], x.shape[0]
        # summed in float32, as a convolution accumulates
        padded = mx.concatenate([mx.zeros((kernel - 1, x.shape[1]), mx.float32),
                                 x.astype(mx.float32)])
        weight = self.weight.astype(mx.float32)
        out = padded[:t] * weight[:, 0]
        for k in range(1, kernel):
            out = out + padded[k:k + t] * weight[:, k]
        return out.astype(x.dtype)


class LightConv(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        clipped, width = cfg.use_clipped_linears, cfg.hidden_size
        self.linear_start = ClippableLinear(width, 2 * width, clipped)
        self.linear_end = ClippableLinear(width, width, clipped)
        self.depthwise_conv1d = DepthwiseConv1d(width, cfg.conv_kernel_size)
        self.pre_layer_norm = RMSNorm(width, cfg.rms_norm_eps)
        self.conv_norm = RMSNorm(width, cfg.rms_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array, clip: Callable[[mx.array], mx.array]) -> mx.array:
        a, b = mx.split(self.linear_start(self.pre_layer_norm(x)), 2, axis=-1)
        h = self.depthwise_conv1d(a * mx.sigmoid(b))
        return self.linear_end(self.act(self.conv_norm(clip(h)))) + x


class ConformerLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.self_attn = Attention(cfg)
        self.lconv1d = LightConv(cfg)
        self.norm_pre_attn = RMSNorm(width, _DEFAULT_EPS)
        self.norm_post_attn = RMSNorm(width, _DEFAULT_EPS)
        self.norm_out = RMSNorm(width, _DEFAULT_EPS)
        self.gradient_clipping = cfg.gradient_clipping

    def __call__(self, x: mx.array, positions: mx.array, band: mx.array, relative: mx.array
                 ) -> mx.array:
        # (the clamp no wider than the dtype's range, as transformers bounds it)
        bound = min(self.gradient_clipping, float(mx.finfo(x.dtype).max))

        def clip(y: mx.array) -> mx.array:
            return mx.clip(y, -bound, bound)

        x = self.feed_forward1(x, clip)
        attended = self.self_attn(self.norm_pre_attn(clip(x)), positions, band, relative)
        x = self.norm_post_attn(clip(attended)) + x
        x = self.feed_forward2(self.lconv1d(x, clip), clip)
        return self.norm_out(clip(x))


class AudioTower(nn.Module):
    """``model.audio_tower``."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.subsample_conv_projection = SubsampleProjection(cfg)
        self.layers = [ConformerLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)


class AudioEmbedder(nn.Module):
    """``model.embed_audio``: RMSNorm without scale, then a projection to the text width."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.embedding_projection = nn.Linear(cfg.output_proj_dims, cfg.text_hidden_size,
                                              bias=False)

    def __call__(self, soft_tokens: mx.array) -> mx.array:
        dtype = self.embedding_projection.weight.dtype
        return self.embedding_projection(mx.fast.rms_norm(soft_tokens.astype(dtype), None,
                                                          self.eps))


class Gemma4Audio(nn.Module):
    """The audio tower and ``embed_audio``; parameter names are the checkpoint's without
    ``model.`` (``audio_tower.*``, ``embed_audio.*``). ``mel_bins``: the feature
    extractor's ``feature_size``, which the projection's width must fit."""

    config_bounds = {
        "conv_kernel_size": ConfigBound(int, 1, 64),
        "attention_chunk_size": ConfigBound(int, 1, 4096),
        "attention_context_left": ConfigBound(int, 2, 4096),
        "attention_context_right": ConfigBound(int, 0, 4096),
        "attention_logit_cap": ConfigBound(float, 0, 1e6, above_low=True),
        "attention_invalid_logits_value": ConfigBound(float, -1e30, 0),
        "residual_weight": ConfigBound(float, -1e6, 1e6),
        "gradient_clipping": ConfigBound(float, 0, 1e38, above_low=True),
        "output_proj_dims": ConfigBound(int, 1, 2**17),
        "use_clipped_linears": ConfigBound(bool),
    }

    def __init__(self, config: Mapping[str, Any] | AudioConfig, mel_bins: int = 128,
                 text_hidden_size: int | None = None) -> None:
        super().__init__()
        cfg = (config if isinstance(config, AudioConfig)
               else AudioConfig.from_dict(config, text_hidden_size))
        columns = subsampled_length(mel_bins)
        if columns != cfg.subsampling_conv_channels[0] // 4:
            raise ModelFolderError(f"the audio tower's projection takes "
                                   f"{cfg.subsampling_conv_channels[0] // 4} mel columns after "
                                   f"subsampling; {mel_bins} mel bins leave {columns}")
        self.config = cfg
        self.audio_tower = AudioTower(cfg)
        self.embed_audio = AudioEmbedder(cfg)
        self._positions = _relative_embeddings(cfg)

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Keep the tower's and ``embed_audio``'s tensors (:data:`AUDIO_PREFIXES`),
        ``model.`` stripped, the convolutions in MLX's layout: torch's (``[out, in, 3, 3]``,
        ``[channels, 1, kernel]``) transposed, MLX's kept (told by shape; where both read
        the same, a ``model.`` name is torch's). Every other tensor is dropped."""
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            hub = name.startswith(("model.audio_tower.", "model.embed_audio."))
            if hub:
                name = name[len("model."):]
            elif not name.startswith(("audio_tower.", "embed_audio.")):
                continue
            if name.endswith(".conv.weight") and value.ndim == 4:
                expected = tuple(self._parameter(name).shape)
                torch_order = value.transpose(0, 2, 3, 1)
                if tuple(torch_order.shape) == expected and (
                        hub or tuple(value.shape) != expected):
                    value = torch_order
            elif name.endswith("depthwise_conv1d.weight") and value.ndim == 3:
                value = value.reshape(value.shape[0], -1)  # [channels, 1 or kernel, ...]
            out[name] = value
        return out

    def _parameter(self, name: str) -> mx.array:
        found: Any = self
        for part in name.split("."):
            found = found[int(part)] if part.isdigit() else found[part]
        return found

    # -- running -----------------------------------------------------------
    def __call__(self, features: Any) -> mx.array:
        """One clip's soft tokens in the text width, ``[steps, text hidden_size]``."""
        return self.embed_audio(self.soft_tokens(features))

    def soft_tokens(self, features: Any) -> mx.array:
        """The tower's output ``[steps, output_proj_dims]`` for one clip's feature frames
        ``[T, mel]`` (transformers' ``last_hidden_state`` at the valid steps)."""
        frames = features if isinstance(features, mx.array) else mx.array(
            np.asarray(features, dtype=np.float32))
        if frames.ndim != 2 or frames.shape[0] < 1:
            raise ValueError(f"features must be [frames, mel bins], got {list(frames.shape)}")
        tower = self.audio_tower
        x = tower.subsample_conv_projection(frames)
        band, relative = self._attention_layout(x.shape[0])
        positions = mx.array(self._positions).astype(x.dtype)
        for layer in tower.layers:
            x = layer(x, positions, band, relative)
        return tower.output_proj(x)

    def _attention_layout(self, steps: int) -> tuple[mx.array, mx.array]:
        """Which key each query attends to (``0 <= i - j < P`` or ``0 < j - i <
        context_right``: transformers' sliding window), and the index ``P + j - i`` into the
        relative embeddings, ``R`` (the zero row) where it runs past them."""
        cfg = self.config
        past, count = cfg.attention_context_left - 1, cfg.relative_positions
        offset = np.arange(steps)[None, :] - np.arange(steps)[:, None]  # j - i
        band = ((-offset >= 0) & (-offset < past)) | \
            ((offset > 0) & (offset < cfg.attention_context_right))
        relative = past + offset
        relative = np.where((relative >= 0) & (relative < count), relative, count)
        return mx.array(band), mx.array(relative.astype(np.int32))


def _relative_embeddings(cfg: AudioConfig) -> np.ndarray:
    """``[R, hidden]`` float32: ``[sin(p w), cos(p w)]`` at relative positions ``p`` from
    ``R - 1`` down to 0, ``w`` geometric from 1 to 1/10000 over ``hidden / 2`` steps."""
    half = cfg.hidden_size // 2
    step = math.log(10_000.0) / max(half - 1, 1)
    rates = np.exp(np.arange(half, dtype=np.float32) * np.float32(-step)).astype(np.float32)
    positions = np.arange(cfg.relative_positions - 1, -1, -1, dtype=np.float32)[:, None]
    angles = (positions * rates[None, :]).astype(np.float32)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


# -- loading from a model folder ------------------------------------------------------------
def load_audio(folder: Path, dtype: mx.Dtype = mx.float32, mel_bins: int = 128
               ) -> Gemma4Audio | None:
    """The audio tower and ``embed_audio`` of a model folder, their float weights in
    ``dtype``; None when config.json has no ``audio_config`` or the weights hold no audio
    tensor. ``mel_bins``: the feature extractor's ``feature_size``. Read as the core reads
    a model folder (``mlxrunner.plugin.load_part``); ModelFolderError otherwise."""

    def build(audio_config: dict[str, Any], config: dict[str, Any]) -> Gemma4Audio:
        text = config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ModelFolderError(f"{folder}/config.json: text_config must be an object")
        return Gemma4Audio(audio_config, mel_bins, (text or config).get("hidden_size"))

    audio: Gemma4Audio | None = load_part(folder, "audio_config", AUDIO_PREFIXES, build,
                                          dtype, what="audio tower")
    return audio
