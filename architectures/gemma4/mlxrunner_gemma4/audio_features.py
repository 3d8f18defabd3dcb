"""Gemma 4's audio features: a clip's samples to the audio tower's log-mel frames.

What transformers' ``Gemma4AudioFeatureExtractor`` does to one clip of float32 samples at
``sampling_rate`` (16 kHz), for the frames it marks valid:

1. samples times ``input_scale_factor``; ``frame_length // 2`` zeros prepended (the first
   frame is centred on the first sample);
2. frames of ``frame_length + 1`` samples every ``hop_length`` (20 ms and 10 ms: 320 and 160
   samples), only those that lie wholly inside the clip (transformers pads a batch to a
   multiple of 128 samples and masks, and zeroes, every frame reaching into the padding:
   these are its valid frames);
3. of each frame, the first ``frame_length`` samples, or with ``preemphasis`` ``p``: HTK's
   flavour ``[x0 (1 - p), x1 - p x0, ..., x[L-1] - p x[L-2]]``, else ``x[1:] - p x[:-1]``
   (all ``L + 1`` samples);
4. times a periodic Hann window (float32), the magnitude of its real FFT of
   ``fft_length`` points (the next power of two, doubled with ``fft_overdrive``), in the
   samples' float32 as numpy computes it;
5. through ``feature_size`` (128) triangular mel filters on the HTK mel scale between
   ``min_frequency`` and ``max_frequency`` (unnormalised; float64), ``log(mel +
   mel_floor)``, minus ``per_bin_mean`` and over ``per_bin_stddev`` when given; float32.

The settings come from ``processor_config.json``'s ``feature_extractor`` object, each key it
leaves out (or a folder without the file) the class's default, which the published
checkpoints repeat. As transformers reads a saved config, ``frame_length`` and
``hop_length`` come from ``frame_length_ms`` and ``hop_length_ms`` (the sample counts it
writes beside them are derived, not read). ``dither`` (random noise) is refused.

The tower turns ``T`` frames into ``ceil(ceil(T / 2) / 2)`` soft tokens (two stride-2
convolutions): what ``Gemma4Processor.replace_audio_token`` counts from the mask.
transformers cuts a clip longer than 480,000 samples (30 s) to that length; it is refused
here (:data:`MAX_SAMPLES`), as is one that yields no soft token or more than the
processor's ``audio_seq_length``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxrunner.plugin import MediaError, ModelFolderError

#: the feature extractor's ``max_length``: transformers cuts longer clips to it
MAX_SAMPLES = 480_000
#: ``Gemma4Processor``'s default cap on one clip's soft tokens
AUDIO_SEQ_LENGTH = 750


@dataclass(frozen=True)
class FeatureConfig:
    """``Gemma4AudioFeatureExtractor``'s settings (the class's defaults, the published
    checkpoints'), and the processor's ``audio_seq_length``."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    audio_seq_length: int = AUDIO_SEQ_LENGTH

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        length = 2 ** math.ceil(math.log2(self.frame_length))
        return length * 2 if self.fft_overdrive else length

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None, audio_seq_length: Any = None,
                  where: str = "processor_config.json feature_extractor") -> FeatureConfig:
        """A ``feature_extractor`` object's settings (None: the defaults); a bad value is one
        ModelFolderError line naming the key."""
        config = {} if config is None else config
        if not isinstance(config, Mapping):
            raise ModelFolderError(f"{where}: expected a JSON object")
        defaults = cls()

        def number(key: str, low: float, high: float) -> float:
            value = config.get(key)
            if value is None:
                return float(getattr(defaults, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not low <= value <= high:
                raise ModelFolderError(f"{where}: {key} must be a number from {low:g} to "
                                       f"{high:g}, got {value!r:.40}")
            return float(value)

        def flag(key: str) -> bool:
            value = config.get(key, getattr(defaults, key))
            if not isinstance(value, bool):
                raise ModelFolderError(f"{where}: {key} must be true or false, got "
                                       f"{value!r:.40}")
            return value

        size = int(number("feature_size", 1, 4096))
        if size != config.get("feature_size", size):
            raise ModelFolderError(f"{where}: feature_size must be an integer")

        def per_bin(key: str) -> tuple[float, ...] | None:
            value = config.get(key)
            if value is None:
                return None
            flat = np.asarray(value, dtype=object).reshape(-1)
            if flat.size != size or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    for v in flat):
                raise ModelFolderError(f"{where}: {key} must hold {size} numbers (one per mel "
                                       "bin)")
            return tuple(float(v) for v in flat)

        if config.get("dither") not in (None, 0):
            raise ModelFolderError(f"{where}: dither (random noise on the samples) is not "
                                   "supported")
        rate = number("sampling_rate", 1000, 192_000)
        seq = AUDIO_SEQ_LENGTH if audio_seq_length is None else audio_seq_length
        if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= 1 << 20:
            raise ModelFolderError(f"processor_config.json: audio_seq_length must be a "
                                   f"positive integer, got {seq!r:.40}")
        cfg = cls(feature_size=size, sampling_rate=int(rate),
                  frame_length_ms=number("frame_length_ms", 1, 1000),
                  hop_length_ms=number("hop_length_ms", 0.1, 1000),
                  min_frequency=number("min_frequency", 0, rate / 2),
                  max_frequency=number("max_frequency", 0, rate / 2),
                  preemphasis=number("preemphasis", 0, 1),
                  preemphasis_htk_flavor=flag("preemphasis_htk_flavor"),
                  fft_overdrive=flag("fft_overdrive"),
                  input_scale_factor=number("input_scale_factor", 1e-6, 1e6),
                  mel_floor=number("mel_floor", 1e-30, 1e3),
                  per_bin_mean=per_bin("per_bin_mean"),
                  per_bin_stddev=per_bin("per_bin_stddev"), audio_seq_length=seq)
        if cfg.sampling_rate != rate or cfg.min_frequency >= cfg.max_frequency:
            raise ModelFolderError(f"{where}: sampling_rate must be an integer and "
                                   "min_frequency below max_frequency")
        if cfg.hop_length < 1 or cfg.frame_length < 2:
            raise ModelFolderError(f"{where}: frames of {cfg.frame_length} samples every "
                                   f"{cfg.hop_length} are too short")
        if cfg.per_bin_stddev is not None and 0.0 in cfg.per_bin_stddev:
            raise ModelFolderError(f"{where}: per_bin_stddev must not be 0")
        return cfg


def mel_filters(cfg: FeatureConfig) -> np.ndarray:
    """``[fft_length // 2 + 1, feature_size]`` float64: triangles on the HTK mel scale
    (``2595 log10(1 + f / 700)``), their corners ``feature_size + 2`` points evenly spaced in
    mels from ``min_frequency`` to ``max_frequency``; bins at ``i * (rate // 2) / (bins - 1)``
    Hz."""
    def to_mel(hz: Any) -> Any:
        return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)

    corners = np.linspace(to_mel(cfg.min_frequency), to_mel(cfg.max_frequency),
                          cfg.feature_size + 2)
    corners = 700.0 * (10.0 ** (corners / 2595.0) - 1.0)
    bins = np.linspace(0, cfg.sampling_rate // 2, cfg.fft_length // 2 + 1)
    low, centre, high = corners[:-2], corners[1:-1], corners[2:]
    rising = (bins[:, None] - low) / (centre - low)
    falling = (high - bins[:, None]) / (high - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


def subsampled_length(frames: int) -> int:
    """What the tower's two convolutions of stride 2 leave of ``frames`` steps,
    ``ceil(ceil(frames / 2) / 2)``: a clip's soft tokens, of its mel bins the columns."""
    halved = -(-frames // 2)
    return -(-halved // 2)


def log_mel_features(samples: np.ndarray, cfg: FeatureConfig,
                     filters: np.ndarray | None = None) -> np.ndarray:
    """``[frames, feature_size]`` float32 log-mel features of one clip (1-D float32 samples
    at ``cfg.sampling_rate``; see the module's notes); ``filters``: :func:`mel_filters`'s,
    if already made."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    if cfg.input_scale_factor != 1.0:
        x = x * np.float32(cfg.input_scale_factor)
    length, hop = cfg.frame_length, cfg.hop_length
    x = np.concatenate([np.zeros(length // 2, dtype=np.float32), x])
    count = (len(x) - (length + 1)) // hop + 1
    if count <= 0:
        return np.zeros((0, cfg.feature_size), dtype=np.float32)
    windows = np.lib.stride_tricks.sliding_window_view(x, length + 1)[::hop][:count]
    p = cfg.preemphasis
    if p > 0 and cfg.preemphasis_htk_flavor:
        frames = np.concatenate([windows[:, :1] * (1.0 - p),
                                 windows[:, 1:-1] - p * windows[:, :-2]], axis=1)
    elif p > 0:
        frames = windows[:, 1:] - p * windows[:, :-1]
    else:
        frames = windows[:, :-1]
    n = np.arange(length, dtype=np.float64)
    hann = (0.5 - 0.5 * np.cos(2.0 * np.pi * n / length)).astype(np.float32)
    magnitude = np.abs(np.fft.rfft(frames * hann, n=cfg.fft_length, axis=-1))
    mel = magnitude @ (mel_filters(cfg) if filters is None else filters)
    features = np.log(mel + cfg.mel_floor)
    if cfg.per_bin_mean is not None:
        features = features - np.asarray(cfg.per_bin_mean)
    if cfg.per_bin_stddev is not None:
        features = features / np.asarray(cfg.per_bin_stddev)
    return features.astype(np.float32)


def audio_features(samples: np.ndarray, cfg: FeatureConfig,
                   filters: np.ndarray | None = None) -> np.ndarray:
    """A clip's features for the tower, checked: 1-D finite float samples, at most
    :data:`MAX_SAMPLES`, giving 1 to ``audio_seq_length`` soft tokens; else one MediaError
    line."""
    x = np.asarray(samples)
    if x.ndim != 1 or not np.issubdtype(x.dtype, np.floating):
        raise MediaError(f"an audio clip must be 1-D float samples (mono, "
                         f"{cfg.sampling_rate} Hz), got {x.dtype} {list(x.shape)}")
    rate = cfg.sampling_rate
    if len(x) > MAX_SAMPLES:
        raise MediaError(f"an audio clip of {len(x) / rate:.1f} s is longer than the "
                         f"{MAX_SAMPLES / rate:g} s Gemma 4 takes")
    if not np.isfinite(x).all():
        raise MediaError("an audio clip holds samples that are not finite numbers")
    features = log_mel_features(x, cfg, filters)
    soft = subsampled_length(len(features))
    if soft < 1:
        raise MediaError(f"an audio clip of {len(x)} samples is too short (at least "
                         f"{cfg.frame_length + 1 - cfg.frame_length // 2} are needed)")
    if soft > cfg.audio_seq_length:
        raise MediaError(f"an audio clip of {len(x) / rate:.1f} s gives {soft} soft tokens, "
                         f"more than the {cfg.audio_seq_length} the processor allows")
    return features
