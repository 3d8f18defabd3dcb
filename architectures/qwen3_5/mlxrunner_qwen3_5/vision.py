"""Qwen3.5 vision tower: image (or video frame) patches to the text model's embedding width.

The checkpoint's ``model.visual.*`` tensors and config.json's ``vision_config``. Input: the
rows the image processor emits, ``patches [N, C * T * P * P]`` (channels, temporal patch,
patch rows, patch columns, flattened in that order), each image's ``(t, h, w)`` grid of
patches, the rows of each image in *merge-window order*: for each frame, the ``m x m``
windows (``m = spatial_merge_size``) row by row, inside a window its patches row by row.

- Patch embedding: a Conv3d whose kernel equals its stride is a linear map of each patch's
  flattened values (``patch_embed.proj``, the checkpoint's ``[D, C, T, P, P]`` kernel
  flattened to ``[D, C * T * P * P]``).
- Learned absolute positions: a square ``side x side`` table (``pos_embed``,
  ``side = sqrt(num_position_embeddings)``) resampled bilinearly, corners aligned, to each
  image's ``h x w`` grid (source coordinate ``r (side - 1) / (h - 1)``), added to every
  frame's patches.
- ``depth`` pre-norm blocks: ``x += proj(attn(norm1(x))); x += fc2(act(fc1(norm2(x))))``
  (LayerNorm eps 1e-6, biases everywhere). Attention is full (not causal) within one frame
  of one image and never across frames or images; 2-D RoPE: with ``d = head_dim / 4``
  frequencies ``theta^(-2i / (head_dim / 2))``, the angles are ``[row * f, col * f]``
  repeated twice across the head (rotate-half convention, the whole head rotated).
- Merger: LayerNorm, then each window's ``m^2`` rows side by side (``[N / m^2, D m^2]``),
  ``fc2(gelu(fc1(x)))`` (exact, erf GELU) to ``out_hidden_size``.

:meth:`Qwen3_5Vision.hidden_states` gives the blocks' output (transformers'
``last_hidden_state``), ``__call__`` the merger's (its ``pooler_output``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxrunner.plugin import (
    ConfigBound,
    ConfigMultiple,
    ModelFolderError,
    check_config,
    load_part,
)

#: tensor name prefixes of the vision tower: Hub checkpoints first, then other layouts
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
_LAYER_NORM_EPS = 1e-6
_ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu": nn.gelu,
    "silu": nn.silu,
}

Grid = Sequence[tuple[int, int, int]]


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision_config`` fields the tower reads (transformers' ``Qwen3_5VisionConfig``
    defaults where a key is absent)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionConfig:
        where = "config.json vision_config"
        check_config(config, Qwen3_5Vision, where)
        act = config.get("hidden_act", cls.hidden_act)
        if not isinstance(act, str) or act not in _ACTIVATIONS:
            raise ModelFolderError(f"{where}: hidden_act {act!r:.40} is not supported "
                                   f"({', '.join(_ACTIVATIONS)})")
        if config.get("deepstack_visual_indexes"):
            raise ModelFolderError(f"{where}: deepstack_visual_indexes (Qwen3-VL's deepstack "
                                   "mergers) are not part of the qwen3_5 vision tower")
        rope = config.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ModelFolderError(f"{where}: rope_parameters must be an object")
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ModelFolderError(f"{where}: the vision tower's rope_type must be 'axial', "
                                   f"got {rope_type!r:.40}")
        values: dict[str, Any] = {}
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                    "patch_size", "spatial_merge_size", "temporal_patch_size",
                    "out_hidden_size", "num_position_embeddings"):
            value = config.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelFolderError(f"{where}: {key} must be an integer, got {value!r:.40}")
            values[key] = value
        cfg = cls(hidden_act=act,
                  rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
                  **values)
        if cfg.grid_side ** 2 != cfg.num_position_embeddings:
            raise ModelFolderError(f"{where}: num_position_embeddings "
                                   f"({cfg.num_position_embeddings}) must be a square")
        if cfg.head_dim % 4:
            raise ModelFolderError(f"{where}: the 2-D RoPE needs hidden_size / num_heads "
                                   f"({cfg.head_dim}) to be a multiple of 4")
        return cfg


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches.astype(self.proj.weight.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array,
                 segments: Sequence[tuple[int, int]]) -> mx.array:
        """``segments``: ``(frames, length)`` per image, in row order: each of its
        ``frames`` consecutive runs of ``length`` rows attends within itself."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.heads, self.head_dim)
        q, k, v = _rope(qkv[:, 0], cos, sin), _rope(qkv[:, 1], cos, sin), qkv[:, 2]
        outs, start = [], 0
        for frames, length in segments:
            split = [a[start:start + frames * length].reshape(frames, length, self.heads, -1)
                     .transpose(0, 2, 1, 3) for a in (q, k, v)]
            out = mx.fast.scaled_dot_product_attention(*split, scale=self.scale)
            outs.append(out.transpose(0, 2, 1, 3).reshape(frames * length, -1))
            start += frames * length
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return self.proj(out)


def _rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half RoPE of ``x [N, heads, head_dim]`` in float32 (cos, sin ``[N, head_dim]``)."""
    dtype = x.dtype
    x = x.astype(mx.float32)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).astype(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_LAYER_NORM_EPS)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array,
                 segments: Sequence[tuple[int, int]]) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=_LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.linear_fc1.weight.shape[1])
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class Qwen3_5Vision(nn.Module):
    """The vision tower; parameter names are the checkpoint's without ``model.visual.``."""

    config_bounds = {
        "depth": ConfigBound(int, 1, 1024),
        "num_heads": ConfigBound(int, 1, 1024),
        "in_channels": ConfigBound(int, 1, 64),
        "patch_size": ConfigBound(int, 1, 1024),
        "temporal_patch_size": ConfigBound(int, 1, 64),
        "spatial_merge_size": ConfigBound(int, 1, 64),
        "out_hidden_size": ConfigBound(int, 1, 2**17),
        "num_position_embeddings": ConfigBound(int, 1, 2**24),
    }
    config_multiples = (ConfigMultiple("hidden_size", "num_heads"),)

    def __init__(self, config: Mapping[str, Any] | VisionConfig) -> None:
        super().__init__()
        cfg = config if isinstance(config, VisionConfig) else VisionConfig.from_dict(config)
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = [Block(cfg) for _ in range(cfg.depth)]
        self.merger = PatchMerger(cfg)
        spatial = cfg.head_dim // 2
        exponents = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
        # plain numpy, not a parameter: float32 as transformers computes it
        self.inv_freq = (np.float32(1.0) / np.float32(cfg.rope_theta) ** exponents
                         ).astype(np.float32)

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Strip the tower's prefix (``model.visual.`` and the others in
        :data:`VISION_PREFIXES`; tensors without one are dropped when any name has one) and
        flatten the patch embedding's Conv3d kernel to the linear map's ``[D, C*T*P*P]``:
        transformers stores ``[D, C, T, P, P]``, MLX converters ``[D, T, P, P, C]``."""
        names = list(weights)
        prefixed = any(n.startswith(VISION_PREFIXES) for n in names)
        cfg = self.config
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                name = name[len(prefix):]
            elif prefixed:
                continue
            if name == "patch_embed.proj.weight" and value.ndim == 5:
                channels = cfg.in_channels
                if value.shape[1] != channels and value.shape[-1] == channels:
                    value = value.transpose(0, 4, 1, 2, 3)
                value = value.reshape(value.shape[0], -1)
            out[name] = value
        return out

    # -- running -----------------------------------------------------------
    def __call__(self, patches: mx.array, grid_thw: Grid) -> mx.array:
        """The merger's output ``[N / m^2, out_hidden_size]``: one row per merge window."""
        return self.merger(self.hidden_states(patches, grid_thw))

    def hidden_states(self, patches: mx.array, grid_thw: Grid) -> mx.array:
        """The last block's output ``[N, hidden_size]`` (before the merger)."""
        grid = self._check_grid(patches, grid_thw)
        x = self.patch_embed(patches)
        x = x + self._positions(grid).astype(x.dtype)
        cos, sin = self._rope_tables(grid)
        segments = [(t, h * w) for t, h, w in grid]
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return x

    def merge(self, hidden: mx.array) -> mx.array:
        """The merger over :meth:`hidden_states`' output."""
        return self.merger(hidden)

    def _check_grid(self, patches: mx.array, grid_thw: Grid) -> list[tuple[int, int, int]]:
        cfg, m = self.config, self.config.spatial_merge_size
        grid = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        if not grid:
            raise ValueError("grid_thw lists no image")
        for t, h, w in grid:
            if t < 1 or h < 1 or w < 1 or h % m or w % m:
                raise ValueError(f"grid (t, h, w) = {(t, h, w)}: each must be positive and h, w "
                                 f"multiples of spatial_merge_size {m}")
        rows = sum(t * h * w for t, h, w in grid)
        if patches.ndim != 2 or tuple(patches.shape) != (rows, cfg.patch_dim):
            raise ValueError(f"patches must be [{rows}, {cfg.patch_dim}] for grids {grid}, got "
                             f"{list(patches.shape)}")
        return grid

    def _window_order(self, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Each patch's (row, col) in merge-window order."""
        m = self.config.spatial_merge_size
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")

        def order(a: np.ndarray) -> np.ndarray:
            return a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)

        return order(rows), order(cols)

    def _positions(self, grid: Iterable[tuple[int, int, int]]) -> mx.array:
        """The learned position table resampled to each image (merge-window order, every
        frame), float32 ``[N, hidden_size]``."""
        side, m = self.config.grid_side, self.config.spatial_merge_size
        table = self.pos_embed.weight.astype(mx.float32).reshape(side, -1)
        parts = []
        for t, h, w in grid:
            along_h = mx.array(_bilinear_matrix(h, side))  # [h, side]
            along_w = mx.array(_bilinear_matrix(w, side))  # [w, side]
            rows = (along_h @ table).reshape(h, side, -1)  # [h, side (columns), D]
            image = along_w @ rows  # [h, w, D]
            image = image.reshape(h // m, m, w // m, m, -1).transpose(0, 2, 1, 3, 4)
            image = image.reshape(h * w, -1)
            parts.append(mx.tile(image, (t, 1)) if t > 1 else image)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def _rope_tables(self, grid: Iterable[tuple[int, int, int]]) -> tuple[mx.array, mx.array]:
        """cos and sin ``[N, head_dim]`` (float32) of each patch's (row, col) angles."""
        rows, cols = [], []
        for t, h, w in grid:
            r, c = self._window_order(h, w)
            rows.append(np.tile(r, t))
            cols.append(np.tile(c, t))
        inv_freq = mx.array(self.inv_freq)
        row = mx.array(np.concatenate(rows).astype(np.float32))[:, None] * inv_freq
        col = mx.array(np.concatenate(cols).astype(np.float32))[:, None] * inv_freq
        angles = mx.concatenate([row, col, row, col], axis=-1)
        return mx.cos(angles), mx.sin(angles)


def _bilinear_matrix(size: int, side: int) -> np.ndarray:
    """``[size, side]`` float32 weights resampling ``side`` points to ``size`` (corners
    aligned): target ``i`` reads source ``i (side - 1) / (size - 1)`` from its two neighbours
    (the last one clamped), as transformers' ``get_vision_interpolation_indices_and_weights``."""
    src = (np.arange(size, dtype=np.float32) * np.float32(side - 1)
           / np.float32(max(size - 1, 1)))
    floor = np.floor(src)
    out = np.zeros((size, side), dtype=np.float32)
    for offset in (0, 1):
        taps = np.clip(floor.astype(np.int64) + offset, 0, side - 1)
        weights = np.maximum(np.float32(1) - np.abs(src - floor - np.float32(offset)),
                             np.float32(0))
        np.add.at(out, (np.arange(size), taps), weights.astype(np.float32))
    return out


# -- loading from a model folder ------------------------------------------------------------
def load_vision(folder: Path, dtype: mx.Dtype = mx.float32) -> Qwen3_5Vision | None:
    """The vision tower of a model folder, its float weights in ``dtype``; None when
    config.json has no ``vision_config`` or the weights hold no vision tensor (read as the
    core reads a folder: ``mlxrunner.plugin.load_part``)."""
    tower: Qwen3_5Vision | None = load_part(
        folder, "vision_config", VISION_PREFIXES, lambda part, _: Qwen3_5Vision(part), dtype,
        "vision tower")
    return tower
