"""Write the image preprocessing fixtures: four tiny image files and what transformers makes
of them.

``vision_fixtures/images/`` (``--images`` rewrites them; committed, since another Pillow's
PNG or JPEG encoder may write other bytes): drawn with numpy from fixed seeds, each a case
the decoding must get right:

- ``rgba.png`` (27x18, RGBA): alpha from 0 to 255, a fully transparent block (composited
  onto white);
- ``exif.jpg`` (stored 14 wide, 30 high; EXIF orientation 6: upright it is 30x14);
- ``gray.png`` (64x9, mode L; an aspect ratio of 7);
- ``palette.gif`` (21x25, 16 colours, colour 0 transparent).

``vision_fixtures/image_reference.npz``: for each image, ``{image}_rgb`` (the uint8 pixels
transformers' ``convert_to_rgb`` gives the upright image, ``ImageOps.exif_transpose`` as
its ``load_image`` applies it), and for each processor config of :data:`CONFIGS` but
``hub`` what ``AutoImageProcessor`` (for a folder whose config.json says ``model_type``
``qwen3_5``: ``Qwen2VLImageProcessorPil``) returns for that image: ``{image}_{config}_patches``
(``pixel_values``, float32) and ``{image}_{config}_grid`` (``image_grid_thw``). The Qwen3.5
Hub config (``hub``) makes at least 256x256 pixels of any image (about 1.5 MB of patches
each); of those only ``{image}_hub_grid``, the first row (``{image}_hub_row0``) and each
row's product with :func:`projection` (``{image}_hub_projection``, float64) are kept; the
reference test compares them whole, live. ``smart_sizes`` / ``smart_resized``: transformers'
``smart_resize`` at the Hub settings for :data:`SIZES` (0 0: it refused).

Run from the repository root (needs torch, transformers and Pillow):
    /tmp/ci/.ci-venv/bin/python architectures/qwen3_5/tests/make_image_fixtures.py [--images]
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
IMAGES = FIXTURES / "images"
REFERENCE = FIXTURES / "image_reference.npz"
IMAGE_FILES = ("rgba.png", "exif.jpg", "gray.png", "palette.gif")

#: processor configs (preprocessor_config.json's contents) -> each image through each
CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-0.8B's preprocessor_config.json
    "hub": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessorFast"},
    # scaled up to at least 700 pixels; no mean or std: the class's (CLIP's)
    "up_clip": {"size": {"shortest_edge": 700, "longest_edge": 2000}, "patch_size": 2,
                "merge_size": 2, "temporal_patch_size": 2},
    # scaled down to at most 200 pixels (the older min_pixels / max_pixels keys), bilinear,
    # 3 frames, a mean and std per channel
    "down_bilinear": {"min_pixels": 16, "max_pixels": 200, "patch_size": 2, "merge_size": 2,
                      "temporal_patch_size": 3, "resample": 2,
                      "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.25, 0.3],
                      "rescale_factor": 0.00392156862745098},
    # only rounded to multiples of 6 (2x2 patches, 3x3 windows); scalar mean and std
    "round_m3": {"size": {"shortest_edge": 36, "longest_edge": 4096}, "patch_size": 2,
                 "merge_size": 3, "temporal_patch_size": 2, "image_mean": 0.5,
                 "image_std": 0.5},
}
#: (height, width) for smart_resize at the Hub settings: shapes of photos and screens,
#: halves that round to even (528 / 32 = 16.5 -> 16, 400 / 32 = 12.5 -> 12, 560 / 32 = 17.5
#: -> 18, 336 / 32 = 10.5 -> 10), below 256x256, beyond 4096x4096, aspect ratios of exactly
#: 200 and above it, a single pixel
SIZES = ((1080, 1920), (3000, 4000), (528, 400), (560, 336), (48, 80), (80, 48), (16, 16),
         (1, 1), (300, 200),
         (8192, 8192), (5000, 3), (10, 2000), (9, 2000), (2000, 10), (333, 1001),
         (4100, 4100), (250, 4000), (256, 256), (255, 257))


def projection(width: int) -> np.ndarray:
    """A fixed weight per column, each between 0.5 and 1.5 (float64)."""
    k = np.arange(width, dtype=np.float64)
    return 1.0 + 0.5 * np.sin(0.618 * k + 0.5)


def make_images() -> dict[str, bytes]:
    """The image files' bytes (deterministic for one Pillow)."""
    from PIL import Image

    rng = np.random.default_rng(2024)
    out: dict[str, bytes] = {}

    def encode(image: Image.Image, fmt: str, **kw: Any) -> bytes:
        buf = io.BytesIO()
        image.save(buf, fmt, **kw)
        return buf.getvalue()

    def picture(height: int, width: int) -> np.ndarray:
        y, x = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
        base = 255 * np.stack([x, y, 1 - 0.5 * (x + y)], axis=2)
        return np.clip(base + rng.normal(0, 30, (height, width, 3)), 0, 255).astype(np.uint8)

    rgba = np.concatenate([picture(18, 27), np.zeros((18, 27, 1), np.uint8)], axis=2)
    rgba[..., 3] = np.linspace(0, 255, 27).astype(np.uint8)[None, :]
    rgba[4:9, 15:22, 3] = 0
    out["rgba.png"] = encode(Image.fromarray(rgba), "PNG")

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    out["exif.jpg"] = encode(Image.fromarray(picture(30, 14)), "JPEG", quality=90,
                             exif=exif.tobytes())

    gray = picture(9, 64).mean(axis=2).astype(np.uint8)
    out["gray.png"] = encode(Image.fromarray(gray), "PNG")

    palette = Image.fromarray(picture(25, 21)).quantize(colors=16)
    out["palette.gif"] = encode(palette, "GIF", transparency=0)
    return out


def write_images(folder: Path = IMAGES) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in make_images().items():
        (folder / name).write_bytes(data)


def upright(path: Path) -> Any:
    """The image as transformers' ``load_image`` opens it (EXIF orientation applied), before
    the processor's ``convert_to_rgb`` (which composites transparency onto white)."""
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        return ImageOps.exif_transpose(image)


def processor(config: dict[str, Any]) -> Any:
    """transformers' image processor for a Qwen3.5 folder with this preprocessor_config."""
    from transformers import AutoImageProcessor

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}))
        (folder / "preprocessor_config.json").write_text(json.dumps(config))
        proc = AutoImageProcessor.from_pretrained(folder)
    if type(proc).__name__ != "Qwen2VLImageProcessorPil":
        raise RuntimeError(f"expected Qwen2VLImageProcessorPil, got {type(proc).__name__}")
    return proc


def transformers_inputs(path: Path, config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values float32, image_grid_thw [1, 3] int64) for one image file."""
    out = processor(config)(images=upright(path), return_tensors="np")
    return (np.asarray(out["pixel_values"], dtype=np.float32),
            np.asarray(out["image_grid_thw"], dtype=np.int64))


def reference(images: Path = IMAGES) -> dict[str, np.ndarray]:
    from transformers.image_transforms import convert_to_rgb
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    arrays: dict[str, np.ndarray] = {}
    for filename in IMAGE_FILES:
        name = filename.split(".")[0]
        path = images / filename
        arrays[f"{name}_rgb"] = np.asarray(convert_to_rgb(upright(path), return_numpy=True),
                                           dtype=np.uint8)
        for config_name, config in CONFIGS.items():
            patches, grid = transformers_inputs(path, config)
            key = f"{name}_{config_name}"
            arrays[f"{key}_grid"] = grid
            if config_name == "hub":
                arrays[f"{key}_row0"] = patches[0]
                arrays[f"{key}_projection"] = patches.astype(np.float64) @ projection(
                    patches.shape[1])
            else:
                arrays[f"{key}_patches"] = patches
    resized = []
    for height, width in SIZES:
        try:
            resized.append(smart_resize(height, width, factor=32, min_pixels=65536,
                                        max_pixels=16777216))
        except ValueError:
            resized.append((0, 0))
    arrays["smart_sizes"] = np.array(SIZES, dtype=np.int64)
    arrays["smart_resized"] = np.array(resized, dtype=np.int64)
    return arrays


def main(argv: list[str]) -> int:
    if "--images" in argv:
        write_images()
    np.savez_compressed(REFERENCE, **reference())
    size = REFERENCE.stat().st_size + sum(p.stat().st_size for p in IMAGES.iterdir())
    print(f"{REFERENCE} and {IMAGES}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
