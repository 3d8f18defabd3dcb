"""Media: decoding untrusted images (:mod:`.images`) and prompts that hold media
(:mod:`.prompt`: the encoder contract, :class:`MediaPrompt`)."""

from __future__ import annotations

from .images import (
    IMAGE_FORMATS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    PILLOW_FILTERS,
    RESAMPLE,
    decode_image,
    read_image,
    rescale_normalize,
    resize_image,
)
from .prompt import (
    MODALITIES,
    Encoder,
    MediaItem,
    MediaPrompt,
    cache_key,
    content_digest,
    history_key,
    place_media,
)

__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MODALITIES", "PILLOW_FILTERS",
           "RESAMPLE", "Encoder", "MediaItem", "MediaPrompt", "cache_key", "content_digest",
           "decode_image", "history_key", "place_media", "read_image", "rescale_normalize",
           "resize_image"]
