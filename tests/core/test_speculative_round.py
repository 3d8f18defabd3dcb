"""The speculative round, and generation with a draft (the scheduler with one row), on a
target small enough to enumerate (no plugins needed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner import GenerationResult, SamplerOptions, generate, settings
from mlxrunner.decode import DepthController, SpeculativeStats, can_speculate, decide
from mlxrunner.plugin import Distribution, DraftProposal, Sampler
from mlxrunner.testing.speculative import (
    ScriptedDraft,
    ToyTarget,
    check_speculative_greedy,
    plain_tokens,
    speculative_tokens,
)

mx.set_default_device(mx.cpu)
GREEDY = SamplerOptions(temperature=0)


def toy(vocab: int = 16, seed: int = 0, scale: float = 2.0) -> ToyTarget:
    return ToyTarget({"vocab_size": vocab, "hidden_size": 16, "seed": seed, "scale": scale})


# -- step 5: acceptance, residual and bonus --------------------------------------------------------


def _dense(rows):
    return Distribution(mx.array(rows, dtype=mx.float32))


def _emitted_frequencies(p: Distribution, q: Distribution, runs: int) -> np.ndarray:
    """One-draft rounds, the draft drawn from q: the first emitted token is the draft if
    accepted, else the residual's draw; its distribution must be p's first row."""
    vocab = p.probs.shape[-1]
    q_dense = np.array(q.dense(vocab), dtype=np.float64)[0]
    rng = np.random.default_rng(0)
    counts = np.zeros(vocab)
    for seed in range(runs):
        draft = int(rng.choice(vocab, p=q_dense / q_dense.sum()))
        sampler = Sampler(SamplerOptions(temperature=1.0, seed=seed), vocab)
        d = decide(sampler, p, q, mx.array([draft], dtype=mx.int32))
        accepted = int(d.accepted.item())
        counts[draft if accepted else int(d.fix_tokens[0].item())] += 1
    return counts / runs


RESIDUAL_EXAMPLES = [
    # p (2 rows: the draft's row, the bonus row), q, normalise(max(p - q, 0))
    ("dense q", [[0.5, 0.3, 0.2, 0.0], [0.25] * 4], _dense([[0.2, 0.5, 0.1, 0.2]]),
     [0.75, 0.0, 0.25, 0.0]),
    ("sparse q", [[0.5, 0.3, 0.2, 0.0], [0.25] * 4],
     Distribution(mx.array([[0.6, 0.4]]), mx.array([[2, 0]], dtype=mx.int32)),
     [0.25, 0.75, 0.0, 0.0]),
    ("point-mass q", [[0.5, 0.5, 0.0, 0.0], [0.25] * 4],
     DraftProposal.point_mass(mx.array([0])).distribution(), [0.0, 1.0, 0.0, 0.0]),
    ("q outside p", [[0.0, 0.0, 1.0, 0.0], [0.25] * 4], _dense([[0.0, 0.0, 0.0, 1.0]]),
     [0.0, 0.0, 1.0, 0.0]),
]


@pytest.mark.parametrize("name, p_rows, q, residual", RESIDUAL_EXAMPLES,
                         ids=[e[0] for e in RESIDUAL_EXAMPLES])
def test_residual_examples_and_the_emitted_token_follows_p(name, p_rows, q, residual):
    p = _dense(p_rows)
    sampler = Sampler(SamplerOptions(temperature=1.0, seed=0), 4)
    got = np.array(sampler.residual(p[0:1], q).dense(4))[0]
    np.testing.assert_allclose(got, residual, atol=1e-6)
    freq = _emitted_frequencies(p, q, runs=1000)
    # binomial standard error at 1000 runs is at most 0.016: allow 4 of them
    np.testing.assert_allclose(freq, p_rows[0], atol=0.064)


def test_greedy_round_accepts_up_to_the_first_disagreement():
    # point masses: p argmax per row (3 drafts + bonus row), drafts agree on the first two
    p = Distribution(mx.ones((4, 1)), mx.array([[5], [6], [7], [8]], dtype=mx.int32))
    sampler = Sampler(GREEDY, 16)
    drafts = mx.array([5, 6, 9], dtype=mx.int32)
    d = decide(sampler, p, DraftProposal.point_mass(drafts).distribution(), drafts)
    assert int(d.accepted.item()) == 2
    assert int(d.fix_tokens[2].item()) == 7  # the target's own choice at the rejection
    drafts = mx.array([5, 6, 7], dtype=mx.int32)
    d = decide(sampler, p, DraftProposal.point_mass(drafts).distribution(), drafts)
    assert int(d.accepted.item()) == 3 and int(d.fix_tokens[3].item()) == 8  # bonus


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_shortcut_decides_as_the_general_round_on_point_masses(seed):
    """Greedy rounds compare argmaxes instead of drawing: on point masses the general round
    (acceptance tests, residuals, bonus draw) decides the same, from the same keys."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 8))
    target = rng.integers(0, 4, size=n + 1)
    drafts_np = np.where(rng.random(n) < 0.7, target[:n], rng.integers(0, 4, size=n))
    p = Distribution(mx.ones((n + 1, 1)), mx.array(target[:, None], dtype=mx.int32))
    drafts = mx.array(drafts_np, dtype=mx.int32) if n else None
    q = DraftProposal.point_mass(drafts).distribution() if n else None
    greedy, general = Sampler(GREEDY, 4), Sampler(SamplerOptions(temperature=1.0, seed=seed), 4)
    fast, slow = decide(greedy, p, q, drafts), decide(general, p, q, drafts)
    accepted = int(slow.accepted.item())
    assert int(fast.accepted.item()) == accepted
    assert int(fast.fix_tokens[accepted].item()) == int(slow.fix_tokens[accepted].item())
    assert greedy.draws == general.draws == 2 * n + 1


def test_a_round_draws_everything_before_one_sync_from_a_fixed_number_of_keys():
    p = _dense([[0.5, 0.5, 0, 0]] * 4)
    q = _dense([[0.25] * 4] * 3)
    sampler = Sampler(SamplerOptions(temperature=1.0, seed=3), 4)
    decide(sampler, p, q, mx.array([0, 1, 2], dtype=mx.int32))
    assert sampler.draws == 3 + 3 + 1  # uniforms, residual draws, bonus draw


# -- the loop ----------------------------------------------------------------------------------


def test_greedy_speculative_equals_plain_on_the_toy_target():
    stats = check_speculative_greedy(toy(), max_tokens=60, prompts=2, prompt_len=5,
                                     random_drafts=False)
    assert all(s.generated_tokens == 60 for s in stats)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 9, 17])
def test_the_budget_is_met_exactly(max_tokens):
    target = toy()
    prompt = [1, 2, 3]
    plain = plain_tokens(target, prompt, max_tokens)
    draft = ScriptedDraft.for_script(target, prompt + plain, block_size=8,
                                     wrong_every_round=False)
    tokens, stats = speculative_tokens(target, draft, prompt, max_tokens)
    assert tokens == plain and len(tokens) == max_tokens
    assert stats.generated_tokens == max_tokens
    # every round drafted no more than the budget left minus the bonus
    assert sum(stats.depths.values()) == stats.rounds
    assert max(stats.depths, default=0) <= max(0, max_tokens - 2)


def test_an_agreeing_draft_needs_fewer_target_forwards_than_tokens():
    target = toy()
    prompt = [4, 5, 6]
    plain = plain_tokens(target, prompt, 100)
    draft = ScriptedDraft.for_script(target, prompt + plain, block_size=8,
                                     wrong_every_round=False)
    result = generate(target, prompt, draft=draft, options=GREEDY, max_tokens=100)
    assert isinstance(result, GenerationResult)
    assert result.tokens == plain
    stats = result.stats
    assert stats.acceptance_rate > 0.95
    assert stats.target_forwards < len(plain) / 4  # 1 prefill + ~99 / 8 rounds
    assert stats.tau > 6.0  # (the depth controller's warm-up drafts 1, 4 and none once)
    d = stats.as_dict()
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "tau", "tokens_per_second",
                "target_forwards", "generated_tokens"):
        assert key in d
    assert d["generated_tokens"] == 100 and d["accepted"] == stats.accepted


def test_eos_inside_an_accepted_run_ends_generation():
    target = toy()
    prompt = [1, 2, 3]
    plain = plain_tokens(target, prompt, 40)
    # an EOS that first appears well inside the output
    index = next(i for i, t in enumerate(plain) if i >= 4 and t not in plain[:i])
    eos = plain[index]
    expected = plain_tokens(target, prompt, 40, eos_ids={eos})
    assert expected == plain[:index + 1]
    draft = ScriptedDraft.for_script(target, prompt + plain, block_size=8,
                                     wrong_every_round=False)
    result = generate(target, prompt, draft=draft, options=GREEDY, max_tokens=40,
                      eos_ids={eos})
    assert result.tokens == expected
    assert result.finish_reason == "stop"
    # the round that met EOS had accepted drafts after it: they were dropped
    assert result.stats.committed_in_rounds > result.stats.generated_tokens - 1


def test_seeded_sampling_is_reproducible_and_streams_every_token():
    target = toy(vocab=32)
    prompt = [1, 2, 3]
    options = SamplerOptions(temperature=0.9, top_k=10, seed=7)
    plain = plain_tokens(target, prompt, 30, options=SamplerOptions(temperature=0))
    draft = ScriptedDraft.for_script(target, prompt + plain)
    seen: list[int] = []
    a = generate(target, prompt, draft=draft, options=options, max_tokens=30,
                 on_token=seen.append)
    b = generate(target, prompt, draft=draft, options=options, max_tokens=30)
    assert a.tokens == b.tokens == seen and len(seen) == 30


def test_logprob_requests_do_not_draft():
    assert can_speculate(SamplerOptions())
    assert not can_speculate(SamplerOptions(logprobs=True))
    assert not can_speculate(SamplerOptions(top_logprobs=3))
    target = toy()
    draft = ScriptedDraft.for_script(target, [0] * 10)
    result = generate(target, [1, 2], draft=draft, max_tokens=6,
                      options=SamplerOptions(temperature=0, logprobs=True))
    assert len(result.logprobs) == 6 and not isinstance(result.stats, SpeculativeStats)


# -- the depth controller ------------------------------------------------------------------------


def _drive(controller: DepthController, accept_rate: float, cost, rounds: int = 300,
           seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    depth = 0
    for _ in range(rounds):
        depth = controller.choose(7)
        accepted = 0
        while accepted < depth and rng.random() < accept_rate:
            accepted += 1
        controller.update(depth, accepted, cost(depth))
    return controller.best(7)


def test_depth_controller_goes_deep_when_drafts_are_cheap_and_good():
    assert _drive(DepthController(7), 0.9, lambda d: 1.0 + 0.02 * d) == 7


def test_depth_controller_stays_shallow_when_drafts_are_poor_or_costly():
    assert _drive(DepthController(7), 0.1, lambda d: 1.0 + 0.3 * d) <= 1
    middle = _drive(DepthController(7), 0.7, lambda d: 1.0 + 0.25 * d)
    assert 1 <= middle <= 5
    # the optimum of E(d) / T(d) with a = 0.7 and T = 1 + 0.25 d
    expected = [(1 - 0.7 ** (d + 1)) / 0.3 / (1 + 0.25 * d) for d in range(8)]
    assert abs(middle - int(np.argmax(expected))) <= 1


def test_depth_controller_warms_up_deep_shallow_middle_and_honours_the_limit():
    c = DepthController(7)
    seen = []
    for _ in range(4):
        d = c.choose(7)
        seen.append(d)
        c.update(d, 0, 1.0)
    assert seen[:3] == [7, 1, 4]
    assert c.choose(0) == 0 and c.choose(2) <= 2


def test_depth_controller_is_not_put_off_by_one_slow_round():
    """A depth's first round may hold one-off costs (a trace): ten times its time once does
    not keep the controller from the depth that pays."""
    rng = np.random.default_rng(1)
    c, seen = DepthController(7), set()
    for _ in range(40):
        depth = c.choose(7)
        accepted = 0
        while accepted < depth and rng.random() < 0.97:
            accepted += 1
        cost = 1.0 + 0.1 * depth
        c.update(depth, accepted, cost * (10 if depth not in seen else 1))
        seen.add(depth)
    assert c.best(7) == 7


def test_paused_controller_probes_the_deepest_and_resumes():
    """Drafts that stop being rejected are taken up again: a paused controller's probes
    draft the deepest depth, which observes every position."""
    c = DepthController(7, probe_every=8)
    for _ in range(30):  # nothing accepted: drafting pauses
        depth = c.choose(7)
        c.update(depth, 0, 1.0 + 0.2 * depth)
    assert c.best(7) == 0
    probes = []
    for _ in range(40):  # now every draft is accepted
        depth = c.choose(7)
        probes += [depth] if depth else []
        c.update(depth, depth, 1.0 + 0.2 * depth)
    assert probes[0] == 7 and c.best(7) == 7


def test_unmeasured_controller_depends_on_acceptance_only():
    a, b = DepthController(7, measured=False), DepthController(7, measured=False)
    for k in range(50):
        for c, seconds in ((a, 0.001), (b, 5.0)):
            d = c.choose(7)
            c.update(d, min(d, k % 3), seconds)
    assert a.best(7) == b.best(7)


def test_a_full_only_controller_drafts_the_whole_block_or_nothing():
    """A fixed-depth draft (DFlash2): its rounds against plain steps. Where a round of 7
    costs three plain steps, drafts accepted half the time commit 2 tokens a round and
    plain steps win; accepted nearly always, 8 tokens a round win."""
    c = DepthController(7, full_only=True)
    warm = []
    for _ in range(3):
        warm.append(c.choose(7))
        c.update(warm[-1], 0, 1.0 + 2.0 * (warm[-1] > 0))
    assert warm == [7, 0, 7]
    poor = _drive(DepthController(7, full_only=True, probe_every=8), 0.5,
                  lambda d: 3.0 if d else 1.0)
    good = _drive(DepthController(7, full_only=True), 0.97, lambda d: 3.0 if d else 1.0)
    assert (poor, good) == (0, 7)
    c = DepthController(7, full_only=True, probe_every=8)
    depths = set()
    for _ in range(40):  # paused, its probes still draft the whole block
        depth = c.choose(7)
        depths.add(depth)
        c.update(depth, 0, 3.0 if depth else 1.0)
    assert depths == {0, 7} and c.best(7) == 0
    assert c.choose(3) in (0, 3)  # near the budget's end: what is left, or nothing


def test_a_fixed_depth_draft_pauses_only_where_timed():
    """Greedy, a fixed-depth draft's rounds are the whole block or none (and the output is
    plain decoding's); a seeded sampled run drafts the whole block every round (a choice
    by timing would make its tokens depend on the machine's speed)."""
    target = toy()
    prompt = [2, 3, 4]
    plain = plain_tokens(target, prompt, 60)
    draft = ScriptedDraft.for_script(target, prompt + plain, block_size=8)
    assert not draft.adaptive_depth
    tokens, stats = speculative_tokens(target, draft, prompt, 60)
    assert tokens == plain
    # (a round at the budget's end drafts what is left)
    assert all(n == 1 for d, n in stats.depths.items() if d not in (0, 7))
    assert stats.depths.get(0, 0) >= 1  # its warm-up
    # a draft that is always wrong: still plain decoding's output, rounds of the whole block
    # or none (how often it pauses depends on this machine's timings: see the next test)
    wrong = ScriptedDraft.for_script(target, [t + 1 for t in prompt + plain], block_size=8)
    tokens, stats = speculative_tokens(target, wrong, prompt, 60)
    assert tokens == plain
    # every forward after the prompt's is a round, a paused step one of depth 0 (timed)
    assert stats.rounds == stats.target_forwards - 1 and stats.round_ms().get(0, 1.0) > 0
    assert all(n == 1 for d, n in stats.depths.items() if d not in (0, 7)), stats.depths
    seeded = generate(target, prompt, draft=draft, max_tokens=40,
                      options=SamplerOptions(temperature=1.0, seed=3))
    # every round drafts min(7, budget left - 1): each shorter depth once, at the end
    assert all(n == 1 for d, n in seeded.stats.depths.items() if d != 7)


def test_a_fixed_depth_draft_pauses_where_its_rounds_cost_more_than_plain_steps():
    """Whole-block-or-none choice with given round times (a verify of 8 costing 3 plain
    steps): a draft that is never right pauses after its warm-up and comes back only for a
    probe every 16 rounds; one that is always right never pauses."""
    for accept_rate, pauses in ((0.0, True), (1.0, False)):
        controller = DepthController(7, full_only=True)
        chosen = []
        for _ in range(64):
            depth = controller.choose(7)
            chosen.append(depth)
            controller.update(depth, depth if accept_rate else 0, 3.0 if depth else 1.0)
        later = chosen[8:]
        if pauses:
            assert later.count(0) >= len(later) - len(later) // 16 - 1, chosen
            assert 7 in later  # a probe
        else:
            assert 0 not in later, chosen

def test_an_adaptive_draft_under_lockstep_follows_its_acceptance():
    """A distributed rank (lockstep) chooses no depth by its own timings: an adaptive draft
    follows its acceptance alone, so one that is always wrong soon drafts little; a
    fixed-depth draft drafts its whole block every round."""
    target = toy()
    prompt = [2, 3, 4]
    plain = plain_tokens(target, prompt, 40)
    wrong = [t + 1 for t in prompt + plain]
    adaptive = ScriptedDraft.for_script(target, wrong, block_size=8)
    adaptive.adaptive_depth = True
    with settings.overridden(lockstep=True):
        tokens, stats = speculative_tokens(target, adaptive, prompt, 40)
        fixed = generate(target, prompt, draft=ScriptedDraft.for_script(target, wrong),
                         max_tokens=40, options=GREEDY)
    assert tokens == plain and fixed.tokens == plain
    drafted = sum(d * n for d, n in stats.depths.items())
    assert drafted < 7 * 40 // 4  # far below the whole block every round
    assert max(fixed.stats.depths, key=fixed.stats.depths.get) == 7


def test_stats_start_empty():
    s = SpeculativeStats()
    assert s.acceptance_rate == 0.0 and s.tau == 0.0 and s.tokens_per_second == 0.0
    target = toy()
    none = generate(target, [2, 3, 4], draft=ScriptedDraft.for_script(target, [2, 3, 4]),
                    max_tokens=0)
    assert none.tokens == [] and isinstance(none.stats, SpeculativeStats)
    assert none.stats.rounds == 0 and none.stats.draft and none.stats.prompt_tokens == 3
    plain = generate(target, [2, 3, 4], max_tokens=0)  # the same facts without a draft
    assert plain.tokens == [] and plain.finish_reason == "length"
    assert plain.stats.prompt_tokens == 3 and plain.stats.generated_tokens == 0


def test_on_token_can_end_generation_plain_and_speculative():
    """on_token returning True keeps that token and ends generation ("stop") on both paths;
    the speculative round's remaining tokens are dropped and not counted."""
    from mlxrunner import generate

    target = toy(vocab=32)
    prompt = [1, 2, 3]
    full = plain_tokens(target, prompt, 20, options=GREEDY)
    draft = ScriptedDraft.for_script(target, prompt + full)
    for with_draft in (None, draft):
        seen: list[int] = []

        def stop_at_seven(token: int, seen=seen) -> bool:
            seen.append(token)
            return len(seen) == 7

        result = generate(target, prompt, options=GREEDY, max_tokens=20,
                          on_token=stop_at_seven, draft=with_draft)
        assert result.tokens == seen == full[:7]
        assert result.finish_reason == "stop"
        assert result.stats.generated_tokens == 7


@pytest.mark.parametrize("depth", [0, 3])
@pytest.mark.parametrize("last_n", [-1, 0, 4])
def test_penalties_see_the_whole_history_in_every_round(depth, last_n):
    """A repetition penalty over all of the history (repeat_last_n -1) or its last tokens
    holds in rounds with drafts and in rounds without (a depth-0 round saw none of the
    history)."""
    target = toy(vocab=32)
    prompt = [1, 2, 3, 1, 2]
    options = SamplerOptions(temperature=0, repeat_penalty=3.0, repeat_last_n=last_n)
    plain = plain_tokens(target, prompt, 24, options=options)
    draft = ScriptedDraft.for_script(target, prompt + plain)
    tokens, _ = speculative_tokens(target, draft, prompt, 24, options=options, depth=depth)
    assert tokens == plain
