"""The layers of ``mlxrunner.nn``, each against the plain MLX computation it stands for (or
transformers' RoPE, where torch is installed).

- ``linears``: one product for several layers equals each layer alone, float and quantized,
  with or without bias; the layers keep their shapes and names (row views of the packed
  matrix), new weights are packed again, and layers that cannot share a product run alone.
- ``Linear``/``Embedding``: the product with a residual, the tied head, the scale, quantized.
- ``RMSNorm(offset=1)``: ``rms_norm(x) * (1 + w)`` with ``1 + w`` computed in float32.
- ``RoPE.from_config``: every rope type a supported checkpoint uses rotates as transformers
  does, at a long position; unknown types are one clear error.
- ``store``: the masks a layer attends with, with and without a cache; ``Taps``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner.plugin import KVCache, RingCache

mx.set_default_device(mx.cpu)


def _linear(i: int, o: int, bias: bool = False, seed: int = 0) -> mnn.Linear:
    mx.random.seed(seed)
    layer = mnn.Linear(i, o, bias=bias)
    mx.eval(layer.parameters())
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_linears_share_one_product_and_keep_the_layers(bias):
    layers = [_linear(64, o, bias, seed) for seed, o in enumerate((32, 16, 8))]
    x = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    want = [x @ l.weight.T + (l.bias if bias else 0) for l in layers]
    got = mnn.linears(x, *layers)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert float(mx.abs(a - b).max()) < 1e-5
    joined, parts = mnn.joined_linears(x, *layers)
    assert joined.shape == (2, 3, 56) and len(parts) == 3
    assert [tuple(l.weight.shape) for l in layers] == [(32, 64), (16, 64), (8, 64)]
    # new weights are noticed and packed again
    layers[1].weight = mx.zeros((16, 64))
    assert float(mx.abs(mnn.linears(x, *layers)[1]).max()) == (
        0.0 if not bias else float(mx.abs(mx.broadcast_to(layers[1].bias, (2, 3, 16))).max()))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linears_share_a_product(bits):
    layers = [_linear(64, o, seed=seed) for seed, o in enumerate((32, 32))]
    quantized = [l.to_quantized(group_size=32, bits=bits) for l in layers]
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    want = [q(x) for q in quantized]
    for a, b in zip(mnn.linears(x, *quantized), want):
        assert float(mx.abs(a - b).max()) < 1e-5
    mixed = mnn.linears(x, quantized[0], layers[1])  # other kinds: one by one
    assert float(mx.abs(mixed[1] - layers[1](x)).max()) < 1e-5


def test_linear_residual_embedding_and_tied_head():
    layer = _linear(32, 16)
    x, r = mx.random.normal((4, 32)), mx.random.normal((4, 16))
    assert float(mx.abs(layer(x, r) - (x @ layer.weight.T + r)).max()) < 1e-5
    quantized = layer.to_quantized(group_size=32, bits=8)
    assert isinstance(quantized, mnn.QuantizedLinear)
    assert float(mx.abs(quantized(x, r) - (quantized(x) + r)).max()) == 0.0
    embedding = mnn.Embedding(10, 32, scale=32 ** 0.5)
    embedding.weight = embedding.weight.astype(mx.bfloat16)
    ids = mx.array([[1, 7]])
    want = embedding.weight[ids] * mx.array(32 ** 0.5, mx.bfloat16)  # scale in bf16
    assert mx.array_equal(embedding(ids), want)
    h = mx.random.normal((2, 32)).astype(mx.bfloat16)
    assert mx.array_equal(embedding.as_linear(h), h @ embedding.weight.T)
    q = embedding.to_quantized(group_size=32, bits=8)
    assert q.scale == embedding.scale and q(ids).shape == (1, 2, 32)


def test_zero_centred_norm_computes_one_plus_w_in_float32():
    norm = mnn.RMSNorm(16, eps=1e-6, offset=1.0)
    assert float(mx.abs(norm.weight).max()) == 0.0  # stored as w
    norm.weight = (0.01 * mx.random.normal((16,))).astype(mx.bfloat16)
    x = mx.random.normal((3, 16)).astype(mx.bfloat16)
    applied = (norm.weight.astype(mx.float32) + 1.0).astype(mx.bfloat16)
    assert mx.array_equal(norm(x), mx.fast.rms_norm(x, applied, 1e-6))
    norm.weight = norm.weight.astype(mx.float32)  # a bf16 folder computed in float32
    assert mx.array_equal(norm.applied_weight(), norm.weight + 1.0)


@pytest.mark.parametrize("rows", [3, 65, 300])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norms_of_any_rows_are_mlxs_norm(rows, offset):
    """A prompt's rows (past every kernel's) and a step's give MLX's norm, and a post norm's
    add ``(residual + norm(x)) * scale`` its operations, bit for bit."""
    keys = mx.random.split(mx.random.key(rows), 4)
    x = mx.random.normal((1, rows, 96), key=keys[0]).astype(mx.bfloat16)
    residual = mx.random.normal((1, rows, 96), key=keys[1]).astype(mx.bfloat16)
    scale = mx.array([0.5], mx.bfloat16)
    norm = mnn.RMSNorm(96, 1e-5, offset=offset)
    norm.weight = mx.random.normal((96,), key=keys[2]).astype(mx.bfloat16)
    weight = (norm.weight.astype(mx.float32) + offset).astype(mx.bfloat16)
    want = mx.fast.rms_norm(x, weight, 1e-5)
    assert mx.array_equal(norm(x), want)
    assert mx.array_equal(norm.add_normed(residual, x), residual + want)
    assert mx.array_equal(norm.add_normed(residual, x, scale), (residual + want) * scale)


def test_gated_mlp_is_its_math():
    mx.random.seed(4)
    mlp = mnn.GatedMLP(16, 24, "gelu_pytorch_tanh")
    x = mx.random.normal((2, 16))
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    want = (nn.gelu_approx(gate) * up) @ mlp.down_proj.weight.T
    assert float(mx.abs(mlp(x) - want).max()) < 1e-4
    assert float(mx.abs(mlp(x, x) - (want + x)).max()) < 1e-4
    with pytest.raises(ValueError, match="unsupported activation 'relu2'"):
        mnn.GatedMLP(16, 24, "relu2")


def test_quantized_experts_equal_dequantized_experts():
    mx.random.seed(5)
    dense = mnn.ExpertLinear(4, 64, 32)
    dense.weight = mx.random.normal((4, 32, 64))
    quant = dense.to_quantized(group_size=32, bits=4)
    dequant = mnn.ExpertLinear(4, 64, 32)
    dequant.weight = mx.dequantize(quant.weight, quant.scales, quant.biases, 32, 4)
    x = mx.random.normal((6, 1, 1, 64))
    idx = mx.array([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1], [0, 2]])
    np.testing.assert_allclose(np.array(quant(x, idx)), np.array(dequant(x, idx)), atol=1e-4)
    order = mx.argsort(idx.flatten())
    rows = x.reshape(6, 1, 64)[order // 2]
    np.testing.assert_allclose(np.array(quant(rows, idx.flatten()[order], True)),
                               np.array(dequant(rows, idx.flatten()[order], True)), atol=1e-4)


@pytest.mark.parametrize("tokens", [3, 40])  # below and above the sort-by-expert threshold
def test_experts_glu_is_the_weighted_sum_of_expert_mlps(tokens):
    mx.random.seed(6)
    gate_up, down = mnn.ExpertLinear(4, 16, 2 * 8), mnn.ExpertLinear(4, 8, 16)
    gate_up.weight = mx.random.normal(gate_up.weight.shape) * 0.3
    down.weight = mx.random.normal(down.weight.shape) * 0.3
    x = mx.random.normal((1, tokens, 16))
    idx = mx.random.randint(0, 4, (1, tokens, 2))
    w = mx.softmax(mx.random.normal((1, tokens, 2)), axis=-1)
    got = mnn.experts_glu(x, idx, w, gate_up, down, mnn.silu_mul)
    want = mx.zeros((1, tokens, 16))
    for j in range(2):
        e = idx[..., j]
        gu = mx.einsum("btd,btod->bto", x, gate_up.weight[e])
        act = nn.silu(gu[..., :8]) * gu[..., 8:]
        want = want + w[..., j:j + 1] * mx.einsum("bti,btoi->bto", act, down.weight[e])
    assert float(mx.abs(got - want).max()) < 1e-4


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "partial": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 32},
}


@pytest.mark.reference
@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_kinds_rotate_as_transformers_does(kind):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import modeling_rope_utils

    head_dim = 64
    parameters = dict(ROPES[kind])
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4,
                                      head_dim=head_dim, max_position_embeddings=131072,
                                      rope_parameters=parameters)
    init = modeling_rope_utils.ROPE_INIT_FUNCTIONS.get(parameters["rope_type"])
    if init is None:  # default: transformers computes it in the rotary module
        partial = parameters.get("partial_rotary_factor", 1.0)
        dims = int(head_dim * partial)
        inv = 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dims, 2).float() / dims))
        scale = 1.0
    else:
        inv, scale = init(config, "cpu")
        dims = 2 * inv.shape[0]
    rope = mnn.RoPE.from_config(head_dim, config.to_dict())
    position = 400  # far enough that llama3's and yarn's scaled frequencies show
    x = mx.random.normal((1, 2, 1, head_dim), key=mx.random.key(9))
    ours = np.array(rope(x, position))
    t = torch.tensor(np.array(x))
    angle = torch.cat([position * inv.float()] * 2)
    rotated, rest = t[..., :dims], t[..., dims:]
    half = dims // 2
    turned = torch.cat([-rotated[..., half:], rotated[..., :half]], dim=-1)
    want = torch.cat([(rotated * angle.cos() + turned * angle.sin()) * scale, rest], dim=-1)
    assert np.abs(ours - want.numpy()).max() < 1e-4
    # a traced offset gives the same rotation
    assert np.abs(np.array(rope(x, mx.array(position, dtype=mx.int32))) - ours).max() == 0


@pytest.mark.parametrize("parameters, message", [
    ({"rope_type": "dynamic"}, "unsupported rope_type 'dynamic'"),
    ({"rope_type": "default", "rope_theta": "abc"}, "must be numbers"),
    ({"rope_type": "default", "partial_rotary_factor": 0.0}, "in (0, 1]"),
    ({"rope_type": "linear", "factor": -1.0}, "factor -1.0 must be > 0"),
])
def test_rope_config_errors_are_one_line(parameters, message):
    with pytest.raises(mnn.RopeConfigError) as info:
        mnn.RoPE.from_config(64, {"rope_parameters": parameters})
    assert message in str(info.value)


def test_store_gives_the_mask_of_each_cache_kind():
    k = mx.zeros((1, 2, 5, 8))
    assert mnn.store(None, k, k).mask == "causal"
    assert mnn.store(None, k[:, :, :1], k[:, :, :1]).mask is None
    window = mnn.store(None, k, k, window=3).mask  # a sliding window without a cache
    assert window.tolist()[4] == [False, False, True, True, True]
    cache = KVCache()
    keys, values, mask = mnn.store(cache, k, k)
    assert mask == "causal" and keys.shape[2] == 5 and cache.offset == 5
    assert mnn.store(cache, k[:, :, :1], k[:, :, :1]).mask is None
    ring = RingCache(4)
    mnn.store(ring, k, k)
    keys, _, mask = mnn.store(ring, k[:, :, :2], k[:, :, :2])
    assert mask.shape == (2, keys.shape[2])  # a block over a wrapped ring: its own mask


def test_taps_collect_in_request_order():
    taps = mnn.Taps([2, 0], 3)
    for i in range(3):
        taps.after(i, mx.full((1, 1, 2), float(i)))
    logits, tapped = taps.result(mx.zeros((1, 1, 5)))
    assert tapped.tolist() == [[[2.0, 2.0, 0.0, 0.0]]]
    assert mnn.Taps(None, 3).result(logits) is logits
    assert mnn.Taps([], 3).result(logits)[1].shape == (1, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        mnn.Taps([3], 3)
    with pytest.raises(ValueError, match="twice"):
        mnn.Taps([1, 1], 3)


def test_gradients_flow_through_packed_and_transposed_weights():
    """Under a gradient (or a compiled training step) the weights are traced: the layers
    compute from them directly (nothing packed or held), and the gradients are plain
    products' gradients, also after an eager call packed the layers."""
    layers = [_linear(16, 8, seed=1), _linear(16, 4, seed=2)]
    x = mx.random.normal((3, 16), key=mx.random.key(3))
    mnn.linears(x, *layers)  # eager: packed, views held

    def loss(params):
        for layer, p in zip(layers, params):
            layer.update(p)
        a, b = mnn.linears(x, *layers)
        return (a ** 2).sum() + (b ** 3).sum() + (layers[0](x, a) ** 2).sum()

    def reference(params):
        a = x @ params[0]["weight"].T
        b = x @ params[1]["weight"].T
        return (a ** 2).sum() + (b ** 3).sum() + ((x @ params[0]["weight"].T + a) ** 2).sum()

    params = [l.trainable_parameters() for l in layers]
    got = mx.grad(loss)(params)
    want = mx.grad(reference)(params)
    for g, w in zip(got, want):
        assert float(mx.abs(g["weight"] - w["weight"]).max()) < 1e-4
    compiled = mx.compile(mx.grad(loss))
    for g, w in zip(compiled(params), want):
        assert float(mx.abs(g["weight"] - w["weight"]).max()) < 1e-4
