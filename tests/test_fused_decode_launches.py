"""What a decode step of Gemma 4 and Qwen3.5 launches on CUDA, counted on the CPU: the core's
fused kernels forced on, each launch stood in for by the MLX operations it replaces (the
kernels' own math is checked in the CUDA emulation and on the GPU; here, which launches a
step makes). A launch a model stops making shows here before a GPU run counts it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner.nn import attention, cuda_norms, cuda_products
from mlxrunner.nn import heads as heads_module


@pytest.fixture
def launches(monkeypatch) -> Counter:
    """The fused kernels' launches, by kind, while the fused paths are forced on."""
    counts: Counter = Counter()

    def product(x, w, res, glu, up=None, post=None):
        counts["product with post norm" if post is not None else "product"] += 1
        return cuda_products._reference(x, w, res, glu, up, post)

    def heads(parts, rot, offset, D, starts):
        counts["heads"] += 1
        counts["head parts"] += len(parts)
        return cuda_norms._reference_heads(parts, rot, offset, D, starts)

    def add_norm(residual, x, weight, eps, scale):
        counts["add norm"] += 1
        return cuda_norms._reference_add_norm(residual, x, weight, eps, scale)

    def attend(q, keys, values, scale, mask, splits=None, gate=None):
        counts["attend with gate" if gate is not None else "attend"] += 1
        out = attention.folded_attention(q, keys, values, scale=scale, mask=mask)
        return out if gate is None else out * mx.sigmoid(gate)

    for module in (cuda_products, cuda_norms):
        monkeypatch.setattr(module, "kernel_allowed", lambda name: True)
        monkeypatch.setattr(module, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(attention, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    monkeypatch.setattr(heads_module, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_products, "_launch", product)
    monkeypatch.setattr(cuda_norms, "_launch_heads", heads)
    monkeypatch.setattr(cuda_norms, "_launch_add_norm", add_norm)
    monkeypatch.setattr(attention, "_launch", attend)
    return counts


def _one_step(model, launches: Counter) -> tuple[dict[str, int], mx.array, mx.array]:
    """The launches of one eager decode step after a 12-token prompt, its logits, and the
    same step's logits with nothing forced (the reference)."""
    ids = mx.array(np.random.default_rng(0).integers(3, 200, (1, 13)).astype(np.int32))
    cache = model.make_cache()
    mx.eval(model(ids[:, :12], cache))
    launches.clear()
    logits = model(ids[:, 12:], cache)
    mx.eval(logits)
    got = {k: v for k, v in launches.items() if v}
    return got, logits


def _gemma4():
    from mlxrunner_gemma4 import Gemma4Model

    config = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 5,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 16, "global_head_dim": 32, "vocab_size": 256,
              "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
              "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "sliding_window": 8,
              "layer_types": ["sliding_attention"] * 2 + ["full_attention"] +
                             ["sliding_attention", "full_attention"],
              "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True}
    mx.random.seed(1)
    return Gemma4Model(config)


def test_a_gemma4_decode_step_runs_its_post_norms_in_its_products(launches, monkeypatch):
    """Per layer one heads launch (q, k and v together where the layer writes keys) and one
    attention; each of the three post-norm residual adds in the launch of the product
    before it, none as a kernel of its own. The logits are the unforced step's."""
    mx.set_default_device(mx.cpu)
    model = _gemma4()
    got, logits = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    layers, writers = 5, 3
    assert got["product with post norm"] == 3 * layers, got
    assert "add norm" not in got, got
    assert got["heads"] == layers and got["head parts"] == 3 * writers + (layers - writers), got
    assert got["attend"] == layers, got
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=1e-5, atol=1e-5)


def test_a_qwen3_5_decode_step_gates_its_attention_in_the_kernels(launches, monkeypatch,
                                                                 shared_data_dir: Path):
    """The attention layer's query, key and output gate laid out by one heads launch, the
    gate applied by the attention launch."""
    from mlxrunner_qwen3_5 import Qwen3_5

    path = shared_data_dir / "configs" / "Qwen3.5-0.8B-Base.config.json"
    if not path.is_file():
        pytest.skip(f"shared config {path} not present")
    config = json.loads(path.read_text())
    text = dict(config.get("text_config", config))
    text.update(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                hidden_size=128, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                vocab_size=256)
    text.pop("full_attention_interval", None)
    mx.set_default_device(mx.cpu)
    mx.random.seed(2)
    model = Qwen3_5(text)
    got, logits = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    assert got["heads"] == 1 and got["head parts"] == 3, got
    assert got["attend with gate"] == 1 and "attend" not in got, got
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=1e-5, atol=1e-5)
