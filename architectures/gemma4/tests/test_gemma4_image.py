"""Gemma 4's image preprocessing (image -> patches, positions, soft tokens) against transformers.

Reference: ``AutoImageProcessor`` for a ``gemma4`` folder (``Gemma4ImageProcessorPil``,
Pillow's resize) on Qwen3.5's four committed test images and one drawn 2 x 300 image
(make_image_fixtures.py, ``vision_fixtures/image_reference.npz``), each through four
processor configs: Gemma 4's published one and three small ones (patches of 1, 2 and 3
pixels, 2 x 2 and 3 x 3 pooling, 70 and 140 soft tokens, nearest, bilinear and bicubic,
normalised or not, ``null`` keys). Ours: ``read_image`` (the core's decoding) then
``image_inputs``. Positions and soft token counts are equal; pixel values within 1e-6 (max
abs difference; measured 0: the same Pillow resize, then the same float32 arithmetic; the
published config's are compared by a SHA-256 of all of them, so bit for bit).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytest.importorskip("PIL", reason="Pillow is not installed (pip install 'mlxrunner[vision]')")

from mlxrunner_gemma4.image import (  # noqa: E402
    GEMMA4_DEFAULTS,
    ImageProcessorConfig,
    aspect_ratio_size,
    image_inputs,
    patchify,
    placeholder_count,
    placeholder_ids,
)

from mlxrunner.plugin import MediaError, ModelFolderError, read_image  # noqa: E402

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
TOLERANCE = 1e-6  # max abs difference of the pixel values (in [0, 1], or about [-3, 3])


def _load_maker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gemma4_make_image_fixtures",
                                                  HERE / "make_image_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _load_maker()
SMALL_CONFIGS = [c for c in MAKER.CONFIGS if c != "hub"]


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(MAKER.REFERENCE) as data:
        return dict(data)


def rgb(name: str) -> np.ndarray:
    if name == "wide":
        return MAKER.wide_image()
    filename = next(f for f in MAKER.IMAGE_FILES if f.startswith(name + "."))
    return read_image(MAKER.IMAGES / filename)


def ours(name: str, config: dict | None) -> tuple[np.ndarray, np.ndarray, int]:
    return image_inputs(rgb(name), config)


def test_fixtures_are_small(reference):
    assert MAKER.REFERENCE.stat().st_size < 200 * 1024
    assert all((MAKER.IMAGES / f).is_file() for f in MAKER.IMAGE_FILES)


@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("name", MAKER.NAMES)
def test_inputs_equal_transformers(name, config, reference):
    pixels, positions, soft = ours(name, MAKER.CONFIGS[config])
    key = f"{name}_{config}"
    expected = reference[f"{key}_pixels"]
    assert pixels.dtype == np.float32 and pixels.shape == expected.shape
    assert float(np.abs(pixels - expected).max()) <= TOLERANCE
    assert positions.dtype == np.int64
    assert np.array_equal(positions, reference[f"{key}_positions"])
    assert soft == int(reference[f"{key}_soft"])
    height, width = rgb(name).shape[:2]
    assert placeholder_count(height, width, MAKER.CONFIGS[config]) == soft


@pytest.mark.parametrize("name", MAKER.NAMES)
def test_published_config_equals_transformers(name, reference):
    """Gemma 4's published settings, from the Hub file and from no file at all: 2,520 rows of
    768 values, the real ones bit-equal to transformers'."""
    pixels, positions, soft = ours(name, MAKER.CONFIGS["hub"])
    assert pixels.shape == (2520, 768) and positions.shape == (2520, 2)
    assert soft == int(reference[f"{name}_hub_soft"]) <= 280
    rows, cols = reference[f"{name}_hub_grid"].tolist()
    assert rows * cols == soft * 9 and rows % 3 == 0 and cols % 3 == 0
    ys, xs = np.divmod(np.arange(rows * cols), cols)
    assert np.array_equal(positions[:rows * cols], np.stack([xs, ys], axis=1))
    assert (positions[rows * cols:] == -1).all() and (pixels[rows * cols:] == 0).all()
    assert float(np.abs(pixels[0] - reference[f"{name}_hub_row0"]).max()) <= TOLERANCE
    weights = MAKER.projection(pixels.shape[1])
    projected = pixels.astype(np.float64) @ weights
    expected = reference[f"{name}_hub_projection"].astype(np.float64)
    # elements within TOLERANCE, and the reference's float32 storage (half an ulp of ~1200)
    bound = TOLERANCE * float(weights.sum()) + 1e-4
    assert float(np.abs(projected - expected).max()) <= bound
    assert np.array_equal(MAKER.digest(pixels), reference[f"{name}_hub_digest"])
    no_file = ours(name, None)
    assert no_file[2] == soft and np.array_equal(no_file[0], pixels) and \
        np.array_equal(no_file[1], positions)


def test_aspect_ratio_size_equals_transformers(reference):
    sizes = reference["sizes"].tolist()
    for budget, (patch, soft, kernel) in MAKER.BUDGETS.items():
        for (height, width), expected in zip(sizes, reference[f"{budget}_resized"].tolist()):
            if expected == [0, 0]:
                with pytest.raises(MediaError):
                    aspect_ratio_size(height, width, patch, soft * kernel ** 2, kernel)
            else:
                assert list(aspect_ratio_size(height, width, patch, soft * kernel ** 2,
                                              kernel)) == expected, (budget, height, width)


def test_patches_are_row_major_with_xy_positions():
    """Patch k of a 3x4 grid of 2x2-pixel patches carries the value k (its raster index);
    inside a row, pixel row, pixel column, channel."""
    p, gh, gw = 2, 3, 4
    index = np.arange(gh * gw, dtype=np.float32).reshape(gh, gw)
    image = np.repeat(np.repeat(index, p, axis=0), p, axis=1)[..., None].repeat(3, axis=2)
    patches, positions = patchify(image, p)
    assert patches.shape == (gh * gw, 3 * p * p)
    assert (patches == np.arange(gh * gw, dtype=np.float32)[:, None]).all()
    assert positions.tolist() == [[x, y] for y in range(gh) for x in range(gw)]
    pixels = np.arange(p * p * 3, dtype=np.float32).reshape(p, p, 3)
    assert patchify(pixels, p)[0][0].tolist() == list(range(12))


def test_one_image_through_the_tiny_tower():
    """An image file through image_inputs into the committed tiny tower (patches of 4, 2 x 2
    pooling, a 16-entry position table): one soft token per <|image|> placeholder, padding
    rows ignored, images batch."""
    import mlx.core as mx
    from mlxrunner_gemma4.vision import load_vision

    tower = load_vision(FIXTURES / "tiny_vision")
    assert tower is not None
    cfg = tower.config
    config = {"patch_size": cfg.patch_size, "pooling_kernel_size": cfg.pooling_kernel_size,
              "max_soft_tokens": 70}
    image = read_image(MAKER.IMAGES / "rgba.png")[:, :18]  # 18x18: a 16x16 patch grid
    height, width = aspect_ratio_size(18, 18, cfg.patch_size, 70 * cfg.pooling_kernel_size ** 2,
                                      cfg.pooling_kernel_size)
    side = max(height, width) // cfg.patch_size
    if side > cfg.position_embedding_size:
        pytest.skip(f"a {side}-patch side exceeds the tiny tower's position table "
                    f"({cfg.position_embedding_size})")
    pixels, positions, soft = image_inputs(image, config)
    assert (height, width, soft) == (64, 64, 64) and pixels.shape == (280, 48)
    out = tower(mx.array(pixels[None]), positions[None])
    assert tuple(out.shape) == (soft, cfg.text_hidden_size)
    assert tower.soft_token_counts(positions[None]) == [soft]
    assert len(placeholder_ids(soft)) == soft + 2
    unpadded = tower(mx.array(pixels[None, :256]), positions[None, :256])
    assert float(mx.abs(out - unpadded).max()) <= 1e-5
    other = image_inputs(read_image(MAKER.IMAGES / "palette.gif")[:17, :18], config)
    both = tower(mx.array(np.stack([pixels, other[0]])), np.stack([positions, other[1]]))
    assert both.shape[0] == soft + other[2] == 2 * soft
    assert float(mx.abs(both[:soft] - out).max()) <= 1e-5


def test_placeholders():
    assert placeholder_ids(3) == [255999, 258880, 258880, 258880, 258882]
    assert placeholder_ids(1, {"boi_token_id": 7, "image_token_id": 8, "eoi_token_id": 9,
                               "model_type": "gemma4"}) == [7, 8, 9]
    assert placeholder_ids(2, {"image_token_id": None}) == [255999, 258880, 258880, 258882]
    with pytest.raises(ModelFolderError, match="eoi_token_id"):
        placeholder_ids(1, {"eoi_token_id": "x"})
    with pytest.raises(ValueError, match="positive"):
        placeholder_ids(0)
    # Gemma 4's published settings: at most 280, each image its own count
    assert placeholder_count(768, 768, None) == 256 and placeholder_count(1, 1, None) == 256
    assert placeholder_count(1080, 1920, None) == 264
    assert placeholder_count(2, 300, None) == 204  # 48 x 9792 pixels: 1 x 68 windows
    assert placeholder_count(768, 768, {"max_soft_tokens": 1120}) == 1089
    assert placeholder_count(96, 48, {"do_resize": False}) == 2
    with pytest.raises(MediaError, match="do_resize is off"):
        placeholder_count(100, 48, {"do_resize": False})


def test_configs_read_as_transformers_reads_them():
    assert ImageProcessorConfig.from_dict(None) == ImageProcessorConfig.from_dict(
        MAKER.CONFIGS["hub"]) == ImageProcessorConfig.from_dict(GEMMA4_DEFAULTS) == \
        ImageProcessorConfig.from_dict({}) == ImageProcessorConfig()
    hub = ImageProcessorConfig()
    assert (hub.patch_size, hub.max_soft_tokens, hub.pooling_kernel_size, hub.max_patches,
            hub.resample, hub.do_normalize, hub.rescale_factor) == (
        16, 280, 3, 2520, "bicubic", False, 1 / 255)
    # null: flags off, resample bilinear (transformers' resize), unused values ignored
    nulls = ImageProcessorConfig.from_dict({
        "do_resize": None, "do_rescale": None, "do_normalize": None, "resample": None,
        "rescale_factor": None, "image_mean": None, "image_std": None})
    assert (nulls.do_resize, nulls.do_rescale, nulls.do_normalize, nulls.resample) == (
        False, False, False, "bilinear")
    assert ImageProcessorConfig.from_dict({"image_mean": 0.5, "image_std": [1, 2, 3]}
                                          ).image_mean == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("config, match", [
    ({"patch_size": 0}, "patch_size"),
    ({"patch_size": None}, "patch_size"),
    ({"patch_size": 16.0}, "patch_size"),
    ({"pooling_kernel_size": True}, "pooling_kernel_size"),
    ({"pooling_kernel_size": None}, "pooling_kernel_size"),
    ({"max_soft_tokens": 100}, "max_soft_tokens must be one of 70, 140"),
    ({"max_soft_tokens": None}, "max_soft_tokens"),
    ({"max_soft_tokens": 280.0}, "max_soft_tokens"),
    ({"do_normalize": True, "image_mean": [0.5, 0.5]}, "image_mean"),
    ({"do_normalize": True, "image_mean": None}, "image_mean"),
    ({"image_std": [0.5, 0, 0.5]}, "image_std"),
    ({"image_std": "x"}, "image_std"),
    ({"rescale_factor": -1}, "rescale_factor"),
    ({"rescale_factor": None}, "rescale_factor"),
    ({"resample": 7}, "resample"),
    ({"resample": 3.0}, "resample"),
    ({"do_resize": "yes"}, "do_resize"),
    ({"patch_size": 1024, "pooling_kernel_size": 4}, "more than the limit"),
    ([1, 2], "JSON object"),
])
def test_bad_configs_are_one_line(config, match):
    with pytest.raises(ModelFolderError, match=match) as info:
        ImageProcessorConfig.from_dict(config)
    assert "\n" not in str(info.value)


def test_bad_images_are_one_line():
    config = {"do_resize": False, "patch_size": 2, "pooling_kernel_size": 2,
              "max_soft_tokens": 70}
    with pytest.raises(MediaError, match="do_resize is off"):
        image_inputs(np.zeros((6, 8, 3), np.uint8), config)
    pixels, positions, soft = image_inputs(np.full((8, 12, 3), 255, np.uint8), config)
    assert soft == 6 and pixels.shape == (280, 12) and (pixels[:24] == 1).all()
    # more patches than max_patches with do_resize off: kept, not padded (as transformers)
    pixels, positions, soft = image_inputs(np.zeros((40, 40, 3), np.uint8), config)
    assert pixels.shape == (400, 12) and soft == 100 and (positions >= 0).all()
    with pytest.raises(MediaError, match="empty"):
        aspect_ratio_size(0, 5, 16, 2520, 3)
    with pytest.raises(ValueError, match="uint8"):
        image_inputs(np.zeros((4, 4, 3), np.float32), None)
    with pytest.raises(ValueError, match="uint8"):
        image_inputs(np.zeros((4, 4), np.uint8), None)
    # an extreme aspect ratio is not refused (transformers accepts it): one row of windows
    pixels, positions, soft = image_inputs(np.zeros((1, 8000, 3), np.uint8), None)
    assert soft == 280 and positions[:, 1].max() == 2 and positions[:, 0].max() == 839


@pytest.mark.reference
def test_live_transformers_matches_ours_and_the_fixtures(reference):
    """make_image_fixtures.py, run now: its outputs equal the committed ones (positions,
    counts and digests exactly, pixels within 1e-6), and ours equal its full outputs (the
    published config's too) within 1e-6."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fresh = MAKER.reference()
    assert sorted(fresh) == sorted(reference)
    for key, value in fresh.items():
        if value.dtype.kind in "iu":
            assert np.array_equal(value, reference[key]), key
        else:
            assert np.abs(value - reference[key]).max() <= TOLERANCE, key
    worst = 0.0
    for name in MAKER.NAMES:
        for config_name, config in MAKER.CONFIGS.items():
            expected, expected_positions, expected_soft = MAKER.transformers_inputs(name, config)
            pixels, positions, soft = ours(name, config)
            assert soft == expected_soft, (name, config_name)
            assert np.array_equal(positions, expected_positions), (name, config_name)
            assert pixels.shape == expected.shape, (name, config_name)
            worst = max(worst, float(np.abs(pixels - expected).max()))
    assert worst <= TOLERANCE, worst
    assert math.isfinite(worst)
