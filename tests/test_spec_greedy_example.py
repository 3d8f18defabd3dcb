"""Greedy exactness on the example architecture (full-attention KV caches): speculative greedy
equals plain greedy over 200 tokens, with random DFlash and DFlash2 drafts and a scripted draft
that runs every rollback length."""

from __future__ import annotations

import mlx.core as mx
import pytest

mx.set_default_device(mx.cpu)

pytest.importorskip("mlxrunner_example_architecture",
                    reason="the example-architecture plugin is not installed")
pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")

from mlxrunner import host as plugins  # noqa: E402
from mlxrunner.testing.speculative import (  # noqa: E402
    check_speculative_greedy,
    randomize,
)

CONFIG = {
    "architectures": ["ExampleLlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 96,
    "tie_word_embeddings": False,
}


def test_example_architecture_speculative_greedy_equals_plain():
    model = plugins.architecture_for(CONFIG)(CONFIG)
    randomize(model, seed=1)
    model.eval()
    stats = check_speculative_greedy(model, max_tokens=200, prompts=3, prompt_len=8, seed=0)
    assert len(stats) == 6  # 3 prompts x (DFlash or DFlash2 in turn, scripted)
    assert {s.draft for s in stats} == {"DFlashDraftModel", "DFlash2DraftModel", "ScriptedDraft"}
    assert all(s.generated_tokens == 200 for s in stats)
    # most random drafts are rejected; the scripted draft accepts a share of every length
    assert sum(s.drafted for s in stats) > 1000
    assert any(s.accepted > 0 for s in stats)
