"""Speculative decoding inside the batch (mlxrunner.batch): every drafted sequence's block is
verified in one batched target forward, each row accepts with its own sampler and rolls back
to what it committed (full KV, rings, recurrent state), sequences without a draft share the
batch; each sequence gives exactly what it gives alone (greedy: plain decoding's tokens;
seeded sampling: its solo speculative draws)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import mlxrunner
from mlxrunner import SamplerOptions, settings
from mlxrunner.batch import BatchRequest, Scheduler
from mlxrunner.cache import PrefixCache
from mlxrunner.decode import DepthController
from mlxrunner.testing.speculative import ScriptedDraft, random_draft, speculative_tokens

GREEDY = SamplerOptions(temperature=0)
SAMPLED = SamplerOptions(temperature=0.8, seed=11)


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _scripted(model, prompts, budgets):
    """Each prompt's solo greedy tokens, and a scripted draft of each that knows them (wrong
    on purpose once a round, so every accepted length occurs)."""
    alone = [mlxrunner.generate(model, p, options=GREEDY, max_tokens=m).tokens
             for p, m in zip(prompts, budgets)]
    return alone, [ScriptedDraft.for_script(model, p + a + [0] * 16, block_size=5)
                   for p, a in zip(prompts, alone)]


def _run(model, requests, max_sequences):
    scheduler = Scheduler(model, max_sequences=max_sequences)
    for request in requests:
        scheduler.submit(request)
    scheduler.run_until_idle()
    return requests


def test_scripted_drafts_roll_back_every_length_in_a_batch(model):
    # the script is each prompt's greedy continuation: the draft is right except where
    # it is wrong on purpose (every accepted length occurs); lockstep: depths follow
    # acceptance alone (chosen from measured round times, drafting paused on a loaded
    # machine, and then no round rolled back)
    prompts = _prompts(model.vocab_size, [6, 11, 4], seed=5)
    budgets = [14, 9, 12]
    alone, drafts = _scripted(model, prompts, budgets)
    requests = [BatchRequest(prompts[0], GREEDY, budgets[0], draft=drafts[0]),
                BatchRequest(prompts[1], GREEDY, budgets[1]),  # no draft: shares the batch
                BatchRequest(prompts[2], GREEDY, budgets[2], draft=drafts[2])]
    with settings.overridden(lockstep=True):
        _run(model, requests, 2)
    for request, want in zip(requests, alone):
        assert request.tokens == want
    for drafted in (requests[0], requests[2]):  # rounds committed several tokens
        assert drafted.stats.target_forwards < len(drafted.tokens)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_random_dflash2_drafts_in_a_batch_give_solo_outputs(tiny, name):
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    model = tiny(name)
    draft = random_draft(model, "DFlash2DraftModel", seed=3)
    prompts = _prompts(model.vocab_size, [7, 12, 5], seed=6)
    options = [GREEDY, SAMPLED, SamplerOptions(temperature=0.6, top_k=30, seed=4)]
    budgets = [12, 10, 9]
    alone = [speculative_tokens(model, draft, p, m, options=o)[0]
             for p, o, m in zip(prompts, options, budgets)]
    assert alone[0] == mlxrunner.generate(model, prompts[0], options=GREEDY,
                                          max_tokens=budgets[0]).tokens
    requests = [BatchRequest(p, o, m, draft=draft) for p, o, m in zip(prompts, options, budgets)]
    for request, want in zip(_run(model, requests, 3), alone):
        assert request.tokens == want and request.finish_reason == "length"


def test_a_draft_with_logprobs_is_refused(model):
    draft = ScriptedDraft.for_script(model, [1] * 32)
    with pytest.raises(ValueError, match="without a draft"):
        Scheduler(model).submit(BatchRequest([1, 2], SamplerOptions(logprobs=True), 4,
                                             draft=draft))


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_drafted_rows_pause_and_resume_drafting(model, adaptive, monkeypatch):
    """With every drafted sequence greedy, the batch picks its depth from measured rounds,
    none among them (plain steps, drafting paused: the target's tapped states wait for the
    draft and reach it in one commit when drafting resumes; the scripted draft checks that
    its context then holds every position). Outputs stay the solo greedy ones. A draft of
    fixed depth (DFlash2: its whole block costs the same at any depth) drafts its whole
    block or none, so its rounds verify one width (each width is a trace of its own)."""
    prompts = _prompts(model.vocab_size, [6, 9], seed=8)
    budgets = [24, 20]
    alone, drafts = _scripted(model, prompts, budgets)
    for draft in drafts:
        draft.adaptive_depth = adaptive
    chosen = []
    choose = DepthController.choose
    monkeypatch.setattr(DepthController, "choose",
                        lambda self, limit: chosen.append(choose(self, limit)) or chosen[-1])
    scheduler = Scheduler(model, max_sequences=2)
    requests = [scheduler.submit(BatchRequest(p, GREEDY, m, draft=d))
                for p, m, d in zip(prompts, budgets, drafts)]
    scheduler.run_until_idle()
    for request, want in zip(requests, alone):
        assert request.tokens == want
    # the controller's warm-up visits the full depth, 1, the middle and none, or for a
    # fixed-depth draft the full depth and none
    assert {0, 1, 4} <= set(chosen) if adaptive else set(chosen) == {0, 4}


@pytest.mark.parametrize("seed, paused", [(None, True), (7, False)])
def test_sampled_drafted_rows_without_a_seed_follow_measured_rounds(model, monkeypatch, seed,
                                                                    paused):
    """A sampled sequence without a seed draws at random whatever depths its rounds draft,
    so the batch's controller chooses them from measured rounds, as the sequence alone does,
    pausing drafting where it does not pay (drafting the whole block every round made the
    demo pair's batch of one 1.5x slower than alone on a CPU); a seeded one drafts its
    draft's depth every round, so that its draws are its solo run's."""
    monkeypatch.setattr(DepthController, "choose", lambda self, limit: 0)  # never pays
    prompts = _prompts(model.vocab_size, [6, 9], seed=12)
    drafts = [ScriptedDraft.for_script(model, p + [0] * 40, block_size=5) for p in prompts]
    options = SamplerOptions(temperature=0.8, seed=seed)
    scheduler = Scheduler(model, max_sequences=2)
    requests = [scheduler.submit(BatchRequest(p, options, 20, draft=d))
                for p, d in zip(prompts, drafts)]
    scheduler.run_until_idle()
    for request in requests:
        assert len(request.tokens) == 20
        assert (request.stats.drafted == 0) == paused


GEMMA4_FIXTURES = (Path(__file__).resolve().parents[2] / "architectures" / "gemma4" / "tests"
                   / "fixtures")


@pytest.mark.parametrize("assistant", ["e2b_plain", "e2b_ordered"])
def test_gemma4_assistant_rows_give_their_solo_greedy_outputs(tmp_path, assistant,
                                                              monkeypatch):
    """The assistant attends over its target's caches: in the batch it reads its own row's
    (not the solo caches it started with, nor another sequence's), rows joining and leaving,
    the rounds drafting at full depth (lockstep) so the rings wrap."""
    pytest.importorskip("mlxrunner_gemma4", reason="the gemma4 plugin is not installed")
    from mlxrunner_test_support import write_tokenizer

    folder = tmp_path / "e2b"
    shutil.copytree(GEMMA4_FIXTURES / "e2b", folder)
    (folder / "reference.npz").unlink(missing_ok=True)
    write_tokenizer(folder)
    bundle = mlxrunner.load(folder, draft=GEMMA4_FIXTURES / "assistant" / assistant)
    model, draft = bundle.model, bundle.draft
    proposed = []
    made = type(draft).new_session

    def counted(self, sampler):  # count the rounds' proposals
        session = made(self, sampler)
        propose = session.propose

        def counting(*args):
            proposed.append(args)
            return propose(*args)

        session.propose = counting
        return session

    monkeypatch.setattr(type(draft), "new_session", counted)
    prompts = _prompts(model.vocab_size, [6, 11, 4, 9, 7], seed=8)
    budgets = [30, 14, 24, 12, 20]
    with settings.overridden(lockstep=True):
        alone = [mlxrunner.generate(model, p, options=GREEDY, max_tokens=m).tokens
                 for p, m in zip(prompts, budgets)]
        one = _run(model, [BatchRequest(prompts[0], GREEDY, budgets[0], draft=draft)], 1)
        assert one[0].tokens == alone[0]
        # five rows through two or three places: they join as others leave
        proposed.clear()
        for places in (2, 3):
            scheduler = Scheduler(model, max_sequences=places)
            requests = [BatchRequest(p, GREEDY, m, draft=draft)
                        for p, m in zip(prompts, budgets)]
            for request in requests:
                scheduler.submit(request)
                scheduler.step()
            scheduler.run_until_idle()
            for request, want in zip(requests, alone):
                assert request.error is None and request.tokens == want
        assert len(proposed) > 40  # rounds drafted, in every row
        # with a prefix cache: the second time round every prompt is met before
        cache = PrefixCache(model.make_cache, block=4)
        for turn in (1, 2):
            requests = [BatchRequest(p, GREEDY, m, draft=draft, prefix_cache=cache)
                        for p, m in zip(prompts, budgets)]
            _run(model, requests, 3)
            for request, want in zip(requests, alone):
                assert request.error is None and request.tokens == want
                assert (request.stats.cached_tokens > 0) == (turn == 2)


def test_generate_batch_with_a_draft_equals_generate_per_prompt(tiny):
    """One draft for all prompts (a logprob request decodes without it, as alone), then one
    per prompt, with on_token ending one prompt early."""
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    model = tiny("qwen3_5")
    draft = random_draft(model, "DFlash2DraftModel", seed=3)
    prompts = _prompts(model.vocab_size, [7, 12, 5], seed=9)
    options = [GREEDY, SAMPLED, SamplerOptions(temperature=0.7, seed=5, logprobs=True)]
    alone = [mlxrunner.generate(model, p, options=o, max_tokens=10, draft=draft)
             for p, o in zip(prompts, options)]
    together = mlxrunner.generate_batch(model, prompts, options=options, max_tokens=10,
                                        draft=draft)
    for a, t in zip(alone, together):
        assert t.tokens == a.tokens
        assert t.stats.as_dict()["mode"] == a.stats.as_dict()["mode"]
    assert len(together[2].logprobs) == len(together[2].tokens)
    assert [e["logprob"] for e in together[2].logprobs] == \
        pytest.approx([e["logprob"] for e in alone[2].logprobs], abs=1e-4)
    seen: list[tuple[int, int]] = []

    def on_token(i, token):
        seen.append((i, token))
        return i == 1 and len([s for s in seen if s[0] == 1]) == 3

    each = mlxrunner.generate_batch(model, prompts[:2], options=options[:2], max_tokens=10,
                                    draft=[draft, None], on_token=on_token)
    assert each[0].tokens == alone[0].tokens and each[0].stats.rounds > 0
    plain = mlxrunner.generate(model, prompts[1], options=options[1], max_tokens=10)
    assert each[1].tokens == plain.tokens[:3] and each[1].finish_reason == "stop"
    assert [t for i, t in seen if i == 0] == alone[0].tokens
    with pytest.raises(ValueError, match="one draft each"):
        mlxrunner.generate_batch(model, prompts, draft=[draft])


def _break(draft, method: str, at: int) -> list:
    """Make ``draft``'s sessions raise from the ``at``-th call of ``method`` on (counted
    over all its sessions: the list returned)."""
    made, calls = draft.new_session, []

    def new_session(sampler):
        session = made(sampler)
        original = getattr(session, method)

        def broken(*args):
            calls.append(args)
            if len(calls) >= at:
                raise RuntimeError("the draft broke")
            return original(*args)

        setattr(session, method, broken)
        return session

    draft.new_session = new_session
    return calls


@pytest.mark.parametrize("method, at", [("propose", 2), ("commit", 2), ("extend_tokens", 3),
                                        ("prefill", 1)])
def test_a_failing_draft_leaves_its_row_decoding_without_it(model, caplog, method, at):
    """A draft whose session raises mid-generation (its proposal, its commit, the tokens it
    is handed, its prefill): its sequence goes on without drafting (plain decoding's
    tokens), the other rows, drafted or not, are untouched."""
    prompts = _prompts(model.vocab_size, [6, 9, 5], seed=12)
    budgets = [16, 14, 12]
    alone, drafts = _scripted(model, prompts, budgets)
    failing = drafts[0]
    calls = _break(failing, method, at)
    requests = [BatchRequest(prompts[0], GREEDY, budgets[0], draft=failing),
                BatchRequest(prompts[1], GREEDY, budgets[1], draft=drafts[1]),
                BatchRequest(prompts[2], GREEDY, budgets[2])]
    with settings.overridden(lockstep=True):  # every step a round at full depth
        _run(model, requests, 3)
    for request, want in zip(requests, alone):
        assert request.error is None and request.finish_reason == "length"
        assert request.tokens == want
    assert len(calls) == at  # it was not asked again
    assert requests[1].stats.target_forwards < len(requests[1].tokens)  # still drafting
    assert "a draft failed (RuntimeError: the draft broke)" in caplog.text


@pytest.mark.parametrize("method, at", [("propose", 2), ("commit", 2), ("extend_tokens", 3),
                                        ("prefill", 1)])
def test_a_failing_draft_is_raised_by_generate(model, caplog, method, at):
    """generate raises what its draft raised (its tokens would be plain decoding's, so a
    broken draft would otherwise pass the exactness checks plugin authors run), as a
    batch request with ``strict_draft`` ends with it."""
    prompt = _prompts(model.vocab_size, [6], seed=12)[0]
    _, (draft,) = _scripted(model, [prompt], [16])
    calls = _break(draft, method, at)
    with settings.overridden(lockstep=True), pytest.raises(RuntimeError, match="draft broke"):
        mlxrunner.generate(model, prompt, options=GREEDY, max_tokens=16, draft=draft)
    assert "draft broke" not in caplog.text  # raised, not also logged
    calls.clear()
    request = BatchRequest(prompt, GREEDY, 16, draft=draft, strict_draft=True)
    with settings.overridden(lockstep=True):
        _run(model, [request], 1)
    assert request.finish_reason == "error" and "draft broke" in str(request.error)


def test_a_cache_kind_without_a_batched_form_decodes_one_at_a_time(caplog):
    """A model whose caches have no batched form (a plugin's own cache kind) still serves a
    scheduler of many rows: its sequences run one at a time, each with its solo output."""
    from mlxrunner.testing.speculative import ToyTarget

    target = ToyTarget({"vocab_size": 24, "hidden_size": 16, "seed": 2})
    prompts = _prompts(24, [4, 6, 5], seed=3)
    alone = [mlxrunner.generate(target, p, options=GREEDY, max_tokens=7).tokens for p in prompts]
    with caplog.at_level("WARNING", logger="mlxrunner.batch"):
        scheduler = Scheduler(target, max_sequences=4)
    assert "no batched form of TokenHistoryCache" in caplog.text
    requests = [scheduler.submit(BatchRequest(p, GREEDY, 7)) for p in prompts]
    scheduler.run_until_idle()
    assert [r.tokens for r in requests] == alone
