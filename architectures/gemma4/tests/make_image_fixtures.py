"""Write the Gemma 4 image preprocessing reference: what transformers makes of a few images.

The images: Qwen3.5's four committed test images (``architectures/qwen3_5/tests/
vision_fixtures/images/``, read by path, not copied: an RGBA PNG with transparent pixels, a
JPEG with EXIF orientation 6, a grayscale PNG with an aspect ratio of 7, a palette GIF with
a transparent colour) and :func:`wide_image`, drawn here (2 x 300 pixels: an aspect ratio
above every soft token budget, the resize's branch for a side that floors to 0).

``vision_fixtures/image_reference.npz``: for each image and each processor config of
:data:`CONFIGS` but ``hub``, what ``AutoImageProcessor`` (for a folder whose config.json says
``model_type`` ``gemma4``: ``Gemma4ImageProcessorPil`` without torchvision) returns:
``{image}_{config}_pixels`` (``pixel_values[0]``, float32), ``{image}_{config}_positions``
(``image_position_ids[0]``, stored as int16) and ``{image}_{config}_soft``
(``num_soft_tokens_per_image``). Gemma 4's published config (``hub``) pads every image to
2,520 patches of 768 values (7.7 MB); of those only the soft token count, the grid of real
patches (``{image}_hub_grid``, rows and columns), the first row (``{image}_hub_row0``), each
row's product with :func:`projection` (``{image}_hub_projection``, float64 products stored
as float32) and :func:`digest` of all the pixel values (``{image}_hub_digest``) are kept;
the reference test compares them whole, live. ``sizes`` / ``{budget}_resized``: transformers'
``get_aspect_ratio_preserving_size`` for :data:`SIZES` at the budgets of :data:`BUDGETS`
(``0 0``: it refused).

Run from the repository root (needs torch, transformers and Pillow):
    /tmp/ci/.ci-venv/bin/python architectures/gemma4/tests/make_image_fixtures.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
REFERENCE = FIXTURES / "image_reference.npz"
#: Qwen3.5's committed test images, reused
IMAGES = HERE.parents[1] / "qwen3_5" / "tests" / "vision_fixtures" / "images"
IMAGE_FILES = ("rgba.png", "exif.jpg", "gray.png", "palette.gif")
#: the images by name: a file of IMAGE_FILES, or "wide" (:func:`wide_image`)
NAMES = tuple(f.split(".")[0] for f in IMAGE_FILES) + ("wide",)

#: processor configs (the image processor's settings) -> each image through each
CONFIGS: dict[str, dict[str, Any]] = {
    # google/gemma-4-*'s processor_config.json "image_processor" object (the class defaults)
    "hub": {"do_convert_rgb": True, "do_normalize": False, "do_rescale": True,
            "do_resize": True, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
            "image_processor_type": "Gemma4ImageProcessor", "image_seq_length": 280,
            "max_soft_tokens": 280, "patch_size": 16, "pooling_kernel_size": 3,
            "resample": 3, "rescale_factor": 0.00392156862745098},
    # the tiny tower's geometry (patch 4 would be 48 values a row; 2 keeps the file small):
    # 70 soft tokens of 2 x 2 patches of 2 pixels, bilinear, normalised per channel
    "p2k2_bilinear": {"patch_size": 2, "pooling_kernel_size": 2, "max_soft_tokens": 70,
                      "resample": 2, "do_normalize": True, "image_mean": [0.4, 0.5, 0.6],
                      "image_std": [0.2, 0.25, 0.3]},
    # one-pixel patches, 3 x 3 pooling, 140 soft tokens, nearest, another rescale factor,
    # scalar mean and std (ignored: do_normalize is off by default)
    "p1k3_nearest": {"patch_size": 1, "pooling_kernel_size": 3, "max_soft_tokens": 140,
                     "resample": 0, "rescale_factor": 0.5 / 255, "image_mean": 0.5,
                     "image_std": 0.5},
    # nulls as transformers reads them (resample: its resize's default, bilinear;
    # do_normalize: off; the unused image_mean ignored), 70 soft tokens of 2 x 2 patches of 3
    "p3k2_nulls": {"patch_size": 3, "pooling_kernel_size": 2, "max_soft_tokens": 70,
                   "resample": None, "do_normalize": None, "image_mean": None},
}
#: budgets for get_aspect_ratio_preserving_size: name -> (patch, max_soft_tokens, kernel)
BUDGETS = {"hub": (16, 280, 3), "max": (16, 1120, 3), "small": (2, 70, 2)}
#: (height, width): photos and screens, tiny, wide and tall beyond the budget's aspect
#: ratio, the wide fixture, exact fits
SIZES = ((1080, 1920), (3000, 4000), (768, 768), (1, 1), (18, 27), (30, 14), (9, 64),
         (25, 21), (2, 300), (300, 2), (1, 8192), (8192, 1), (10, 2000), (333, 1001),
         (480, 1008), (672, 672), (224, 224), (4000, 30), (20, 3000), (600, 850))


def wide_image() -> np.ndarray:
    """A deterministic 2 x 300 RGB uint8 image (longer than 70 soft tokens allow)."""
    x = np.arange(300)
    rows = [np.stack([(x * 7) % 256, (x * 13 + 50 * r) % 256, (255 - x) % 256], axis=1)
            for r in range(2)]
    return np.stack(rows).astype(np.uint8)


def projection(width: int) -> np.ndarray:
    """A fixed weight per column, each between 0.5 and 1.5 (float64)."""
    k = np.arange(width, dtype=np.float64)
    return 1.0 + 0.5 * np.sin(0.618 * k + 0.5)


def digest(pixels: np.ndarray) -> np.ndarray:
    """The SHA-256 of float32 little-endian pixel values, as 32 uint8."""
    data = np.ascontiguousarray(pixels, dtype="<f4").tobytes()
    return np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8).copy()


def upright(name: str) -> Any:
    """The image as transformers' ``load_image`` opens it (EXIF orientation applied), before
    the processor's ``convert_to_rgb`` (which composites transparency onto white)."""
    from PIL import Image, ImageOps

    if name == "wide":
        return Image.fromarray(wide_image())
    filename = next(f for f in IMAGE_FILES if f.startswith(name + "."))
    with Image.open(IMAGES / filename) as image:
        return ImageOps.exif_transpose(image)


def processor(config: dict[str, Any]) -> Any:
    """transformers' image processor for a Gemma 4 folder whose processor_config.json's
    ``image_processor`` is this config."""
    from transformers import AutoImageProcessor

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"]}))
        (folder / "processor_config.json").write_text(json.dumps(
            {"image_processor": config, "image_seq_length": 280}))
        proc = AutoImageProcessor.from_pretrained(folder)
    if type(proc).__name__ != "Gemma4ImageProcessorPil":
        raise RuntimeError(f"expected Gemma4ImageProcessorPil, got {type(proc).__name__}")
    return proc


def transformers_inputs(name: str, config: dict[str, Any]
                        ) -> tuple[np.ndarray, np.ndarray, int]:
    """(pixel_values float32, image_position_ids int64, soft tokens) for one image."""
    out = processor(config)(images=upright(name), return_tensors="np")
    soft = out["num_soft_tokens_per_image"]
    return (np.asarray(out["pixel_values"][0], dtype=np.float32),
            np.asarray(out["image_position_ids"][0], dtype=np.int64), int(np.ravel(soft)[0]))


def reference() -> dict[str, np.ndarray]:
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        get_aspect_ratio_preserving_size,
    )

    arrays: dict[str, np.ndarray] = {}
    for name in NAMES:
        for config_name, config in CONFIGS.items():
            pixels, positions, soft = transformers_inputs(name, config)
            key = f"{name}_{config_name}"
            arrays[f"{key}_soft"] = np.array(soft, dtype=np.int64)
            if config_name == "hub":
                real = positions[:, 0] >= 0
                arrays[f"{key}_grid"] = np.array(  # (rows, columns) of real patches
                    [positions[real, 1].max() + 1, positions[real, 0].max() + 1], np.int64)
                arrays[f"{key}_row0"] = pixels[0]
                arrays[f"{key}_projection"] = (pixels.astype(np.float64) @ projection(
                    pixels.shape[1])).astype(np.float32)
                arrays[f"{key}_digest"] = digest(pixels)
            else:
                arrays[f"{key}_positions"] = positions.astype(np.int16)
                arrays[f"{key}_pixels"] = pixels
    arrays["sizes"] = np.array(SIZES, dtype=np.int64)
    for budget, (patch, soft, kernel) in BUDGETS.items():
        resized = []
        for height, width in SIZES:
            try:
                resized.append(get_aspect_ratio_preserving_size(
                    height, width, patch, soft * kernel ** 2, kernel))
            except ValueError:
                resized.append((0, 0))
        arrays[f"{budget}_resized"] = np.array(resized, dtype=np.int64)
    return arrays


def main() -> int:
    np.savez_compressed(REFERENCE, **reference())
    print(f"{REFERENCE}: {REFERENCE.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
