"""Decoding untrusted images (mlxrunner.plugin.decode_image / read_image / resize_image):
upright RGB pixels or one MediaError line, whatever the bytes.

Pillow is optional (the ``vision`` extra; the ``test`` extra and requirements-test.txt
install it): the tests that decode skip without it, the one for the missing-Pillow message
runs either way.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from mlxrunner.errors import MLXRunnerError
from mlxrunner.plugin import (
    MediaError,
    ModelFolderError,
    decode_image,
    read_image,
    read_processor_config,
    resize_image,
)

needs_pillow = pytest.mark.skipif(importlib.util.find_spec("PIL") is None,
                                  reason="Pillow is not installed (the vision extra)")


def encode(array: np.ndarray, fmt: str, **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kw)
    return buf.getvalue()


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming ``width x height`` RGB, then a few bytes of
    pixel data: tiny, and far too large if decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def one_line(exc: pytest.ExceptionInfo[MediaError]) -> str:
    message = str(exc.value)
    assert isinstance(exc.value, MLXRunnerError) and "\n" not in message
    return message


@needs_pillow
@pytest.mark.parametrize("fmt, kw", [("PNG", {}), ("JPEG", {"quality": 95}), ("BMP", {}),
                                     ("GIF", {}), ("WEBP", {"lossless": True})])
def test_accepted_formats_decode_to_rgb(fmt, kw):
    pixels = noise(5, 7)
    rgb = decode_image(encode(pixels, fmt, **kw))
    assert rgb.shape == (5, 7, 3) and rgb.dtype == np.uint8 and rgb.flags.writeable
    if fmt in ("PNG", "BMP", "WEBP"):  # lossless
        assert np.array_equal(rgb, pixels)


@needs_pillow
def test_alpha_is_composited_onto_white():
    """As transformers' convert_to_rgb: transparent pixels become white, half-transparent
    ones half white; a palette's transparent colour and grey+alpha too."""
    from PIL import Image

    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[..., 0] = 200  # red everywhere, hidden where alpha is 0
    rgba[0, :, 3] = [0, 128, 255]
    rgba[1, :, 3] = 255
    rgb = decode_image(encode(rgba, "PNG"))
    assert rgb[0, 0].tolist() == [255, 255, 255]
    assert rgb[0, 2].tolist() == [200, 0, 0] and (rgb[1] == [200, 0, 0]).all()
    assert np.abs(rgb[0, 1].astype(int) - [228, 127, 127]).max() <= 1

    la = np.stack([np.full((2, 2), 10, np.uint8), np.array([[0, 255], [255, 255]],
                                                           np.uint8)], axis=2)
    buf = io.BytesIO()
    Image.fromarray(la, mode="LA").save(buf, "PNG")
    assert decode_image(buf.getvalue())[:, :, 0].tolist() == [[255, 10], [10, 10]]

    palette = Image.fromarray(np.array([[0, 1], [1, 0]], np.uint8), mode="L").convert("P")
    buf = io.BytesIO()
    palette.save(buf, "GIF", transparency=0)
    gif = decode_image(buf.getvalue())
    assert gif[0, 0].tolist() == [255, 255, 255] and gif[0, 1].tolist() == [1, 1, 1]


@needs_pillow
def test_exif_orientation_is_applied():
    from PIL import Image

    stored = np.zeros((4, 8, 3), np.uint8)  # 8 wide, 4 high: left half black, right white
    stored[:, 4:] = 255
    for orientation, shape, check in [
        (1, (4, 8, 3), lambda a: a[:, :4].max() < 40 and a[:, 4:].min() > 215),
        (3, (4, 8, 3), lambda a: a[:, :4].min() > 215 and a[:, 4:].max() < 40),  # 180
        # 90 degrees clockwise to view: the left columns become the top rows
        (6, (8, 4, 3), lambda a: a[:4].max() < 40 and a[4:].min() > 215),
    ]:
        exif = Image.Exif()
        exif[0x0112] = orientation
        rgb = decode_image(encode(stored, "JPEG", quality=95, exif=exif.tobytes()))
        assert rgb.shape == shape, orientation
        assert check(rgb), orientation


@needs_pillow
def test_an_animation_gives_its_first_frame():
    from PIL import Image

    frames = [Image.fromarray(np.full((3, 3, 3), c, np.uint8)) for c in ((255, 0, 0),
                                                                          (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    rgb = decode_image(buf.getvalue())
    assert (rgb[..., 0] > 200).all() and (rgb[..., 2] < 50).all()


@needs_pillow
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_truncated_files_are_refused(fmt):
    data = encode(noise(40, 50), fmt)
    with pytest.raises(MediaError) as exc:
        decode_image(data[: len(data) // 2], what="half.img")
    assert one_line(exc).startswith("half.img: ")
    assert "truncated or corrupt" in str(exc.value) or "not a readable image" in str(exc.value)


@needs_pillow
def test_random_bytes_and_other_formats_are_refused():
    rng = np.random.default_rng(1)
    for data in (rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), b"GIF89a",
                 b"<svg xmlns='http://www.w3.org/2000/svg'/>", encode(noise(4, 4), "TIFF")):
        with pytest.raises(MediaError) as exc:
            decode_image(data)
        message = one_line(exc)
        assert "not an image in an accepted format" in message or \
            "not a readable image" in message, message
    with pytest.raises(MediaError, match="empty"):
        decode_image(b"")
    with pytest.raises(TypeError):
        decode_image("a path")  # type: ignore[arg-type]


@needs_pillow
def test_too_many_pixels_is_refused_from_the_header():
    # 10^10 pixels: Pillow's own decompression-bomb check refuses it at open
    with pytest.raises(MediaError) as exc:
        decode_image(png_claiming(100_000, 100_000))
    assert "too many pixels" in one_line(exc)
    # 81 M pixels: under Pillow's limit, over ours (64 M); refused before any decoding
    with pytest.raises(MediaError) as exc:
        decode_image(png_claiming(9000, 9000))
    assert "9000x9000 pixels (81000000), more than the limit of 67108864" in one_line(exc)
    # a real image over a lower limit
    with pytest.raises(MediaError, match="20x30 pixels"):
        decode_image(encode(noise(30, 20), "PNG"), max_pixels=599)
    assert decode_image(encode(noise(30, 20), "PNG"), max_pixels=600).shape == (30, 20, 3)


@needs_pillow
def test_too_many_bytes_is_refused_unread(tmp_path):
    data = encode(noise(30, 20), "PNG")
    with pytest.raises(MediaError) as exc:
        decode_image(data, max_bytes=len(data) - 1)
    assert f"{len(data)} bytes, more than the limit of {len(data) - 1}" in one_line(exc)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    assert read_image(path).shape == (30, 20, 3)
    with pytest.raises(MediaError, match="larger than the limit"):
        read_image(path, max_bytes=100)


@needs_pillow
def test_read_image_reads_regular_files_only(tmp_path):
    with pytest.raises(MediaError, match="no such image file"):
        read_image(tmp_path / "missing.png")
    with pytest.raises(MediaError, match="not a regular file"):
        read_image(tmp_path)
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.png"
        os.mkfifo(fifo)
        with pytest.raises(MediaError, match="not a regular file"):
            read_image(fifo)  # refused, not read (a read would block)
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(MediaError, match=r"text\.png: not an image"):
        read_image(tmp_path / "text.png")


@needs_pillow
def test_resize_is_pillows():
    from PIL import Image

    pixels = noise(17, 23)
    for name, code in (("bicubic", Image.Resampling.BICUBIC),
                       ("bilinear", Image.Resampling.BILINEAR)):
        expected = np.array(Image.fromarray(pixels).resize((40, 12), resample=code))
        assert np.array_equal(resize_image(pixels, (12, 40), name), expected)
    with pytest.raises(MediaError, match="more than the limit"):
        resize_image(pixels, (10_000, 10_000))
    with pytest.raises(ValueError, match="uint8"):
        resize_image(pixels.astype(np.float32), (4, 4))
    with pytest.raises(ValueError, match="resample"):
        resize_image(pixels, (4, 4), "cubic")


def test_without_pillow_the_error_says_how_to_install_it(monkeypatch):
    for name in ("PIL", "PIL.Image", "PIL.ImageOps"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MediaError) as exc:
        decode_image(b"\x89PNG\r\n\x1a\n")
    assert 'pip install "mlxrunner[vision]"' in one_line(exc)
    with pytest.raises(MediaError, match="mlxrunner\\[vision\\]"):
        resize_image(np.zeros((2, 2, 3), np.uint8), (4, 4))


def test_media_error_is_public():
    import mlxrunner.errors
    import mlxrunner.plugin

    assert mlxrunner.plugin.MediaError is mlxrunner.errors.MediaError
    assert issubclass(MediaError, MLXRunnerError)
    assert {"decode_image", "read_image", "resize_image", "MediaError"} <= set(
        mlxrunner.plugin.__all__)
    assert Path(mlxrunner.plugin.__file__).name == "plugin.py"


def test_read_processor_config(tmp_path):
    assert read_processor_config(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    assert read_processor_config(tmp_path) == {"patch_size": 16}
    # processor_config.json without an image_processor object: preprocessor_config.json
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "X"}))
    assert read_processor_config(tmp_path) == {"patch_size": 16}
    # ... with one: that one (transformers prefers it)
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"patch_size": 14}}))
    assert read_processor_config(tmp_path) == {"patch_size": 14}

    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="not valid JSON"):
        read_processor_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(" " * (1024 * 1024 + 1))
    with pytest.raises(ModelFolderError, match="larger than"):
        read_processor_config(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").mkdir()
    with pytest.raises(ModelFolderError, match="not a regular file"):
        read_processor_config(tmp_path)
