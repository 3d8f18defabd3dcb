"""Gemma 4 vision tower and ``embed_vision``: image patches to soft tokens in the text width.

The checkpoint's ``model.vision_tower.*`` and ``model.embed_vision.*`` tensors and
config.json's ``vision_config``. Input: what ``Gemma4ImageProcessor`` emits per image,
``pixel_values [images, max_patches, 3 * P * P]`` (each patch's pixels in ``[0, 1]``, patch
row, patch column, channel flattened in that order) and ``position_ids [images,
max_patches, 2]``: each patch's ``(x, y)`` = (column, row) in its image's ``h x w`` patch
grid, padding rows ``(-1, -1)``. Each image is run on its own rows (padding never enters
attention, as transformers masks it), so images of any size batch together.

- Patch embedding: ``input_proj(2 * (pixels - 0.5))`` (no bias) plus a learned position per
  axis, ``position_embedding_table[0][x] + position_embedding_table[1][y]``.
- ``num_hidden_layers`` sandwich-norm layers (RMSNorm ``x * weight``, eps ``rms_norm_eps``):
  ``x += post_attention_norm(attn(input_norm(x)))``, ``x += post_ffw_norm(mlp(pre_ffw_norm(x)))``.
  Attention is full (not causal) within one image, unscaled (scale 1.0), grouped KV heads;
  q and k are RMS-normed per head (with scales), v without. 2-D RoPE over the whole head:
  with ``head_dim / 4`` frequencies ``theta^(-2i / (head_dim / 2))`` (theta 100 by
  default), the first half of each head rotates by the column ``x``, the second by the row
  ``y``, each half in the rotate-half convention. MLP: ``down(gelu_tanh(gate(x)) * up(x))``.
  Every linear is a ``ClippableLinear`` (``*.linear.weight``): with ``use_clipped_linears``
  its input and output are clamped to the checkpoint's ``input_min/max``, ``output_min/max``.
- Pooling to soft tokens: the mean of each ``k x k`` window of patches
  (``k = pooling_kernel_size``; one soft token per window, windows row by row), times
  ``sqrt(hidden_size)``, then with ``standardize`` ``(x - std_bias) * std_scale``.
- ``embed_vision``: RMSNorm without scale, then ``embedding_projection`` (no bias) to the
  text model's ``hidden_size``.

:meth:`Gemma4Vision.hidden_states` gives the encoder's output (before pooling),
:meth:`Gemma4Vision.soft_tokens` the tower's (transformers' ``Gemma4VisionModel``
``last_hidden_state``) and ``__call__`` ``embed_vision``'s: what ``Gemma4Model`` puts at the
image placeholder positions, every image's soft tokens in order.
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

from mlxrunner.plugin import (
    ConfigBound,
    ModelFolderError,
    check_config,
    load_part,
)

#: tensor name prefixes of the tower and its projection: Hub checkpoints, then MLX layouts
#: (mlx-vlm keeps transformers' names without ``model.``)
VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "vision_tower.",
                   "embed_vision.")
_ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu": nn.gelu,
    "silu": nn.silu,
}
#: transformers' Gemma4TextConfig.hidden_size default (the projection's output width)
_TEXT_HIDDEN_DEFAULT = 2304


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision_config`` fields the tower reads (transformers' ``Gemma4VisionConfig``
    defaults where a key is absent), and the text model's width."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0
    text_hidden_size: int = _TEXT_HIDDEN_DEFAULT

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    @classmethod
    def from_dict(cls, config: Mapping[str, Any],
                  text_hidden_size: Any = None) -> VisionConfig:
        where = "config.json vision_config"
        check_config(config, Gemma4Vision, where)
        if text_hidden_size is not None:
            check_config({"hidden_size": text_hidden_size}, None, "config.json text_config")
        act = config.get("hidden_activation", cls.hidden_activation)
        if not isinstance(act, str) or act not in _ACTIVATIONS:
            raise ModelFolderError(f"{where}: hidden_activation {act!r:.40} is not supported "
                                   f"({', '.join(_ACTIVATIONS)})")
        rope = config.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ModelFolderError(f"{where}: rope_parameters must be an object")
        rope_type = rope.get("rope_type", "axial")
        if rope_type not in ("axial", "default"):  # transformers reads "default" as axial
            raise ModelFolderError(f"{where}: the vision tower's rope_type must be 'axial', "
                                   f"got {rope_type!r:.40}")
        values: dict[str, Any] = {}
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "patch_size",
                    "pooling_kernel_size", "position_embedding_size"):
            if config.get(key) is not None:  # check_config bounded it: an integral number
                values[key] = int(config[key])
        for key in ("use_clipped_linears", "standardize"):
            if config.get(key) is not None:
                values[key] = bool(config[key])
        if config.get("rms_norm_eps") is not None:
            values["rms_norm_eps"] = float(config["rms_norm_eps"])
        theta = rope.get("rope_theta", config.get("rope_theta"))
        cfg = cls(hidden_activation=act,
                  rope_theta=float(theta) if theta is not None else cls.rope_theta,
                  text_hidden_size=(int(text_hidden_size) if text_hidden_size is not None
                                    else _TEXT_HIDDEN_DEFAULT),
                  **values)
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelFolderError(f"{where}: num_attention_heads ({cfg.num_attention_heads}) "
                                   "must be a multiple of num_key_value_heads "
                                   f"({cfg.num_key_value_heads})")
        if cfg.head_dim % 4:
            raise ModelFolderError(f"{where}: the 2-D RoPE needs head_dim ({cfg.head_dim}) to "
                                   "be a multiple of 4")
        return cfg


class ClippableLinear(nn.Module):
    """A linear map without bias (``linear``); with ``clipped``, its input and output are
    clamped to the checkpoint's scalar bounds."""

    def __init__(self, in_dims: int, out_dims: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min = mx.array(-math.inf)
            self.input_max = mx.array(math.inf)
            self.output_min = mx.array(-math.inf)
            self.output_max = mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (Gemma 4 scales by ``weight``, not ``1 + weight``)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, cfg.position_embedding_size,
                                                  cfg.hidden_size))

    def __call__(self, pixels: mx.array, xs: mx.array, ys: mx.array) -> mx.array:
        x = self.input_proj((2 * (pixels - 0.5)).astype(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return x + (table[0][xs] + table[1][ys]).astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        clipped = cfg.use_clipped_linears
        self.q_proj = ClippableLinear(cfg.hidden_size, self.heads * self.head_dim, clipped)
        self.k_proj = ClippableLinear(cfg.hidden_size, self.kv_heads * self.head_dim, clipped)
        self.v_proj = ClippableLinear(cfg.hidden_size, self.kv_heads * self.head_dim, clipped)
        self.o_proj = ClippableLinear(self.heads * self.head_dim, cfg.hidden_size, clipped)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """``x [n, hidden]``: the patches of one image, all attending to all."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(n, self.kv_heads, self.head_dim))
        v = mx.fast.rms_norm(self.v_proj(x).reshape(n, self.kv_heads, self.head_dim), None,
                             self.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q, k, v = (a.transpose(1, 0, 2)[None] for a in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(n, -1))


def _rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """2-D RoPE of ``x [n, heads, head_dim]`` in float32 (cos, sin ``[n, head_dim]``: the
    column's angles twice, then the row's twice): each half of the head rotates on its own,
    rotate-half convention within it."""
    dtype = x.dtype
    x = x.astype(mx.float32)
    quarter = x.shape[-1] // 4
    parts = x.reshape(*x.shape[:-1], 2, 2, quarter)  # [..., axis, half of its part, quarter]
    rotated = mx.concatenate([-parts[..., 1:, :], parts[..., :1, :]], axis=-2)
    rotated = rotated.reshape(x.shape)
    return (x * cos[:, None] + rotated * sin[:, None]).astype(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        clipped = cfg.use_clipped_linears
        self.gate_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clipped)
        self.up_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clipped)
        self.down_proj = ClippableLinear(cfg.intermediate_size, cfg.hidden_size, clipped)
        self.act = _ACTIVATIONS[cfg.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class VisionTower(nn.Module):
    """``model.vision_tower``: patch embedder, encoder and (with ``standardize``) the soft
    tokens' ``std_bias`` / ``std_scale``; the pooling has no parameters."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.std_bias = mx.zeros((cfg.hidden_size,))
            self.std_scale = mx.ones((cfg.hidden_size,))


class MultimodalEmbedder(nn.Module):
    """``model.embed_vision``: RMSNorm without scale, then a projection to the text width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.embedding_projection = nn.Linear(cfg.hidden_size, cfg.text_hidden_size,
                                              bias=False)

    def __call__(self, soft_tokens: mx.array) -> mx.array:
        dtype = self.embedding_projection.weight.dtype
        return self.embedding_projection(mx.fast.rms_norm(soft_tokens.astype(dtype), None,
                                                          self.eps))


@dataclass(frozen=True)
class _Image:
    """One image's real rows: their indices in its padded input, columns, rows, grid."""

    rows: np.ndarray
    xs: np.ndarray
    ys: np.ndarray
    height: int
    width: int


class Gemma4Vision(nn.Module):
    """The vision tower and ``embed_vision``; parameter names are the checkpoint's without
    ``model.`` (``vision_tower.*``, ``embed_vision.*``)."""

    config_bounds = {
        "patch_size": ConfigBound(int, 1, 1024),
        "pooling_kernel_size": ConfigBound(int, 1, 64),
        "position_embedding_size": ConfigBound(int, 1, 2**20),
        "use_clipped_linears": ConfigBound(bool),
        "standardize": ConfigBound(bool),
    }

    def __init__(self, config: Mapping[str, Any] | VisionConfig,
                 text_hidden_size: int | None = None) -> None:
        super().__init__()
        cfg = (config if isinstance(config, VisionConfig)
               else VisionConfig.from_dict(config, text_hidden_size))
        self.config = cfg
        self.vision_tower = VisionTower(cfg)
        self.embed_vision = MultimodalEmbedder(cfg)
        spatial = cfg.head_dim // 2
        exponents = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
        # plain numpy, not a parameter: float32 as transformers computes it
        self.inv_freq = (np.float32(1.0) / np.float32(cfg.rope_theta) ** exponents
                         ).astype(np.float32)

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Keep the tower's and ``embed_vision``'s tensors (:data:`VISION_PREFIXES`),
        ``model.`` stripped; every other tensor is dropped."""
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            if name.startswith(("model.vision_tower.", "model.embed_vision.")):
                out[name[len("model."):]] = value
            elif name.startswith(("vision_tower.", "embed_vision.")):
                out[name] = value
        return out

    # -- running -----------------------------------------------------------
    def __call__(self, pixel_values: Any, position_ids: Any) -> mx.array:
        """``[soft tokens, text hidden_size]``: every image's soft tokens in order
        (:meth:`soft_token_counts` each), projected by ``embed_vision``."""
        return self.embed_vision(self.soft_tokens(pixel_values, position_ids))

    def soft_tokens(self, pixel_values: Any, position_ids: Any) -> mx.array:
        """The tower's output ``[soft tokens, hidden_size]``: each image's encoder output
        pooled over ``k x k`` windows (windows row by row), scaled by ``sqrt(hidden_size)``
        and standardized; the images one after another."""
        pixels, images = self._check_inputs(pixel_values, position_ids)
        parts = [self._pool(self._encode(pixels[i], image), image)
                 for i, image in enumerate(images)]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def hidden_states(self, pixel_values: Any, position_ids: Any) -> mx.array:
        """The encoder's output ``[images, max_patches, hidden_size]`` (before pooling),
        padding rows zero."""
        pixels, images = self._check_inputs(pixel_values, position_ids)
        rows = pixels.shape[1]
        out = []
        for i, image in enumerate(images):
            hidden = self._encode(pixels[i], image)
            # each input row reads its own output row, padding the zero row appended
            source = np.full(rows, len(image.rows), dtype=np.int32)
            source[image.rows] = np.arange(len(image.rows), dtype=np.int32)
            zero = mx.zeros((1, hidden.shape[1]), dtype=hidden.dtype)
            out.append(mx.concatenate([hidden, zero])[mx.array(source)])
        return mx.stack(out)

    def soft_token_counts(self, position_ids: Any) -> list[int]:
        """How many soft tokens each image gives: ``(h / k) * (w / k)``."""
        k = self.config.pooling_kernel_size
        return [image.height * image.width // k ** 2
                for image in self._images(_positions(position_ids))]

    def _encode(self, pixels: mx.array, image: _Image) -> mx.array:
        """The encoder's output ``[n, hidden_size]`` for one image's ``n`` real rows."""
        tower = self.vision_tower
        rows = mx.array(image.rows)
        xs, ys = mx.array(image.xs), mx.array(image.ys)
        x = tower.patch_embedder(pixels[rows], xs, ys)
        cos, sin = self._rope_tables(image)
        for layer in tower.encoder.layers:
            x = layer(x, cos, sin)
        return x

    def _pool(self, hidden: mx.array, image: _Image) -> mx.array:
        """Mean over each ``k x k`` window (float32), scaled and standardized in float32."""
        k = self.config.pooling_kernel_size
        per_row = image.width // k
        window = (image.xs // k) + per_row * (image.ys // k)
        weights = np.zeros((image.height * image.width // k ** 2, len(image.xs)),
                           dtype=np.float32)
        weights[window, np.arange(len(image.xs))] = np.float32(1.0 / k ** 2)
        pooled = (mx.array(weights) @ hidden.astype(mx.float32)).astype(hidden.dtype)
        pooled = pooled.astype(mx.float32) * math.sqrt(self.config.hidden_size)
        if self.config.standardize:
            tower = self.vision_tower
            pooled = ((pooled - tower.std_bias.astype(mx.float32))
                      * tower.std_scale.astype(mx.float32))
        return pooled.astype(hidden.dtype)

    def _rope_tables(self, image: _Image) -> tuple[mx.array, mx.array]:
        """cos and sin ``[n, head_dim]`` (float32): ``[x f, x f, y f, y f]``."""
        inv_freq = mx.array(self.inv_freq)
        col = mx.array(image.xs.astype(np.float32))[:, None] * inv_freq
        row = mx.array(image.ys.astype(np.float32))[:, None] * inv_freq
        angles = mx.concatenate([col, col, row, row], axis=-1)
        return mx.cos(angles), mx.sin(angles)

    def _check_inputs(self, pixel_values: Any, position_ids: Any
                      ) -> tuple[mx.array, list[_Image]]:
        pixels = pixel_values if isinstance(pixel_values, mx.array) else mx.array(
            np.asarray(pixel_values, dtype=np.float32))
        positions = _positions(position_ids)
        if pixels.ndim == 2:
            pixels = pixels[None]
        width = self.config.patch_dim
        if pixels.ndim != 3 or tuple(pixels.shape) != (*positions.shape[:2], width):
            raise ValueError(f"pixel_values must be [images, patches, {width}] matching "
                             f"position_ids {list(positions.shape)}, got "
                             f"{list(pixels.shape)}")
        return pixels, self._images(positions)

    def _images(self, positions: np.ndarray) -> list[_Image]:
        """Each image's real rows, checked to tile a full ``h x w`` grid, ``h`` and ``w``
        multiples of ``pooling_kernel_size``, within the position table."""
        k, size = self.config.pooling_kernel_size, self.config.position_embedding_size
        images = []
        for i, image in enumerate(positions):
            rows = np.flatnonzero(~(image == -1).all(axis=-1))
            xs, ys = image[rows, 0], image[rows, 1]
            if not len(rows):
                raise ValueError(f"image {i} has no patch (every position is (-1, -1))")
            if xs.min() < 0 or ys.min() < 0:
                raise ValueError(f"image {i}: positions must be (-1, -1) (padding) or "
                                 "non-negative")
            width, height = int(xs.max()) + 1, int(ys.max()) + 1
            if width > size or height > size:
                raise ValueError(f"image {i}: a {height} x {width} patch grid exceeds the "
                                 f"position table ({size} per side)")
            cells = np.unique(ys.astype(np.int64) * width + xs)
            if len(rows) != height * width or len(cells) != len(rows):
                raise ValueError(f"image {i}: its {len(rows)} positions do not tile a "
                                 f"{height} x {width} grid once each")
            if height % k or width % k:
                raise ValueError(f"image {i}: a {height} x {width} patch grid is not a "
                                 f"multiple of pooling_kernel_size {k} on each side")
            images.append(_Image(rows.astype(np.int32), xs.astype(np.int32),
                                 ys.astype(np.int32), height, width))
        return images


def _positions(position_ids: Any) -> np.ndarray:
    """``position_ids`` as int64 numpy ``[images, patches, 2]`` (one image may drop the
    first axis)."""
    positions = np.asarray(position_ids)
    if positions.ndim == 2:
        positions = positions[None]
    if (positions.ndim != 3 or positions.shape[-1] != 2 or not positions.shape[0]
            or not np.issubdtype(positions.dtype, np.integer)):
        raise ValueError("position_ids must be integer [images, patches, 2] (x, y), got "
                         f"{positions.dtype} {list(positions.shape)}")
    return positions.astype(np.int64)


# -- loading from a model folder ------------------------------------------------------------
def load_vision(folder: Path, dtype: mx.Dtype = mx.float32) -> Gemma4Vision | None:
    """The vision tower and ``embed_vision`` of a model folder, their float weights in
    ``dtype``; None when config.json has no ``vision_config`` or the weights hold no vision
    tensor (read as the core reads a folder: ``mlxrunner.plugin.load_part``)."""

    def build(part: dict[str, Any], config: dict[str, Any]) -> Gemma4Vision:
        text = config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ModelFolderError(f"{folder}/config.json: text_config must be an object")
        return Gemma4Vision(part, (text or config).get("hidden_size"))

    tower: Gemma4Vision | None = load_part(folder, "vision_config", VISION_PREFIXES, build,
                                           dtype, "vision tower")
    return tower
