"""Shared fixtures of the Qwen3.5 plugin tests: the committed checkpoints and a loader.

Test modules reach these through pytest fixtures only: with ``--import-mode=importlib``
another ``conftest`` (the repository's tests/) may own that module name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _core_loader() -> Callable[..., Any] | None:
    try:
        from mlxrunner import load_model
    except ImportError:  # a core without a loader
        return None
    return load_model


def load_folder(folder: Path, dtype: mx.Dtype | None = None) -> Any:
    """Load a model folder: through ``mlxrunner.load_model`` once the core has it, else the
    same steps by hand (text_config unwrap, sanitize, quantize by ``.scales``, strict load)."""
    load_model = _core_loader()
    if load_model is not None:
        return load_model(folder, dtype=dtype)
    from mlxrunner_qwen3_5 import Qwen3_5

    config = json.loads((folder / "config.json").read_text())
    text = dict(config.get("text_config", config))
    for key, value in config.items():
        if key != "text_config":
            text.setdefault(key, value)
    model = Qwen3_5(text)
    weights: dict[str, mx.array] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    weights = model.sanitize(weights)
    quant = config.get("quantization")
    if quant:
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(name="load_folder", scope="session")
def load_folder_fixture() -> Callable[..., Any]:
    """The loader above, for test modules (they cannot import this conftest by name)."""
    return load_folder


@pytest.fixture(scope="session")
def reference() -> Callable[[str], dict[str, np.ndarray]]:
    cache: dict[str, dict[str, np.ndarray]] = {}

    def get(name: str) -> dict[str, np.ndarray]:
        if name not in cache:
            with np.load(FIXTURES / name / "reference.npz") as data:
                cache[name] = dict(data)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def fixture_model() -> Callable[..., Any]:
    """``fixture_model(name, dtype=None)``: the committed checkpoint, loaded once per dtype."""
    cache: dict[tuple[str, Any], Any] = {}

    def get(name: str, dtype: mx.Dtype | None = None) -> Any:
        key = (name, dtype)
        if key not in cache:
            cache[key] = load_folder(FIXTURES / name, dtype)
        return cache[key]

    return get
