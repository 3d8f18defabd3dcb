"""DFlash and DFlash2 block-diffusion drafts for mlxrunner (registered by ``plugin``)."""

from .dflash import DFlashArgs, DFlashDraftModel, DFlashSession
from .dflash2 import DFlash2DraftModel, DFlash2Session, block_convolve

__all__ = ["DFlashArgs", "DFlashDraftModel", "DFlashSession", "DFlash2DraftModel",
           "DFlash2Session", "block_convolve"]
