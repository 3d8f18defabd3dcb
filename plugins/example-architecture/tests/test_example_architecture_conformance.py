"""mlxrunner.testing's conformance checks on the example architecture.

This is the test a third-party architecture copies: load a tiny checkpoint, run the checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner.plugin import Model
from mlxrunner.testing import (
    check_cache_rollback,
    check_prefill_decode,
    check_taps,
    random_prompt,
    run_conformance,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = ["tiny-example-llama", "tiny-example-llama-tied"]
_models: dict[str, Model] = {}


def model_named(name: str) -> Model:
    if name not in _models:
        _models[name] = mlxrunner.load_model(FIXTURES / name)
    return _models[name]


@pytest.mark.parametrize("name", NAMES)
def test_conformance(name):
    ran = run_conformance(model_named(name), batch=2, prompt_len=10, draft_len=4, rounds=4)
    assert ran == ["prefill_decode", "taps+layer_index", "cache_rollback", "compiled_step"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), prompt_len=st.integers(1, 16), draft_len=st.integers(1, 7),
       rounds=st.integers(1, 4))
def test_conformance_on_random_settings(seed, prompt_len, draft_len, rounds):
    run_conformance(model_named("tiny-example-llama"), seed=seed, prompt_len=prompt_len,
                    draft_len=draft_len, rounds=rounds)


def test_every_single_tap():
    model = model_named("tiny-example-llama")
    check_taps(model, random_prompt(model.vocab_size, 2, 6, seed=1), [0, 1, 2])


def test_decode_across_the_kv_cache_growth_step():
    # KVCache grows its buffer 256 positions at a time; decode across that boundary.
    model = model_named("tiny-example-llama-tied")
    ids = random_prompt(model.vocab_size, 1, 262, seed=2)
    check_prefill_decode(model, ids, prefill_len=253)


def test_rollback_after_a_long_prompt():
    model = model_named("tiny-example-llama")
    ids = random_prompt(model.vocab_size, 1, 254, seed=3)
    check_cache_rollback(model, ids, draft_len=7, accepted=[2, 7, 0])
