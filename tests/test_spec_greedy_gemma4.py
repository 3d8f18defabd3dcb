"""Greedy exactness on tiny Gemma 4 targets (sliding rings, KV-shared layers, full
attention): speculative greedy equals plain greedy over 200 tokens with random DFlash and
DFlash2 drafts and a scripted draft, with rings that wrap (window 8) and rings that never
wrap (window 512 > prompt + 200)."""

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


@pytest.mark.parametrize(("window", "prompts", "prompt_len", "seed"), [
    # prompts longer than the window: rings have wrapped before the first round
    pytest.param(8, 3, 12, 2, id="rings-wrap"),
    pytest.param(512, 2, 8, 3, id="rings-never-wrap"),
])
def test_gemma4_speculative_greedy_equals_plain(tmp_path, window, prompts, prompt_len, seed):
    model = mlxrunner.load_model(_with_window(tmp_path, window), dtype="float32")
    caches = model.make_cache()
    assert any(type(c).__name__ == "RingCache" for c in caches)
    assert any(c is None for c in caches)  # KV-shared layers keep no cache
    stats = check_speculative_greedy(model, max_tokens=200, prompts=prompts,
                                     prompt_len=prompt_len, seed=seed)
    assert all(s.generated_tokens == 200 for s in stats)
