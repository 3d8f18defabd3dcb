"""Decoding untrusted audio (mlxrunner.plugin.decode_audio / read_audio / resample_audio):
float32 mono samples at 16 kHz or one MediaError line, whatever the bytes.

WAV is read without any dependency; FLAC, Ogg and MP3 need soundfile (the ``audio`` extra;
requirements-test.txt installs it): those tests skip without it, the one for the
missing-soundfile message runs either way.
"""

from __future__ import annotations

import importlib.util
import io
import os
import struct
import sys
import wave

import numpy as np
import pytest

from mlxrunner.errors import MLXRunnerError
from mlxrunner.media import AUDIO_SAMPLE_RATE, MAX_AUDIO_SECONDS
from mlxrunner.plugin import MediaError, decode_audio, read_audio, resample_audio

needs_soundfile = pytest.mark.skipif(importlib.util.find_spec("soundfile") is None,
                                     reason="soundfile is not installed (the audio extra)")


def pcm_wav(samples: np.ndarray, width: int, rate: int = 16_000) -> bytes:
    """A WAV the standard library writes: ``samples [frames, channels]`` as stored."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(samples.shape[1])
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(np.ascontiguousarray(samples).tobytes())
    return buf.getvalue()


def riff(fmt: bytes, data: bytes, *, data_size: int | None = None,
         extra: bytes = b"") -> bytes:
    """A WAV built chunk by chunk: ``fmt`` the format chunk's body, ``extra`` chunks between
    it and the data, ``data_size`` what the data chunk claims (its length by default)."""
    size = len(data) if data_size is None else data_size
    chunks = (b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra + b"data"
              + struct.pack("<I", size) + data)
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def fmt_chunk(tag: int, channels: int, rate: int, bits: int, block: int | None = None
              ) -> bytes:
    block = channels * bits // 8 if block is None else block
    return struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)


def extensible(sub_tag: int, channels: int, rate: int, bits: int) -> bytes:
    guid = struct.pack("<H", sub_tag) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    return fmt_chunk(0xFFFE, channels, rate, bits) + struct.pack("<HHI", 22, bits, 3) + guid


def one_line(exc: pytest.ExceptionInfo[MediaError]) -> str:
    message = str(exc.value)
    assert isinstance(exc.value, MLXRunnerError) and "\n" not in message
    return message


def tone(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(rate * seconds))) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


rng = np.random.default_rng(0)


def test_wav_pcm16_mono_is_scaled_by_32768_exactly():
    stored = rng.integers(-32768, 32768, (1000, 1)).astype("<i2")
    stored[:2, 0] = [-32768, 32767]
    got = decode_audio(pcm_wav(stored, 2))
    assert got.dtype == np.float32 and got.shape == (1000,) and got.flags.writeable
    assert np.array_equal(got, stored[:, 0].astype(np.float32) / 32768)
    assert got[0] == -1.0


def test_wav_stereo_channels_are_averaged():
    stored = rng.integers(-32768, 32768, (500, 2)).astype("<i2")
    got = decode_audio(pcm_wav(stored, 2))
    want = (stored.astype(np.float32) / 32768).mean(axis=1)
    assert got.shape == (500,) and np.abs(got - want).max() < 1e-7
    left_only = stored.copy()
    left_only[:, 1] = 0
    assert np.allclose(decode_audio(pcm_wav(left_only, 2)), want - stored[:, 1] / 65536,
                       atol=1e-7)


def test_wav_8_bit_is_unsigned_around_128():
    stored = rng.integers(0, 256, (300, 1)).astype(np.uint8)
    got = decode_audio(pcm_wav(stored, 1))
    assert np.array_equal(got, (stored[:, 0].astype(np.float32) - 128) / 128)
    assert decode_audio(pcm_wav(np.array([[0], [128], [255]], np.uint8), 1)).tolist() == \
        [-1.0, 0.0, 127 / 128]


def test_wav_24_bit_is_sign_extended():
    values = rng.integers(-2**23, 2**23, 400)
    values[:3] = [-2**23, 2**23 - 1, -1]
    stored = np.stack([values & 0xFF, (values >> 8) & 0xFF, (values >> 16) & 0xFF],
                      axis=-1).astype(np.uint8)
    got = decode_audio(riff(fmt_chunk(1, 1, 16_000, 24), stored.tobytes()))
    assert np.array_equal(got, (values / 2**23).astype(np.float32))
    assert got[:3].tolist() == [-1.0, (2**23 - 1) / 2**23, -1 / 2**23]


def test_wav_32_bit_integer_and_float_and_extensible():
    ints = rng.integers(-2**31, 2**31, 200).astype("<i4")
    assert np.array_equal(decode_audio(pcm_wav(ints[:, None], 4)),
                          (ints / 2**31).astype(np.float32))
    floats = rng.uniform(-1, 1, 200).astype("<f4")
    assert np.array_equal(decode_audio(riff(fmt_chunk(3, 1, 16_000, 32), floats.tobytes())),
                          floats)
    doubles = rng.uniform(-1, 1, 200)
    assert np.array_equal(decode_audio(riff(fmt_chunk(3, 1, 16_000, 64),
                                            doubles.astype("<f8").tobytes())),
                          doubles.astype(np.float32))
    stereo = rng.integers(-32768, 32768, (100, 2)).astype("<i2")
    got = decode_audio(riff(extensible(1, 2, 16_000, 16), stereo.tobytes()))
    assert np.allclose(got, (stereo / 32768).mean(axis=1), atol=1e-7)
    assert np.array_equal(decode_audio(riff(extensible(3, 1, 16_000, 32), floats.tobytes())),
                          floats)


def test_other_chunks_odd_sizes_and_streamed_lengths_are_read():
    stored = rng.integers(-32768, 32768, 64).astype("<i2")
    odd = b"LIST" + struct.pack("<I", 3) + b"abc" + b"\0"  # padded to an even size
    got = decode_audio(riff(fmt_chunk(1, 1, 16_000, 16), stored.tobytes(), extra=odd))
    assert np.array_equal(got, stored / np.float32(32768))
    # a streaming writer's unknown length (0xFFFFFFFF): the data runs to the end
    streamed = riff(fmt_chunk(1, 1, 16_000, 16), stored.tobytes(), data_size=0xFFFFFFFF)
    assert np.array_equal(decode_audio(streamed), stored / np.float32(32768))
    # a trailing partial frame is dropped
    assert len(decode_audio(riff(fmt_chunk(1, 2, 16_000, 16), stored.tobytes() + b"\1"))) == 32


def test_a_44_1_khz_file_is_resampled_to_16_khz():
    sine = tone(440.0, 44_100, 1.0)
    stored = np.round(sine * 32767).astype("<i2")[:, None]
    got = decode_audio(pcm_wav(stored, 2, rate=44_100))
    assert len(got) == 16_000  # ceil(44100 * 16000 / 44100)
    assert abs(peak_hz(got, 16_000) - 440.0) <= 1.0
    inner = slice(500, -500)  # away from the edges, where the clip starts from silence
    assert np.abs(got[inner] - tone(440.0, 16_000, 1.0)[inner]).max() < 1e-3


@pytest.mark.parametrize("rate", [8_000, 11_025, 22_050, 24_000, 32_000, 44_100, 48_000,
                                  96_000, 12_345])
def test_resampling_keeps_a_sine_its_frequency_and_level(rate):
    got = resample_audio(tone(1000.0, rate, 0.5), rate, 16_000)
    assert got.dtype == np.float32 and len(got) == -(-int(rate * 0.5) * 16_000 // rate)
    want = tone(1000.0, 16_000, 0.5)[:len(got)]
    inner = slice(len(got) // 10, -len(got) // 10)
    assert np.abs(got[inner] - want[inner]).max() < 1e-4
    assert abs(peak_hz(got[inner], 16_000) - 1000.0) < 16_000 / len(got[inner]) + 1e-9


def test_resampling_removes_what_16_khz_cannot_hold():
    """A tone above the new Nyquist frequency (8 kHz) would alias to 16 kHz - f; it is
    filtered out (below -80 dB), while a tone well inside the band passes whole."""
    for freq, low, high in ((10_000.0, 0.0, 1e-4), (8_500.0, 0.0, 1e-4),
                            (3_000.0, 0.999, 1.001)):
        got = resample_audio(tone(freq, 44_100, 0.5, amplitude=1.0), 44_100, 16_000)
        rms = np.sqrt(np.mean(got[800:-800] ** 2)) / np.sqrt(0.5)
        assert low <= rms <= high, (freq, rms)


def test_resampling_to_the_same_rate_is_a_copy_and_other_rates_are_asked_for():
    samples = tone(500.0, 16_000, 0.1)
    same = resample_audio(samples, 16_000, 16_000)
    assert np.array_equal(same, samples) and same is not samples
    wav = pcm_wav(np.round(tone(500.0, 8_000, 0.2) * 30_000).astype("<i2")[:, None], 2,
                  rate=8_000)
    assert len(decode_audio(wav)) == 3_200
    assert len(decode_audio(wav, sample_rate=24_000)) == 4_800
    with pytest.raises(ValueError):
        resample_audio(samples, 0, 16_000)


@pytest.mark.parametrize("data, message", [
    (b"", "empty, not audio"),
    (b"hello, this is text and not a sound", "not audio in an accepted format"),
    (b"RIFF\0\0\0\0WAVE", "no data chunk"),
    (b"RIFF\0\0\0\0WAVEfmt \x10\0\0\0\1\0", "truncated"),
    (riff(fmt_chunk(1, 1, 16_000, 16), b"\0" * 400, data_size=4000),
     "data chunk claims 4000 bytes, 400 are there"),
    (riff(fmt_chunk(1, 1, 16_000, 16), b""), "holds no audio samples"),
    (b"RIFF\x24\0\0\0WAVEdata\x04\0\0\0\0\0\0\0", "no format chunk"),
    (riff(fmt_chunk(1, 1, 16_000, 16)[:12], b"\0" * 8), "format chunk is too short"),
    (riff(fmt_chunk(1, 1, 16_000, 12, block=2), b"\0" * 8), "PCM at 12 bits"),
    (riff(fmt_chunk(2, 1, 16_000, 4, block=256), b"\0" * 512), "format tag 2"),
    (riff(fmt_chunk(3, 1, 16_000, 16), b"\0" * 8), "float at 16 bits"),
    (riff(fmt_chunk(1, 2, 16_000, 16, block=3), b"\0" * 12), "inconsistent"),
    (riff(fmt_chunk(1, 0, 16_000, 16, block=0), b"\0" * 12), "inconsistent"),
    (riff(fmt_chunk(1, 33, 16_000, 8), b"\0" * 66), "33 channels"),
    (riff(fmt_chunk(1, 1, 500, 16), b"\0" * 8), "at 500 Hz"),
    (riff(fmt_chunk(1, 1, 400_000, 16), b"\0" * 8), "at 400000 Hz"),
    (riff(extensible(1, 1, 16_000, 16)[:-14] + b"\0" * 14, b"\0" * 8), "sub-format"),
    (riff(fmt_chunk(1, 1, 16_000, 16), b"\0" * 8, extra=b"junk\0\0\0\0" * 300),
     "more than 256 chunks"),
    (riff(fmt_chunk(3, 1, 16_000, 32), np.array([0, np.nan], "<f4").tobytes()),
     "not finite"),
    (riff(fmt_chunk(3, 1, 16_000, 32), np.array([np.inf, 0], "<f4").tobytes()),
     "not finite"),
])
def test_bad_wav_is_one_media_error_line(data, message):
    with pytest.raises(MediaError) as exc:
        decode_audio(data, what="clip.wav")
    line = one_line(exc)
    assert line.startswith("clip.wav: ") and message in line, line


def test_too_long_is_refused_from_the_header_before_decoding():
    # one million 8-bit frames at 1 kHz claim 1000 s: refused by the header's count
    data = riff(fmt_chunk(1, 1, 1_000, 8), b"\x80" * 1_000_000)
    with pytest.raises(MediaError) as exc:
        decode_audio(data)
    assert "1000.0 s of audio, longer than the limit of 300 s" in one_line(exc)
    assert MAX_AUDIO_SECONDS == 300.0
    two_seconds = pcm_wav(np.zeros((32_000, 1), "<i2"), 2)
    with pytest.raises(MediaError, match="2.0 s of audio, longer than the limit of 1.5 s"):
        decode_audio(two_seconds, max_seconds=1.5)
    assert len(decode_audio(two_seconds, max_seconds=2.0)) == 32_000


def test_too_many_bytes_is_refused_unread(tmp_path):
    data = pcm_wav(np.zeros((100, 1), "<i2"), 2)
    with pytest.raises(MediaError) as exc:
        decode_audio(data, max_bytes=len(data) - 1)
    assert f"{len(data)} bytes, more than the limit of {len(data) - 1}" in one_line(exc)
    path = tmp_path / "clip.wav"
    path.write_bytes(data)
    assert read_audio(path).shape == (100,)
    with pytest.raises(MediaError, match="larger than the limit"):
        read_audio(path, max_bytes=100)
    with pytest.raises(TypeError):
        decode_audio("clip.wav")  # type: ignore[arg-type]


def test_read_audio_reads_regular_files_only(tmp_path):
    with pytest.raises(MediaError, match="no such audio file"):
        read_audio(tmp_path / "missing.wav")
    with pytest.raises(MediaError, match="not a regular file"):
        read_audio(tmp_path)
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.wav"
        os.mkfifo(fifo)
        with pytest.raises(MediaError, match="not a regular file"):
            read_audio(fifo)  # (refused unread: a FIFO would block)
    path = tmp_path / "clip.wav"
    stored = rng.integers(-32768, 32768, (50, 1)).astype("<i2")
    path.write_bytes(pcm_wav(stored, 2))
    assert np.array_equal(read_audio(path), stored[:, 0] / np.float32(32768))
    path.write_bytes(b"RIFF")
    with pytest.raises(MediaError) as exc:
        read_audio(path)
    assert one_line(exc).startswith(f"{path}: ")


def test_without_soundfile_flac_ogg_and_mp3_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile raises
    for head in (b"fLaC\0\0\0\x22", b"OggS\0\2", b"ID3\4\0\0", b"\xff\xfb\x90\x00"):
        with pytest.raises(MediaError) as exc:
            decode_audio(head + b"\0" * 64)
        assert 'pip install "mlxrunner[audio]"' in one_line(exc)
    # WAV needs nothing
    assert decode_audio(pcm_wav(np.zeros((10, 1), "<i2"), 2)).shape == (10,)


def encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@needs_soundfile
def test_flac_decodes_exactly_and_is_resampled():
    stored = rng.integers(-32768, 32768, (4000, 2)).astype(np.int16)
    data = encoded(stored, 16_000, "FLAC", "PCM_16")
    assert data[:4] == b"fLaC"
    got = decode_audio(data)
    assert np.allclose(got, (stored / 32768).mean(axis=1), atol=1e-7)
    sine = np.round(tone(440.0, 48_000, 0.5) * 32767).astype(np.int16)
    got = decode_audio(encoded(sine, 48_000, "FLAC", "PCM_16"))
    assert len(got) == 8_000 and abs(peak_hz(got, 16_000) - 440.0) <= 2.0


@needs_soundfile
@pytest.mark.parametrize("fmt, subtype", [("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_lossy_formats_keep_a_tone(fmt, subtype):
    import soundfile

    if fmt not in soundfile.available_formats():
        pytest.skip(f"this libsndfile has no {fmt}")
    data = encoded(tone(660.0, 44_100, 1.0), 44_100, fmt, subtype)
    got = decode_audio(data)
    assert abs(len(got) - 16_000) <= 1_000  # (an MP3 frame's padding at most)
    assert abs(peak_hz(got[2000:14000], 16_000) - 660.0) <= 3.0


@needs_soundfile
def test_bad_flac_ogg_and_mp3_are_one_media_error_line():
    flac = encoded(rng.integers(-32768, 32768, 16_000).astype(np.int16), 16_000, "FLAC",
                   "PCM_16")
    for data, message in [
        (b"fLaC" + bytes(rng.integers(0, 256, 500, dtype=np.uint8)), "truncated or corrupt"),
        (b"OggS" + b"\0" * 200, "truncated or corrupt"),
        (b"ID3\3\0\0\0\0\0\0" + b"\0" * 100, "truncated or corrupt"),
    ]:
        with pytest.raises(MediaError) as exc:
            decode_audio(data, what="clip")
        line = one_line(exc)
        assert line.startswith("clip: ") and message in line, line
    with pytest.raises(MediaError) as exc:
        decode_audio(flac, max_seconds=0.5)
    assert "longer than the limit of 0.5 s" in one_line(exc)
    # a FLAC cut short: refused, or what is there (libsndfile reads up to the cut)
    try:
        got = decode_audio(flac[: len(flac) // 2])
    except MediaError as exc:
        assert "\n" not in str(exc)
    else:
        assert 0 < len(got) < 16_000


def test_the_default_rate_is_16_khz():
    assert AUDIO_SAMPLE_RATE == 16_000


def test_an_unusual_sample_rate_is_refused_not_resampled_at_any_cost():
    tone = np.sin(np.arange(1000) * 0.1).astype(np.float32)
    assert len(resample_audio(tone, 44100, 16000)) == -(-1000 * 160 // 441)
    with pytest.raises(MediaError, match="191999 Hz: an unusual sample rate"):
        resample_audio(tone, 191999, 16000)
