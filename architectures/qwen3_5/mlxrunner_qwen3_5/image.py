"""Qwen3.5's image preprocessing: an RGB image to the vision tower's patch rows and grid.

What transformers' image processor for ``model_type`` ``qwen3_5`` does
(``AutoImageProcessor`` gives ``Qwen2VLImageProcessorPil`` when torchvision is not
installed, the class our results equal bit for bit; with torchvision it gives
``Qwen2VLImageProcessor``, which resizes with torch, not Pillow, and is not compared here),
to the ``[H, W, 3]`` uint8 pixels of ``mlxrunner.plugin.decode_image`` / ``read_image``:

1. resize (Pillow, bicubic unless ``resample`` says otherwise) to :func:`smart_resize`'s
   size: each side a multiple of ``patch_size * merge_size``, the area within
   ``[min_pixels, max_pixels]`` (``size``'s ``shortest_edge`` and ``longest_edge``), the
   aspect ratio kept as well as those allow;
2. rescale by ``rescale_factor`` (1/255; computed in float64, stored as float32), then
   normalise per channel, ``(x - image_mean) / image_std`` in float32;
3. cut into ``patch_size`` squares listed in merge-window order (the ``merge_size`` x
   ``merge_size`` windows row by row, inside a window its patches row by row), each row
   ``C * temporal_patch_size * P * P`` values: per channel, the patch repeated
   ``temporal_patch_size`` times (a still image is a clip of identical frames), so one
   image's grid is ``(1, H / P, W / P)``.

The settings come from the model folder's ``preprocessor_config.json`` (or the
``image_processor`` object of ``processor_config.json``, which transformers prefers), read by
:func:`read_processor_config`. A key the file leaves out takes the processor class's default
(:data:`CLASS_DEFAULTS`: patch 14, CLIP's mean and std, 56*56 to 28*28*1280 pixels, as
transformers does); a folder with neither file takes Qwen3.5's published settings
(:data:`QWEN3_5_DEFAULTS`: patch 16, mean and std 0.5, 256*256 to 4096*4096 pixels).
``do_convert_rgb`` is not read: the decoded pixels are already RGB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxrunner.plugin import (
    MediaError,
    ModelFolderError,
    pixel_settings,
    rescale_normalize,
    resize_image,
)

#: transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD``, the processor class's defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: ``Qwen2VLImageProcessorPil``'s class defaults, for keys a config file leaves out
CLASS_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
    "rescale_factor": 1 / 255, "resample": 3,  # PIL.Image.Resampling.BICUBIC
    "do_resize": True, "do_rescale": True, "do_normalize": True,
}
#: the ``preprocessor_config.json`` of Qwen's Qwen3.5 checkpoints (Qwen/Qwen3.5-0.8B, ...),
#: for a folder without one
QWEN3_5_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
#: transformers' ``PILImageResampling`` values (Pillow's) -> Pillow's filter names
#: ``smart_resize`` refuses a longer side more than this many times the shorter
MAX_ASPECT_RATIO = 200
#: the most bytes read of a processor config file
_MAX_PIXELS_BOUND = 2 ** 31


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The settings of transformers' ``Qwen2VLImageProcessorPil`` that shape the patches
    (the class's defaults; :meth:`from_dict` reads a config file's)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: str = "bicubic"
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def factor(self) -> int:
        """What both sides are a multiple of: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None,
                  where: str = "preprocessor_config.json") -> ImageProcessorConfig:
        """A config file's settings (``None``: no file, Qwen3.5's published settings), each
        missing or ``null`` key the class default, as transformers reads it; a bad value is
        one ModelFolderError line naming the key."""
        if config is None:
            config = QWEN3_5_DEFAULTS
        if not isinstance(config, Mapping):
            raise ModelFolderError(f"{where}: expected a JSON object")

        def get(key: str) -> Any:
            value = config.get(key)
            return CLASS_DEFAULTS[key] if value is None else value

        def integer(key: str, value: Any, high: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ModelFolderError(f"{where}: {key} must be an integer from 1 to {high}, "
                                       f"got {value!r:.40}")
            return value

        def flag(key: str) -> bool:
            value = get(key)
            if not isinstance(value, bool):
                raise ModelFolderError(f"{where}: {key} must be true or false, got "
                                       f"{value!r:.40}")
            return value

        size = config.get("size")
        size = dict(CLASS_DEFAULTS["size"]) if size is None else size
        if not isinstance(size, Mapping):
            raise ModelFolderError(f"{where}: size must be an object, got {size!r:.40}")
        edges = {"shortest_edge": size.get("shortest_edge"),
                 "longest_edge": size.get("longest_edge")}
        # the older keys, as transformers' __init__ reads them, win over size's
        for old, new in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if config.get(old) is not None:
                edges[new] = config[old]
        for key, value in edges.items():
            if value is None:
                raise ModelFolderError(f"{where}: size must give shortest_edge and "
                                       f"longest_edge (the least and most pixels), lacks {key}")
        resample, rescale, mean, std = pixel_settings(
            get("resample"), get("rescale_factor"), get("image_mean"), get("image_std"), where)
        return cls(
            patch_size=integer("patch_size", get("patch_size"), 1024),
            temporal_patch_size=integer("temporal_patch_size", get("temporal_patch_size"), 64),
            merge_size=integer("merge_size", get("merge_size"), 64),
            min_pixels=integer("size.shortest_edge", edges["shortest_edge"], _MAX_PIXELS_BOUND),
            max_pixels=integer("size.longest_edge", edges["longest_edge"], _MAX_PIXELS_BOUND),
            image_mean=mean, image_std=std, rescale_factor=rescale, resample=resample,
            do_resize=flag("do_resize"), do_rescale=flag("do_rescale"),
            do_normalize=flag("do_normalize"))


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize``: each side rounded to a multiple of ``factor``
    (Python's ``round``, halves to even); if that area is above ``max_pixels``, both sides
    scaled down by one ratio and floored to multiples (at least ``factor``); below
    ``min_pixels``, scaled up and ceiled. An aspect ratio above 200 is one MediaError."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"image {width}x{height}: the longer side is more than "
                         f"{MAX_ASPECT_RATIO} times the shorter")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_inputs(rgb: np.ndarray,
                 processor_config: Mapping[str, Any] | ImageProcessorConfig | None
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image's vision-tower input: ``(patches, (t, h, w))``, ``patches`` float32
    ``[t * h * w, C * temporal_patch_size * P * P]`` in merge-window order (what
    ``Qwen3_5Vision(mx.array(patches), [grid])`` takes) and the grid of patches, ``t = 1``.
    ``rgb``: ``[H, W, 3]`` uint8; ``processor_config``: a folder's settings
    (:func:`read_processor_config`; ``None`` for Qwen3.5's published ones)."""
    cfg = processor_config if isinstance(processor_config, ImageProcessorConfig) \
        else ImageProcessorConfig.from_dict(processor_config)
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"image_inputs takes [H, W, 3] uint8 pixels, got {rgb.dtype} "
                         f"{list(rgb.shape)}")
    height, width = rgb.shape[:2]
    factor = cfg.factor
    image: np.ndarray = rgb
    if cfg.do_resize:
        size = smart_resize(height, width, factor, cfg.min_pixels, cfg.max_pixels)
        image = resize_image(rgb, size, cfg.resample)
    elif height % factor or width % factor:
        raise MediaError(f"image {width}x{height}: do_resize is off and its sides are not "
                         f"multiples of {factor} (patch_size x merge_size)")
    image = rescale_normalize(image, cfg.rescale_factor if cfg.do_rescale else None,
                              cfg.image_mean if cfg.do_normalize else None, cfg.image_std)
    return patchify(image, cfg.patch_size, cfg.merge_size,
                    cfg.temporal_patch_size)


def patchify(image: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
             ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``image [H, W, C]`` (sides multiples of ``patch_size * merge_size``) to its patch
    rows in merge-window order, each ``[C, temporal_patch_size, P, P]`` flattened, and its
    grid ``(1, H / P, W / P)``."""
    height, width, channels = image.shape
    p, m = patch_size, merge_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"patchify: {height}x{width} is not a multiple of {p * m}")
    grid_h, grid_w = height // p, width // p
    # [H, W, C] -> (window row, merge row, patch row, window col, merge col, patch col, C)
    blocks = image.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    # -> (window row, window col, merge row, merge col, C, patch row, patch col)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None],
                             (*blocks.shape[:5], temporal_patch_size, p, p))
    patches = np.ascontiguousarray(frames.reshape(grid_h * grid_w,
                                                  channels * temporal_patch_size * p * p))
    return patches, (1, grid_h, grid_w)


def placeholder_count(grid_thw: Sequence[int], merge_size: int) -> int:
    """How many ``<|image_pad|>`` tokens an image of grid ``(t, h, w)`` fills: one per merge
    window, ``t * h * w / merge_size ** 2`` (the vision tower's output rows)."""
    t, h, w = (int(v) for v in grid_thw)
    if t < 1 or h < 1 or w < 1 or merge_size < 1 or h % merge_size or w % merge_size:
        raise ValueError(f"grid (t, h, w) = {(t, h, w)}: each must be positive and h, w "
                         f"multiples of merge_size {merge_size}")
    return t * h * w // merge_size ** 2

