"""Fixtures for the cross-package tests."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxrunner_test_support import shared_data, write_model_folder


@pytest.fixture(autouse=True)
def _default_device_kept():
    """A test that sets MLX's default device (the GPU tests do) leaves the next one the device
    it started on (the test modules set theirs at import): the CPU-only assertions after it
    would otherwise see the GPU."""
    device = mx.default_device()
    yield
    mx.set_default_device(device)


@pytest.fixture
def shared_data_dir() -> Path:
    path = shared_data()
    if path is None:
        pytest.skip("shared data not found (set MLXRUNNER_SHARED_DATA or place ../shared/data)")
    return path


@pytest.fixture
def example_model_folder(tmp_path: Path) -> Path:
    pytest.importorskip("mlxrunner_example_architecture",
                        reason="the example-architecture plugin is not installed")
    return write_model_folder(tmp_path / "tiny")
