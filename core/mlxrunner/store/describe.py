"""What ``list`` shows of an entry, read from its files when it is written: architecture,
and how the target's and the draft's weights are stored."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import MLXRunnerError
from ..model.modelfile import read_modelfile
from ..model.safetensors import FLOAT_DTYPES, stored_dtypes
from .sources import QUANTIZATIONS

_GGUF_TYPE = re.compile(r"[.-](Q\d+_[A-Z0-9_]+|Q\d+|IQ\d+_[A-Z0-9_]+|F16|BF16|F32)\.gguf$",
                        re.IGNORECASE)


def quantization_label(q: Any) -> str | None:
    """``q4``, ``q8``, ``mxfp4``, ``nvfp4`` (or ``q<bits>/g<group>``) for a config.json
    ``quantization`` object."""
    if not isinstance(q, dict) or "bits" not in q:
        return None
    mode, bits, group = q.get("mode", "affine"), q.get("bits"), q.get("group_size", 64)
    for label, spec in QUANTIZATIONS.items():
        if spec == (mode, bits, group):
            return label
    return f"{mode} {bits}-bit/g{group}" if mode != "affine" else f"q{bits}/g{group}"


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _float_precision(folder: Path, own: Any = lambda name: True) -> str | None:
    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        try:
            names |= {FLOAT_DTYPES[d] for n, d in stored_dtypes(f).items()
                      if d in FLOAT_DTYPES and own(n)}
        except MLXRunnerError:
            return None
    return "/".join(sorted(names)) or None


def _weights_file(folder: Path) -> Path | None:
    """The file a Modelfile's FROM names inside the folder (a GGUF file), if any."""
    try:
        modelfile = read_modelfile(folder / "Modelfile")
    except MLXRunnerError:
        return None
    target = modelfile.from_path
    if target is not None and target.is_file() and target.parent == folder.absolute():
        return target
    return None


def _gguf_architecture(path: Path) -> str | None:
    try:
        import mlx.core as mx

        loaded = mx.load(str(path), return_metadata=True)
    except Exception:  # not a GGUF file MLX reads: nothing to show
        return None
    metadata = loaded[1] if isinstance(loaded, tuple) else {}
    value = metadata.get("general.architecture") if isinstance(metadata, dict) else None
    return value if isinstance(value, str) else None


def precision_of(folder: Path, draft: bool = False) -> str | None:
    config = _config(folder)
    if config is not None:
        label = quantization_label(config.get("quantization")
                                   or config.get("quantization_config"))
        if label is not None:
            return label
        return _float_precision(folder, (lambda n: not n.startswith("draft.")) if not draft
                                else (lambda n: True))
    return None


def describe_folder(folder: Path) -> dict[str, Any]:
    """``architecture``, ``target_precision`` and ``draft_precision`` of a model folder."""
    config = _config(folder)
    architecture = None
    target = None
    if config is not None:
        archs = config.get("architectures")
        architecture = archs[0] if isinstance(archs, list) and archs else config.get("model_type")
        target = precision_of(folder)
    else:
        weights = _weights_file(folder)
        if weights is not None:
            match = _GGUF_TYPE.search(weights.name)
            target = f"gguf {match.group(1).upper()}" if match else "gguf"
            if weights.suffix.lower() == ".gguf":
                architecture = _gguf_architecture(weights)
    draft = precision_of(folder / "draft", draft=True) if (folder / "draft").is_dir() else None
    return {"architecture": architecture if isinstance(architecture, str) else None,
            "target_precision": target, "draft_precision": draft}
