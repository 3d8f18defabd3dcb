"""What generate takes, through the scheduler: a grammar's constraint per sequence and a
prefix cache. Each sequence's output (tokens, logprobs, finish reason, cached tokens) is what
``mlxrunner.generate`` gives it alone with the same constraint or a cache in the same state."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import mlxrunner
from mlxrunner import SamplerOptions
from mlxrunner import host as plugins
from mlxrunner.batch import BatchRequest, Scheduler
from mlxrunner.cache import PrefixCache
from mlxrunner.decode import compile_format

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo() -> Any:
    if "demo-qwen3.5" not in plugins.host().registry("models"):
        pytest.skip("the demo plugin (mlxrunner-demo) is not installed")
    return mlxrunner.load("demo-qwen3.5")


def test_constrained_rows_match_generate_beside_free_rows(demo: Any) -> None:
    model, eos = demo.model, frozenset(demo.stop_token_ids())
    grammar = compile_format(SCHEMA, demo.tokenizer, model.vocab_size, eos)
    prompts = [demo.tokenizer.encode(t) for t in ("def parse(line):", "x = {", "import os")]
    options = [SamplerOptions(temperature=0), SamplerOptions(temperature=0.9, seed=4),
               SamplerOptions(temperature=0.8, seed=2, logprobs=True, top_logprobs=3)]
    constrained = [True, True, False]
    budget = 24
    alone = [mlxrunner.generate(model, p, options=o, max_tokens=budget, eos_ids=eos,
                                constraint=grammar.constraint() if c else None)
             for p, o, c in zip(prompts, options, constrained)]
    scheduler = Scheduler(model, max_sequences=4)
    requests = [scheduler.submit(BatchRequest(p, o, budget, eos,
                                              constraint=grammar.constraint() if c else None))
                for p, o, c in zip(prompts, options, constrained)]
    scheduler.run_until_idle()
    for a, r, c in zip(alone, requests, constrained):
        assert r.tokens == a.tokens
        # a batched product over several rows rounds apart from a one-row one (BLAS blocks)
        assert [e["logprob"] for e in r.logprobs] == \
            pytest.approx([e["logprob"] for e in a.logprobs], abs=1e-4)
        assert [[i for i, _ in e["top_logprobs"]] for e in r.logprobs] == \
            [[i for i, _ in e["top_logprobs"]] for e in a.logprobs]
        assert r.finish_reason == a.finish_reason
        if c and r.finish_reason == "stop":
            text = demo.tokenizer.decode([t for t in r.tokens if t not in eos])
            assert set(json.loads(text)) == {"n", "ok"}


def test_a_prefix_hit_fills_the_caches_and_gives_the_cold_output(tiny: Any) -> None:
    for name in ("qwen3_5", "gemma4"):
        model = tiny(name)
        rng = np.random.default_rng(1)
        base = rng.integers(0, model.vocab_size, 11).tolist()
        follow = [base + rng.integers(0, model.vocab_size, n).tolist() for n in (6, 3)]
        options = [SamplerOptions(temperature=0), SamplerOptions(temperature=0.9, seed=7)]
        alone_cache = PrefixCache(model.make_cache, block=4)
        batch_cache = PrefixCache(model.make_cache, block=4)
        # the first prompt fills each cache the same way
        first = mlxrunner.generate(model, base, options=options[0], max_tokens=5,
                                   prefix_cache=alone_cache)
        scheduler = Scheduler(model, max_sequences=4)
        warm = scheduler.submit(BatchRequest(base, options[0], 5,
                                               prefix_cache=batch_cache))
        scheduler.run_until_idle()
        assert warm.tokens == first.tokens
        alone = [mlxrunner.generate(model, p, options=o, max_tokens=6,
                                    prefix_cache=alone_cache)
                 for p, o in zip([base, *follow], [options[0], *options])]
        cold = [mlxrunner.generate(model, p, options=o, max_tokens=6)
                for p, o in zip([base, *follow], [options[0], *options])]
        requests = [scheduler.submit(BatchRequest(p, o, 6, prefix_cache=batch_cache))
                    for p, o in zip([base, *follow], [options[0], *options])]
        scheduler.run_until_idle()
        for a, c, r in zip(alone, cold, requests):
            assert r.tokens == a.tokens == c.tokens
            assert r.stats.cached_tokens > 0
        assert requests[0].stats.cached_tokens == len(base)  # met whole: no prefill
        # the next turn: the first reply's end was stored too, as generate stores it
        turn = follow[0] + requests[1].tokens + [3, 4]
        again = mlxrunner.generate(model, turn, options=options[0], max_tokens=4,
                                   prefix_cache=alone_cache)
        request = scheduler.submit(BatchRequest(turn, options[0], 4, prefix_cache=batch_cache))
        scheduler.run_until_idle()
        assert request.tokens == again.tokens
        # the batch may have fed the reply's last token too (a step queued before the
        # budget ended it), which generate's last step leaves out
        assert again.stats.cached_tokens <= request.stats.cached_tokens <= \
            again.stats.cached_tokens + 1
        assert again.stats.cached_tokens > len(follow[0])


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_drafted_rows_with_a_prefix_cache_give_their_solo_outputs(tiny: Any, name: str) -> None:
    """A drafted sequence with the prefix cache joins the batch: a hit rebuilds its draft's
    session from the tapped states kept with the caches, and what it stores (its prompt's
    chunks, then the reply) keeps its taps for the next turn, as generate does alone."""
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.testing.speculative import random_draft

    model = tiny(name)
    draft = random_draft(model, "DFlash2DraftModel", seed=3)
    rng = np.random.default_rng(2)
    base = rng.integers(0, model.vocab_size, 11).tolist()
    prompts = [base] + [base + rng.integers(0, model.vocab_size, n).tolist() for n in (6, 3)]
    options = [SamplerOptions(temperature=0), SamplerOptions(temperature=0),
               SamplerOptions(temperature=0.9, seed=7)]
    alone_cache = PrefixCache(model.make_cache, block=4)
    batch_cache = PrefixCache(model.make_cache, block=4)
    first = mlxrunner.generate(model, base, options=options[0], max_tokens=5, draft=draft,
                               prefix_cache=alone_cache)
    scheduler = Scheduler(model, max_sequences=4)
    warm = scheduler.submit(BatchRequest(base, options[0], 5, draft=draft,
                                         prefix_cache=batch_cache))
    scheduler.run_until_idle()
    assert warm.tokens == first.tokens
    alone = [mlxrunner.generate(model, p, options=o, max_tokens=8, draft=draft,
                                prefix_cache=alone_cache) for p, o in zip(prompts, options)]
    cold = [mlxrunner.generate(model, p, options=o, max_tokens=8, draft=draft)
            for p, o in zip(prompts, options)]
    requests = [scheduler.submit(BatchRequest(p, o, 8, draft=draft, prefix_cache=batch_cache))
                for p, o in zip(prompts, options)]
    scheduler.run_until_idle()
    for a, c, r in zip(alone, cold, requests):
        assert r.tokens == a.tokens == c.tokens
        assert r.stats.cached_tokens > 0
        assert r.stats.as_dict()["mode"] == "speculative" and r.stats.rounds > 0
    assert requests[0].stats.cached_tokens == len(base)  # met whole: no prefill
    # the next turn starts from the sampled reply, stored with its taps
    turn = prompts[2] + requests[2].tokens + [3, 4]
    again = mlxrunner.generate(model, turn, options=options[2], max_tokens=6, draft=draft,
                               prefix_cache=alone_cache)
    request = scheduler.submit(BatchRequest(turn, options[2], 6, draft=draft,
                                            prefix_cache=batch_cache))
    scheduler.run_until_idle()
    assert request.tokens == again.tokens
    assert request.stats.cached_tokens > len(prompts[2])


def test_drafted_rows_under_a_grammar_give_their_solo_outputs(demo: Any) -> None:
    """A drafted sequence with a grammar joins the batch: its proposals are masked as alone
    (kept, redrawn from q under the mask, or cut), its verify rows drawn under the same
    masks; greedy and seeded rows give generate's tokens, beside a free drafted row."""
    model, draft, eos = demo.model, demo.draft, frozenset(demo.stop_token_ids())
    assert draft is not None  # the demo's DFlash2 draft
    grammar = compile_format(SCHEMA, demo.tokenizer, model.vocab_size, eos)
    prompts = [demo.tokenizer.encode(t) for t in ("def parse(line):", "x = {", "import os")]
    options = [SamplerOptions(temperature=0), SamplerOptions(temperature=0.9, seed=4),
               SamplerOptions(temperature=0.7, seed=9)]
    constrained = [True, True, False]
    budget = 24
    alone = [mlxrunner.generate(model, p, options=o, max_tokens=budget, eos_ids=eos,
                                draft=draft, constraint=grammar.constraint() if c else None)
             for p, o, c in zip(prompts, options, constrained)]
    scheduler = Scheduler(model, max_sequences=4)
    requests = [scheduler.submit(BatchRequest(p, o, budget, eos, draft=draft,
                                              constraint=grammar.constraint() if c else None))
                for p, o, c in zip(prompts, options, constrained)]
    scheduler.run_until_idle()
    for a, r, c in zip(alone, requests, constrained):
        assert r.tokens == a.tokens and r.finish_reason == a.finish_reason
        assert r.stats.rounds > 0
        if c and r.finish_reason == "stop":
            text = demo.tokenizer.decode([t for t in r.tokens if t not in eos])
            assert set(json.loads(text)) == {"n", "ok"}
