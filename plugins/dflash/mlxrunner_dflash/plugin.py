"""Hook implementations: registers the DFlash and DFlash2 draft architectures and the
``train-draft`` command."""

from __future__ import annotations

import argparse

from mlxrunner.plugin import hookimpl


@hookimpl
def register_drafts(register):
    from .dflash import DFlashDraftModel
    from .dflash2 import DFlash2DraftModel

    register("DFlashDraftModel", DFlashDraftModel)
    register("DFlash2DraftModel", DFlash2DraftModel)


def _train_draft(args: argparse.Namespace) -> int:
    # the trainer (numpy, optimizers) loads only when the command runs: every other
    # command's start-up builds this one's parser too
    from .train import run

    return run(args)


@hookimpl
def register_commands(cli):
    from .train_options import HELP, add_arguments

    cli.command("train-draft", HELP, add_arguments, _train_draft)
