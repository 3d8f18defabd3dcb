"""The folded attention (mlxrunner.attend on CUDA) inside the architectures' traced
forwards and a draft's traced block: run here on the CPU by declaring the default
device CUDA-like for attention only, against the eager forwards with MLX's function."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner import attention

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = {
    "qwen3_5": ROOT / "architectures/qwen3_5/tests/fixtures/tiny_hk2_hv4_tied",
    "gemma4-dense": ROOT / "architectures/gemma4/tests/fixtures/dense",
    "gemma4-e2b": ROOT / "architectures/gemma4/tests/fixtures/e2b",
}


def _forwards(model, ids: np.ndarray, traced: bool) -> list[mx.array]:
    for flag in ("compile_steps", "compile_decode"):
        if hasattr(model, flag):
            setattr(model, flag, traced)
    cache = model.make_cache()
    outs = [model(mx.array(ids[:, :12]), cache)]
    for start, stop in ((12, 13), (13, 14), (14, 19), (19, 20)):
        outs.append(model(mx.array(ids[:, start:stop]), cache))
    mx.eval(outs)
    return outs


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_traced_forwards_with_folded_attention(name, monkeypatch, capsys):
    if not FIXTURES[name].is_dir():
        pytest.skip(f"fixture {FIXTURES[name]} not present")
    mx.set_default_device(mx.cpu)
    model = mlxrunner.load_model(str(FIXTURES[name]))
    ids = np.random.default_rng(1).integers(0, model.vocab_size, (1, 24)).astype(np.int32)
    want = _forwards(model, ids, traced=False)
    calls = []
    real = attention.folded_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "folded_attention", spy)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    got = _forwards(model, ids, traced=True)
    assert calls, "the folded attention did not run"
    assert "disagrees" not in capsys.readouterr().err
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def test_draft_blocks_with_folded_attention(monkeypatch):
    """Greedy speculative decoding with a DFlash draft whose traced block attends through
    the folded path gives the target's own greedy tokens."""
    pytest.importorskip("mlxrunner_dflash")
    from mlxrunner.testing import check_speculative_greedy

    mx.set_default_device(mx.cpu)
    target = mlxrunner.load_model(str(FIXTURES["qwen3_5"]))
    calls = []
    real = attention.folded_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "folded_attention", spy)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    stats = check_speculative_greedy(target, max_tokens=60)
    assert calls and {s.draft for s in stats} >= {"DFlashDraftModel", "DFlash2DraftModel"}
