"""DFlash and DFlash2 block-diffusion drafts for mlxrunner (registered by ``plugin``)."""

from .dflash import DFlashArgs, DFlashDraftModel
from .dflash2 import DFlash2DraftModel, block_convolve

__all__ = ["DFlashArgs", "DFlashDraftModel", "DFlash2DraftModel", "block_convolve"]
