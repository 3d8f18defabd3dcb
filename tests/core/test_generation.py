"""Plain decoding: greedy equals a cache-free argmax loop, EOS and length stops, logprobs,
seeded sampling, and logprob requests decoding without the draft."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner import SamplerOptions

FIXTURE = (Path(__file__).resolve().parents[2] / "plugins" / "example-architecture" / "tests"
           / "fixtures" / "tiny-example-llama")


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("mlxrunner_example_architecture")
    return mlxrunner.load_model(FIXTURE)


def argmax_loop(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = model(mx.array([ids]))  # no cache: an independent path
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    return ids[len(prompt):]


GREEDY = SamplerOptions(temperature=0)


def test_greedy_equals_a_cache_free_argmax_loop(model):
    prompt = [3, 9, 4, 1, 5]
    result = mlxrunner.generate(model, prompt, options=GREEDY, max_tokens=20)
    assert result.tokens == argmax_loop(model, prompt, 20)
    assert result.finish_reason == "length" and result.stats.generated_tokens == 20


def test_stops_after_an_eos_token(model):
    prompt = [3, 9, 4, 1, 5]
    expected = argmax_loop(model, prompt, 6)
    eos = expected[3]
    result = mlxrunner.generate(model, prompt, options=GREEDY, max_tokens=20, eos_ids={eos})
    first = expected.index(eos)
    assert result.tokens == expected[:first + 1] and result.finish_reason == "stop"


def test_logprobs_are_the_log_softmax_of_raw_logits(model):
    prompt = [2, 7, 1]
    options = SamplerOptions(temperature=0, logprobs=True, top_logprobs=3)
    result = mlxrunner.generate(model, prompt, options=options, max_tokens=4)
    assert len(result.logprobs) == 4
    ids = list(prompt)
    for token, info in zip(result.tokens, result.logprobs):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        logp = np.array(logits - mx.logsumexp(logits))
        assert info["logprob"] == pytest.approx(float(logp[token]), abs=1e-4)
        top = [i for i, _ in info["top_logprobs"]]
        assert top == list(np.argsort(-logp, kind="stable")[:3])
        ids.append(token)


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    prompt = [4, 4, 2]
    runs = [mlxrunner.generate(model, prompt, options=SamplerOptions(temperature=1.0, seed=s),
                               max_tokens=24).tokens for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_logprob_requests_decode_without_the_draft(model):
    from mlxrunner.testing.speculative import random_draft

    pytest.importorskip("mlxrunner_dflash")
    draft = random_draft(model, "DFlash2DraftModel")
    options = SamplerOptions(temperature=0, logprobs=True)
    result = mlxrunner.generate(model, [1, 2, 3], options=options, max_tokens=5, draft=draft)
    assert result.stats.as_dict()["mode"] == "plain" and len(result.logprobs) == 5


@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
def test_chunked_prefill_gives_the_last_rows_logits_and_the_same_caches(model, chunk):
    """Any chunking (the last chunk full, partial or a single token) ends with the prompt's
    last-row logits and caches that continue exactly like a one-shot prefill's."""
    from mlxrunner.decode import prefill

    prompt = [3, 9, 4, 1, 5, 2, 8, 6]
    whole_cache, split_cache = model.make_cache(), model.make_cache()
    whole, _ = prefill(model, prompt, whole_cache, chunk=len(prompt))
    split, _ = prefill(model, prompt, split_cache, chunk=chunk)
    np.testing.assert_allclose(np.array(split), np.array(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(whole),
                               np.array(model(mx.array([prompt]))[:, -1, :]), rtol=1e-5,
                               atol=1e-5)
    step = mx.array([[7]])
    np.testing.assert_allclose(np.array(model(step, split_cache)),
                               np.array(model(step, whole_cache)), rtol=1e-5, atol=1e-5)


def test_a_prefill_forward_reads_the_head_of_its_last_row_only(model):
    """Inside last_logits_only (the core's prefill) an architecture passing its stream through
    mlxrunner.nn.head_rows gives the last position's logits alone, equal to that row of the
    full logits; outside it, every row's."""
    import mlxrunner.nn as mnn

    ids = mx.array([[3, 14, 15, 9, 2, 6, 5]])
    full = model(ids, model.make_cache())
    with mnn.last_logits_only():
        last = model(ids, model.make_cache())
    assert full.shape[1] == 7 and last.shape[1] == 1
    assert mx.allclose(last[:, 0], full[:, -1], atol=1e-5)
    assert model(ids, model.make_cache()).shape[1] == 7  # the switch ended with its block


def test_a_prefill_reads_no_logits_of_its_chunks_before_the_last(model, monkeypatch):
    """The core's prefill runs a prompt's chunks before its last inside caches_only, where
    head_rows gives no row (the forward's logits ``[B, 0, V]``), and its last chunk inside
    last_logits_only; the caches and logits are a one-shot prefill's."""
    import mlxrunner.nn as mnn
    from mlxrunner.decode import prefill

    rows: list[int] = []
    forward = type(model).__call__

    def spied(self, ids, *args, **kwargs):
        out = forward(self, ids, *args, **kwargs)
        rows.append((out[0] if isinstance(out, tuple) else out).shape[1])
        return out

    monkeypatch.setattr(type(model), "__call__", spied)
    prompt = [3, 9, 4, 1, 5, 2, 8]
    split_cache, whole_cache = model.make_cache(), model.make_cache()
    split, _ = prefill(model, prompt, split_cache, chunk=3)
    assert rows == [0, 0, 1]
    whole, _ = prefill(model, prompt, whole_cache, chunk=len(prompt))
    np.testing.assert_allclose(np.array(split), np.array(whole), rtol=1e-5, atol=1e-5)
    with mnn.caches_only():
        assert model(mx.array([prompt]), model.make_cache()).shape[1] == 0
    step = mx.array([[7]])
    np.testing.assert_allclose(np.array(model(step, split_cache)),
                               np.array(model(step, whole_cache)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("every, after_layers", [(1, [0, 1]), (2, [1]), (0, [])])
def test_a_prompt_chunk_is_handed_to_the_device_every_n_layers(model, monkeypatch, every,
                                                                after_layers):
    """With ``prompt_submit_layers`` n, a prefill's chunk of at least 64 rows hands the
    stream after every n-th layer but the last (3 layers here) to ``mx.async_eval``:
    the streams the prefill's taps give for those layers. Shorter chunks and forwards
    outside a prefill submit none, and the logits and caches are a chunk built whole's."""
    from mlxrunner import settings
    from mlxrunner.decode import prefill

    submitted: list[mx.array] = []
    real = mx.async_eval

    def spied(*arrays):
        submitted.extend(arrays)
        return real(*arrays)

    rows, layers, hidden = 64, 3, 32  # (64: the fewest rows a chunk submits)
    prompt = [(7 * i) % 60 + 3 for i in range(rows + 9)]
    whole_cache, cache = model.make_cache(), model.make_cache()
    with settings.overridden(prompt_submit_layers=0):
        whole, _ = prefill(model, prompt, whole_cache, chunk=rows)
    monkeypatch.setattr(mx, "async_eval", spied)
    with settings.overridden(prompt_submit_layers=every):
        # (a chunk of 64 rows, then one of 9)
        logits, tapped = prefill(model, prompt, cache, chunk=rows, taps=range(layers))
        model(mx.array([prompt]), model.make_cache())  # (no prefill: never submitted)
    assert tapped is not None and len(submitted) == len(after_layers)
    for stream, layer in zip(submitted, after_layers):
        assert mx.array_equal(stream, tapped[:, :rows, layer * hidden:(layer + 1) * hidden])
    assert mx.array_equal(logits, whole)
    for mine, theirs in zip(cache, whole_cache):
        assert all(mx.array_equal(a, b) for a, b in zip(mine.state, theirs.state))


def test_the_prompt_submit_switch_takes_a_whole_number():
    from mlxrunner import settings

    read = settings.Settings.from_environment
    assert read({}).prompt_submit_layers is None  # (the device's default)
    assert read({"MLXRUNNER_PROMPT_SUBMIT_LAYERS": " 3 "}).prompt_submit_layers == 3
    assert read({"MLXRUNNER_PROMPT_SUBMIT_LAYERS": "0"}).prompt_submit_layers == 0
    for bad in ("-1", "two", "1.5", "\u00b2", str(settings.MAX_LAYERS + 1)):
        with pytest.raises(settings.SettingsError, match="MLXRUNNER_PROMPT_SUBMIT_LAYERS="):
            read({"MLXRUNNER_PROMPT_SUBMIT_LAYERS": bad})
