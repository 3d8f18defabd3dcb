"""Gemma 4 checkpoints whose images attend to themselves both ways (``use_bidirectional_attention:
"vision"``, 31B-style), through the core's media path, against transformers.

Reference: ``Gemma4ForConditionalGeneration`` on CPU torch float32, eager attention, given the
processor's ``mm_token_type_ids`` (tests/make_bidirectional_fixtures.py, folder
``vision_fixtures/tiny_bidirectional``: a 31B-shaped text model, no per-layer inputs, K=V
full layers, a sliding window of 8, and make_media_fixtures.py's vision tower), on the same
prompts as test_gemma4_media.py (one image of 60 soft tokens; two images of 66 and 42 soft
tokens with text and a stray audio token between them). Its sliding layers' masks are
AND(window, OR(causal, same image run)); the full layers stay causal. Ours: the model as
``mlxrunner.load_model`` loads it, float32 on the CPU, its image items ``whole`` (one prefill
chunk each, whatever the chunk size), the model ORing the image blocks into its sliding
layers' masks for chunks holding media. Tolerance: max abs logit difference 1e-4 (we
measured 1.8e-6 with one image, 1.7e-6 with two, every chunk size); causal masks instead
miss by 0.35 / 0.85.
"""

from __future__ import annotations

import json
from pathlib import Path

import gemma4_media_checks as checks
import mlx.core as mx
import numpy as np
import pytest
from gemma4_media_checks import (
    GREEDY,
    IMAGES,
    TOLERANCE,
    log_softmax,
    max_err,
    read_reference,
)

import mlxrunner
from mlxrunner import MediaPrompt, SamplerOptions
from mlxrunner.plugin import Model, read_image
from mlxrunner.testing import prefill, prefix_cache_for

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision_fixtures" / "tiny_bidirectional"
CASES = ("one_image", "two_images")


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return read_reference(FOLDER)


@pytest.fixture(scope="module")
def model() -> Model:
    return mlxrunner.load_model(FOLDER)


def media_prompt(model: Model, reference: dict[str, np.ndarray], case: str) -> MediaPrompt:
    """The case's prompt as a chat template writes it, its images placed."""
    return checks.media_prompt(model, FOLDER, reference, case)






def test_the_fixture_is_small_31b_shaped_and_bidirectional(reference):
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) < 1_000_000
    config = json.loads((FOLDER / "config.json").read_text())
    text = config["text_config"]
    assert text["use_bidirectional_attention"] == "vision" and "vision_config" in config
    assert not text["hidden_size_per_layer_input"] and not text["num_kv_shared_layers"]
    # every image spans more than the sliding window
    assert min(int(n) for case in CASES for n in reference[f"{case}_soft"]) > \
        text["sliding_window"]


@pytest.mark.parametrize("case", CASES)
def test_the_blocks_move_transformers_logits(reference, case):
    """Transformers' causal masks (no mm_token_type_ids) give other logits: the fixture
    checks the blockwise overlay."""
    assert np.abs(reference[f"{case}_causal_logits"] - reference[f"{case}_logits"]).max() > 0.1


def test_the_encoder_gives_whole_images(model, reference):
    encoder = model.load_encoders(FOLDER)["image"]
    item = encoder.prepare(read_image(IMAGES / "rgba.png"))
    soft = int(reference["one_image_soft"][0])
    assert item.whole and item.tokens == (123, *[120] * soft, 124)
    causal = HERE / "vision_fixtures" / "tiny_media"  # E2B-style: split freely
    assert not mlxrunner.load_model(causal).load_encoders(causal)["image"].prepare(
        read_image(IMAGES / "rgba.png")).whole


@pytest.mark.parametrize("case", CASES)
def test_generation_starts_from_transformers_logits(model, reference, case):
    prompt = media_prompt(model, reference, case)
    assert list(prompt) == reference[f"{case}_ids"].tolist()
    options = SamplerOptions(temperature=0.0, logprobs=True, top_logprobs=model.vocab_size)
    result = mlxrunner.generate(model, prompt, max_tokens=1, options=options)
    got = np.full(model.vocab_size, -np.inf)
    for token, value in result.logprobs[0]["top_logprobs"]:
        got[token] = value
    assert np.abs(got - log_softmax(reference[f"{case}_logits"])).max() < TOLERANCE


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [64, 16, 5, 3])  # all but 64 smaller than every image
def test_chunked_prefill_logits_match_transformers(model, reference, case, chunk):
    prompt = media_prompt(model, reference, case)
    logits, _ = prefill(model, prompt, model.make_cache(), chunk=chunk)
    assert max_err(logits[0], reference[f"{case}_logits"]) < TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_a_forward_without_a_cache_matches(model, reference, case):
    prompt = media_prompt(model, reference, case)
    ids = mx.array([list(prompt)])
    embedded = prompt.embeddings(model, ids, 0)
    assert embedded is not None
    assert max_err(model(ids, embeddings=embedded)[0, -1], reference[f"{case}_logits"]) < \
        TOLERANCE


def test_greedy_generation_matches_transformers(model, reference):
    want = reference["one_image_greedy"].tolist()
    prompt = media_prompt(model, reference, "one_image")
    got = mlxrunner.generate(model, prompt, max_tokens=len(want), options=GREEDY)
    assert got.tokens == want


def test_a_batch_of_image_and_text_prompts_equals_generate_per_prompt(model, reference):
    prompts = [media_prompt(model, reference, "one_image"), [2, 40, 41, 42, 43, 44],
               media_prompt(model, reference, "two_images")]
    want = [mlxrunner.generate(model, p, max_tokens=8, options=GREEDY).tokens for p in prompts]
    assert want[0] == reference["one_image_greedy"][:8].tolist()
    got = mlxrunner.generate_batch(model, prompts, max_tokens=8, options=GREEDY)
    assert [r.tokens for r in got] == want


@pytest.mark.parametrize("case", CASES)
def test_a_repeated_image_prompt_hits_the_prefix_cache(model, reference, case):
    prompt = media_prompt(model, reference, case)
    cache = prefix_cache_for(model.make_cache)
    runs = [mlxrunner.generate(model, prompt, max_tokens=4, options=GREEDY, prefix_cache=cache)
            for _ in range(3)]
    assert runs[0].stats.cached_tokens == 0
    assert runs[1].stats.cached_tokens > 0 and runs[2].stats.cached_tokens > 0
    assert runs[1].tokens == runs[0].tokens == runs[2].tokens
    if case == "one_image":
        assert runs[0].tokens == reference["one_image_greedy"][:4].tolist()
