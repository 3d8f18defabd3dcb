"""Gemma 4's image preprocessing: an RGB image to the vision tower's patches and positions.

What transformers' image processor for ``model_type`` ``gemma4`` does (``AutoImageProcessor``
gives ``Gemma4ImageProcessorPil`` when torchvision is not installed, the class our results
equal bit for bit; with torchvision it gives ``Gemma4ImageProcessor``, which resizes with
torch, not Pillow, and is not compared here), to the ``[H, W, 3]`` uint8 pixels of
``mlxrunner.plugin.decode_image`` / ``read_image``:

1. resize (Pillow, bicubic unless ``resample`` says otherwise; skipped when the size is
   already right) to :func:`aspect_ratio_size`: the largest size keeping the aspect ratio
   whose sides are multiples of ``pooling_kernel_size * patch_size`` and whose patches number
   at most ``max_patches = max_soft_tokens * pooling_kernel_size ** 2`` (a side that would
   round to 0 becomes one multiple, the other ``floor(long / short)`` multiples, at most
   ``max_soft_tokens``);
2. rescale by ``rescale_factor`` (1/255; a float64 product stored as float32): pixels in
   ``[0, 1]``; ``do_normalize`` is off in Gemma 4's settings (mean 0, std 1);
3. cut into ``patch_size`` squares, row by row, each row the patch's pixels (pixel row,
   pixel column, channel), with each patch's ``(x, y)`` = (column, row) in the patch grid;
   padded to ``max_patches`` rows with zero pixels and ``(-1, -1)`` positions.

That is what ``Gemma4Vision(pixel_values, position_ids)`` takes (one image's arrays, or
several stacked), and the image fills ``(h / k) * (w / k)`` soft tokens (``h x w`` patches,
``k = pooling_kernel_size``; at most ``max_soft_tokens``, 280 by default): the prompt holds
``<|image>`` (``boi_token_id`` 255999), that many ``<|image|>`` (``image_token_id`` 258880)
and ``<image|>`` (``eoi_token_id`` 258882), as ``Gemma4Processor.replace_image_token``
expands one image. (The processor's ``image_seq_length``, 280, is not what it inserts: the
count is each image's own.)

The settings come from the model folder's ``processor_config.json`` (its ``image_processor``
object, which transformers prefers) or ``preprocessor_config.json``, read by
:func:`read_processor_config`. A key the file leaves out takes the processor class's
default, and a folder with neither file Gemma 4's published settings: both are
:data:`GEMMA4_DEFAULTS` (patch 16, 280 soft tokens, 3 x 3 pooling, bicubic, rescale 1/255,
no normalisation; google/gemma-4-*'s ``processor_config.json`` holds these). A key set to
``null`` is read as transformers 5.24 reads it (``from_pretrained`` keeps the ``None``, not
the class default): a ``do_*`` flag is off, ``resample`` is bilinear (the default of
transformers' ``resize``); a null ``patch_size``, ``max_soft_tokens`` or
``pooling_kernel_size``, ``rescale_factor`` with ``do_rescale``, or ``image_mean`` /
``image_std`` with ``do_normalize`` is refused (transformers fails on them).
``do_convert_rgb`` is not read: the decoded pixels are already RGB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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

#: the soft token budgets transformers accepts (``_SUPPORTED_SOFT_TOKENS``)
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
#: ``Gemma4ImageProcessorPil``'s class defaults, which the released checkpoints' processor
#: configs repeat: for keys a config file leaves out and for a folder without one
GEMMA4_DEFAULTS: dict[str, Any] = {
    "patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
    "rescale_factor": 1 / 255, "resample": 3,  # PIL.Image.Resampling.BICUBIC
    "do_resize": True, "do_rescale": True, "do_normalize": False,
}
#: config.json's defaults (transformers' ``Gemma4Config``) for the image's marker tokens
BOI_TOKEN_ID = 255999  # <|image>
IMAGE_TOKEN_ID = 258880  # <|image|>, one per soft token
EOI_TOKEN_ID = 258882  # <image|>
#: transformers' ``PILImageResampling`` values (Pillow's) -> Pillow's filter names
#: the most pixels the patch budget may cover, ``max_patches * patch_size ** 2`` (the core's
#: cap on a resized image: 8192 x 8192)
MAX_BUDGET_PIXELS = 64 * 1024 * 1024
#: the most bytes read of a processor config file


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The settings of transformers' ``Gemma4ImageProcessorPil`` that shape the patches (the
    class's defaults, Gemma 4's; :meth:`from_dict` reads a config file's)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    rescale_factor: float = 1 / 255
    resample: str = "bicubic"
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = False

    @property
    def max_patches(self) -> int:
        """The rows every image is padded to: ``max_soft_tokens * pooling_kernel_size ** 2``."""
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    @property
    def side_multiple(self) -> int:
        """What both resized sides are a multiple of: ``pooling_kernel_size * patch_size``."""
        return self.pooling_kernel_size * self.patch_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None,
                  where: str = "preprocessor_config.json") -> ImageProcessorConfig:
        """A config file's settings (``None``: no file, Gemma 4's published settings), each
        missing key the class default and ``null`` read as transformers reads it (see the
        module's notes); a bad value is one ModelFolderError line naming the key."""
        if config is None:
            config = GEMMA4_DEFAULTS
        if not isinstance(config, Mapping):
            raise ModelFolderError(f"{where}: expected a JSON object")

        def get(key: str) -> Any:
            return config.get(key) if key in config else GEMMA4_DEFAULTS[key]

        def integer(key: str, high: int) -> int:
            value = get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ModelFolderError(f"{where}: {key} must be an integer from 1 to {high}, "
                                       f"got {value!r:.40}")
            return value

        def flag(key: str) -> bool:
            value = get(key)
            if value is None:  # transformers tests the flag's truth
                return False
            if not isinstance(value, bool):
                raise ModelFolderError(f"{where}: {key} must be true or false, got "
                                       f"{value!r:.40}")
            return value

        soft = get("max_soft_tokens")
        if isinstance(soft, bool) or not isinstance(soft, int) or \
                soft not in SUPPORTED_SOFT_TOKENS:
            raise ModelFolderError(f"{where}: max_soft_tokens must be one of "
                                   f"{', '.join(map(str, SUPPORTED_SOFT_TOKENS))} (as "
                                   f"transformers accepts), got {soft!r:.40}")
        do_rescale, do_normalize = flag("do_rescale"), flag("do_normalize")
        # null as transformers reads it: resize's bilinear, and unused values' defaults
        resample = get("resample")
        rescale, mean, std = get("rescale_factor"), get("image_mean"), get("image_std")
        if rescale is None and not do_rescale:
            rescale = GEMMA4_DEFAULTS["rescale_factor"]
        if not do_normalize:
            mean = GEMMA4_DEFAULTS["image_mean"] if mean is None else mean
            std = GEMMA4_DEFAULTS["image_std"] if std is None else std
        filter_name, rescale, mean, std = pixel_settings(
            2 if resample is None else resample, rescale, mean, std, where)
        cfg = cls(patch_size=integer("patch_size", 1024), max_soft_tokens=soft,
                  pooling_kernel_size=integer("pooling_kernel_size", 64),
                  image_mean=mean, image_std=std,
                  rescale_factor=rescale, resample=filter_name,
                  do_resize=flag("do_resize"), do_rescale=do_rescale,
                  do_normalize=do_normalize)
        budget = cfg.max_patches * cfg.patch_size ** 2
        if budget > MAX_BUDGET_PIXELS:
            raise ModelFolderError(f"{where}: max_soft_tokens x (pooling_kernel_size x "
                                   f"patch_size)^2 is {budget} pixels, more than the limit "
                                   f"of {MAX_BUDGET_PIXELS}")
        return cfg


def _config(processor_config: Mapping[str, Any] | ImageProcessorConfig | None
            ) -> ImageProcessorConfig:
    return processor_config if isinstance(processor_config, ImageProcessorConfig) \
        else ImageProcessorConfig.from_dict(processor_config)


def aspect_ratio_size(height: int, width: int, patch_size: int, max_patches: int,
                      pooling_kernel_size: int) -> tuple[int, int]:
    """transformers' ``get_aspect_ratio_preserving_size``: ``(height, width)`` scaled by
    ``sqrt(max_patches * patch_size ** 2 / (height * width))``, each side floored to a
    multiple of ``m = pooling_kernel_size * patch_size``; a side floored to 0 becomes ``m``
    and the other ``floor(long / short) * m``, at most ``max_patches / k ** 2`` multiples.
    A size it refuses (more than ``max_patches`` patches, which float rounding could give)
    is one MediaError line."""
    if height < 1 or width < 1:
        raise MediaError(f"image {width}x{height}: an empty image")
    target_px = max_patches * patch_size ** 2
    factor = math.sqrt(target_px / (height * width))
    multiple = pooling_kernel_size * patch_size
    target_height = math.floor(factor * height / multiple) * multiple
    target_width = math.floor(factor * width / multiple) * multiple
    if target_height == 0 and target_width == 0:  # pragma: no cover - needs area < 1 multiple
        raise MediaError(f"image {width}x{height}: resizes to 0x0")
    longest = (max_patches // pooling_kernel_size ** 2) * multiple
    if target_height == 0:
        target_height = multiple
        target_width = min(math.floor(width / height) * multiple, longest)
    elif target_width == 0:
        target_width = multiple
        target_height = min(math.floor(height / width) * multiple, longest)
    if target_height * target_width > target_px:
        raise MediaError(f"image {width}x{height}: resizing to {target_width}x{target_height} "
                         f"exceeds {max_patches} patches of {patch_size}")
    return target_height, target_width


def image_inputs(rgb: np.ndarray,
                 processor_config: Mapping[str, Any] | ImageProcessorConfig | None
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """One image's vision-tower input, as transformers' processor gives its row of the
    batch: ``(pixel_values, position_ids, soft_tokens)``, ``pixel_values`` float32
    ``[max_patches, 3 * P * P]`` (real patches row by row, then zero rows), ``position_ids``
    int64 ``[max_patches, 2]`` (each patch's ``(x, y)``, padding ``(-1, -1)``) and the number
    of soft tokens (``<|image|>`` placeholders) the image fills. ``rgb``: ``[H, W, 3]``
    uint8; ``processor_config``: a folder's settings (:func:`read_processor_config`;
    ``None`` for Gemma 4's published ones). Stack several images' arrays for one batch."""
    cfg = _config(processor_config)
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"image_inputs takes [H, W, 3] uint8 pixels, got {rgb.dtype} "
                         f"{list(rgb.shape)}")
    height, width = rgb.shape[:2]
    image: np.ndarray = rgb
    if cfg.do_resize:
        size = aspect_ratio_size(height, width, cfg.patch_size, cfg.max_patches,
                                 cfg.pooling_kernel_size)
        if size != (height, width):
            image = resize_image(rgb, size, cfg.resample)
    elif height % cfg.side_multiple or width % cfg.side_multiple:
        raise MediaError(f"image {width}x{height}: do_resize is off and its sides are not "
                         f"multiples of {cfg.side_multiple} (pooling_kernel_size x "
                         "patch_size)")
    image = rescale_normalize(image, cfg.rescale_factor if cfg.do_rescale else None,
                              cfg.image_mean if cfg.do_normalize else None, cfg.image_std)
    patches, positions = patchify(image, cfg.patch_size)
    soft_tokens = len(patches) // cfg.pooling_kernel_size ** 2
    pad = cfg.max_patches - len(patches)
    if pad > 0:  # transformers pads up to max_patches (never cuts: do_resize off may exceed)
        patches = np.concatenate([patches, np.zeros((pad, patches.shape[1]), np.float32)])
        positions = np.concatenate([positions, np.full((pad, 2), -1, np.int64)])
    return patches, positions, soft_tokens


def patchify(image: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``image [H, W, C]`` (sides multiples of ``patch_size``) to its patch rows, row by row,
    each the patch's ``[P, P, C]`` pixels flattened, and their ``(x, y)`` positions
    (int64 ``[patches, 2]``)."""
    height, width, channels = image.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"patchify: {height}x{width} is not a multiple of {p}")
    grid_h, grid_w = height // p, width // p
    # [H, W, C] -> (patch row, pixel row, patch col, pixel col, C) -> patch-major
    blocks = image.reshape(grid_h, p, grid_w, p, channels).transpose(0, 2, 1, 3, 4)
    patches = np.ascontiguousarray(blocks.reshape(grid_h * grid_w, p * p * channels))
    ys, xs = np.divmod(np.arange(grid_h * grid_w, dtype=np.int64), grid_w)
    return patches, np.stack([xs, ys], axis=1)


def placeholder_count(height: int, width: int,
                      processor_config: Mapping[str, Any] | ImageProcessorConfig | None
                      ) -> int:
    """How many soft tokens (``<|image|>`` placeholders) an image of ``height x width``
    pixels fills, without its pixels (``Gemma4Processor._get_num_multimodal_tokens``): the
    resized grid's ``(h / k) * (w / k)``; :func:`image_inputs` gives the same count."""
    cfg = _config(processor_config)
    if cfg.do_resize:
        height, width = aspect_ratio_size(height, width, cfg.patch_size, cfg.max_patches,
                                          cfg.pooling_kernel_size)
    elif height < 1 or width < 1 or height % cfg.side_multiple or width % cfg.side_multiple:
        raise MediaError(f"image {width}x{height}: do_resize is off and its sides are not "
                         f"positive multiples of {cfg.side_multiple}")
    return (height // cfg.patch_size) * (width // cfg.patch_size) \
        // cfg.pooling_kernel_size ** 2


def placeholder_ids(soft_tokens: int, model_config: Mapping[str, Any] | None = None
                    ) -> list[int]:
    """The token ids one image stands for in a prompt, as ``Gemma4Processor`` expands it:
    ``boi_token_id``, ``soft_tokens`` x ``image_token_id``, ``eoi_token_id`` (config.json's
    ids, Gemma 4's where ``model_config`` is None or lacks them)."""
    if isinstance(soft_tokens, bool) or not isinstance(soft_tokens, (int, np.integer)) or \
            soft_tokens < 1:
        raise ValueError(f"soft_tokens must be a positive integer, got {soft_tokens!r:.40}")
    config = model_config or {}
    ids = []
    for key, default in (("boi_token_id", BOI_TOKEN_ID), ("image_token_id", IMAGE_TOKEN_ID),
                         ("eoi_token_id", EOI_TOKEN_ID)):
        value = config.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelFolderError(f"config.json: {key} must be a token id, got "
                                   f"{value!r:.40}")
        ids.append(value)
    boi, image, eoi = ids
    return [boi, *[image] * int(soft_tokens), eoi]
