"""Drafts a target's own checkpoint carries (Qwen3.5's MTP head): found, built and loaded
from the model folder's weights, with no draft folder or draft config.

An architecture declares one with class attributes:

- on the target class, ``checkpoint_draft``: the name of a registered draft architecture
  (``register_drafts``) that its checkpoints may carry;
- on that draft class, ``checkpoint_prefixes``: the tensor-name prefixes its weights have in
  the target's files, and ``checkpoint_kind``: the short name ``show`` and ``run --stats``
  give it (``mtp``).

The draft is built as ``cls(config, target)`` from the target's own config.json (its text
part) through the draft's ``config_for_checkpoint`` (which derives the draft's settings
from it) and ``validate``; its tensors reach its ``sanitize`` under their stored names.
A folder without tensors under those prefixes has no checkpoint draft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import ModelFolderError
from ..host import manager as plugins
from .draft import DraftModel, build_draft
from .interface import Model
from .loading import (
    declared_dtype,
    install_weights,
    read_config,
    read_weights,
    text_config,
    weight_files,
)
from .safetensors import check_safetensors


def checkpoint_draft_class(target: Model) -> type[DraftModel] | None:
    """The draft class ``target``'s checkpoints may carry, or None."""
    name = type(target).checkpoint_draft
    if not name:
        return None
    cls: type[DraftModel] = plugins.lookup("drafts", str(name)).obj
    return cls


def load_checkpoint_draft(folder: str | Path, target: Model,
                          dtype: str | mx.Dtype | None = None) -> DraftModel | None:
    """The draft built from ``folder``'s own weights for ``target``, or None when the
    architecture declares none or the folder's files hold none of its tensors.

    Computed in ``dtype`` if given, else in the dtype config.json declares (as the target
    is). Errors: :class:`~mlxrunner.errors.DraftConfigError` when the draft does not fit,
    :class:`~mlxrunner.errors.ModelFolderError` for missing or misshapen tensors.
    """
    cls = checkpoint_draft_class(target)
    if cls is None:
        return None
    prefixes = tuple(getattr(cls, "checkpoint_prefixes", ()))
    if not prefixes:
        return None
    where = Path(folder).expanduser()
    try:
        files = weight_files(where)
    except ModelFolderError:  # weights not in safetensors (a GGUF file's folder)
        return None
    holding = [f for f in files if any(n.startswith(prefixes) for n in check_safetensors(f))]
    if not holding:
        return None
    full_config = read_config(where)
    config = text_config(full_config)
    weights = {k: v for k, v in read_weights(holding).items() if k.startswith(prefixes)}
    draft = build_draft(cls, config, target, weights.keys())
    kind = getattr(cls, "checkpoint_kind", cls.__name__)
    install_weights(draft, config, weights, where,
                    dtype if dtype is not None else declared_dtype(full_config),
                    what=f"{kind} draft")
    return draft


def describe_checkpoint_draft(draft: Any) -> str | None:
    """``mtp (built into the checkpoint)`` for a checkpoint's own draft, else None."""
    kind = getattr(type(draft), "checkpoint_kind", None) if draft is not None else None
    return f"{kind} (built into the checkpoint)" if kind else None
