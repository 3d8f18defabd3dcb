"""Greedy exactness on tiny Gemma 4 targets (sliding rings, KV-shared layers, full
attention): speculative greedy equals plain greedy over 200 tokens with random DFlash and
DFlash2 drafts and a scripted draft, with rings that never wrap (window 512 > prompt + 200;
the wrapped case is test_spec_greedy_gemma4.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

mx.set_default_device(mx.cpu)

pytest.importorskip("mlxrunner_gemma4", reason="the Gemma 4 plugin is not installed")
pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")

import mlxrunner  # noqa: E402
from mlxrunner.testing.speculative import check_speculative_greedy  # noqa: E402

WINDOW = 512
FIXTURE = Path(__file__).resolve().parent.parent / "architectures" / "gemma4" / "tests" / \
    "fixtures" / "e2b"


def _with_window(tmp_path: Path, window: int) -> Path:
    if not (FIXTURE / "config.json").exists():
        pytest.skip(f"no tiny Gemma 4 checkpoint at {FIXTURE}")
    folder = tmp_path / f"gemma4-window-{window}"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    (config.get("text_config") or config)["sliding_window"] = window
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gemma4_speculative_greedy_equals_plain_with_rings_that_never_wrap(tmp_path):
    model = mlxrunner.load_model(_with_window(tmp_path, WINDOW), dtype="float32")
    caches = model.make_cache()
    assert any(type(c).__name__ == "RingCache" for c in caches)
    assert any(c is None for c in caches)  # KV-shared layers keep no cache
    stats = check_speculative_greedy(model, max_tokens=200, prompts=2, prompt_len=8, seed=3)
    assert all(s.generated_tokens == 200 for s in stats)
