"""The batch scheduler (mlxrunner.batch): sequences with their own prompts, options, budgets
and stop ids, joining and leaving a running batch, each give exactly what
``mlxrunner.generate`` gives them alone, greedy and sampled with seeds (logprobs included);
a long prompt is prefilled in chunks while the running streams go on; cancellation, stop
callbacks, stop ids, the running-set bound and the memory budget."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner import SamplerOptions
from mlxrunner.batch import BatchRequest, Scheduler, generate_batch
from mlxrunner.decode import compiled_steps

OPTIONS = [
    SamplerOptions(temperature=0),
    SamplerOptions(temperature=0.9, seed=3),
    SamplerOptions(temperature=0.7, top_k=20, seed=5, repeat_penalty=1.3, repeat_last_n=8),
    SamplerOptions(temperature=0, logprobs=True, top_logprobs=2),
    SamplerOptions(temperature=1.0, top_p=0.9, min_p=0.05, seed=9, presence_penalty=0.5),
]
LENGTHS = [5, 13, 9, 3, 20]  # Gemma 4's rings (window 8) wrap in prompts and in decoding
BUDGETS = [12, 7, 15, 4, 10]


def _prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _alone(model, prompt, options, max_tokens, eos_ids=frozenset()):
    return mlxrunner.generate(model, prompt, options=options, max_tokens=max_tokens,
                              eos_ids=eos_ids)


def test_each_sequence_gets_its_solo_output(model):
    prompts = _prompts(model.vocab_size, LENGTHS)
    steps = compiled_steps(model)
    steps.clear()
    alone = [_alone(model, p, o, m) for p, o, m in zip(prompts, OPTIONS, BUDGETS)]
    alone_traced = steps.replays() > 0
    steps.clear()
    # three rows at most: later sequences join as earlier ones leave, into their rows
    together = generate_batch(model, prompts, options=OPTIONS, max_tokens=BUDGETS,
                              max_sequences=3)
    for a, t in zip(alone, together):
        assert t.tokens == a.tokens
        assert t.logprobs == a.logprobs
        assert t.finish_reason == "length"
    # the batched steps were traced where solo steps are (not where the step machinery
    # runs a model eagerly, e.g. its products on the host BLAS)
    assert steps.enabled and (steps.replays() > 0) == alone_traced


def test_stop_ids_and_callbacks_end_one_sequence(model):
    prompts = _prompts(model.vocab_size, [6, 4, 8], seed=1)
    greedy = SamplerOptions(temperature=0)
    first = _alone(model, prompts[0], greedy, 10)
    eos = frozenset({first.tokens[4]})
    scheduler = Scheduler(model)
    seen = []
    stopped = scheduler.submit(BatchRequest(prompts[1], greedy, 10,
                                            on_token=lambda t, _: seen.append(t) or
                                            len(seen) == 3))
    by_eos = scheduler.submit(BatchRequest(prompts[0], greedy, 10, eos_ids=eos))
    other = scheduler.submit(BatchRequest(prompts[2], OPTIONS[1], 9))
    scheduler.run_until_idle()
    assert scheduler.idle
    assert stopped.finish_reason == "stop" and stopped.tokens == seen
    assert seen == _alone(model, prompts[1], greedy, 3).tokens
    assert by_eos.finish_reason == "stop"
    assert by_eos.tokens == _alone(model, prompts[0], greedy, 10, eos).tokens
    assert other.tokens == _alone(model, prompts[2], OPTIONS[1], 9).tokens


def test_a_cancelled_sequence_leaves_and_the_others_go_on(model):
    prompts = _prompts(model.vocab_size, [7, 5, 9], seed=2)
    scheduler = Scheduler(model)
    requests = [scheduler.submit(BatchRequest(p, OPTIONS[i], 12)) for i, p in enumerate(prompts)]
    waiting = scheduler.submit(BatchRequest(prompts[0], OPTIONS[0], 5))
    waiting.cancel()
    for _ in range(6):
        scheduler.step()
    requests[1].cancel()
    scheduler.run_until_idle()
    assert requests[1].finish_reason == "cancel" and 0 < len(requests[1].tokens) < 12
    assert waiting.finish_reason == "cancel" and waiting.tokens == []
    for i in (0, 2):
        assert requests[i].tokens == _alone(model, prompts[i], OPTIONS[i], 12).tokens


def test_a_long_prompt_does_not_stall_the_running_streams(model):
    prompts = _prompts(model.vocab_size, [4, 30], seed=3)
    greedy = SamplerOptions(temperature=0)
    scheduler = Scheduler(model, prefill_chunk=8)
    streaming = scheduler.submit(BatchRequest(prompts[0], greedy, 12))
    scheduler.step()  # the short prompt is prefilled and has its first token
    long = scheduler.submit(BatchRequest(prompts[1], greedy, 3))
    counts = []
    while not long.tokens:
        scheduler.step()
        counts.append(len(streaming.tokens))
    # four chunks of 8: the stream decoded a token at each step meanwhile
    assert len(counts) == 4 and counts == sorted(set(counts))
    scheduler.run_until_idle()
    assert streaming.tokens == _alone(model, prompts[0], greedy, 12).tokens


def test_a_short_prompt_sent_after_a_long_one_starts_within_a_step(model):
    """The prompts being prefilled take turns, a chunk each: a short request does not wait
    for every chunk of a long prompt sent before it (2 tokens waited 112 s behind 2,890)."""
    prompts = _prompts(model.vocab_size, [40, 3], seed=9)
    greedy = SamplerOptions(temperature=0)
    scheduler = Scheduler(model, prefill_chunk=8)
    long = scheduler.submit(BatchRequest(prompts[0], greedy, 4))
    scheduler.step()  # the long prompt's first chunk
    short = scheduler.submit(BatchRequest(prompts[1], greedy, 4))
    scheduler.step()
    assert short.tokens and not long.tokens  # 3 tokens prefilled before the next 8 of 40
    scheduler.run_until_idle()
    assert long.tokens == _alone(model, prompts[0], greedy, 4).tokens
    assert short.tokens == _alone(model, prompts[1], greedy, 4).tokens


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(model):
    """Short prompts arriving every step go before it, but not for ever: a prompt passed
    over for a few steps goes first."""
    prompts = _prompts(model.vocab_size, [40] + [3] * 30, seed=10)
    greedy = SamplerOptions(temperature=0)
    scheduler = Scheduler(model, prefill_chunk=8, max_sequences=64)
    long = scheduler.submit(BatchRequest(prompts[0], greedy, 2))
    shorts = []
    steps = 0
    while not long.tokens:
        shorts.append(scheduler.submit(BatchRequest(prompts[1 + steps % 30], greedy, 2)))
        scheduler.step()
        steps += 1
        assert steps <= 5 * 3, "the long prompt was starved"
    scheduler.run_until_idle()
    assert long.tokens == _alone(model, prompts[0], greedy, 2).tokens
    assert shorts[0].tokens == _alone(model, prompts[1], greedy, 2).tokens


def test_short_prompts_start_together_within_a_chunk_of_tokens(model):
    """A step prefills up to ``prefill_chunk`` prompt tokens over the admitted prompts, one
    chunk each: a chunk that would pass the budget waits for the next step."""
    prompts = _prompts(model.vocab_size, [3, 3, 3, 6, 11], seed=8)
    greedy = SamplerOptions(temperature=0)
    scheduler = Scheduler(model, prefill_chunk=8)
    requests = [scheduler.submit(BatchRequest(p, greedy, 5)) for p in prompts]
    started = []
    for _ in range(5):
        scheduler.step()
        started.append([i for i, r in enumerate(requests) if r.tokens])
    # 3 + 3; 3 (6 waits); 6 (the 11's first chunk of 8 waits); 8 of 11; the 11's last 3
    assert started == [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    scheduler.run_until_idle()
    for prompt, request in zip(prompts, requests):
        assert request.tokens == _alone(model, prompt, greedy, 5).tokens


@pytest.mark.parametrize("budget", ["rows", "memory"])
def test_admission_is_bounded_and_first_come_first_served(model, budget):
    prompts = _prompts(model.vocab_size, [5, 6, 7], seed=4)
    greedy = SamplerOptions(temperature=0)
    if budget == "rows":
        scheduler = Scheduler(model, max_sequences=2)
    else:  # room for about one sequence
        scheduler = Scheduler(model, memory_budget=1)
    requests = [scheduler.submit(BatchRequest(p, greedy, 6)) for p in prompts]
    most, order, more = 0, [], True
    while more:
        more = scheduler.step()
        most = max(most, scheduler.running)
        order += [i for i, r in enumerate(requests) if r.tokens and i not in order]
    assert most == (2 if budget == "rows" else 1)
    assert order == [0, 1, 2]
    for p, r in zip(prompts, requests):
        assert r.tokens == _alone(model, p, greedy, 6).tokens


def test_the_batch_caches_stay_within_the_memory_budget(model):
    """A budget of two rows as long as the longest request: never more than two run, the
    batch's arrays never pass it, and each output is its solo one."""
    prompts = _prompts(model.vocab_size, [5, 9, 6, 10, 7], seed=5)
    greedy = SamplerOptions(temperature=0)
    probe = Scheduler(model)
    probe.submit(BatchRequest(prompts[0], greedy, 2))
    while not probe.running:
        probe.step()
    budget = probe.batch.bytes_for(2, 10 + 6)
    assert budget > 0 and probe.batch.bytes_for(3, 10 + 6) > budget
    scheduler = Scheduler(model, memory_budget=budget)
    requests = [scheduler.submit(BatchRequest(p, greedy, 6)) for p in prompts]
    most, more = 0, True
    while more:
        more = scheduler.step()
        most = max(most, scheduler.running)
        assert sum(a.nbytes for a in scheduler.batch.state) <= budget
    assert most == 2
    for p, r in zip(prompts, requests):
        assert r.tokens == _alone(model, p, greedy, 6).tokens


def test_bad_requests_say_what_is_wrong(model):
    scheduler = Scheduler(model)
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.submit(BatchRequest([]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.submit(BatchRequest([model.vocab_size]))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.submit(BatchRequest([1], max_tokens=0))
    with pytest.raises(ValueError, match="one max_tokens each"):
        generate_batch(model, [[1], [2]], max_tokens=[3])
    assert scheduler.idle


def test_logprobs_survive_the_batch_compacting_under_a_queued_step(model):
    """Eight rows, seven of which end well before the eighth: the batch compacts while a
    step is queued, and the one left (asking for logprobs) still gets its own logprobs and
    tokens, as alone."""
    prompts = _prompts(model.vocab_size, [4, 6, 5, 7, 3, 8, 4, 6], seed=12)
    options = [SamplerOptions(temperature=0)] * 7 + \
        [SamplerOptions(temperature=0, logprobs=True, top_logprobs=2)]
    budgets = [10] * 7 + [28]
    alone = _alone(model, prompts[-1], options[-1], budgets[-1])
    scheduler = Scheduler(model, max_sequences=8)
    requests = [scheduler.submit(BatchRequest(p, o, m))
                for p, o, m in zip(prompts, options, budgets)]
    grew = 0
    while scheduler.step():
        grew = max(grew, scheduler.batch.rows)
    assert grew >= 8 and scheduler.batch.rows < grew  # it compacted
    assert requests[-1].tokens == alone.tokens
    assert requests[-1].logprobs == alone.logprobs


class _FailingConstraint:
    """A constraint that allows every token, then fails at its ``fail_at``-th mask (or
    ``advance``): a grammar engine error inside one request."""

    def __init__(self, vocab_size: int, fail_at: int, where: str) -> None:
        self.words_count = (vocab_size + 31) // 32
        self.calls, self.fail_at, self.where = 0, fail_at, where
        self.complete = False

    def words(self):
        import numpy as np

        self.calls += 1
        if self.where == "words" and self.calls >= self.fail_at:
            raise RuntimeError("grammar engine error: stand-in")
        return np.full(self.words_count, -1, dtype=np.int32)

    def advance(self, token: int) -> None:
        if self.where == "advance" and self.calls >= self.fail_at:
            raise RuntimeError("grammar engine error: stand-in")


@pytest.mark.parametrize("where", ["words", "advance"])
def test_one_requests_grammar_failure_ends_it_alone(tiny, where):
    """A request whose structured output fails mid-way ends with its own error; the rows
    decoding beside it finish with what each gives alone."""
    model = tiny("example")
    prompts = _prompts(model.vocab_size, [6, 4, 8], seed=5)
    greedy = SamplerOptions(temperature=0)
    scheduler = Scheduler(model)
    others = [scheduler.submit(BatchRequest(prompts[i], OPTIONS[i], 12)) for i in (0, 2)]
    failing = scheduler.submit(BatchRequest(
        prompts[1], greedy, 12, constraint=_FailingConstraint(model.vocab_size, 4, where)))
    scheduler.run_until_idle()
    assert failing.finish_reason == "error" and "stand-in" in str(failing.error)
    assert len(failing.tokens) < 12
    for request, i in zip(others, (0, 2)):
        assert request.finish_reason == "length" and request.error is None
        assert request.tokens == _alone(model, prompts[i], OPTIONS[i], 12).tokens


def test_a_batched_step_writes_its_caches_in_place_on_the_host():
    """On the CPU a model with host products runs the batch's steps uncompiled, its host
    operations evaluating as they go: the caches' buffers are handed to the forward with no
    other holder, so each step's writes reuse them. MLX's peak memory over many steps stays
    far below one more copy of the batch's buffers (it was that copy at every step)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the host operations run on MLX's CPU device")
    pytest.importorskip("mlxrunner_example_architecture",
                        reason="the example-architecture plugin is not installed")
    from mlxrunner_example_architecture.model import ExampleLlama

    from mlxrunner.testing.speculative import randomize

    model = ExampleLlama({"architectures": ["ExampleLlamaForCausalLM"], "hidden_size": 256,
                          "intermediate_size": 512, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2,
                          "head_dim": 64, "vocab_size": 512, "tie_word_embeddings": False})
    randomize(model, seed=1)
    model.eval()
    greedy = SamplerOptions(temperature=0)
    scheduler = Scheduler(model, max_sequences=4)
    for p in _prompts(model.vocab_size, [600, 610, 620, 630], seed=7):
        scheduler.submit(BatchRequest(p, greedy, 40))
    steps = 0
    while scheduler.step() and (scheduler.prefilling or steps < 5):
        steps += 1 if not scheduler.prefilling else 0
    buffers = sum(a.nbytes for a in scheduler.batch.state)
    assert buffers > 4 << 20  # (large enough for the comparison to mean something)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(20):
        scheduler.step()
    mx.synchronize()
    assert mx.get_peak_memory() - base < buffers / 4
