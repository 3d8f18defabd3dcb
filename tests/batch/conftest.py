"""Tiny float32 models for the batching tests: Qwen3.5 (Gated DeltaNet + attention), Gemma 4
(sliding rings of window 8, KV shared across layers), the example architecture, and a model
written in plain mlx.nn (``mx.fast.scaled_dot_product_attention`` with "causal"/None, a
ring's own mask)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

import mlxrunner
from mlxrunner.plugin import Model
from plain_mlx_model import PlainModel

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "qwen3_5": ROOT / "architectures" / "qwen3_5" / "tests" / "fixtures" / "tiny_hk2_hv4_tied",
    "gemma4": ROOT / "architectures" / "gemma4" / "tests" / "fixtures" / "e2b",
    "example": ROOT / "plugins" / "example-architecture" / "tests" / "fixtures" /
    "tiny-example-llama",
}
PLUGINS = {"qwen3_5": "mlxrunner_qwen3_5", "gemma4": "mlxrunner_gemma4",
           "example": "mlxrunner_example_architecture"}
_loaded: dict[str, Model] = {}


NAMES = ["qwen3_5", "gemma4", "example", "plain"]


def tiny_model(name: str) -> Model:
    if name not in _loaded:
        if name == "plain":
            mx.random.seed(0)
            model: Model = PlainModel(window=5)
            mx.eval(model.parameters())
        else:
            pytest.importorskip(PLUGINS[name], reason=f"the {name} plugin is not installed")
            if not (FOLDERS[name] / "config.json").exists():
                pytest.skip(f"no tiny {name} checkpoint at {FOLDERS[name]}")
            model = mlxrunner.load_model(FOLDERS[name], dtype="float32")
        _loaded[name] = model
    return _loaded[name]


@pytest.fixture(params=NAMES)
def model(request) -> Model:
    mx.set_default_device(mx.cpu)
    return tiny_model(request.param)


@pytest.fixture
def tiny():
    """``tiny(name)``: one of the models above by name."""
    mx.set_default_device(mx.cpu)
    return tiny_model
