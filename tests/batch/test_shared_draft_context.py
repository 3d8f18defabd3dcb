"""The shared context of a block draft's greedy sequences in a batch
(``BlockDraft.new_batch()``): one block forward and one commit for every row give each row
the proposals its own session gives alone, through rows joining, leaving and compaction,
sliding draft layers included; and the batch's drafted rows accept what they accept alone."""

from __future__ import annotations

import numpy as np
import pytest

import mlxrunner
import mlxrunner.plugin
from mlxrunner import SamplerOptions, settings
from mlxrunner.batch import BatchRequest, Scheduler
from mlxrunner.testing.speculative import random_draft, speculative_tokens

GREEDY = SamplerOptions(temperature=0)


def _tapped(rng, rows, draft, target):
    width = len(draft.taps) * target.hidden_size
    return rng.standard_normal((1, rows, width)).astype(np.float32)


@pytest.mark.parametrize("architecture,extra", [
    ("DFlashDraftModel", {}),
    # sliding layers of window 6: prompts longer than two windows drop rows at prefill
    ("DFlashDraftModel", {"layer_types": ["sliding_attention", "full_attention"],
                          "sliding_window": 6}),
    ("DFlash2DraftModel", {}),
])
def test_shared_rounds_propose_what_each_session_proposes(tiny, architecture, extra):
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    mx = pytest.importorskip("mlx.core")
    target = tiny("qwen3_5")
    draft = random_draft(target, architecture, seed=5, block_size=5, **extra)
    rng = np.random.default_rng(2)
    sampler = mlxrunner.plugin.Sampler(GREEDY, target.vocab_size)
    shared = draft.new_batch()
    sessions: dict[int, object] = {}  # row -> its solo twin
    anchors: dict[int, int] = {}

    def join(row, prompt):
        mine, twin = draft.new_session(sampler), draft.new_session(sampler)
        tapped = mx.array(_tapped(rng, prompt, draft, target))
        mine.prefill(tapped)
        twin.prefill(tapped)
        shared.add(row, mine)
        sessions[row] = twin
        anchors[row] = int(rng.integers(0, target.vocab_size))

    def round_(n):
        rows = shared.rows
        last = [anchors.get(r, 0) for r in range(rows)]
        got = shared.propose(last, n).tolist()
        for row, twin in sessions.items():
            want = twin.propose(anchors[row], twin.context_length, n).tokens.tolist()
            assert got[row] == want, f"row {row}, depth {n}"
        # each row commits a different number of rows (a verify block's accepted part)
        width = n + 1
        tapped = _tapped(rng, width, draft, target).repeat(rows, axis=0)
        counts = [0] * rows
        for row, twin in sessions.items():
            counts[row] = int(rng.integers(1, width + 1))
            twin.commit(mx.array(tapped[row:row + 1, :counts[row]]))
            anchors[row] = int(rng.integers(0, target.vocab_size))
        shared.commit(mx.array(tapped), counts)

    shared.set_rows(4)
    join(0, 9)
    join(2, 17)  # longer than two sliding windows
    for n in (4, 1, 3):
        round_(n)
    join(1, 3)
    round_(2)
    shared.remove(0)
    del sessions[0]
    join(0, 5)  # a freed row taken again
    round_(4)
    shared.remove(2)
    del sessions[2]
    moved = {0: 0, 1: 1}
    shared.compact(moved, 2)
    round_(3)
    shared.set_rows(8)  # the batch grew
    join(5, 12)
    for n in (4, 2):
        round_(n)


@pytest.mark.parametrize("streams", [3, 12])
def test_demo_pair_rows_accept_what_they_accept_alone(streams):
    """The demo pair (a trained DFlash2 draft): with every round at the full depth (lockstep
    settings: no timing), each batched row's tokens and its number of target forwards are
    its solo speculative run's, rows joining as others leave (12 streams, 9 at a time: the
    batch grows to 16 rows, then compacts as it drains)."""
    pytest.importorskip("mlxrunner_demo", reason="the demo plugin is not installed")
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    mx = pytest.importorskip("mlx.core")
    mx.set_default_device(mx.cpu)
    bundle = mlxrunner.load("demo-qwen3.5")
    model, draft = bundle.model, bundle.draft
    starts = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):",
              "def quicksort(items):", "def read_config(path):", "class LinkedList:"]
    prompts = [bundle.tokenizer.encode(starts[i % len(starts)] + " " * (i // len(starts)))
               for i in range(streams)]
    budgets = [40 + 7 * (i % 4) for i in range(streams)]
    with settings.overridden(lockstep=True):
        alone = [speculative_tokens(model, draft, p, m) for p, m in zip(prompts, budgets)]
        scheduler = Scheduler(model, max_sequences=9)
        requests = [scheduler.submit(BatchRequest(p, GREEDY, m, draft=draft))
                    for p, m in zip(prompts, budgets)]
        scheduler.run_until_idle()
    for request, (tokens, stats) in zip(requests, alone):
        assert request.tokens == tokens
        assert request.stats.target_forwards == stats.target_forwards
    # the pair's draft is right often: rounds commit several tokens
    assert sum(r.stats.target_forwards for r in requests) < \
        0.6 * sum(len(r.tokens) for r in requests)


@pytest.mark.parametrize("architecture,extra", [
    ("DFlashDraftModel", {"layer_types": ["sliding_attention", "full_attention"],
                          "sliding_window": 6}),
    ("DFlash2DraftModel", {}),
])
def test_shared_proposals_follow_each_history_through_pauses(tiny, monkeypatch, architecture,
                                                             extra):
    """Every block the batch drafts proposes, for each running sequence, what a fresh
    session given that sequence's whole history proposes: through rounds, plain steps
    (drafting paused: each step's tapped states reach the shared context), sequences
    joining and leaving, and compaction (12 sequences, 9 at a time). The depth schedule is
    scripted (plain steps and rounds of depth 4 and 2)."""
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.decode import DepthController, prefill

    model = tiny("qwen3_5")
    draft = random_draft(model, architecture, seed=3, block_size=5, **extra)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.vocab_size, int(rng.integers(3, 20))).tolist()
               for _ in range(12)]
    budgets = [int(rng.integers(10, 40)) for _ in range(12)]
    requests = [BatchRequest(p, GREEDY, m, draft=draft) for p, m in zip(prompts, budgets)]

    def expected(request, n):
        history = list(request.prompt) + request.tokens
        session = draft.new_session(mlxrunner.plugin.Sampler(GREEDY, model.vocab_size))
        prefill(model, history[:-1], model.make_cache(), taps=draft.taps,
                on_taps=lambda tapped: (session.prefill(tapped), list(session.state))[1])
        return session.propose(history[-1], len(history) - 1, n).tokens.tolist()

    checked = []
    shared_class = type(draft.new_batch())
    propose = shared_class.propose

    def checking(self, anchors, n):
        out = propose(self, anchors, n)
        got = out.tolist()
        for request in requests:
            if request.tokens and not request.done:  # running: its row drafted
                assert expected(request, n) in got
                checked.append(n)
        return out

    monkeypatch.setattr(shared_class, "propose", checking)
    steps = iter(range(10 ** 6))
    monkeypatch.setattr(DepthController, "choose",
                        lambda self, limit: min(limit, [0, 4, 0, 0, 2][next(steps) % 5]))
    scheduler = Scheduler(model, max_sequences=9)
    for request in requests:
        scheduler.submit(request)
    scheduler.run_until_idle()
    for request, prompt, budget in zip(requests, prompts, budgets):
        assert request.tokens == mlxrunner.generate(model, prompt, options=GREEDY,
                                                    max_tokens=budget).tokens
    assert len(checked) > 50 and scheduler.round_depths.get(0, 0) > 10

