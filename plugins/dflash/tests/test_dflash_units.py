"""Unit checks of the DFlash / DFlash2 pieces against speculative.md, worked by hand or by
an independent from-scratch computation."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlxrunner_dflash import DFlash2DraftModel, DFlashDraftModel
from mlxrunner_dflash.dflash2 import CandidateSelector, block_convolve, greedy_path, sampled_path

from mlxrunner import DraftConfigError, SamplerOptions, settings
from mlxrunner.plugin import Model, Sampler
from mlxrunner.testing.speculative import (
    ToyTarget,
    build_draft,
    random_draft,
    random_draft_config,
)

mx.set_default_device(mx.cpu)


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


# -- dynamic convolution ---------------------------------------------------------------------


def test_block_convolution_matches_the_spec_example():
    x = mx.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    base = mx.array([[1.0, 1.0], [10.0, 10.0]])  # [K=2, C=2]
    dyn = mx.zeros((1, 3, 2, 1))  # [B, L, K, G=1]
    out = block_convolve(x, base, dyn, group_size=2)
    np.testing.assert_array_equal(_np(out), [[[1, 2], [13, 24], [35, 46]]])


def test_block_convolution_dynamic_kernels_follow_groups():
    rng = np.random.default_rng(0)
    B, L, C, K, gs = 1, 5, 6, 3, 2
    G = C // gs
    x = rng.standard_normal((B, L, C)).astype(np.float32)
    base = rng.standard_normal((K, C)).astype(np.float32)
    dyn = rng.standard_normal((B, L, K, G)).astype(np.float32)
    expected = np.zeros_like(x)
    for t in range(L):
        for c in range(C):
            for o in range(K):
                if t - o >= 0:
                    expected[0, t, c] += (base[o, c] + dyn[0, t, o, c // gs]) * x[0, t - o, c]
    out = block_convolve(mx.array(x), mx.array(base), mx.array(dyn), gs)
    np.testing.assert_allclose(_np(out), expected, rtol=1e-5, atol=1e-5)


# -- candidate selector, worked by hand -----------------------------------------------------------


def _hand_selector() -> CandidateSelector:
    sel = CandidateSelector(vocab_size=5, hidden=2, rank=2, top_k=2)
    sel.hidden_projection.weight = mx.eye(2)
    sel.predecessor_codebook.weight = mx.array(
        [[0, 0], [0, 3], [0, 0], [2, 0], [1, 2]], dtype=mx.float32)
    sel.successor_codebook.weight = mx.array(
        [[1, -1], [2, 5], [0, 1], [-1, 0], [0, 0]], dtype=mx.float32)
    return sel


def test_candidate_selector_example_worked_by_hand():
    # Row 0: logits [0, 3, 1, 2, -1] -> candidates (1, 3), unary (3, 2). Anchor 4:
    # pred(4) * proj(h0) = [1, 2] * [1, 0] = [1, 0]; succ(1) = [2, 5] -> 2, succ(3) = [-1, 0]
    # -> -1; scores (5, 1): slot 0, token 1.
    # Row 1: logits [2, 0, 1, 0, 0] -> candidates (0, 2), unary (2, 1). proj(h1) = [0, 1].
    # After token 1: pred(1) * proj = [0, 3]; succ(0) = [1, -1] -> -3, succ(2) = [0, 1] -> 3;
    # scores (-1, 4): slot 1, token 2 (the unary argmax alone would pick 0).
    # After token 3: pred(3) * proj = [0, 0] -> scores (2, 1).
    sel = _hand_selector()
    hidden = mx.array([[1.0, 0.0], [0.0, 1.0]])
    logits = mx.array([[0, 3, 1, 2, -1], [2, 0, 1, 0, 0]], dtype=mx.float32)
    ids, first, transitions = sel.scores(hidden[None], logits[None], anchor=mx.array([4]),
                                         scale=lambda x: x)
    np.testing.assert_array_equal(np.array(ids), [[[1, 3], [0, 2]]])
    np.testing.assert_allclose(_np(first), [[5, 1]])
    np.testing.assert_allclose(_np(transitions[0, 0]), [[-1, 4], [2, 1]])
    assert greedy_path(ids, first, transitions).tolist() == [[1, 2]]
    ids, first, transitions = ids[0], first[0], transitions[0]

    # Temperature 2: q of row 0 is softmax((5, 1) / 2) over (1, 3); a draw that picks slot 1
    # makes row 1 use the scores after token 3: softmax((2, 1) / 2) over (0, 2).
    picks = iter([1, 0])
    proposal = sampled_path(ids, first, transitions, 2.0,
                            lambda probs: mx.array([next(picks)], dtype=mx.int32))
    assert proposal.tokens.tolist() == [3, 0]
    np.testing.assert_array_equal(np.array(proposal.ids), [[1, 3], [0, 2]])
    e = math.exp
    np.testing.assert_allclose(_np(proposal.probs),
                               [[e(2.5) / (e(2.5) + e(0.5)), e(0.5) / (e(2.5) + e(0.5))],
                                [e(1) / (e(1) + e(0.5)), e(0.5) / (e(1) + e(0.5))]], rtol=1e-6)


def test_a_quantized_selector_scores_a_one_row_block():
    """A depth-1 round scores one row: no transitions, also when the codebooks are quantized
    (an 8-bit draft: MLX's quantized embedding takes no empty id array)."""
    import mlx.nn as nn

    sel = CandidateSelector(vocab_size=64, hidden=64, rank=64, top_k=4)
    logits = mx.random.normal((1, 1, 64), key=mx.random.key(0))
    hidden = mx.random.normal((1, 1, 64), key=mx.random.key(1))
    dense = sel.scores(hidden, logits, anchor=mx.array([3]), scale=lambda x: x)
    nn.quantize(sel, group_size=32, bits=8)
    ids, first, transitions = sel.scores(hidden, logits, anchor=mx.array([3]), scale=lambda x: x)
    assert transitions.shape == (1, 0, 4, 4)
    np.testing.assert_array_equal(np.array(ids), np.array(dense[0]))
    np.testing.assert_allclose(_np(first), _np(dense[1]), atol=0.05)
    assert greedy_path(ids, first, transitions).shape == (1, 1)


def test_candidate_selector_scales_and_softcaps_unary_scores():
    sel = _hand_selector()
    hidden = mx.array([[1.0, 0.0]])
    logits = mx.array([[0, 3, 1, 2, -1]], dtype=mx.float32)

    def scale(x):
        return 4.0 * mx.tanh(0.5 * x / 4.0)

    ids, first, _ = sel.scores(hidden[None], logits[None], anchor=mx.array([4]), scale=scale)
    unary = [4 * math.tanh(1.5 / 4), 4 * math.tanh(1.0 / 4)]
    np.testing.assert_allclose(_np(first), [[unary[0] + 2, unary[1] - 1]], rtol=1e-6)


# -- the draft forward against a from-scratch computation ------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d // 2) * 2.0 / d)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _reference_block(draft: DFlashDraftModel, target, tapped: np.ndarray, block_ids: list[int],
                     pos: int) -> np.ndarray:
    """speculative.md's DFlash block forward, written out in numpy: context rows 0..pos-1."""
    args = draft.args
    p = {k: np.array(v) for k, v in mlxrunner_params(draft).items()}
    eps = args.rms_norm_eps
    ctx = _rms(tapped @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    h = np.array(target.embed_tokens(mx.array([block_ids])))[0] * args.input_embedding_scale
    L, H, Hk, D = len(block_ids), args.num_attention_heads, args.num_key_value_heads, args.head_dim
    ctx_pos = np.arange(pos)
    blk_pos = pos + np.arange(L)
    for i, layer in enumerate(draft.layers):
        pre = f"layers.{i}."
        x = _rms(h, p[pre + "input_layernorm.weight"], eps)

        def proj(name, rows, heads, _pre=pre):
            return (rows @ p[_pre + f"self_attn.{name}.weight"].T).reshape(len(rows), heads, D)

        q = _rms(proj("q_proj", x, H), p[pre + "self_attn.q_norm.weight"], eps)
        keys = np.concatenate([_rms(proj("k_proj", ctx, Hk), p[pre + "self_attn.k_norm.weight"],
                                    eps),
                               _rms(proj("k_proj", x, Hk), p[pre + "self_attn.k_norm.weight"],
                                    eps)])
        values = np.concatenate([proj("v_proj", ctx, Hk), proj("v_proj", x, Hk)])
        all_pos = np.concatenate([ctx_pos, blk_pos])
        q = np.stack([_rope(q[:, j], blk_pos, args.rope_theta) for j in range(H)], 1)
        keys = np.stack([_rope(keys[:, j], all_pos, args.rope_theta) for j in range(Hk)], 1)
        allowed = np.ones((L, len(all_pos)), dtype=bool)
        window = layer.self_attn.window
        if window is not None:
            allowed[:, :pos] = (blk_pos[:, None] - ctx_pos[None]) < window
        if args.causal:
            allowed[:, pos:] = np.tril(np.ones((L, L), dtype=bool))
        out = np.zeros((L, H, D))
        for j in range(H):
            kv = j // (H // Hk)
            s = q[:, j] @ keys[:, kv].T / math.sqrt(D)
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, j] = w @ values[:, kv]
        h = h + out.reshape(L, H * D) @ p[pre + "self_attn.o_proj.weight"].T
        x = _rms(h, p[pre + "post_attention_layernorm.weight"], eps)
        gate = x @ p[pre + "mlp.gate_proj.weight"].T
        up = x @ p[pre + "mlp.up_proj.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * up) @ p[pre + "mlp.down_proj.weight"].T
    return _rms(h, p["norm.weight"], eps)


def mlxrunner_params(module) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(module.parameters()))


@pytest.mark.parametrize("layer_types, window, causal", [
    (None, None, False),
    (["sliding_attention", "full_attention"], 5, False),
    (["sliding_attention", "sliding_attention"], 3, True),
])
def test_dflash_block_matches_a_from_scratch_computation(layer_types, window, causal):
    target = ToyTarget({"vocab_size": 32, "hidden_size": 16, "seed": 3})
    draft = random_draft(target, "DFlashDraftModel", layers=2, block_size=4, heads=4,
                         kv_heads=2, head_dim=4, layer_types=layer_types,
                         sliding_window=window, causal=causal, seed=5,
                         input_embedding_scale=1.5)
    assert draft.args.causal is causal
    session = draft.new_session(Sampler(SamplerOptions(temperature=0), 32))
    rng = np.random.default_rng(0)
    total = 0
    tapped_all = []
    # many small commits: sliding stores drop old rows along the way
    for rows in [3, 1, 2, 4, 1, 3, 2, 1, 1, 2]:
        chunk = rng.standard_normal((1, rows, 16)).astype(np.float32)
        tapped_all.append(chunk[0])
        (session.prefill if total == 0 else session.commit)(mx.array(chunk))
        total += rows
    block_ids = [7] + [draft.mask_token_id] * 3
    ours = session.block(7, total, 3)
    again = session.block(7, total, 3)  # the block left nothing behind
    ref = _reference_block(draft, target, np.concatenate(tapped_all), block_ids, total)
    np.testing.assert_allclose(_np(ours), ref[1:], rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(_np(ours), _np(again))
    if window is not None:
        assert session.stores[0].start > 0  # old rows were dropped


def test_dflash_proposals_use_scaled_logits_and_the_request_temperature():
    target = ToyTarget({"vocab_size": 16, "hidden_size": 16})
    draft = random_draft(target, "DFlashDraftModel", layers=1, block_size=3, heads=2,
                         kv_heads=1, head_dim=8, output_multiplier=0.5,
                         final_logit_softcapping=3.0)
    sampler = Sampler(SamplerOptions(temperature=0.7, top_k=2, top_p=0.1, seed=1), 16)
    session = draft.new_session(sampler)
    session.prefill(mx.array(np.ones((1, 4, 16), np.float32)))
    proposal = session.propose(3, 4, 2)
    hidden = session.block(3, 4, 2)
    raw = target.raw_logits(hidden)
    expected = mx.softmax(3.0 * mx.tanh(0.5 * raw / 3.0) / 0.7, axis=-1)
    # dense q over the whole vocabulary: the request's top_k / top_p do not apply to drafts
    assert proposal.ids is None and proposal.probs.shape == (2, 16)
    np.testing.assert_allclose(_np(proposal.probs), _np(expected), rtol=1e-5, atol=1e-7)


# -- configs ---------------------------------------------------------------------------------


def _target():
    return ToyTarget({"vocab_size": 32, "hidden_size": 16})


@pytest.mark.parametrize("change, message", [
    ({"target_layer_ids": [0, 0]}, "strictly ascending"),
    ({"target_layer_ids": [1]}, "outside the target's 1 layers"),
    ({"mask_token_id": 32}, "mask_token_id 32 is outside"),
    ({"block_size": 1}, "block_size must be at least 2"),
    ({"num_target_layers": 4}, "made for a target with 4 layers"),
])
def test_config_errors_are_one_clear_line(change, message):
    target = _target()
    config = random_draft_config(target, "DFlashDraftModel", taps=[0])
    config["dflash_config"].update(change)
    with pytest.raises(DraftConfigError, match=message) as info:
        build_draft(DFlashDraftModel, config, target)
    assert "\n" not in str(info.value)


def test_width_and_vocabulary_mismatches_are_reported():
    target = _target()
    config = random_draft_config(target, "DFlashDraftModel", taps=[0])
    with pytest.raises(DraftConfigError, match="hidden size 24 differs"):
        build_draft(DFlashDraftModel, dict(config, hidden_size=24), target)
    with pytest.raises(DraftConfigError, match="vocabulary 64 differs"):
        build_draft(DFlashDraftModel, dict(config, vocab_size=64), target)
    bad2 = random_draft_config(target, "DFlash2DraftModel", taps=[0], conv_group_size=5)
    with pytest.raises(DraftConfigError, match="not a multiple of conv_group_size 5"):
        build_draft(DFlash2DraftModel, bad2, target)


def test_checkpoint_names_are_the_published_ones():
    target = _target()
    draft = random_draft(target, "DFlash2DraftModel", layers=1, block_size=4, taps=[0],
                         aux_hidden_norms=True)
    names = set(mlxrunner_params(draft))
    layer = {f"layers.0.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                              "q_norm", "k_norm")),
        *(f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
        "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
        "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight")}
    expected = layer | {"fc.weight", "hidden_norm.weight", "norm.weight",
                        "aux_hidden_norms.0.weight",
                        "candidate_selector.predecessor_codebook.weight",
                        "candidate_selector.successor_codebook.weight",
                        "candidate_selector.hidden_projection.weight"}
    assert names == expected
    # published DFlash2 files store the codebooks without ".weight"
    weights = {k.removesuffix(".weight") if "codebook" in k else k: v
               for k, v in mlxrunner_params(draft).items()}
    assert set(draft.sanitize(weights)) == expected


class _ShapeOnlyTarget(Model):
    """Facts of a 27B Qwen3.5 target, no weights."""

    num_layers = 64
    vocab_size = 248320
    hidden_size = 5120


def test_the_spec_example_config_of_a_27b_target_parses_and_fits():
    config = {
        "architectures": ["DFlash2DraftModel"], "hidden_size": 5120, "num_hidden_layers": 5,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 17408, "rms_norm_eps": 1e-6, "vocab_size": 248320,
        "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "is_causal": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "num_target_layers": 64,
        "dflash_config": {"block_size": 8, "mask_token_id": 248070,
                          "target_layer_ids": [5, 19, 33, 47, 61], "conv_kernel_size": 2,
                          "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    }
    draft = build_draft(DFlash2DraftModel, config, _ShapeOnlyTarget({}))  # weights stay lazy
    args = draft.args
    assert (draft.taps, draft.block_size, draft.max_depth, draft.mask_token_id) == \
        ((5, 19, 33, 47, 61), 8, 7, 248070)
    assert args.causal is False and args.sliding_window == 2048 and args.rope_theta == 1e7
    assert draft.fc.weight.shape == (5120, 5 * 5120)
    assert draft.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * 320, 5120)
    assert draft.candidate_selector.predecessor_codebook.weight.shape == (248320, 256)
    assert not draft.adaptive_depth and DFlashDraftModel.adaptive_depth


# -- the traced block against the eager one ----------------------------------------------------


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
@pytest.mark.parametrize("layer_types, window, causal", [
    (None, None, False),
    (["sliding_attention", "full_attention"], 6, False),
    (["sliding_attention", "sliding_attention"], 4, True),
])
def test_traced_blocks_propose_what_the_eager_block_proposes(architecture, layer_types, window,
                                                             causal):
    """Round after round (context past a buffer step, sliding stores dropping rows), the
    traced graph's greedy tokens equal the eager block's, and its hidden rows match."""
    target = ToyTarget({"vocab_size": 48, "hidden_size": 16, "seed": 1})
    extra = {"selector_rank": 4, "selector_top_k": 6} if architecture == "DFlash2DraftModel" \
        else {}
    draft = random_draft(target, architecture, layers=2, block_size=5, heads=4, kv_heads=2,
                         head_dim=4, layer_types=layer_types, sliding_window=window,
                         causal=causal, seed=9, **extra)
    sampler = Sampler(SamplerOptions(temperature=0), 48)
    traced, eager = draft.new_session(sampler), draft.new_session(sampler)
    rng = np.random.default_rng(4)
    first = mx.array(rng.standard_normal((1, 250, 16)).astype(np.float32))
    traced.prefill(first)
    eager.prefill(first)
    pos = 250
    for round_ in range(12):
        current, n = int(rng.integers(0, 48)), int(rng.integers(1, 5))
        got = traced.propose(current, pos, n).tokens
        hidden = traced.traced_rows(mx.array([current]), pos, n, greedy=False)
        with settings.overridden(compile=False):
            want = eager.propose(current, pos, n).tokens
        assert got.tolist() == want.tolist(), f"round {round_}"
        np.testing.assert_allclose(_np(hidden[0]), _np(eager.block(current, pos, n)),
                                   rtol=1e-5, atol=1e-5)
        rows = int(rng.integers(1, n + 2))
        tapped = mx.array(rng.standard_normal((1, rows, 16)).astype(np.float32))
        traced.commit(tapped)
        with settings.overridden(compile=False):
            eager.commit(tapped)
        pos += rows
    assert traced.stores[-1].keys.shape[2] % traced.stores[-1].step == 0
    if window is not None:
        assert traced.stores[0].start > 0  # old rows were dropped along the way


def test_greedy_path_follows_the_chain_of_argmaxes():
    """The table-based greedy path equals walking each block's chain row by row (ties
    included), for blocks batched together."""
    rng = np.random.default_rng(0)
    for b, n, k in [(1, 1, 4), (3, 2, 3), (2, 7, 16), (4, 5, 2)]:
        ids = rng.integers(0, 1000, size=(b, n, k)).astype(np.int32)
        first = rng.integers(-2, 3, size=(b, k)).astype(np.float32)  # ties
        transitions = rng.integers(-2, 3, size=(b, max(n - 1, 0), k, k)).astype(np.float32)
        want = []
        for row in range(b):
            slot = int(np.argmax(first[row]))
            chain = [int(ids[row, 0, slot])]
            for p in range(1, n):
                slot = int(np.argmax(transitions[row, p - 1, slot]))
                chain.append(int(ids[row, p, slot]))
            want.append(chain)
        got = greedy_path(mx.array(ids), mx.array(first), mx.array(transitions))
        assert got.tolist() == want


def test_block_settings_come_from_dflash_config_then_the_top_level():
    target = _target()
    config = random_draft_config(target, "DFlashDraftModel", taps=[0], block_size=6)
    config["mask_token_id"] = 5  # the top level, where dflash_config says nothing
    config["dflash_config"].pop("mask_token_id")
    config["block_size"] = 16  # dflash_config's 6 wins
    draft = build_draft(DFlashDraftModel, config, target)
    assert (draft.taps, draft.block_size, draft.max_depth, draft.mask_token_id) == \
        ((0,), 6, 5, 5)
