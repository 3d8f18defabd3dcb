"""A prompt's eager forward hands the layers built so far to the device every few attentions
(``mlxrunner.nn.pipeline``, ``MLXRUNNER_PIPELINE``): the same logits and caches as a forward
evaluated once built, a submission every fourth ``attend`` of a prompt, none in a decode step,
a traced step or with the switch off; on MLX's CPU device only when asked for (``1``)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlxrunner
from mlxrunner import settings
from mlxrunner.decode import forward
from mlxrunner.testing import random_prompt
from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder


@pytest.fixture(autouse=True)
def on_the_cpu():
    """MLX's CPU device (other tests in the process may have left the GPU as the default)."""
    saved = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(saved)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    config = dict(EXAMPLE_CONFIG, num_hidden_layers=9)  # 9 attentions: 2 submissions
    folder = write_model_folder(tmp_path_factory.mktemp("pipeline") / "m", config)
    return mlxrunner.load_model(folder, dtype="float32")


@pytest.fixture
def submitted(monkeypatch) -> list[int]:
    """The arrays handed to each ``mx.async_eval`` call (evaluated as MLX's own would)."""
    calls: list[int] = []
    real = mx.async_eval

    def async_eval(*arrays):
        calls.append(len(arrays))
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", async_eval)
    return calls


def _prompt_forward(model, ids):
    caches = model.make_cache()
    logits = forward(model, ids, caches)
    mx.eval(logits)
    return logits, caches


@pytest.mark.parametrize("tokens", [64, 130])
def test_a_pipelined_prompt_equals_the_one_evaluated_once_built(model, submitted, tokens):
    ids = random_prompt(model.vocab_size, 1, tokens, seed=tokens)
    with settings.overridden(pipeline="0", host_products=False):
        want, want_caches = _prompt_forward(model, ids)
    assert submitted == []
    with settings.overridden(pipeline="1", host_products=False):
        got, got_caches = _prompt_forward(model, ids)
        assert submitted == [3, 3]  # the 4th and 8th attention's q, keys and values
        assert mx.array_equal(got, want)
        for g, w in zip(got_caches, want_caches):
            assert g.offset == w.offset
            assert all(mx.array_equal(a, b) for a, b in zip(g.state, w.state))
        submitted.clear()
        mx.eval(forward(model, ids[:, -1:], got_caches))  # a decode step (traced): none
    assert submitted == []


def test_nothing_is_submitted_on_the_cpu_by_default_or_below_the_shortest_prompt(
        model, submitted):
    with settings.overridden(pipeline="auto", host_products=False):
        _prompt_forward(model, random_prompt(model.vocab_size, 1, 100, seed=1))
    with settings.overridden(pipeline="1", host_products=False):
        _prompt_forward(model, random_prompt(model.vocab_size, 1, 63, seed=2))
    with settings.overridden(pipeline="1", host_products=True):  # (host layers: evaluated)
        _prompt_forward(model, random_prompt(model.vocab_size, 1, 100, seed=3))
    assert submitted == []


def test_a_bad_pipeline_value_is_one_clear_error():
    with pytest.raises(mlxrunner.MLXRunnerError, match="MLXRUNNER_PIPELINE='yes'.*auto, 1, 0"):
        settings.Settings.from_environment({"MLXRUNNER_PIPELINE": "yes"})
