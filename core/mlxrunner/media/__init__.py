"""Media: decoding untrusted images (:mod:`.images`) and audio (:mod:`.audio`), and prompts
that hold media (:mod:`.prompt`: the encoder contract, :class:`MediaPrompt`)."""

from __future__ import annotations

from .audio import (
    AUDIO_FORMATS,
    AUDIO_SAMPLE_RATE,
    MAX_AUDIO_BYTES,
    MAX_AUDIO_SECONDS,
    decode_audio,
    read_audio,
    resample_audio,
)
from .images import (
    IMAGE_FORMATS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    PILLOW_FILTERS,
    RESAMPLE,
    decode_image,
    pixel_settings,
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

__all__ = ["AUDIO_FORMATS", "AUDIO_SAMPLE_RATE", "IMAGE_FORMATS", "MAX_AUDIO_BYTES",
           "MAX_AUDIO_SECONDS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MODALITIES",
           "PILLOW_FILTERS", "RESAMPLE", "Encoder", "MediaItem", "MediaPrompt", "cache_key",
           "content_digest", "decode_audio", "decode_image", "history_key", "pixel_settings",
           "place_media", "read_audio", "read_image", "resample_audio", "rescale_normalize",
           "resize_image"]
