"""Gemma 4's image and audio encoders for prompts that hold media
(``Gemma4Model.load_encoders``).

A checkpoint with ``use_bidirectional_attention: vision`` (31B-style) lets an image's soft
tokens attend to each other both ways in its sliding layers (the model's
``vision_blocks``): its image items are ``whole`` (never split between prefill chunks).

The image encoder's ``prepare`` preprocesses an image as transformers' image processor does
(:mod:`.image`) and gives the tokens it stands for in the prompt, as ``Gemma4Processor``
expands one ``<|image|>``: ``<|image>``, one ``<|image|>`` per soft token (the slots that
take the encoder's rows), ``<image|>``. ``encode`` runs the vision tower and
``embed_vision`` (:mod:`.vision`) on those patches, when prefill first reaches the image.

The audio encoder does the same for a clip: its log-mel features as transformers' feature
extractor makes them (:mod:`.audio_features`), the tokens as ``replace_audio_token`` expands
one ``<|audio|>``: ``boa_token_id``, one ``audio_token_id`` per soft token,
``eoa_token_index``; ``encode`` runs the audio tower and ``embed_audio`` (:mod:`.audio`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxrunner.plugin import (
    MediaError,
    MediaItem,
    ModelFolderError,
    content_digest,
    read_config,
    read_json,
    read_processor_config,
)

from .audio import Gemma4Audio, load_audio
from .audio_features import FeatureConfig, audio_features, mel_filters, subsampled_length
from .image import ImageProcessorConfig, image_inputs, placeholder_ids
from .vision import Gemma4Vision, load_vision

#: config.json's defaults (transformers' ``Gemma4Config``) for a clip's tokens: the begin
#: marker, the soft token (what a chat template writes per clip), the end marker
AUDIO_TOKEN_DEFAULTS = (("boa_token_id", 256000), ("audio_token_id", 258881),
                        ("eoa_token_index", 258883))
#: the most bytes read of processor_config.json
MAX_PROCESSOR_CONFIG_BYTES = 1024 * 1024


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
        #: a bidirectional-vision checkpoint's image tokens attend to each other both ways
        #: in its sliding layers: an image is prefilled in one chunk
        self.whole = self.model_config.get("use_bidirectional_attention") == "vision"

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
                         content_digest(rgb, self.processor), encode, whole=self.whole)


def load_image_encoder(folder: Path, model_config: Mapping[str, Any], dtype: mx.Dtype
                       ) -> Gemma4ImageEncoder | None:
    """The image encoder of a model folder, the tower's float weights in ``dtype``; None
    when it has no ``vision_config`` or no vision weights. ``model_config``: the config the
    text model was built from (token ids, attention over image tokens: with
    ``use_bidirectional_attention: vision``, 31B-style, its images are prefilled whole)."""
    folder = Path(folder)
    if read_config(folder).get("vision_config") is None:
        return None
    vision = load_vision(folder, dtype)
    if vision is None:
        return None
    processor = ImageProcessorConfig.from_dict(read_processor_config(folder),
                                               f"{folder.name}: image processor config")
    return Gemma4ImageEncoder(vision, processor, model_config)


class Gemma4AudioEncoder:
    """One checkpoint's audio encoder (:class:`mlxrunner.plugin.Encoder`): ``placeholder``
    is config.json's ``audio_token_id``, the token a chat template writes per clip;
    ``sample_rate``: the rate ``prepare`` takes the samples at (the feature extractor's)."""

    modality = "audio"

    def __init__(self, audio: Gemma4Audio, features: FeatureConfig,
                 model_config: Mapping[str, Any]) -> None:
        self.audio = audio
        self.features = features
        self.sample_rate = features.sampling_rate
        self.begin, self.placeholder, self.end = _audio_token_ids(model_config)
        self._filters = mel_filters(features)

    def prepare(self, media: np.ndarray) -> MediaItem:
        """``media``: 1-D float samples, mono at :attr:`sample_rate`
        (:func:`mlxrunner.plugin.decode_audio`). A clip the model cannot take (too short,
        over 30 s, not finite) is one MediaError line."""
        features = audio_features(media, self.features, self._filters)
        soft_tokens = subsampled_length(len(features))

        def encode() -> mx.array:
            return self.audio(features)

        return MediaItem("audio", (self.begin, *[self.placeholder] * soft_tokens, self.end),
                         tuple(range(1, soft_tokens + 1)),
                         content_digest(np.asarray(media, dtype=np.float32), self.features),
                         encode)


def _audio_token_ids(model_config: Mapping[str, Any]) -> tuple[int, int, int]:
    ids = []
    for key, default in AUDIO_TOKEN_DEFAULTS:
        value = model_config.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelFolderError(f"config.json: {key} must be a token id, got "
                                   f"{value!r:.40}")
        ids.append(value)
    return ids[0], ids[1], ids[2]


def load_audio_encoder(folder: Path, model_config: Mapping[str, Any], dtype: mx.Dtype
                       ) -> Gemma4AudioEncoder | None:
    """The audio encoder of a model folder, the tower's float weights in ``dtype``; None
    when it has no ``audio_config`` or no audio weights. The feature extractor's settings
    are ``processor_config.json``'s ``feature_extractor`` object (with its
    ``audio_seq_length``), transformers' defaults where the folder has none."""
    folder = Path(folder)
    if read_config(folder).get("audio_config") is None:
        return None
    path = folder / "processor_config.json"
    processor: Any = {}
    if os.path.lexists(path):
        processor = read_json(path, path.name, MAX_PROCESSOR_CONFIG_BYTES)
        if not isinstance(processor, dict):
            raise ModelFolderError(f"{path}: expected a JSON object")
    features = FeatureConfig.from_dict(processor.get("feature_extractor"),
                                       processor.get("audio_seq_length"),
                                       f"{path.name} feature_extractor")
    audio = load_audio(folder, dtype, features.feature_size)
    if audio is None:
        return None
    return Gemma4AudioEncoder(audio, features, model_config)
