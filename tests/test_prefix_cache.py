"""The prefix cache: a hit gives the very output of a cold run, for every cache kind (full
attention only: the example architecture; Gated DeltaNet recurrent state: Qwen3.5; sliding
rings that have wrapped and KV-shared layers: Gemma 4), partial hits, a chat's second turn,
block-boundary snapshots, the draft's session rebuilt from kept taps, LRU eviction."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

mx.set_default_device(mx.cpu)

import mlxrunner  # noqa: E402
from mlxrunner import generate  # noqa: E402
from mlxrunner.cache import PrefixCache  # noqa: E402
from mlxrunner.decode import Sampler, SamplerOptions, prefill  # noqa: E402
from mlxrunner_test_support import write_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "architectures" / "qwen3_5" / "tests" / "fixtures" / "tiny_alternating_hk1_hv3"
GEMMA = ROOT / "architectures" / "gemma4" / "tests" / "fixtures" / "e2b"
GREEDY = SamplerOptions(temperature=0.0)


def _example(tmp_path: Path):
    pytest.importorskip("mlxrunner_example_architecture")
    return mlxrunner.load_model(write_model_folder(tmp_path / "tiny"), dtype="float32")


def _qwen(tmp_path: Path):
    pytest.importorskip("mlxrunner_qwen3_5")
    if not (QWEN / "config.json").exists():
        pytest.skip(f"no tiny Qwen3.5 checkpoint at {QWEN}")
    return mlxrunner.load_model(QWEN, dtype="float32")


def _gemma(tmp_path: Path):
    """Gemma 4 with a window of 8: every prompt here wraps its rings."""
    pytest.importorskip("mlxrunner_gemma4")
    if not (GEMMA / "config.json").exists():
        pytest.skip(f"no tiny Gemma 4 checkpoint at {GEMMA}")
    folder = tmp_path / "gemma4"
    shutil.copytree(GEMMA, folder)
    config = json.loads((folder / "config.json").read_text())
    assert (config.get("text_config") or config)["sliding_window"] == 8
    return mlxrunner.load_model(folder, dtype="float32")


MODELS = {"kv-only": _example, "recurrent": _qwen, "ring-wrapped": _gemma}


def _prompt(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, model.vocab_size, n).tolist()


@pytest.fixture(params=list(MODELS))
def model(request, tmp_path):
    return MODELS[request.param](tmp_path)


def _run(model, prompt, cache=None, options=GREEDY, max_tokens=10):
    return generate(model, prompt, options=options, max_tokens=max_tokens, prefix_cache=cache)


def test_hits_give_the_cold_output(model):
    kinds = {type(c).__name__ for c in model.make_cache() if c is not None}
    cache = PrefixCache(model.make_cache, block=8)
    first = _prompt(model, 21, seed=1)
    cold = _run(model, first)
    warm = _run(model, first, cache)
    assert warm.tokens == cold.tokens and warm.stats.cached_tokens == 0

    # the next turn: the prompt, the reply and more (what a chat sends next)
    second = first + cold.tokens + _prompt(model, 7, seed=2)
    turn = _run(model, second, cache)
    assert turn.tokens == _run(model, second).tokens
    # the whole first exchange but the reply's last token (never run through the model)
    assert turn.stats.cached_tokens == len(first) + len(cold.tokens) - 1

    # a prompt that leaves the first one after 13 tokens
    branch = first[:13] + _prompt(model, 9, seed=3)
    hit = _run(model, branch, cache)
    assert hit.tokens == _run(model, branch).tokens
    if kinds == {"KVCache"}:
        assert hit.stats.cached_tokens == 13  # keys and values are cut anywhere
    else:
        assert hit.stats.cached_tokens == 0  # no snapshot at 13 (rings, recurrent state)

    # the very same prompt again: nothing left to run (its logits were kept)
    again = _run(model, second, cache)
    assert again.tokens == turn.tokens
    assert again.stats.cached_tokens == len(second)


def test_sampled_hit_equals_cold_with_the_same_seed(model):
    options = SamplerOptions(temperature=1.0, seed=7)
    cache = PrefixCache(model.make_cache, block=8)
    first = _prompt(model, 17, seed=4)
    reply = _run(model, first, cache, options).tokens
    second = first + reply + _prompt(model, 5, seed=5)
    warm = _run(model, second, cache, options)
    assert warm.stats.cached_tokens > len(first)
    assert warm.tokens == _run(model, second, None, options).tokens


def test_snapshots_at_block_boundaries_restore_exactly(model):
    """Stored at each chunk's end (chunks of 8, blocks of 8): a prompt sharing 16 tokens
    resumes at 16, and its logits are those of a cold prefill in the same chunks."""
    cache = PrefixCache(model.make_cache, block=8)
    first = _prompt(model, 24, seed=6)
    caches = model.make_cache()
    prefill(model, first, caches, chunk=8, on_chunk=lambda end: cache.store(first[:end], caches))
    other = first[:19] + _prompt(model, 6, seed=7)
    hit = cache.lookup(other)
    kinds = {type(c).__name__ for c in model.make_cache() if c is not None}
    assert hit.length == (19 if kinds == {"KVCache"} else 16)
    warm, _ = prefill(model, other, hit.caches, chunk=8, start=hit.length)
    cold, _ = prefill(model, other, model.make_cache(), chunk=8)
    if hit.length == 16:  # resumed at a chunk boundary: the very chunks, the very bits
        assert mx.array_equal(warm, cold).item()
    else:
        assert mx.allclose(warm, cold, atol=1e-5).item()


def test_eviction_keeps_the_budget_and_drops_the_least_recent(tmp_path):
    model = _example(tmp_path)
    probe = PrefixCache(model.make_cache, block=8)
    prompts = [_prompt(model, 16, seed=10 + i) for i in range(3)]
    caches = model.make_cache()
    prefill(model, prompts[0], caches)
    probe.store(prompts[0], caches)
    one = probe.bytes  # two blocks of one prompt
    assert one > 0
    cache = PrefixCache(model.make_cache, block=8, budget_bytes=2 * one)
    for p in prompts[:2]:
        caches = model.make_cache()
        prefill(model, p, caches)
        cache.store(p, caches)
    assert cache.bytes == 2 * one
    assert cache.lookup(prompts[0] + [5]).length == 16  # now the most recent
    caches = model.make_cache()
    prefill(model, prompts[2], caches)
    cache.store(prompts[2], caches)
    assert cache.bytes <= 2 * one
    assert cache.lookup(prompts[1] + [5]).length == 0  # the least recent: gone
    assert cache.lookup(prompts[0] + [5]).length == 16
    assert cache.lookup(prompts[2] + [5]).length == 16


def test_speculative_hit_rebuilds_the_draft_session(tmp_path):
    pytest.importorskip("mlxrunner_dflash")
    from mlxrunner.testing.speculative import random_draft

    model = _qwen(tmp_path)
    draft = random_draft(model, "DFlash2DraftModel", seed=3)
    cache = PrefixCache(model.make_cache, block=8)
    first = _prompt(model, 19, seed=8)
    reply = generate(model, first, options=GREEDY, max_tokens=9, draft=draft,
                     prefix_cache=cache)
    assert reply.tokens == _run(model, first, max_tokens=9).tokens
    second = first + reply.tokens + _prompt(model, 5, seed=9)
    warm = generate(model, second, options=GREEDY, max_tokens=12, draft=draft,
                    prefix_cache=cache)
    # what the caches were fed: the whole reply where a plain step queued its last token,
    # else all but the last (a round feeds no token past the ones it kept)
    fed = len(first) + len(reply.tokens)
    assert warm.stats.cached_tokens in (fed - 1, fed)
    assert warm.tokens == _run(model, second, max_tokens=12).tokens
    # the draft's context was rebuilt from the kept taps: it proposes what a session
    # prefilled cold does (with an empty context it would not)
    taps = tuple(draft.taps)
    third = second + _prompt(model, 3, seed=11)
    sessions = []
    for hit in (cache.lookup(third, taps), None):
        session = draft.new_session(Sampler(GREEDY, model.vocab_size))
        session.extend_tokens(third)
        caches = model.make_cache() if hit is None else hit.caches
        start = 0 if hit is None else hit.length
        if hit is not None:
            assert hit.length == len(second) and hit.tapped is not None
            session.prefill(hit.tapped)

        def to_draft(tapped, session=session):
            session.prefill(tapped)
            return list(session.state)

        prefill(model, third, caches, taps=taps, on_taps=to_draft, start=start)
        sessions.append(session)
    warm_q, cold_q = (s.propose(7, len(third), 3).distribution().probs for s in sessions)
    assert mx.allclose(warm_q, cold_q, atol=1e-5).item()


def test_the_default_budget_scales_with_the_model_and_the_setting_overrides_it():
    """Four times the weights, between 256 MiB and 2 GiB (and at most an eighth of the
    machine): a 135M model's server no longer keeps 2 GiB of state; MLXRUNNER_PREFIX_CACHE_MIB
    says otherwise."""
    from mlxrunner import settings
    from mlxrunner.cache import KVCache, default_prefix_budget, prefix_cache_for

    mib = 1 << 20
    assert default_prefix_budget(98 * mib) == min(392 * mib, default_prefix_budget(None))
    assert default_prefix_budget(10 * mib) == min(256 * mib, default_prefix_budget(None))
    assert default_prefix_budget(4000 * mib) == default_prefix_budget(None) <= 2048 * mib

    def make_cache():
        return [KVCache()]

    assert prefix_cache_for(make_cache, 98 * mib).budget_bytes == default_prefix_budget(
        98 * mib)
    with settings.overridden(prefix_cache_mib=64):
        assert prefix_cache_for(make_cache, 98 * mib).budget_bytes == 64 * mib
