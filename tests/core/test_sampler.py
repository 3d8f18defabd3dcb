"""The sampler pipeline: options, order of operations, penalties, draws, residuals, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner import SamplerOptionError, SamplerOptions
from mlxrunner.plugin import Distribution, Sampler

# ---- helpers ---------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (closed forms for integer df)."""
    y = x / 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= y / i
            total += term
        return math.exp(-y) * total
    total = math.erfc(math.sqrt(y))
    for i in range((df - 1) // 2):
        total += math.exp(-y) * y ** (i + 0.5) / math.gamma(i + 1.5)
    return total


def test_chi2_sf_known_values() -> None:
    # 95% quantiles from the standard tables
    for x, df in [(3.841, 1), (5.991, 2), (7.815, 3), (9.488, 4), (16.919, 9), (18.307, 10)]:
        assert chi2_sf(x, df) == pytest.approx(0.05, abs=2e-4)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs; a count where probs is 0 gives p = 0."""
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    keep = probs > 0
    expected = n * probs[keep]
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def pipeline_reference(logits: np.ndarray, o: SamplerOptions) -> np.ndarray:
    """Steps 3-7 in float64 on one row (no penalties), as a dense distribution."""
    v = logits.shape[-1]
    order = np.argsort(-logits, kind="stable")
    keep = order[: o.top_k] if 0 < o.top_k < v else order
    p = softmax(logits[keep].astype(np.float64) / o.temperature)
    before = np.cumsum(p) - p
    p = np.where((before < o.top_p) | (np.arange(p.size) == 0), p, 0.0)
    p = np.where(p < p.max() * o.min_p, 0.0, p)
    out = np.zeros(v)
    out[keep] = p / p.sum()
    return out


def penalise_reference(x: np.ndarray, history: list[int], o: SamplerOptions) -> np.ndarray:
    x = x.astype(np.float64).copy()
    n = o.repeat_last_n
    recent = [] if n == 0 else history if n < 0 else history[-n:]
    for token, count in Counter(recent).items():
        value = x[token]
        if o.repeat_penalty != 1.0:
            value = value * o.repeat_penalty if value < 0 else value / o.repeat_penalty
        x[token] = value - o.presence_penalty - o.frequency_penalty * count
    return x


def dense_probs(sampler: Sampler, logits: np.ndarray, histories=None) -> np.ndarray:
    logits = np.atleast_2d(logits)
    histories = histories if histories is not None else [[] for _ in logits]
    dist = sampler.distributions(mx.array(logits), histories)
    return np.array(dist.dense(logits.shape[-1]))


LOGITS = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))


# ---- options -----------------------------------------------------------------


def test_defaults_are_ollamas() -> None:
    o = SamplerOptions()
    assert (o.temperature, o.top_k, o.top_p, o.min_p) == (0.8, 40, 0.9, 0.0)
    assert (o.repeat_last_n, o.repeat_penalty, o.seed) == (64, 1.0, None)
    assert (o.presence_penalty, o.frequency_penalty, o.logprobs, o.top_logprobs) == (
        0.0, 0.0, False, 0)


def test_generation_config_keys() -> None:
    o = SamplerOptions.from_mapping(
        {"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.1, "top_k": 20,
         "eos_token_id": [1, 2], "max_new_tokens": 5, "top_p": None})
    assert o.temperature == 0.0 and o.repeat_penalty == 1.1 and o.top_k == 20
    assert o.top_p == 0.9  # None ignored
    o = SamplerOptions.from_mapping({"do_sample": True, "temperature": 0.6})
    assert o.temperature == 0.6


def test_layers_later_wins() -> None:
    generation_config = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    modelfile = {"temperature": "0.3", "num_ctx": "4096", "seed": "42"}
    request = {"top_k": 5, "seed": None, "logprobs": True, "top_logprobs": 3}
    o = SamplerOptions.from_mapping(generation_config).merged(modelfile).merged(request)
    assert (o.temperature, o.top_k, o.top_p, o.seed) == (0.3, 5, 0.95, 42)
    assert o.logprobs is True and o.top_logprobs == 3


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": -1}, "top_k must be at least 0"),
        ({"top_p": 1.5}, "top_p must be between 0.0 and 1.0"),
        ({"min_p": -0.1}, "min_p must be between"),
        ({"repeat_penalty": 0}, "repeat_penalty must be > 0"),
        ({"repeat_last_n": -2}, "repeat_last_n must be at least -1"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be finite"),
        ({"logprobs": "maybe"}, "logprobs must be true or false"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"top_logprobs": True}, "top_logprobs must be an integer"),
    ],
)
def test_bad_values(mapping: dict, message: str) -> None:
    with pytest.raises(SamplerOptionError, match=message) as info:
        SamplerOptions.from_mapping(mapping)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
    with pytest.raises(SamplerOptionError, match=message):
        SamplerOptions(**mapping)  # direct construction is checked too


def test_values_are_normalised() -> None:
    o = SamplerOptions(temperature=-1, top_p=1, repeat_penalty="1.5")
    assert o.temperature == 0.0 and o.greedy and isinstance(o.top_p, float)
    assert o.repeat_penalty == 1.5


# ---- order of operations ---------------------------------------------------


def test_top_k_before_top_p() -> None:
    # top-k first: {0: 4/7, 1: 3/7}, mass before token 1 is 4/7 >= 0.5 -> only token 0.
    # (top-p over the whole vocabulary first would have kept tokens 0 and 1.)
    s = Sampler(SamplerOptions(temperature=1.0, top_k=2, top_p=0.5), 4)
    np.testing.assert_allclose(dense_probs(s, LOGITS), [[1, 0, 0, 0]], atol=1e-6)


@pytest.mark.parametrize("top_p, want", [(0.69, [4 / 7, 3 / 7, 0, 0]),
                                         (0.71, [4 / 9, 3 / 9, 2 / 9, 0]),
                                         (0.0, [1, 0, 0, 0])])
def test_top_p_keeps_while_mass_before_is_below_p(top_p: float, want: list[float]) -> None:
    s = Sampler(SamplerOptions(temperature=1.0, top_k=0, top_p=top_p), 4)
    np.testing.assert_allclose(dense_probs(s, LOGITS), [want], atol=1e-6)


def test_min_p_is_relative_to_the_max() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.35), 4)
    # threshold 0.5 * 0.35 = 0.175: an absolute 0.35 would keep token 0 alone
    np.testing.assert_allclose(dense_probs(s, logits), [[0.625, 0.375, 0, 0]], atol=1e-6)


def test_temperature_then_top_p() -> None:
    # At T=0.5 the probs sharpen to (16, 9, 4, 1)/30: mass before token 1 is .533 -> only
    # token 0 survives top_p 0.5; at T=1 (no temperature first) tokens 0, 1 would stay.
    s = Sampler(SamplerOptions(temperature=0.5, top_k=0, top_p=0.5), 4)
    np.testing.assert_allclose(dense_probs(s, LOGITS), [[1, 0, 0, 0]], atol=1e-6)
    s = Sampler(SamplerOptions(temperature=0.5, top_k=0, top_p=0.6), 4)
    np.testing.assert_allclose(dense_probs(s, LOGITS), [[16 / 25, 9 / 25, 0, 0]], atol=1e-6)


def test_penalties_come_before_top_k() -> None:
    # token 0 leads, but a repeat penalty of 4 on it drops it out of the top 2
    s = Sampler(SamplerOptions(temperature=1.0, top_k=2, top_p=1.0, repeat_penalty=4.0), 4)
    logits = np.array([2.0, 1.9, 1.0, -3.0], np.float32)
    dist = s.distributions(mx.array(logits[None]), [[0]])
    assert dist.ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(np.array(dist.probs), [softmax(np.array([1.9, 1.0]))], rtol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        SamplerOptions(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05),
        SamplerOptions(temperature=1.3, top_k=0, top_p=0.95),
        SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
        SamplerOptions(temperature=2.0, top_k=12, top_p=1.0),
    ],
)
def test_pipeline_matches_reference(options: SamplerOptions) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 12)).astype(np.float32) * 2
    s = Sampler(options, 12)
    got = dense_probs(s, logits)
    want = np.stack([pipeline_reference(row, options) for row in logits])
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_shapes_sparse_and_dense() -> None:
    x = mx.array(np.random.default_rng(0).normal(size=(2, 50)).astype(np.float32))
    dist = Sampler(SamplerOptions(top_k=7), 50).distributions(x, [[], []])
    assert dist.ids.shape == (2, 7) and dist.ids.dtype == mx.int32
    assert dist.probs.shape == (2, 7) and dist.probs.dtype == mx.float32
    dist = Sampler(SamplerOptions(top_k=0, top_p=1.0), 50).distributions(x, [[], []])
    assert dist.ids is None and dist.probs.shape == (2, 50)
    np.testing.assert_allclose(np.array(dist.probs).sum(axis=-1), 1.0, rtol=1e-6)
    dist = Sampler(SamplerOptions(top_k=0, top_p=0.5), 50).distributions(x, [[], []])
    assert dist.ids.shape == (2, 50)  # top_p alone sorts the whole row


def test_bfloat16_logits() -> None:
    x = mx.array(np.random.default_rng(5).normal(size=(1, 64)).astype(np.float32))
    s = Sampler(SamplerOptions(top_k=10), 64)
    a = s.distributions(x.astype(mx.bfloat16), [[]])
    b = s.distributions(x.astype(mx.bfloat16).astype(mx.float32), [[]])
    assert a.ids.tolist() == b.ids.tolist()
    np.testing.assert_array_equal(np.array(a.probs), np.array(b.probs))


# ---- penalties -------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        SamplerOptions(repeat_penalty=1.3),
        SamplerOptions(presence_penalty=0.7),
        SamplerOptions(frequency_penalty=0.4),
        SamplerOptions(repeat_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.3),
        SamplerOptions(repeat_penalty=1.5, frequency_penalty=0.2, repeat_last_n=3),
        SamplerOptions(repeat_penalty=1.5, presence_penalty=1.0, repeat_last_n=-1),
        SamplerOptions(repeat_penalty=1.5, presence_penalty=1.0, repeat_last_n=0),
    ],
)
def test_penalties_match_reference(options: SamplerOptions) -> None:
    o = SamplerOptions(**{**options.__dict__, "temperature": 1.0, "top_k": 0, "top_p": 1.0})
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(4, 9)).astype(np.float32) * 3
    histories = [[1, 1, 2, 5, 5, 5, 8], [], [0, 3, 3], [4] * 70 + [6]]
    got = dense_probs(Sampler(o, 9), logits, histories)
    want = np.stack([softmax(penalise_reference(row, h, o)) for row, h in zip(logits, histories)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # the same histories with tokens still on the device (drafts): same result
    on_device = [mx.array(h, dtype=mx.int32) for h in histories[:2]] + histories[2:]
    np.testing.assert_allclose(dense_probs(Sampler(o, 9), logits, on_device), got, rtol=1e-6)
    if o.repeat_last_n == 0:
        np.testing.assert_allclose(got, softmax(logits.astype(np.float64)), rtol=1e-5)
    else:
        assert not np.allclose(got, softmax(logits.astype(np.float64)), rtol=1e-3)


def test_repeat_penalty_sign_rule() -> None:
    o = SamplerOptions(temperature=0.0, repeat_penalty=2.0)
    s = Sampler(o, 3)
    # positive logits are divided, negative multiplied
    x = mx.array([[4.0, 3.0, -1.0]])
    assert s.distributions(x, [[0]]).ids.tolist() == [[1]]  # 4/2 = 2 < 3
    x = mx.array([[-1.0, -1.5, -9.0]])
    assert s.distributions(x, [[0]]).ids.tolist() == [[1]]  # -1*2 = -2 < -1.5


def test_histories_are_per_row_and_not_committed() -> None:
    o = SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, presence_penalty=2.0)
    s = Sampler(o, 5)
    x = mx.array(np.zeros((2, 5), np.float32))
    first = np.array(s.distributions(x, [[0, 1], [0, 1, 2]]).probs)
    assert first[0, 2] > first[1, 2]  # the draft token 2 penalises row 1 only
    again = np.array(s.distributions(x, [[0, 1], [0, 1, 2]]).probs)
    np.testing.assert_array_equal(first, again)
    fresh = np.array(s.distributions(x[:1], [[]]).probs)
    np.testing.assert_allclose(fresh, [[0.2] * 5], rtol=1e-6)
    # ids outside the vocabulary are ignored, on the host and on the device
    for history in ([9, -5, 1], mx.array([9, -5, 1])):
        got = np.array(s.distributions(x[:1], [history]).probs)
        np.testing.assert_allclose(got, np.array(s.distributions(x[:1], [[1]]).probs))


# ---- greedy --------------------------------------------------------------


def test_greedy_is_a_point_mass_on_the_argmax() -> None:
    s = Sampler(SamplerOptions(temperature=0.0), 6)
    assert s.greedy
    x = mx.array([[0.1, 2.0, -1.0, 2.0, 0.0, 1.0], [float("nan"), 0.0, 5.0, 1.0, 5.0, 0.0]])
    dist = s.distributions(x, [[], []])
    assert dist.ids.tolist() == [[1], [2]]  # ties to the lower index, NaN never first
    assert dist.probs.tolist() == [[1.0], [1.0]]
    assert s.draw(dist).tolist() == [1, 2]
    assert s.draws == 2  # a point mass still consumes its key
    assert s.sample(x[0], [1]).item() == 1  # no penalties by default
    s = Sampler(SamplerOptions(temperature=0.0, presence_penalty=5.0), 6)
    assert s.sample(x[0], [1]).item() == 3


# ---- draws -----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        SamplerOptions(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05, seed=123),
        SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, seed=9),
    ],
)
def test_chi_square_frequencies(options: SamplerOptions) -> None:
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=12) * 1.5).astype(np.float32)
    want = pipeline_reference(logits, options)
    s = Sampler(options, 12)
    n = 8000
    dist = s.distributions(mx.array(np.tile(logits, (n, 1))), [[]] * n)
    tokens = np.array(s.draw(dist))
    counts = np.bincount(tokens, minlength=12)
    assert chi_square_p(counts, want) > 1e-3
    # the test has power: a distribution without top_p/min_p, or a slightly tilted one
    unfiltered = SamplerOptions(temperature=options.temperature, top_k=options.top_k, top_p=1.0)
    other = pipeline_reference(logits, unfiltered)
    tilted = pipeline_reference(logits * 1.15, options)
    for wrong in (other, tilted):
        if not np.allclose(wrong, want):
            assert chi_square_p(counts, wrong) < 1e-6


def test_seeded_draws_reproduce() -> None:
    rng = np.random.default_rng(4)
    logits = [mx.array(rng.normal(size=100).astype(np.float32)) for _ in range(30)]

    def run(seed: int | None) -> list[int]:
        s = Sampler(SamplerOptions(temperature=1.5, top_k=50, top_p=0.99, seed=seed), 100)
        history: list[int] = []
        for x in logits:
            history.append(s.sample(x, history).item())
        return history

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(None) != run(None)


def test_stream_does_not_depend_on_batching() -> None:
    rng = np.random.default_rng(6)
    logits = mx.array(rng.normal(size=(5, 40)).astype(np.float32))
    options = SamplerOptions(temperature=1.0, top_k=20, seed=3)
    together = Sampler(options, 40)
    batched = together.draw(together.distributions(logits, [[]] * 5)).tolist()
    alone = Sampler(options, 40)
    one_by_one = [alone.sample(logits[r], []).item() for r in range(5)]
    assert batched == one_by_one
    a, b = Sampler(options, 40), Sampler(options, 40)
    u = a.uniform(4)
    assert u.dtype == mx.float32 and u.shape == (4,)
    assert u.tolist() == [b.uniform(1).item() for _ in range(4)]
    assert all(0.0 <= v < 1.0 for v in u.tolist()) and len(set(u.tolist())) == 4
    assert a.draws == 4 and a.uniform(0).shape == (0,)


def test_seed_streams_do_not_overlap() -> None:
    # seeds that differ only in their high bits must not give shifted copies
    streams = [set(Sampler(SamplerOptions(seed=seed), 10).uniform(16).tolist())
               for seed in (1, 1 + 2**32, 3, -1)]
    for i, a in enumerate(streams):
        for b in streams[i + 1:]:
            assert not a & b


def test_sample_shapes() -> None:
    s = Sampler(SamplerOptions(seed=1), 30)
    x = mx.random.normal((30,), key=mx.random.key(0))
    for logits in (x, x[None]):
        token = s.sample(logits, [1, 2])
        assert token.shape == () and token.dtype == mx.int32


def test_draw_never_picks_a_dropped_token() -> None:
    # uniforms close to 1 must not land on zero-probability entries at the end
    s = Sampler(SamplerOptions(seed=0), 4)
    dist = Distribution(mx.array([[0.5, 0.5, 0.0, 0.0]] * 2000), None)
    assert set(s.draw(dist).tolist()) == {0, 1}
    sparse = Distribution(mx.array([[0.0, 1.0, 0.0]] * 50), mx.array([[3, 1, 2]] * 50))
    assert set(s.draw(sparse).tolist()) == {1}


# ---- distributions, residuals --------------------------------------------


def test_prob_of_and_dense() -> None:
    sparse = Distribution(mx.array([[0.7, 0.3], [0.6, 0.4]]), mx.array([[2, 5], [0, 1]]))
    assert sparse.prob_of(mx.array([5, 3])).tolist() == pytest.approx([0.3, 0.0])
    dense = sparse.dense(6)
    np.testing.assert_allclose(np.array(dense),
                               [[0, 0, 0.7, 0, 0, 0.3], [0.6, 0.4, 0, 0, 0, 0]], atol=1e-7)
    assert Distribution(dense).prob_of(mx.array([2, 1])).tolist() == pytest.approx([0.7, 0.4])
    assert sparse[1].ids.tolist() == [[0, 1]]


def test_residual_examples_from_the_issue() -> None:
    s = Sampler(SamplerOptions(), 6)
    p = Distribution(mx.array([[0.7, 0.3]]), mx.array([[2, 5]]))
    q = Distribution(mx.array([[0.2, 0.8]]), mx.array([[2, 4]]))
    r = s.residual(p, q)
    np.testing.assert_allclose(np.array(r.dense(6)), [[0, 0, 0.625, 0, 0, 0.375]], atol=1e-6)
    s3 = Sampler(SamplerOptions(), 3)
    p = Distribution(mx.array([[0.2, 0.5, 0.3]]))
    q = Distribution(mx.array([[0.1, 0.9]]), mx.array([[0, 2]]))
    r = s3.residual(p, q)
    assert r.ids is None
    np.testing.assert_allclose(np.array(r.probs), [[1 / 6, 5 / 6, 0]], atol=1e-6)


def random_distribution(rng: np.random.Generator, rows: int, vocab: int, k: int | None):
    dense = np.zeros((rows, vocab), np.float32)
    if k is None:
        dense[:] = rng.dirichlet(np.ones(vocab) * 0.3, size=rows)
        return Distribution(mx.array(dense)), dense
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(rows)]).astype(np.int32)
    probs = rng.dirichlet(np.ones(k), size=rows).astype(np.float32)
    probs[:, -1] = 0.0  # a dropped entry inside a sparse distribution
    probs /= probs.sum(axis=-1, keepdims=True)
    np.put_along_axis(dense, ids, probs, axis=-1)
    return Distribution(mx.array(probs), mx.array(ids)), dense


@pytest.mark.parametrize("p_k, q_k, vocab", [(None, None, 30), (None, 5, 30), (6, None, 30),
                                             (6, 5, 30), (300, 300, 400)])
def test_residual_matches_reference(p_k, q_k, vocab) -> None:
    rng = np.random.default_rng(8)
    p, p_dense = random_distribution(rng, 3, vocab, p_k)
    q, q_dense = random_distribution(rng, 3, vocab, q_k)
    r = Sampler(SamplerOptions(), vocab).residual(p, q)
    assert (r.ids is None) == (p_k is None)
    left = np.maximum(p_dense.astype(np.float64) - q_dense, 0)
    want = left / left.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(np.array(r.dense(vocab)), want, atol=1e-6)


def test_residual_of_equal_distributions_is_p() -> None:
    p = Distribution(mx.array([[0.5, 0.5], [0.9, 0.1]]), mx.array([[1, 2], [0, 3]]))
    q = Distribution(mx.array([[0.5, 0.5], [0.2, 0.8]]), mx.array([[2, 1], [0, 3]]))
    r = Sampler(SamplerOptions(), 4).residual(p, q)
    np.testing.assert_allclose(np.array(r.probs), [[0.5, 0.5], [1.0, 0.0]], atol=1e-6)


# ---- logprobs --------------------------------------------------------------


def test_logprobs_from_raw_logits() -> None:
    o = SamplerOptions(temperature=0.3, top_k=2, repeat_penalty=3.0, top_logprobs=3)
    s = Sampler(o, 6)
    x = np.array([[1.0, 3.0, 3.0, -2.0, 0.5, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    chosen, top_ids, top_lp = s.logprobs(mx.array(x), mx.array([4, 5]))
    x64 = x.astype(np.float64)
    logp = x64 - np.log(np.exp(x64).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(np.array(chosen), [logp[0, 4], logp[1, 5]], atol=1e-6)
    assert top_ids.tolist() == [[1, 2, 5], [0, 1, 2]]  # topk_indices order, ties by index
    np.testing.assert_allclose(np.array(top_lp), np.take_along_axis(logp, np.array(top_ids), -1),
                               atol=1e-6)
    none = Sampler(SamplerOptions(), 6).logprobs(mx.array(x[0]), mx.array([1]))
    assert none[1].shape == (1, 0) and none[2].shape == (1, 0)
