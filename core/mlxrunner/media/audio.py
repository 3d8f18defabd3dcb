"""Decoding untrusted audio into float32 mono samples at one sample rate.

What a model does with the samples (its log-mel features, its tower) is the architecture
plugin's; this module turns bytes into the 1-D float32 array transformers' audio processors
take, at ``sample_rate`` (16 kHz unless asked otherwise):

- WAV (RIFF ``WAVE``) is read here, with no dependency: integer PCM of 8 (unsigned), 16, 24
  and 32 bits, IEEE float of 32 and 64 bits, plain or ``WAVE_FORMAT_EXTENSIBLE``. (The
  standard library's ``wave`` reads no float WAV, and no extensible one before Python 3.12.)
- FLAC, Ogg (Vorbis, Opus) and MP3 through soundfile (libsndfile), which is optional
  (``pip install "mlxrunner[audio]"``) and imported on first use. The format is told from
  the first bytes, and libsndfile must agree: nothing else reaches it.
- Integers are scaled as libsndfile scales them to float: ``x / 2**(bits - 1)`` (8-bit WAV
  is unsigned: ``(x - 128) / 128``); float samples must be finite.
- Limits: at most ``max_bytes`` bytes (checked before anything is parsed); at most
  ``max_seconds`` of audio, checked from the header (WAV: the data chunk's size; the others:
  libsndfile's frame count) before any sample is decoded, and again while decoding, so a
  header that understates is cut off at the limit; 1 to :data:`MAX_AUDIO_CHANNELS` channels
  at :data:`MIN_AUDIO_RATE` to :data:`MAX_AUDIO_RATE` Hz.
- Channels are averaged to mono.
- Another rate is resampled by band-limited interpolation (:func:`resample_audio`: a
  Kaiser-windowed sinc, 16 zero crossings each side, its cutoff at 0.9 of the lower of the
  two Nyquist frequencies; each phase of the filter normalised to unit gain at 0 Hz).

Every failure is one :class:`~mlxrunner.errors.MediaError` line.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MediaError
from .files import read_media_file

#: the rate decoded audio is given at unless asked otherwise (what transformers' audio
#: feature extractors of Gemma 4, Whisper, Qwen-Omni take)
AUDIO_SAMPLE_RATE = 16_000
#: the most bytes of one encoded clip
MAX_AUDIO_BYTES = 32 * 1024 * 1024
#: the longest clip decoded (5 minutes; a caller passes its model's own limit)
MAX_AUDIO_SECONDS = 300.0
#: the rates and channel counts accepted (a header outside them is refused unread)
MIN_AUDIO_RATE, MAX_AUDIO_RATE = 1_000, 192_000
MAX_AUDIO_CHANNELS = 32
#: the formats accepted: WAV here, the others through soundfile
AUDIO_FORMATS = ("WAV", "FLAC", "OGG", "MP3")

_INSTALL = 'pip install "mlxrunner[audio]"'
_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 1, 3, 0xFFFE
#: the tail every WAVE_FORMAT_EXTENSIBLE sub-format GUID of a plain format tag shares
_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
#: the most chunks a WAV may hold before its data (format, list, fact, ...)
_MAX_WAV_CHUNKS = 256
#: frames soundfile decodes at a time (the clip is cut off at the limit between reads)
_BLOCK_FRAMES = 1 << 16


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _sniff(head: bytes) -> str | None:
    """The format its first bytes say, or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "WAV"
    if head[:4] == b"fLaC":
        return "FLAC"
    if head[:4] == b"OggS":
        return "OGG"
    # an ID3v2 tag, or an MPEG audio frame's sync word (layer bits non-zero: not AAC)
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0
                              and head[1] & 0x06):
        return "MP3"
    return None


def decode_audio(data: bytes | bytearray | memoryview, *, what: str = "audio",
                 max_bytes: int = MAX_AUDIO_BYTES, max_seconds: float = MAX_AUDIO_SECONDS,
                 sample_rate: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
    """An encoded clip's samples: float32 mono at ``sample_rate`` (see the module's notes);
    ``what`` names it in errors. Every failure is one MediaError line."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_audio takes bytes, not {type(data).__name__}")
    if not MIN_AUDIO_RATE <= sample_rate <= MAX_AUDIO_RATE:
        raise ValueError(f"decode_audio: sample_rate {sample_rate} is outside "
                         f"{MIN_AUDIO_RATE} to {MAX_AUDIO_RATE}")
    view = memoryview(data).cast("B")
    if view.nbytes > max_bytes:
        raise MediaError(f"{what}: {view.nbytes} bytes, more than the limit of {max_bytes}")
    if view.nbytes == 0:
        raise MediaError(f"{what}: empty, not audio")
    kind = _sniff(bytes(view[:12]))
    if kind is None:
        raise MediaError(f"{what}: not audio in an accepted format "
                         f"({', '.join(AUDIO_FORMATS)})")
    if kind == "WAV":
        channels, rate = _wav(view, what, max_seconds)
    else:
        channels, rate = _soundfile_read(view, kind, what, max_seconds)
    mono = channels[:, 0] if channels.shape[1] == 1 else channels.mean(axis=1, dtype=np.float32)
    if rate != sample_rate:
        mono = resample_audio(mono, rate, sample_rate)
    return np.array(mono, dtype=np.float32)  # (a writable copy of its own)


def _check_header(what: str, kind: str, channels: int, rate: int, frames: int,
                  max_seconds: float) -> None:
    if not 1 <= channels <= MAX_AUDIO_CHANNELS:
        raise MediaError(f"{what}: {kind} with {channels} channels (1 to "
                         f"{MAX_AUDIO_CHANNELS} are accepted)")
    if not MIN_AUDIO_RATE <= rate <= MAX_AUDIO_RATE:
        raise MediaError(f"{what}: {kind} at {rate} Hz ({MIN_AUDIO_RATE} to {MAX_AUDIO_RATE} "
                         "Hz are accepted)")
    if frames > max_seconds * rate:
        raise MediaError(f"{what}: {frames / rate:.1f} s of audio, longer than the limit of "
                         f"{max_seconds:g} s")
    if frames <= 0:
        raise MediaError(f"{what}: {kind} holds no audio samples")


# -- WAV ---------------------------------------------------------------------------------
def _wav(view: memoryview, what: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """A WAV file's samples ``[frames, channels]`` (float32) and rate."""
    size = view.nbytes
    fmt: tuple[int, int, int, int, int] | None = None
    at = 12
    for _ in range(_MAX_WAV_CHUNKS + 1):
        if at + 8 > size:
            raise MediaError(f"{what}: WAV is truncated or corrupt (no data chunk)")
        chunk, length = bytes(view[at:at + 4]), struct.unpack("<I", view[at + 4:at + 8])[0]
        body = at + 8
        if chunk == b"data":
            break
        if body + length > size:
            raise MediaError(f"{what}: WAV is truncated (its {chunk!r} chunk ends past the "
                             "file)")
        if chunk == b"fmt ":
            fmt = _wav_format(bytes(view[body:body + length]), what)
        at = body + length + (length & 1)  # chunks are padded to even sizes
    else:  # (a file of many tiny chunks is not walked to its end)
        raise MediaError(f"{what}: WAV has more than {_MAX_WAV_CHUNKS} chunks before its data")
    if fmt is None:
        raise MediaError(f"{what}: WAV has no format chunk before its data")
    tag, channels, rate, bits, block = fmt
    if length == 0xFFFFFFFF:  # a stream's writer could not say: the data runs to the end
        length = size - body
    elif body + length > size:
        raise MediaError(f"{what}: WAV is truncated (its data chunk claims {length} bytes, "
                         f"{size - body} are there)")
    frames = length // block
    _check_header(what, "WAV", channels, rate, frames, max_seconds)
    raw = np.frombuffer(view, dtype=np.uint8, count=frames * block, offset=body)
    width = bits // 8
    if tag == _WAVE_FLOAT:
        samples = raw.view("<f4" if bits == 32 else "<f8").astype(np.float32)
        if not np.isfinite(samples).all():
            raise MediaError(f"{what}: WAV holds samples that are not finite numbers")
    elif width == 1:  # 8-bit PCM is unsigned, centred on 128
        samples = (raw.astype(np.float32) - 128) / np.float32(128)
    elif width == 3:  # little-endian 24-bit, sign-extended through the top byte
        triples = raw.reshape(-1, 3).astype(np.int32)
        values = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        samples = ((values << 8) >> 8).astype(np.float32) / np.float32(1 << 23)
    else:
        samples = raw.view(f"<i{width}").astype(np.float32) / np.float32(2.0 ** (bits - 1))
    return samples.reshape(frames, channels), rate


def _wav_format(chunk: bytes, what: str) -> tuple[int, int, int, int, int]:
    """``(tag, channels, rate, bits, block align)`` of a WAV ``fmt `` chunk, the tag
    resolved through WAVE_FORMAT_EXTENSIBLE; refused unless PCM 8/16/24/32 or float
    32/64, its block holding one sample per channel."""
    if len(chunk) < 16:
        raise MediaError(f"{what}: WAV format chunk is too short ({len(chunk)} bytes)")
    tag, channels, rate, _, block, bits = struct.unpack("<HHIIHH", chunk[:16])
    if tag == _WAVE_EXTENSIBLE:
        if len(chunk) < 40 or chunk[26:40] != _GUID_TAIL:
            raise MediaError(f"{what}: WAV (extensible) of a sub-format that is not PCM or "
                             "float")
        tag = struct.unpack("<H", chunk[24:26])[0]
    accepted = {_WAVE_PCM: (8, 16, 24, 32), _WAVE_FLOAT: (32, 64)}
    if bits not in accepted.get(tag, ()):
        kind = {_WAVE_PCM: "PCM", _WAVE_FLOAT: "float"}.get(tag, f"format tag {tag}")
        raise MediaError(f"{what}: WAV of {kind} at {bits} bits (PCM of 8, 16, 24 or 32 bits "
                         "and float of 32 or 64 bits are accepted)")
    if channels < 1 or block != channels * bits // 8:
        raise MediaError(f"{what}: WAV format chunk is inconsistent ({channels} channels of "
                         f"{bits} bits in blocks of {block} bytes)")
    return tag, channels, rate, bits, block


# -- FLAC, Ogg, MP3 ------------------------------------------------------------------------
def _soundfile() -> Any:
    """Import soundfile, or say how to install it."""
    try:
        # (imported by name: it ships no type information, and mypy may not find it)
        soundfile = importlib.import_module("soundfile")
    except ImportError:
        raise MediaError(f"FLAC, Ogg and MP3 audio need soundfile, which is not installed "
                         f"({_INSTALL})") from None
    except OSError as exc:  # (installed without its libsndfile)
        raise MediaError(f"soundfile cannot load libsndfile ({_short(exc)})") from None
    return soundfile


def _soundfile_read(view: memoryview, kind: str, what: str, max_seconds: float
                    ) -> tuple[np.ndarray, int]:
    """The samples ``[frames, 1]`` (float32, the channels averaged block by block) and rate
    of a clip libsndfile decodes, read a block at a time and refused once past
    ``max_seconds``."""
    soundfile = _soundfile()
    try:
        with soundfile.SoundFile(io.BytesIO(view)) as clip:
            found, channels, rate = str(clip.format), int(clip.channels), int(clip.samplerate)
            if found != kind:
                raise MediaError(f"{what}: starts as {kind} but decodes as {found:.20}")
            # a length the header does not know is libsndfile's SF_COUNT_MAX: read to see
            frames = int(clip.frames)
            _check_header(what, kind, channels, rate, frames if 0 < frames < 1 << 62 else 1,
                          max_seconds)
            limit = int(max_seconds * rate)
            blocks, total = [], 0
            while True:  # one frame past the limit is asked for, to tell that it is past
                block = clip.read(min(_BLOCK_FRAMES, limit + 1 - total), dtype="float32",
                                  always_2d=True)
                if not len(block):
                    break
                total += len(block)
                if total > limit:
                    raise MediaError(f"{what}: more than {max_seconds:g} s of audio, the limit")
                # mono as it comes: many channels would otherwise hold all of them at once
                blocks.append(block if block.shape[1] == 1 else
                              block.mean(axis=1, keepdims=True, dtype=np.float32))
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # libsndfile's errors on a corrupt or truncated stream
        raise MediaError(f"{what}: {kind} data is truncated or corrupt ({_short(exc)})") \
            from None
    if not total:
        raise MediaError(f"{what}: {kind} holds no audio samples")
    samples = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    if not np.isfinite(samples).all():
        raise MediaError(f"{what}: {kind} decodes to samples that are not finite numbers")
    return samples, rate


def read_audio(path: str | os.PathLike[str], *, max_bytes: int = MAX_AUDIO_BYTES,
               max_seconds: float = MAX_AUDIO_SECONDS,
               sample_rate: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
    """An audio file's samples, as :func:`decode_audio` gives them: at most ``max_bytes``
    are read, from a regular file only (a FIFO or device is refused unread)."""
    data = read_media_file(path, max_bytes, "audio")
    return decode_audio(data, what=str(Path(path)), max_bytes=max_bytes, max_seconds=max_seconds,
                        sample_rate=sample_rate)


# -- resampling -----------------------------------------------------------------------------
_ZERO_CROSSINGS = 16
_ROLLOFF = 0.9
_KAISER_BETA = 8.6


#: the largest reduced ratio's denominator resampling takes (every common rate's is far
#: below it: 44.1 kHz to 16 kHz is 160 / 441; a rate sharing no factor with 16 kHz is not)
MAX_RESAMPLE_DOWN = 50_000


def resample_audio(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """``samples`` (1-D) at ``to_rate``: ``ceil(len * to_rate / from_rate)`` samples by
    band-limited interpolation. Output sample ``n`` sits at input time ``t = n * from_rate /
    to_rate`` and is ``sum_m x[m] h(t - m)`` over the input (zero outside it), ``h`` a sinc
    low-pass at :data:`_ROLLOFF` of the lower Nyquist frequency under a Kaiser window
    (beta 8.6) spanning :data:`_ZERO_CROSSINGS` of its zero crossings each side. The rates'
    ratio is reduced to ``up / down``, so ``t`` takes ``up`` fractional phases: the filter
    is tabulated per phase, each row scaled to sum to 1."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    for rate in (from_rate, to_rate):
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate < 1:
            raise ValueError(f"resample_audio: rates must be positive integers, got {rate!r}")
    if from_rate == to_rate or not len(x):
        return x.copy()
    common = math.gcd(int(from_rate), int(to_rate))
    up, down = int(to_rate) // common, int(from_rate) // common
    if down > MAX_RESAMPLE_DOWN:  # the filter table grows with it (~36 entries per step)
        raise MediaError(f"audio at {from_rate} Hz: an unusual sample rate, not resampled "
                         f"to {to_rate} Hz")
    cutoff = _ROLLOFF * min(1.0, up / down)  # in cycles per input sample, times 2
    half = int(math.ceil(_ZERO_CROSSINGS / cutoff))  # taps each side of t
    taps = np.arange(-half + 1, half + 1)
    # distance from input sample floor(t) + k to t, for each phase p / up of t
    distance = np.arange(up)[:, None] / up - taps[None, :]
    span = np.clip(distance * (cutoff / _ZERO_CROSSINGS), -1.0, 1.0)
    window = np.i0(_KAISER_BETA * np.sqrt(1.0 - span ** 2)) / np.i0(_KAISER_BETA)
    table = cutoff * np.sinc(cutoff * distance) * window
    table[np.abs(distance) >= _ZERO_CROSSINGS / cutoff] = 0.0
    table = (table / table.sum(axis=1, keepdims=True)).astype(np.float32)
    count = -(-len(x) * up // down)
    padded = np.concatenate([np.zeros(half, np.float32), x, np.zeros(half + 1, np.float32)])
    # windows[i] holds x[i - half : i + half]: output n reads windows[floor(t) + 1]
    windows = np.lib.stride_tricks.sliding_window_view(padded, len(taps))
    out = np.empty(count, dtype=np.float32)
    for first in range(min(up, count)):  # outputs first, first + up, ...: one phase
        base, phase = divmod(first * down, up)
        outputs = range(first, count, up)
        rows = windows[base + 1::down][:len(outputs)]
        out[first::up] = rows @ table[phase]
    return out
