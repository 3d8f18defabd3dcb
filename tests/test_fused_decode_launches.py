"""What a decode step of Gemma 4 and Qwen3.5 launches on CUDA, counted on the CPU: the core's
fused kernels forced on, each launch stood in for by the MLX operations it replaces (the
kernels' own math is checked in the CUDA emulation and on the GPU; here, which launches a
step makes). A launch a model stops making shows here before a GPU run counts it.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner import settings
from mlxrunner.nn import RMSNorm, attention, cuda_norms, cuda_products
from mlxrunner.nn import heads as heads_module
from mlxrunner_test_support import folded_masks_on_cuda, graph_labels, read_as_one


@pytest.fixture
def launches(monkeypatch) -> Counter:
    """The fused kernels' launches, by kind, while the fused paths are forced on."""
    counts: Counter = Counter()
    inside = []  # a stand-in running: its own norms are not the model's
    mlx_norm = mx.fast.rms_norm

    def rms_norm(*args, **kwargs):
        caller = sys._getframe(1).f_code
        if not inside and caller is RMSNorm.__call__.__code__:  # a norm layer's own
            counts["MLX norm"] += 1
        return mlx_norm(*args, **kwargs)

    @contextmanager
    def standing_in(kind: str) -> Iterator[None]:
        counts[kind] += 1
        inside.append(kind)
        try:
            yield
        finally:
            inside.pop()

    def run(links):
        # one mark a launch, every row it writes read through it (a launch a step reads
        # shows in its graph as one StopGradient)
        last = links[-1]
        kind = "links" if len(links) > 1 else "product with norm after" if last.then \
            else "product with post norm" if last.post else "product"
        counts["chained links"] += len(links) if len(links) > 1 else 0
        with standing_in(kind):
            return read_as_one(cuda_products._reference_links(links))

    def heads(parts, rot, offset, D, starts, positions, case):
        counts["head parts"] += len(parts)
        with standing_in("heads"):
            # (marked twice over: a heads output a step reads shows as two Negatives)
            return [mx.negative(mx.negative(x))
                    for x in cuda_norms._reference_heads(parts, rot, offset, D, starts)]

    def add_norm(residual, x, weight, eps, scale):
        with standing_in("add norm"):
            return cuda_norms._reference_add_norm(residual, x, weight, eps, scale)

    def attend(q, keys, values, scale, mask, splits=None, gate=None, heads=None):
        counts["attend with gate" if gate is not None else "attend"] += 1
        if heads is not None:  # the query's heads made by the attention launch
            counts["queries made by attend"] += 1
            part, rot, offsets, start = heads
            q = cuda_norms._reference_heads([part], rot, offsets, q.shape[3], [start])[0]
        out = attention.folded_attention(q, keys, values, scale=scale, mask=mask)
        return out if gate is None else out * mx.sigmoid(gate)

    counts.allowed = set(settings.KERNELS)  # type: ignore[attr-defined]
    for module in (cuda_products, cuda_norms):
        monkeypatch.setattr(module, "kernel_allowed", lambda name: name in counts.allowed)
        monkeypatch.setattr(module, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(attention, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    monkeypatch.setattr(heads_module, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_products, "_run", run)
    monkeypatch.setattr(mx.fast, "rms_norm", rms_norm)
    monkeypatch.setattr(cuda_norms, "_launch_heads", heads)
    monkeypatch.setattr(cuda_norms, "_launch_add_norm", add_norm)
    monkeypatch.setattr(attention, "_launch", attend)
    return counts


def _one_step(model, launches: Counter, taps: list[int] | None = None, traced: bool = True
              ) -> tuple[dict[str, int], mx.array]:
    """The launches of one decode step after a 12-token prompt (those its outputs read:
    ``launches read``) and its logits (with ``taps``: and the tapped streams); ``traced``:
    built as the core builds a step it traces for ``mx.compile`` (``compiling``), else as an
    eager step."""
    from mlxrunner.constants import compiling

    ids = mx.array(np.random.default_rng(0).integers(3, 200, (1, 13)).astype(np.int32))
    cache = model.make_cache()
    mx.eval(model(ids[:, :12], cache))
    launches.clear()
    with compiling() if traced else nullcontext():
        out = model(ids[:, 12:], cache) if taps is None else \
            mx.concatenate(model(ids[:, 12:], cache, taps=taps), axis=-1)
    got = {k: v for k, v in launches.items() if v}
    labels = graph_labels(out)
    got["launches read"] = labels.count("StopGradient")
    got["head outputs read"] = labels.count("Negative") // 2
    mx.eval(out)
    return got, out


_GEMMA4_CONFIG = {
    "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 5,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "global_head_dim": 128, "vocab_size": 256,
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
    "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 2 + ["full_attention"] +
                   ["sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
#: a small Qwen3.5 (over the 0.8B's shared config): three DeltaNet layers, then attention
_QWEN3_5_SMALL = {
    "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "vocab_size": 256}


def _gemma4(**changes):
    from mlxrunner_gemma4 import Gemma4Model

    mx.random.seed(1)
    return Gemma4Model({**_GEMMA4_CONFIG, **changes})


def _qwen3_5_text(shared_data_dir: Path, **changes) -> dict:
    path = shared_data_dir / "configs" / "Qwen3.5-0.8B-Base.config.json"
    if not path.is_file():
        pytest.skip(f"shared config {path} not present")
    config = json.loads(path.read_text())
    text = dict(config.get("text_config", config))
    text.update(_QWEN3_5_SMALL, **changes)
    text.pop("full_attention_interval", None)
    return text


def test_a_gemma4_decode_step_runs_its_post_norms_in_its_products(launches, monkeypatch):
    """Per layer one heads launch (q, k and v together where the layer writes keys) and one
    attention; each of the three post-norm residual adds in the launch of the product
    before it, none as a kernel of its own; each pre-norm after a layer's first (whose
    input is the embedding) and the final norm in the launch before it; every product
    after a layer's attention, the next layer's q(/k/v) and the head in one launch (a
    chain), which the step reads instead of the launches it replaced. The logits are the
    unforced step's, with chains and without."""
    mx.set_default_device(mx.cpu)
    model = _gemma4()
    got, logits = _one_step(model, launches)
    tapped, _ = _one_step(model, launches, taps=[0, 1, 2, 3, 4])
    eager, _ = _one_step(model, launches, traced=False)
    launches.allowed.discard("chains")
    unchained, unchained_logits = _one_step(model, launches)
    launches.allowed.add("chains")
    launches.allowed.discard("prenorms")
    without, _ = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    layers, writers = 5, 3
    assert "add norm" not in got, got
    assert got["heads"] == layers and got["head parts"] == 3 * writers + (layers - writers), got
    assert got["attend"] == layers, got
    # every query made by its attention launch from the raw heads: a layer that shares
    # another's keys reads no heads launch, one that writes keys reads its keys and values
    assert got["queries made by attend"] == layers, got
    assert got["head outputs read"] == 2 * writers, got
    # one launch a product: read per layer q(/k/v), o's post norm with the next norm after
    # it, gate/up, down's post norm, the per-layer gate times its input, the per-layer
    # projection's post norm with the next norm after it; then the per-layer inputs'
    # projection and the head
    assert unchained["product with post norm"] == 3 * layers, unchained
    assert unchained["product with norm after"] == 2 * layers, unchained
    assert unchained["launches read"] == 6 * layers + 2, unchained
    # an eager step chains nothing (a relaunch's Python time, paid at every eager call)
    assert eager["launches read"] == unchained["launches read"], eager
    # chained: the first layer's q(/k/v), a launch a layer (o to the next layer's q/k/v,
    # the last layer's to the head), the per-layer inputs' projection
    assert got["launches read"] == 1 + layers + 1, got
    # without pre-norms in their launches each norm is MLX's, between two chains: q(/k/v),
    # o with its post norm, gate/up to the per-layer projection's post norm
    assert "product with norm after" not in without, without
    assert without["MLX norm"] - got["MLX norm"] == 2 * layers, (without, got)
    assert without["launches read"] == 3 * layers + 2, without
    # each relaunch stands for the launch it replaced, also for the streams tapped
    assert tapped["launches read"] == got["launches read"], tapped
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(unchained_logits), np.array(want), rtol=1e-5,
                               atol=1e-5)


def test_queries_whose_rotated_pairs_straddle_lanes_come_from_the_heads_launch(launches,
                                                                              monkeypatch):
    """Heads of 16 (a rotated pair 8 entries apart: not in one lane of the attention
    kernel's warps) keep their queries from the heads launch, read by each attention; the
    logits are the unforced step's."""
    mx.set_default_device(mx.cpu)
    model = _gemma4(head_dim=16, global_head_dim=32)
    got, logits = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    layers, writers = 5, 3
    assert "queries made by attend" not in got and got["attend"] == layers, got
    assert got["head outputs read"] == 3 * writers + (layers - writers), got
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=1e-5, atol=1e-5)


def test_a_qwen3_5_decode_step_gates_its_attention_in_the_kernels(launches, monkeypatch,
                                                                 shared_data_dir: Path):
    """The attention layer's query, key and output gate laid out by one heads launch, the
    gate applied by the attention launch."""
    from mlxrunner_qwen3_5 import Qwen3_5

    text = _qwen3_5_text(shared_data_dir)
    mx.set_default_device(mx.cpu)
    mx.random.seed(2)
    model = Qwen3_5(text)
    got, logits = _one_step(model, launches)
    launches.allowed.discard("chains")
    unchained, _ = _one_step(model, launches)
    launches.allowed.add("chains")
    launches.allowed.discard("prenorms")
    without, _ = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    assert got["heads"] == 1 and got["head parts"] == 3, got
    assert got["attend with gate"] == 1 and "attend" not in got, got
    assert got["queries made by attend"] == 1 and got["head outputs read"] == 2, got
    # every pre-norm but the first (the embedding's) and the final norm in the residual
    # product's launch before it
    assert unchained["product with norm after"] == 2 * 4, unchained
    assert without["MLX norm"] - got["MLX norm"] == 2 * 4, (without, got)
    # one launch a product: the first layer's input products, then per layer the output
    # product, gate/up, down and the next layer's input products (the last one's: the head)
    assert unchained["launches read"] == 1 + 4 * 4, unchained
    # chained: those of a layer in one launch
    assert got["launches read"] == 1 + 4, got
    # without pre-norms in their launches: the input products, the output product, gate/up
    # to down (each norm MLX's, between two launches)
    assert without["launches read"] == 3 * 4 + 1, without
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma4", "qwen3_5"])
def test_a_mixture_of_experts_step_reads_each_relaunch_alone(launches, monkeypatch, arch,
                                                             shared_data_dir: Path):
    """A mixture-of-experts layer reads its stream beside the norms (Qwen3.5 adds the
    experts to it itself; Gemma 4 norms it twice and routes on it): each relaunch still
    stands for the launch it replaced, and a second norm of one stream relaunches nothing."""
    if arch == "gemma4":
        model = _gemma4(enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32)
    else:
        from mlxrunner_qwen3_5.moe import Qwen3_5Moe

        mx.random.seed(3)
        model = Qwen3_5Moe(_qwen3_5_text(
            shared_data_dir, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32))
    mx.set_default_device(mx.cpu)
    got, logits = _one_step(model, launches)
    launches.allowed.discard("chains")
    unchained, unchained_logits = _one_step(model, launches)
    launches.allowed.discard("prenorms")
    without, _ = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    assert unchained["product with norm after"] > 0, unchained
    assert unchained["launches read"] == without["launches read"], (unchained, without)
    assert got["launches read"] <= unchained["launches read"], (got, unchained)
    for step in (logits, unchained_logits):
        np.testing.assert_allclose(np.array(step), np.array(want), rtol=1e-5, atol=1e-5)


def test_the_example_llama_runs_a_layer_in_one_launch(launches, monkeypatch):
    """The example architecture (a third party's, built from ``mlxrunner.nn`` and nothing
    else) chains as the built-ins do: o plus the stream with the next norm after it,
    gate/up, down plus o's stream with the next norm after it and the next layer's q/k/v
    in one launch a layer; the logits are the unforced step's."""
    from mlxrunner_llama.model import Llama

    mx.set_default_device(mx.cpu)
    mx.random.seed(4)
    layers = 3
    model = Llama({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False})
    got, logits = _one_step(model, launches)
    launches.allowed.discard("chains")
    unchained, unchained_logits = _one_step(model, launches)
    monkeypatch.undo()
    _, want = _one_step(model, Counter())
    # a launch a product: q/k/v, o, gate/up and down a layer, then the head
    assert unchained["launches read"] == 4 * layers + 1, unchained
    # the first layer's q/k/v, then a launch a layer (the last one's to the head)
    assert got["launches read"] == 1 + layers, got
    for step in (logits, unchained_logits):
        np.testing.assert_allclose(np.array(step), np.array(want), rtol=1e-5, atol=1e-5)


def test_a_prompts_heads_are_one_launch_a_layer_from_a_product_each(launches, monkeypatch):
    """A 70-token prompt on CUDA (more rows than a decode step's kernels take): each layer's
    queries (keys, values) come from a product each, whole in memory (slices of one
    product's rows would each be copied before a norm or the heads kernel reads them), and
    their norms, RoPE and layout from one heads launch a layer, its length not a constant
    of the kernel; each post norm's residual add (and scale) is one launch; the logits are
    the unforced forward's."""
    from mlxrunner.nn import linear

    mx.set_default_device(mx.cpu)
    model = _gemma4()
    mx.eval(model.parameters())
    ids = mx.array(np.random.default_rng(1).integers(3, 200, (1, 70)).astype(np.int32))

    def prompt(cuda: bool, ids: mx.array = ids) -> tuple[dict[str, int], list[str], mx.array]:
        monkeypatch.setattr(linear, "kernel_allowed", lambda name: cuda)
        launches.clear()
        out = model(ids, model.make_cache())
        got = {k: v for k, v in launches.items() if v}
        labels = graph_labels(out)
        mx.eval(out)
        return got, labels, out

    got, labels, logits = prompt(True)
    _, packed_labels, packed_logits = prompt(False)
    # two sequences' prompts: no heads launch takes them, q/k/v stay one product
    batch, batch_labels, _ = prompt(True, mx.concatenate([ids, ids[:, ::-1]]))
    monkeypatch.undo()
    assert "heads" not in batch and batch_labels.count("Split") == packed_labels.count(
        "Split"), (batch, batch_labels.count("Split"))
    want = model(ids, model.make_cache())
    layers, writers = 5, 3
    assert got["heads"] == layers and got["head parts"] == 3 * writers + (layers - writers), got
    # after attention, after the MLP, after the per-layer input (with its scale)
    assert got["add norm"] == 3 * layers, got
    # one product's rows cut for q, k and v in each writing layer: none of those cuts on
    # CUDA (gate/up still one product: the prompt's gated activation reads it in place)
    assert packed_labels.count("Split") - labels.count("Split") == writers, (
        packed_labels.count("Split"), labels.count("Split"))
    for out in (logits, packed_logits):
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-5)


def test_a_prompt_with_gemma4s_wide_heads_attends_folded_in_every_layer(monkeypatch):
    """Gemma 4's 256- and 512-wide heads are past MLX's fused attention on CUDA: a prompt's
    every layer (sliding, full, KV-sharing) attends folded, the causal and window masks
    built once for the prompt (no compare left in its graph, where MLX's own operations
    build one a layer), the logits MLX's function's."""
    mx.set_default_device(mx.cpu)
    model = _gemma4(head_dim=256, global_head_dim=512)
    mx.eval(model.parameters())
    ids = mx.array(np.random.default_rng(2).integers(3, 200, (1, 40)).astype(np.int32))
    want = model(ids, model.make_cache())
    masks = folded_masks_on_cuda(monkeypatch, attention)
    got = model(ids, model.make_cache())
    labels = graph_labels(got)
    assert len(masks) == _GEMMA4_CONFIG["num_hidden_layers"], len(masks)
    assert len({id(m) for m in masks}) == 2  # one causal mask, one sliding window's
    assert "GreaterEqual" not in labels and "LessEqual" not in labels, labels
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
