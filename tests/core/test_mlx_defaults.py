"""mlxrunner sets MLX's float32 precision (and, on Linux, CUDA graph batching) at import,
before MLX reads them, and leaves values the user set alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SHOW = ("import json, os, mlx.core, mlxrunner; "
        "print(json.dumps({k: os.environ.get(k) for k in "
        "('MLX_ENABLE_TF32', 'MLX_MAX_OPS_PER_BUFFER')}))")


def _environment_after_import(**overrides: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLX_ENABLE_TF32", "MLX_MAX_OPS_PER_BUFFER")}
    env.update(overrides)
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_import_sets_full_float32_and_graph_batching() -> None:
    got = _environment_after_import()
    assert got["MLX_ENABLE_TF32"] == "0"
    if sys.platform.startswith("linux"):
        assert got["MLX_MAX_OPS_PER_BUFFER"] == "200"


def test_values_the_user_set_win() -> None:
    got = _environment_after_import(MLX_ENABLE_TF32="1", MLX_MAX_OPS_PER_BUFFER="20")
    assert got == {"MLX_ENABLE_TF32": "1", "MLX_MAX_OPS_PER_BUFFER": "20"}


def test_float32_products_are_full_precision_after_import() -> None:
    """Where MLX would use TF32 (CUDA), the product now matches float64 to float32 rounding;
    elsewhere it already does."""
    code = ("import mlx.core as mx, mlxrunner, numpy as np; "
            "a = mx.random.normal((128, 256), key=mx.random.key(0)); "
            "b = mx.random.normal((256, 64), key=mx.random.key(1)); "
            "ref = np.array(a).astype(np.float64) @ np.array(b).astype(np.float64); "
            "print(float(np.abs(np.array(a @ b) - ref).max() / np.abs(ref).max()))")
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert float(out.stdout) < 1e-5
