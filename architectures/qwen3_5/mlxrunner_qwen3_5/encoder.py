"""Qwen3.5's image encoder for prompts that hold images (``Qwen3_5.load_encoders``).

A chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the
processor repeats ``<|image_pad|>`` once per merge window of the image's patch grid, and
those tokens take the vision tower's merged rows. ``prepare`` preprocesses an image as
transformers' image processor does (:mod:`.image`) and gives those tokens (the markers stay
in the template's text around them); ``encode`` runs the vision tower (:mod:`.vision`) when
prefill first reaches the image.

Positions (transformers' ``get_rope_index``): an image whose merged grid is ``h' x w'``
(the patch grid over ``spatial_merge_size``; one frame: a still image's grid has ``t = 1``,
the temporal patch already folded into each patch) puts its token ``k`` (row-major over the
grid, the order the merger emits them) at ``(0, k // w', k % w')`` from the image's first
position, and the text after it ``max(h', w')`` positions on.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxrunner.plugin import (
    MediaError,
    MediaItem,
    ModelFolderError,
    content_digest,
    read_config,
    read_processor_config,
)

from .image import ImageProcessorConfig, image_inputs, placeholder_count
from .model import Qwen3_5Config
from .vision import Qwen3_5Vision, load_vision


def grid_positions(frames: int, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """The ``[3, frames * rows * cols]`` positions (temporal, height, width) of a merged
    grid's tokens in the merger's order, from the item's first position, and the positions
    the item takes (``max(rows, cols)``, as transformers counts an image)."""
    t, h, w = np.meshgrid(np.arange(frames), np.arange(rows), np.arange(cols), indexing="ij")
    return np.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)]), max(rows, cols)


class Qwen3_5ImageEncoder:
    """One checkpoint's image encoder (:class:`mlxrunner.plugin.Encoder`): ``placeholder``
    is config.json's ``image_token_id`` (``<|image_pad|>``)."""

    modality = "image"

    def __init__(self, vision: Qwen3_5Vision, processor: ImageProcessorConfig,
                 placeholder: int) -> None:
        self.vision = vision
        self.processor = processor
        self.placeholder = placeholder

    def prepare(self, media: np.ndarray) -> MediaItem:
        """``media``: ``[H, W, 3]`` uint8 RGB. Bad pixels are one MediaError line."""
        rgb = np.asarray(media)
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise MediaError(f"an image must be [H, W, 3] uint8 RGB pixels, got {rgb.dtype} "
                             f"{list(rgb.shape)}")
        patches, grid = image_inputs(rgb, self.processor)
        m = self.processor.merge_size
        count = placeholder_count(grid, m)
        positions, span = grid_positions(grid[0], grid[1] // m, grid[2] // m)

        def encode() -> mx.array:
            return self.vision(mx.array(patches), [grid])

        return MediaItem("image", (self.placeholder,) * count, tuple(range(count)),
                         content_digest(rgb, self.processor), encode,
                         positions=positions, span=span)


def load_image_encoder(folder: Path, config: Qwen3_5Config, dtype: mx.Dtype
                       ) -> Qwen3_5ImageEncoder | None:
    """The image encoder of a model folder, the tower's float weights in ``dtype``; None
    when it has no ``vision_config`` or no vision weights. ``config``: the text model's. A
    tower that does not fit the text model or the image processor's settings is one
    ModelFolderError line."""
    folder = Path(folder)
    if read_config(folder).get("vision_config") is None:
        return None
    vision = load_vision(folder, dtype)
    if vision is None:
        return None
    processor = ImageProcessorConfig.from_dict(read_processor_config(folder),
                                               f"{folder.name}: image processor config")
    tower = vision.config
    where = f"{folder.name}: "
    if tower.out_hidden_size != config.hidden_size:
        raise ModelFolderError(f"{where}the vision tower gives rows of {tower.out_hidden_size}, "
                               f"the text model's width is {config.hidden_size}")
    for key, ours, theirs in (
            ("patch_size", processor.patch_size, tower.patch_size),
            ("merge_size", processor.merge_size, tower.spatial_merge_size),
            ("temporal_patch_size", processor.temporal_patch_size, tower.temporal_patch_size)):
        if ours != theirs:
            raise ModelFolderError(f"{where}the image processor's {key} ({ours}) is not the "
                                   f"vision tower's ({theirs})")
    if not 0 <= config.image_token_id < config.vocab_size:
        raise ModelFolderError(f"{where}image_token_id {config.image_token_id} is outside the "
                               f"vocabulary ({config.vocab_size} tokens)")
    return Qwen3_5ImageEncoder(vision, processor, config.image_token_id)
