"""Qwen3.5's image preprocessing (image file -> patch rows and grid) against transformers.

Reference: ``AutoImageProcessor`` for a ``qwen3_5`` folder (``Qwen2VLImageProcessorPil``,
Pillow's resize) on four tiny committed image files (make_image_fixtures.py,
``vision_fixtures/``), each through four processor configs: Qwen3.5's Hub config and three
small ones covering the resize branches (up, down, rounding only), bilinear and bicubic,
1 to 3 frames, merge windows of 2 and 3, per-channel and scalar mean and std and the
class's defaults. Ours: ``read_image`` (the core's decoding) then ``image_inputs``. Decoded
pixels and grids are equal; patches within 1e-6 (max abs difference; measured 0: the same
Pillow resize, then the same float32 arithmetic).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytest.importorskip("PIL", reason="Pillow is not installed (pip install 'mlxrunner[vision]')")

from mlxrunner_qwen3_5.image import (  # noqa: E402
    CLASS_DEFAULTS,
    QWEN3_5_DEFAULTS,
    ImageProcessorConfig,
    image_inputs,
    patchify,
    placeholder_count,
    smart_resize,
)

from mlxrunner.plugin import MediaError, ModelFolderError, read_image  # noqa: E402

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
IMAGES = FIXTURES / "images"
TOLERANCE = 1e-6  # max abs difference of the patch values (they lie in about [-2.2, 2.7])


def _load_maker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("qwen3_5_make_image_fixtures",
                                                  HERE / "make_image_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _load_maker()
NAMES = [f.split(".")[0] for f in MAKER.IMAGE_FILES]
SMALL_CONFIGS = [c for c in MAKER.CONFIGS if c != "hub"]


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(MAKER.REFERENCE) as data:
        return dict(data)


def ours(name: str, config: dict | None) -> tuple[np.ndarray, tuple[int, int, int]]:
    filename = next(f for f in MAKER.IMAGE_FILES if f.startswith(name + "."))
    return image_inputs(read_image(IMAGES / filename), config)


def test_fixtures_are_small(reference):
    size = MAKER.REFERENCE.stat().st_size + sum(p.stat().st_size for p in IMAGES.iterdir())
    assert size < 128 * 1024
    assert sorted(p.name for p in IMAGES.iterdir()) == sorted(MAKER.IMAGE_FILES)


@pytest.mark.parametrize("name", NAMES)
def test_decoded_pixels_equal_transformers(name, reference):
    """read_image: the EXIF orientation applied, transparency composited onto white, as
    transformers' load_image + convert_to_rgb give them."""
    filename = next(f for f in MAKER.IMAGE_FILES if f.startswith(name + "."))
    rgb = read_image(IMAGES / filename)
    assert rgb.dtype == np.uint8 and rgb.flags.c_contiguous
    assert np.array_equal(rgb, reference[f"{name}_rgb"])


def test_the_fixture_images_are_the_cases_they_claim(reference):
    assert reference["exif_rgb"].shape == (14, 30, 3)  # stored 14 wide and 30 high
    rgba = reference["rgba_rgb"]
    assert (rgba[4:9, 15:22] == 255).all()  # a fully transparent block: white
    assert (rgba[:, 0] == 255).all()  # alpha 0 in the first column
    gray = reference["gray_rgb"]
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
    assert (reference["palette_rgb"] == 255).all(axis=2).any()  # colour 0 transparent


@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("name", NAMES)
def test_patches_equal_transformers(name, config, reference):
    patches, grid = ours(name, MAKER.CONFIGS[config])
    expected = reference[f"{name}_{config}_patches"]
    assert [list(grid)] == reference[f"{name}_{config}_grid"].tolist()
    assert patches.dtype == np.float32 and patches.shape == expected.shape
    assert float(np.abs(patches - expected).max()) <= TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_hub_config_equals_transformers(name, reference):
    """Qwen3.5's published settings, from the Hub file and from no file at all."""
    patches, grid = ours(name, MAKER.CONFIGS["hub"])
    assert [list(grid)] == reference[f"{name}_hub_grid"].tolist()
    t, h, w = grid
    assert patches.shape == (t * h * w, 3 * 2 * 16 * 16) and h * w * 256 >= 65536
    assert float(np.abs(patches[0] - reference[f"{name}_hub_row0"]).max()) <= TOLERANCE
    weights = MAKER.projection(patches.shape[1])
    projected = patches.astype(np.float64) @ weights
    bound = TOLERANCE * float(weights.sum())  # what elements within TOLERANCE allow
    assert float(np.abs(projected - reference[f"{name}_hub_projection"]).max()) <= bound
    no_file, no_file_grid = ours(name, None)
    assert no_file_grid == grid and np.array_equal(no_file, patches)


def test_smart_resize_equals_transformers(reference):
    for (height, width), (rh, rw) in zip(reference["smart_sizes"].tolist(),
                                         reference["smart_resized"].tolist()):
        if rh == 0:
            with pytest.raises(MediaError, match="more than 200 times"):
                smart_resize(height, width, 32, 65536, 16777216)
        else:
            assert smart_resize(height, width, 32, 65536, 16777216) == (rh, rw), (height,
                                                                                   width)


def test_patch_rows_are_in_merge_window_order():
    """Patch k of a 4x6 grid (2x2 pixel patches, 2x2 windows) carries the value k (its
    raster index): the rows come window by window, inside a window row by row."""
    p, m, gh, gw = 2, 2, 4, 6
    index = np.arange(gh * gw, dtype=np.float32).reshape(gh, gw)
    image = np.repeat(np.repeat(index, p, axis=0), p, axis=1)[..., None].repeat(3, axis=2)
    patches, grid = patchify(image, p, m, temporal_patch_size=2)
    assert grid == (1, gh, gw) and patches.shape == (gh * gw, 3 * 2 * p * p)
    order = [r * gw + c for wr in range(gh // m) for wc in range(gw // m)
             for r in range(wr * m, wr * m + m) for c in range(wc * m, wc * m + m)]
    assert (patches == np.array(order, dtype=np.float32)[:, None]).all()
    # channels outermost in a row, then the repeated frame, then the patch's pixels
    colours = np.zeros((p * m, p * m, 3), np.float32) + np.array([1, 2, 3], np.float32)
    row = patchify(colours, p, m, 3)[0][0]
    assert row.tolist() == [1.0] * 12 + [2.0] * 12 + [3.0] * 12


def test_placeholders_are_the_towers_output_rows():
    """An image file through image_inputs into the committed tiny tower (4x4 patches, 2
    frames, 2x2 windows): one output row per <|image_pad|> token."""
    import mlx.core as mx
    from mlxrunner_qwen3_5.vision import load_vision

    tower = load_vision(FIXTURES / "tiny_vl")
    assert tower is not None
    cfg = tower.config
    config = {"patch_size": cfg.patch_size, "merge_size": cfg.spatial_merge_size,
              "temporal_patch_size": cfg.temporal_patch_size,
              "size": {"shortest_edge": 16, "longest_edge": 4096},
              "image_mean": 0.5, "image_std": 0.5}
    patches, grid = image_inputs(read_image(IMAGES / "rgba.png"), config)
    assert grid == (1, 4, 6)  # 18x27 pixels -> 16x24: 4x6 patches of 4
    out = tower(mx.array(patches), [grid])
    assert out.shape[0] == placeholder_count(grid, cfg.spatial_merge_size) == 6


def test_placeholder_count():
    assert placeholder_count((1, 14, 20), 2) == 70
    assert placeholder_count((2, 6, 6), 3) == 8
    with pytest.raises(ValueError, match="merge_size"):
        placeholder_count((1, 3, 4), 2)


def test_configs_read_as_transformers_reads_them():
    assert ImageProcessorConfig.from_dict(None) == ImageProcessorConfig.from_dict(
        MAKER.CONFIGS["hub"]) == ImageProcessorConfig.from_dict(QWEN3_5_DEFAULTS)
    hub = ImageProcessorConfig.from_dict(None)
    assert (hub.patch_size, hub.temporal_patch_size, hub.merge_size, hub.min_pixels,
            hub.max_pixels, hub.image_mean, hub.image_std, hub.resample) == (
        16, 2, 2, 65536, 16777216, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic")
    # a file's missing or null keys: the class's defaults (patch 14, CLIP's mean and std)
    assert ImageProcessorConfig.from_dict({}) == ImageProcessorConfig() == \
        ImageProcessorConfig.from_dict({k: None for k in CLASS_DEFAULTS})
    assert ImageProcessorConfig().image_mean == (0.48145466, 0.4578275, 0.40821073)
    # the older keys win over size's
    old = ImageProcessorConfig.from_dict({"size": {"shortest_edge": 1, "longest_edge": 2},
                                          "min_pixels": 10, "max_pixels": 20})
    assert (old.min_pixels, old.max_pixels) == (10, 20)


@pytest.mark.parametrize("config, match", [
    ({"patch_size": 0}, "patch_size"),
    ({"patch_size": 16.0}, "patch_size"),
    ({"merge_size": True}, "merge_size"),
    ({"size": {"longest_edge": 100}}, "shortest_edge"),
    ({"size": [1, 2]}, "size must be an object"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_std": [0.5, 0, 0.5]}, "image_std"),
    ({"image_std": "x"}, "image_std"),
    ({"rescale_factor": -1}, "rescale_factor"),
    ({"resample": 7}, "resample"),
    ({"resample": 3.0}, "resample"),
    ({"do_resize": "yes"}, "do_resize"),
    ([1, 2], "JSON object"),
])
def test_bad_configs_are_one_line(config, match):
    with pytest.raises(ModelFolderError, match=match):
        ImageProcessorConfig.from_dict(config)


def test_bad_images_are_one_line():
    with pytest.raises(MediaError, match="more than 200 times"):
        image_inputs(np.zeros((2, 500, 3), np.uint8), None)
    config = {"do_resize": False, "patch_size": 2, "merge_size": 2}
    with pytest.raises(MediaError, match="do_resize is off"):
        image_inputs(np.zeros((6, 8, 3), np.uint8), config)
    patches, grid = image_inputs(np.zeros((8, 12, 3), np.uint8), config)  # multiples: fine
    assert grid == (1, 4, 6)
    # a folder asking for more pixels than the core resizes to
    with pytest.raises(MediaError, match="more than the limit"):
        image_inputs(np.zeros((4, 4, 3), np.uint8),
                     {"size": {"shortest_edge": 2 ** 30, "longest_edge": 2 ** 31}})
    with pytest.raises(ValueError, match="uint8"):
        image_inputs(np.zeros((4, 4, 3), np.float32), None)


@pytest.mark.reference
def test_live_transformers_matches_ours_and_the_fixtures(reference):
    """make_image_fixtures.py, run now: its outputs equal the committed ones (grids and
    pixels exactly, patches within 1e-6), and ours equal its full outputs (the Hub config's
    too) within 1e-6."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fresh = MAKER.reference()
    assert sorted(fresh) == sorted(reference)
    for key, value in fresh.items():
        if value.dtype.kind in "iu":
            assert np.array_equal(value, reference[key]), key
        else:
            scale = float(MAKER.projection(1536).sum()) if key.endswith("_projection") else 1
            assert np.abs(value - reference[key]).max() <= TOLERANCE * scale, key
    worst = 0.0
    for filename in MAKER.IMAGE_FILES:
        name = filename.split(".")[0]
        for config_name, config in MAKER.CONFIGS.items():
            expected, expected_grid = MAKER.transformers_inputs(IMAGES / filename, config)
            patches, grid = ours(name, config)
            assert [list(grid)] == expected_grid.tolist(), (name, config_name)
            assert patches.shape == expected.shape, (name, config_name)
            worst = max(worst, float(np.abs(patches - expected).max()))
    assert worst <= TOLERANCE, worst
    assert math.isfinite(worst)
