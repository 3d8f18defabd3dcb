"""Hook implementations: registers the DFlash and DFlash2 draft architectures."""

from __future__ import annotations

import mlxrunner


@mlxrunner.hookimpl
def register_drafts(register):
    from .dflash import DFlashDraftModel
    from .dflash2 import DFlash2DraftModel

    register("DFlashDraftModel", DFlashDraftModel)
    register("DFlash2DraftModel", DFlash2DraftModel)


@mlxrunner.hookimpl
def register_commands(cli):
    # The trainer module is imported when the CLI builds its parser; it pulls in nothing
    # heavier than this package itself.
    from . import train

    cli.command("train-draft", train.HELP, train.add_arguments, train.run)
