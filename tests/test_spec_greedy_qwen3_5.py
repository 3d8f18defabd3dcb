"""Greedy exactness on a tiny Qwen3.5 target (Gated DeltaNet recurrent state + full
attention): speculative greedy equals plain greedy over 200 tokens, with random DFlash and
DFlash2 drafts and a scripted draft that runs every rollback length."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

mx.set_default_device(mx.cpu)

pytest.importorskip("mlxrunner_qwen3_5", reason="the Qwen3.5 plugin is not installed")
pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")

import mlxrunner  # noqa: E402
from mlxrunner.testing.speculative import check_speculative_greedy  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "architectures" / "qwen3_5" / "tests" / \
    "fixtures"


def test_qwen3_5_speculative_greedy_equals_plain_with_recurrent_rollback():
    folders = sorted(p for p in FIXTURES.glob("*") if (p / "config.json").exists())
    if not folders:
        pytest.skip(f"no tiny Qwen3.5 checkpoint under {FIXTURES}")
    model = mlxrunner.load_model(folders[0], dtype="float32")
    kinds = {type(c).__name__ for c in model.make_cache() if c is not None}
    assert "RecurrentCache" in kinds, kinds
    stats = check_speculative_greedy(model, max_tokens=200, prompts=3, prompt_len=8, seed=1)
    assert all(s.generated_tokens == 200 for s in stats)
