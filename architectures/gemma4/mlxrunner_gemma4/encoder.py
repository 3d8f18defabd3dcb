"""Gemma 4's image encoder for prompts that hold images (``Gemma4Model.load_encoders``).

``prepare`` preprocesses an image as transformers' image processor does (:mod:`.image`) and
gives the tokens it stands for in the prompt, as ``Gemma4Processor`` expands one
``<|image|>``: ``<|image>``, one ``<|image|>`` per soft token (the slots that take the
encoder's rows), ``<image|>``. ``encode`` runs the vision tower and ``embed_vision``
(:mod:`.vision`) on those patches, when prefill first reaches the image.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxrunner.plugin import (
    MediaError,
    MediaItem,
    content_digest,
    read_config,
    read_processor_config,
)

from .image import ImageProcessorConfig, image_inputs, placeholder_ids
from .vision import Gemma4Vision, load_vision


class Gemma4ImageEncoder:
    """One checkpoint's image encoder (:class:`mlxrunner.plugin.Encoder`): ``placeholder``
    is config.json's ``image_token_id``, the token a chat template writes per image."""

    modality = "image"

    def __init__(self, vision: Gemma4Vision, processor: ImageProcessorConfig,
                 model_config: Mapping[str, Any]) -> None:
        self.vision = vision
        self.processor = processor
        self.model_config = dict(model_config)
        self.placeholder = placeholder_ids(1, self.model_config)[1]

    def prepare(self, media: np.ndarray) -> MediaItem:
        """``media``: ``[H, W, 3]`` uint8 RGB. Bad pixels are one MediaError line."""
        rgb = np.asarray(media)
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise MediaError(f"an image must be [H, W, 3] uint8 RGB pixels, got {rgb.dtype} "
                             f"{list(rgb.shape)}")
        pixels, positions, soft_tokens = image_inputs(rgb, self.processor)
        # the real patches come first; the padding rows would only be skipped by the tower
        patches = soft_tokens * self.processor.pooling_kernel_size ** 2
        pixels, positions = pixels[:patches], positions[:patches]
        tokens = tuple(placeholder_ids(soft_tokens, self.model_config))

        def encode() -> mx.array:
            return self.vision(pixels[None], positions[None])

        return MediaItem("image", tokens, tuple(range(1, soft_tokens + 1)),
                         content_digest(rgb, self.processor), encode)


def load_image_encoder(folder: Path, model_config: Mapping[str, Any], dtype: mx.Dtype
                       ) -> Gemma4ImageEncoder | None:
    """The image encoder of a model folder, the tower's float weights in ``dtype``; None
    when it has no ``vision_config`` or no vision weights. ``model_config``: the config the
    text model was built from (token ids, attention over image tokens). A checkpoint whose
    images need bidirectional attention (``use_bidirectional_attention: vision``, 31B-style)
    is refused with one MediaError line."""
    folder = Path(folder)
    if read_config(folder).get("vision_config") is None:
        return None
    if model_config.get("use_bidirectional_attention") == "vision":
        raise MediaError(f"{folder.name}: images need bidirectional attention over image "
                         "tokens (use_bidirectional_attention: vision), which this version "
                         "does not run")
    vision = load_vision(folder, dtype)
    if vision is None:
        return None
    processor = ImageProcessorConfig.from_dict(read_processor_config(folder),
                                               f"{folder.name}: image processor config")
    return Gemma4ImageEncoder(vision, processor, model_config)
