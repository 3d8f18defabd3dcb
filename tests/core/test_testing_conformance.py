"""mlxrunner.testing: the checks pass on a correct model and fail on each kind of broken one.

The toy model mixes the three situations the checks must handle: a full-attention layer
(KVCache), a recurrent layer with its own snapshotting cache, and a layer without a cache
(``None`` in ``make_cache``). Each broken variant below changes one thing.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
import mlxrunner.plugin
from mlxrunner import testing
from mlxrunner.testing import (
    check_cache_rollback,
    check_prefill_decode,
    check_taps,
    check_taps_against,
    random_prompt,
    run_conformance,
)

VOCAB, HIDDEN = 32, 16


class StateCache(mlxrunner.plugin.Cache):
    """Recurrent state plus the states captured at scheduled offsets during a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.value: mx.array | None = None
        self.snapshots: dict[int, mx.array] = {}

    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        if offset != self.offset:
            self.value = self.snapshots[offset]
            self.offset = offset
        self.discard_snapshots()

    def discard_snapshots(self) -> None:
        super().discard_snapshots()
        self.snapshots = {}

    @property
    def state(self) -> list[mx.array]:
        return [] if self.value is None else [self.value]


class AttentionLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.rope = nn.RoPE(HIDDEN)

    def __call__(self, x, cache, causal=True, rope_offset=True):
        B, L, _ = x.shape
        q, k, v = (t.reshape(B, L, 1, HIDDEN).transpose(0, 2, 1, 3)
                   for t in mx.split(self.qkv(self.norm(x)), 3, axis=-1))
        offset = cache.offset if cache is not None and rope_offset else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        mask = "causal" if causal and L > 1 else None
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=HIDDEN ** -0.5, mask=mask)
        return x + self.out(o.transpose(0, 2, 1, 3).reshape(B, L, HIDDEN))


class RecurrentLayer(nn.Module):
    """s_t = decay * s_{t-1} + W x_t; output x + U s_t."""

    def __init__(self) -> None:
        super().__init__()
        self.decay_logit = mx.zeros((HIDDEN,))
        self.write = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.read = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def __call__(self, x, cache, causal=True, rope_offset=True):
        B, L, _ = x.shape
        decay = mx.sigmoid(self.decay_logit)
        s = cache.value if cache is not None and cache.value is not None else mx.zeros((B, HIDDEN))
        start = cache.offset if cache is not None else 0
        inputs = self.write(x)
        outs = []
        for t in range(L):
            s = decay * s + inputs[:, t]
            outs.append(s)
            if cache is not None and start + t + 1 in cache.scheduled:
                cache.snapshots[start + t + 1] = s
        if cache is not None:
            cache.value, cache.offset = s, start + L
        return x + self.read(mx.stack(outs, axis=1))


class MLPLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def __call__(self, x, cache, causal=True, rope_offset=True):
        return x + self.down(nn.gelu(self.up(self.norm(x))))


class ToyModel(mlxrunner.plugin.Model):
    # What the broken variants change:
    tap_shift = 0            # -1: tap the input of layer t; +1: the output of layer t + 1
    causal = True            # False: prefill attends to later tokens
    rope_offset = True       # False: positions restart at 0 in every forward
    state_cache_cls: type = StateCache
    kv_cache_cls: type = mlxrunner.plugin.KVCache

    def __init__(self, config=None) -> None:
        super().__init__(config or {})
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = [AttentionLayer(), RecurrentLayer(), MLPLayer()]
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def make_cache(self):
        return [self.kv_cache_cls(), self.state_cache_cls(), None]

    def layer_states(self, ids, cache=None):
        """Inputs and outputs of every layer."""
        cache = cache if cache is not None else [None] * len(self.layers)
        h = self.embed_tokens(ids)
        inputs, outputs = [], []
        for layer, c in zip(self.layers, cache):
            inputs.append(h)
            h = layer(h, c, causal=self.causal, rope_offset=self.rope_offset)
            outputs.append(h)
        return inputs, outputs

    def __call__(self, ids, cache=None, *, taps=None):
        inputs, outputs = self.layer_states(ids, cache)
        logits = self.raw_logits(self.norm(outputs[-1]))
        if taps is None:
            return logits
        last = len(self.layers) - 1
        picked = [inputs[t] if self.tap_shift < 0 else
                  outputs[min(t + self.tap_shift, last)] for t in taps]
        return logits, self.combine_taps(picked)

    def combine_taps(self, picked):
        return mx.concatenate(picked, axis=-1)

    def embed_tokens(self, ids):
        return self.embed(ids)

    def raw_logits(self, hidden):
        return self.head(hidden)

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def vocab_size(self):
        return VOCAB

    @property
    def hidden_size(self):
        return HIDDEN


def build(cls=ToyModel):
    mx.random.seed(7)
    model = cls()
    # Decay rates spread over (0, 1) so the recurrent state matters at every step.
    model.layers[1].decay_logit = mx.random.normal((HIDDEN,))
    mx.eval(model.parameters())
    return model


class ForgetfulStateCache(StateCache):
    """Rolls the offset back but keeps the state of the rejected tokens."""

    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        self.offset = offset
        self.discard_snapshots()


class StuckKVCache(mlxrunner.plugin.KVCache):
    """Ignores restore: the rejected drafts stay in the cache."""

    def restore(self, offset: int) -> None:
        self.discard_snapshots()


class TapsOneLayerEarly(ToyModel):
    tap_shift = -1


class TapsOneLayerLate(ToyModel):
    tap_shift = 1


class TapsReversed(ToyModel):
    def combine_taps(self, picked):
        return mx.concatenate(picked[::-1], axis=-1)


class TapsStacked(ToyModel):
    def combine_taps(self, picked):
        return mx.stack(picked, axis=-1)


class TapsChangeLogits(ToyModel):
    def __call__(self, ids, cache=None, *, taps=None):
        out = super().__call__(ids, cache, taps=taps)
        return out if taps is None else (out[0] + 1e-2, out[1])


class NonCausalPrefill(ToyModel):
    causal = False


class PositionsRestart(ToyModel):
    rope_offset = False


class ForgetfulRecurrence(ToyModel):
    state_cache_cls = ForgetfulStateCache


class StuckAttention(ToyModel):
    kv_cache_cls = StuckKVCache


class MissingCacheEntry(ToyModel):
    def make_cache(self):
        return super().make_cache()[:2]


PROMPT = random_prompt(VOCAB, batch=2, length=7, seed=3)


def reference_hidden_states(model, ids):
    """transformers' layout: embeddings, then the output of every layer (pre-norm here)."""
    inputs, outputs = model.layer_states(ids)
    return [inputs[0], *outputs]


# -- a correct model passes -----------------------------------------------------

def test_correct_model_passes_every_check():
    model = build()
    assert run_conformance(model, batch=2, prompt_len=9, rounds=4) == [
        "prefill_decode", "taps+layer_index", "cache_rollback"]
    check_taps_against(model, PROMPT, [0, 1, 2], reference_hidden_states(model, PROMPT),
                       last_entry_is_normed=False)


def test_parameters_are_restored_after_the_layer_index_check():
    model = build()
    before = model(PROMPT)
    check_taps(model, PROMPT, [0, 1, 2])
    assert mx.array_equal(model(PROMPT), before)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 2), prompt_len=st.integers(1, 10),
       draft_len=st.integers(1, 5), rounds=st.integers(1, 3))
def test_run_conformance_on_random_settings(seed, batch, prompt_len, draft_len, rounds):
    run_conformance(build(), seed=seed, batch=batch, prompt_len=prompt_len,
                    draft_len=draft_len, rounds=rounds)


def test_models_without_taps_skip_the_tap_check():
    class NoTaps(ToyModel):
        supports_taps = False

    assert run_conformance(build(NoTaps), prompt_len=5, rounds=1) == [
        "prefill_decode", "cache_rollback"]


def test_draft_factory_reaches_the_speculative_check(monkeypatch):
    calls = []

    def fake_check(model, draft_factory, *, prompt_ids, seed):
        calls.append((draft_factory, prompt_ids.shape, seed))

    monkeypatch.setattr(testing, "check_speculative_greedy", fake_check, raising=False)
    factory = object()
    ran = run_conformance(build(), seed=5, prompt_len=4, rounds=1, draft_factory=factory)
    assert ran[-1] == "speculative_greedy"
    assert calls == [(factory, (1, 4), 5)]


# -- each broken model fails the check that covers it ------------------------------

@pytest.mark.parametrize("cls, message", [
    (TapsOneLayerEarly, "did not change when layer 0's parameters were perturbed"),
    (TapsOneLayerLate, "changed when layer 1's parameters were perturbed"),
    (TapsReversed, "slice 0 of taps=[0, 1]"),
    (TapsStacked, "tapped shape (2, 7, 16, 2)"),
    (TapsChangeLogits, "logits with taps=[0, 1] vs without taps"),
])
def test_check_taps_catches(cls, message):
    with pytest.raises(AssertionError, match=None) as info:
        check_taps(build(cls), PROMPT, [0, 1])
    assert message in str(info.value)


@pytest.mark.parametrize("cls, matches", [(TapsOneLayerEarly, "hidden_states[1]"),
                                          (TapsOneLayerLate, "hidden_states[3]")])
def test_check_taps_against_names_an_off_by_one_tap(cls, matches):
    reference = reference_hidden_states(build(), PROMPT)
    with pytest.raises(AssertionError) as info:
        check_taps_against(build(cls), PROMPT, [1], reference, last_entry_is_normed=False)
    assert f"it matches {matches}" in str(info.value)
    assert "off by one" in str(info.value)


def test_check_taps_against_skips_a_normed_last_entry_only():
    model = build()
    reference = reference_hidden_states(model, PROMPT)
    reference[-1] = model.norm(reference[-1])  # transformers' convention
    check_taps_against(model, PROMPT, [0, 2], reference)
    with pytest.raises(AssertionError, match="tap 2 vs reference hidden_states"):
        check_taps_against(model, PROMPT, [0, 2], reference, last_entry_is_normed=False)


@pytest.mark.parametrize("cls, message", [
    (NonCausalPrefill, "prefill 3 + decode 4 tokens vs one full forward"),
    (PositionsRestart, "prefill 3 + decode 4 tokens vs one full forward"),
    (MissingCacheEntry, "make_cache() returned 2 entries for 3 layers"),
])
def test_check_prefill_decode_catches(cls, message):
    with pytest.raises(AssertionError) as info:
        check_prefill_decode(build(cls), PROMPT)
    assert message in str(info.value)


@pytest.mark.parametrize("cls, message", [
    (ForgetfulRecurrence, "logits decoded after rollback (accepted per round [1] of 3)"),
    (StuckAttention, "round 0: after restore(8) with 1 of 3 drafts accepted: cache offsets "
                     "should be 8, got layer 0: 10"),
])
def test_check_cache_rollback_catches(cls, message):
    with pytest.raises(AssertionError) as info:
        check_cache_rollback(build(cls), PROMPT, draft_len=3, accepted=1)
    assert message in str(info.value)


def test_rollback_to_the_current_offset_keeps_everything():
    # Accepting every draft restores to the current offset: a forgetful cache is then right.
    check_cache_rollback(build(ForgetfulRecurrence), PROMPT, draft_len=3, accepted=[3, 3])


def test_error_messages_report_the_size_of_the_difference():
    with pytest.raises(AssertionError) as info:
        check_cache_rollback(build(ForgetfulRecurrence), PROMPT, draft_len=3, accepted=[0])
    text = str(info.value)
    assert "max |error|" in text and "> atol 0.0001" in text


def test_bad_arguments_are_value_errors():
    model = build()
    with pytest.raises(ValueError, match="accepted must be in 0..draft_len=2"):
        check_cache_rollback(model, PROMPT, draft_len=2, accepted=3)
    with pytest.raises(ValueError, match="taps must be ascending distinct layers in 0..2"):
        check_taps(model, PROMPT, [2, 0])
    with pytest.raises(ValueError, match="expected num_layers \\+ 1 = 4"):
        check_taps_against(model, PROMPT, [0], [np.zeros((2, 7, HIDDEN))] * 3)
