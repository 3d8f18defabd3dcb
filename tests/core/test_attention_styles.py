"""Every documented way of writing attention gets the core's compiled step.

A third party's layer may attend through ``mnn.store`` + ``mnn.attend``, through
``mlxrunner.attend`` over its cache's keys with ``"causal"``, None or a boolean mask of
its own, or through ``mx.fast.scaled_dot_product_attention`` directly (sliding windows
too). Each passes the conformance kit with the compiled step, and greedy decoding through
traced steps (replays counted, tracing never switched off) is token for token what eager
decoding gives. Tracing is per thread: two models decode at once on two threads, both
exact. Where a trace cannot be exact the fallback names the plugin, the architecture and
the first layer whose output differs, and the conformance kit says the same.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlxrunner
import mlxrunner.plugin
from attention_styles import STYLES, StyledModel, styled_model
from mlxrunner import SamplerOptions, settings
from mlxrunner.testing import (
    check_compiled_step,
    compiled_steps,
    random_prompt,
    run_conformance,
)
from plain_mlx_model import PlainModel

mx.set_default_device(mx.cpu)

# attention_styles.py attends through ``mlxrunner.attend`` on purpose, as a plugin written
# before mlxrunner.nn does: that name's DeprecationWarning is expected here.
pytestmark = pytest.mark.filterwarnings(r"ignore:mlxrunner\.attend:DeprecationWarning")

EXAMPLE = Path(__file__).resolve().parents[2] / "plugins" / "example-architecture" / \
    "tests" / "fixtures" / "tiny-example-llama"
GREEDY = SamplerOptions(temperature=0)


def decode(model, prompt, tokens=24, compiled=True):
    with settings.overridden(compile=compiled):
        return mlxrunner.generate(model, prompt, max_tokens=tokens, options=GREEDY).tokens


def assert_traced_decode_is_eager(model, prompt, tokens=24):
    steps = compiled_steps(model)
    steps.clear()
    want = decode(model, prompt, tokens, compiled=False)
    got = decode(model, prompt, tokens)
    assert got == want
    assert steps.enabled and steps.fallback is None
    # every token after the prompt's first came from a replayed trace
    assert steps.replays() >= tokens - 2, steps.replays()


@pytest.mark.parametrize("style", STYLES)
def test_each_attention_style_passes_the_conformance_kit(style):
    model = styled_model(style)
    prompt_len = 8 if style == "sdpa-window" else 12  # beyond the window: a wrapped ring
    ran = run_conformance(model, prompt_len=prompt_len, draft_len=4)
    assert "compiled_step" in ran
    assert check_compiled_step(model, random_prompt(model.vocab_size, 2, 9, seed=1),
                               block=4) > 0


@pytest.mark.parametrize("style", STYLES)
def test_each_attention_style_decodes_through_the_compiled_step(style):
    model = styled_model(style)
    assert_traced_decode_is_eager(model, [3, 1, 4, 1, 5, 9, 2, 6])


def test_every_style_in_one_model():
    model = styled_model(*STYLES)
    assert_traced_decode_is_eager(model, [7, 7, 2, 30, 11])
    assert check_compiled_step(model, random_prompt(model.vocab_size, 1, 10, seed=4)) > 0


def test_a_plain_mlx_nn_model_decodes_through_the_compiled_step():
    mx.random.seed(0)
    model = PlainModel(window=4)
    mx.eval(model.parameters())
    assert_traced_decode_is_eager(model, [5, 4, 3, 2, 1, 9])


def test_the_example_architecture_decodes_through_the_compiled_step():
    if not (EXAMPLE / "config.json").exists():
        pytest.skip(f"no example checkpoint at {EXAMPLE}")
    model = mlxrunner.load_model(EXAMPLE, dtype="float32")
    assert_traced_decode_is_eager(model, [1, 2, 3, 4, 5, 6, 7])


def test_two_models_decode_at_once_on_two_threads():
    """Traces of two models made and replayed on two threads at the same time: each is what
    the model decodes eagerly alone (a frame or routing shared between threads would mix
    their masks up)."""
    models = [styled_model("sdpa", "attend-causal", seed=1),
              styled_model("store", "sdpa-window", "attend-array", seed=2)]
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]
    want = [decode(m, p, 40, compiled=False) for m, p in zip(models, prompts)]
    start = threading.Barrier(2)
    got: dict[int, list[list[int]]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(i):
        try:
            start.wait()
            for _ in range(3):
                got[i].append(decode(models[i], prompts[i], 40))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i, model in enumerate(models):
        assert got[i] == [want[i]] * 3
        steps = compiled_steps(model)
        assert steps.enabled and steps.replays() > 100
    assert mx.fast.scaled_dot_product_attention.__module__ != "mlxrunner.decode.step"


def test_a_trace_that_cannot_be_exact_names_the_plugin_the_architecture_and_the_layer(
        caplog):
    """A causal mask aligned to the last key is right over an eager forward's keys and
    wrong over a whole buffer (verify blocks): the one warning names where, and the
    conformance kit reports the same line; decoding stays exact (eagerly)."""

    class EndAligned(StyledModel):
        pass

    mlxrunner.plugin.register("EndAlignedForTest", EndAligned)
    mx.random.seed(0)
    model = EndAligned(("store", "sdpa", "end-aligned", "store"))
    mx.eval(model.parameters())
    with caplog.at_level(logging.WARNING, logger="mlxrunner.decode"):
        with pytest.raises(AssertionError) as failed:
            check_compiled_step(model, random_prompt(model.vocab_size, 1, 9), block=4)
    message = str(failed.value)
    assert "EndAligned (plugin " in message and "architecture EndAlignedForTest" in message
    assert "layer 2 is the first whose output differs (layer 1 relative difference " \
        in message
    gaps = re.findall(r"layer (\d) relative difference ([0-9.e+-]+)", message)
    assert [layer for layer, _ in gaps] == ["1", "2"]
    assert float(gaps[0][1]) <= 1e-3 < float(gaps[1][1])  # agreeing, then not
    warnings = [r.getMessage() for r in caplog.records if "running eagerly" in r.getMessage()]
    assert len(warnings) == 1 and compiled_steps(model).fallback in warnings[0]
    prompt = [4, 4, 8, 15, 16, 23]
    with settings.overridden(compile=False):
        want = mlxrunner.generate(model, prompt, max_tokens=12, options=GREEDY).tokens
    assert mlxrunner.generate(model, prompt, max_tokens=12, options=GREEDY).tokens == want
