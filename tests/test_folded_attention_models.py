"""mlxrunner.nn.attend's CUDA paths inside the architectures' traced forwards and a draft's
traced block, run here on the CPU by declaring the default device CUDA-like for attention
only, against the eager forwards with MLX's function: the folded form, and the fused
kernel's dispatch (checked before tracing, then launched; MLX's operations stand in for
the kernel, whose arithmetic tests/core/test_attention.py checks under emulation)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner.nn import attention, kernels
from mlxrunner_test_support import logged

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


def _spy_on(monkeypatch, path: str) -> list:
    """Calls to ``attention.<path>`` (``folded_attention`` or the kernel's ``_launch``,
    MLX's operations standing in for the latter), recorded; attend sees CUDA."""
    calls = []
    real = attention.folded_attention

    def spy(q, keys, values, *args, **kwargs):
        calls.append(q.shape)
        if path == "_launch":  # (the kernel's contract: its output gate included)
            scale, mask = args[:2]
            out = real(q, keys, values, scale=scale, mask=mask)
            gate = kwargs.get("gate")
            return out if gate is None else out * mx.sigmoid(gate)
        return real(q, keys, values, *args, **kwargs)

    monkeypatch.setattr(attention, path, spy)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    monkeypatch.setattr(kernels, "_verdicts", {})
    return calls


@pytest.mark.parametrize("path", ["folded_attention", "_launch"])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_traced_forwards_with_cuda_attention(name, path, monkeypatch, caplog):
    if not FIXTURES[name].is_dir():
        pytest.skip(f"fixture {FIXTURES[name]} not present")
    mx.set_default_device(mx.cpu)
    model = mlxrunner.load_model(str(FIXTURES[name]))
    ids = np.random.default_rng(1).integers(0, model.vocab_size, (1, 24)).astype(np.int32)
    want = _forwards(model, ids, traced=False)
    calls = _spy_on(monkeypatch, path)
    got = _forwards(model, ids, traced=True)
    assert calls, f"attention.{path} did not run"
    assert "disagrees" not in logged(caplog)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["folded_attention", "_launch"])
def test_draft_blocks_with_cuda_attention(path, monkeypatch):
    """Greedy speculative decoding with DFlash drafts whose traced blocks attend through
    the CUDA paths gives the target's own greedy tokens."""
    pytest.importorskip("mlxrunner_dflash")
    from mlxrunner.testing import check_speculative_greedy

    mx.set_default_device(mx.cpu)
    target = mlxrunner.load_model(str(FIXTURES["qwen3_5"]))
    calls = _spy_on(monkeypatch, path)
    stats = check_speculative_greedy(target, max_tokens=60)
    assert calls and {s.draft for s in stats} >= {"DFlashDraftModel", "DFlash2DraftModel"}
