"""Gemma 4 prompts holding images, through the core's media path, against transformers.

Reference: ``Gemma4ForConditionalGeneration`` on CPU torch float32, eager attention
(tests/make_media_fixtures.py, folder ``vision_fixtures/tiny_media``: an E2B-shaped text
model with per-layer inputs and a tiny vision tower), on prompts with one image and with two
images of different sizes, text before, between and after them. Ours: the model as
``mlxrunner.load_model`` loads it, float32 on the CPU, its image encoder from
``load_encoders``, the images read with ``mlxrunner.plugin.read_image`` and placed with
``mlxrunner.place_media``. The last logits are read through the core's prefill as
``mlxrunner.generate`` reports them (every token's logprob) and by running the prompt in
chunks through the model with the embeddings ``MediaPrompt`` gives each chunk (a plugin's
tests may not import ``mlxrunner.decode.prefill`` or the prefix cache: tools/check_layers.py).
Tolerance: max abs logit difference 1e-4 (logits are O(1); we
measured 1.3e-6 with one image, 1.5e-5 with two). What each part of the per-layer inputs'
contract moves the last logits by, measured: the token table looking up the image ids
instead of padding 0.19 / 1.5, the projection reading the text embeddings instead of the
merged ones 0.41 / 1.5; the stray audio token embedded as itself, not padding, 0.09.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gemma4_media_checks as checks
import mlx.core as mx
import numpy as np
import pytest
from gemma4_media_checks import (
    GREEDY,
    IMAGES,
    TOLERANCE,
    generation_logprobs,
    log_softmax,
    max_err,
    read_reference,
)

import mlxrunner
from mlxrunner import MediaPrompt, SamplerOptions
from mlxrunner.plugin import MediaError, Model, read_image
from mlxrunner.testing import prefill, prefix_cache_for

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision_fixtures" / "tiny_media"
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




def test_the_fixture_is_small_e2b_shaped_and_has_a_vision_tower():
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) < 1_000_000
    config = json.loads((FOLDER / "config.json").read_text())
    text = config["text_config"]
    assert text["hidden_size_per_layer_input"] > 0 and text["num_kv_shared_layers"] > 0
    assert text["use_bidirectional_attention"] is None and "vision_config" in config


def test_the_encoder_expands_an_image_as_the_processor_does(model, reference):
    encoder = model.load_encoders(FOLDER)["image"]
    assert encoder.modality == "image" and encoder.placeholder == 120  # config's image id
    rgba = read_image(IMAGES / "rgba.png")
    item = encoder.prepare(rgba)
    soft = int(reference["one_image_soft"][0])
    assert item.tokens == (123, *[120] * soft, 124)  # boi, the soft tokens, eoi
    assert item.slots == tuple(range(1, soft + 1))
    rows = item.encode()
    assert rows.shape == (soft, model.hidden_size) and rows.dtype == model.dtype
    assert encoder.prepare(rgba.copy()).digest == item.digest
    assert encoder.prepare(rgba[:, ::-1].copy()).digest != item.digest
    with pytest.raises(MediaError, match="uint8 RGB"):
        encoder.prepare(rgba.astype(np.float32))






def chunked_last_logits(model: Model, prompt: MediaPrompt, chunk: int) -> mx.array:
    """The last position's logits of ``prompt`` through the core's prefill, ``chunk`` tokens
    at a time (a chunk holding image slots gets the encoder's rows)."""
    logits, _ = prefill(model, prompt, model.make_cache(), chunk=chunk)
    return logits[0]


@pytest.mark.parametrize("case", CASES)
def test_generation_starts_from_transformers_logits(model, reference, case):
    prompt = media_prompt(model, reference, case)
    assert list(prompt) == reference[f"{case}_ids"].tolist()
    got = generation_logprobs(model, prompt)
    assert np.abs(got - log_softmax(reference[f"{case}_logits"])).max() < TOLERANCE


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [16, 5])  # the images span 4 to 14 chunks
def test_chunked_prefill_logits_match_transformers(model, reference, case, chunk):
    prompt = media_prompt(model, reference, case)
    logits = chunked_last_logits(model, prompt, chunk)
    assert max_err(logits, reference[f"{case}_logits"]) < TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_the_image_rows_and_padded_media_ids_are_what_moves_the_logits(model, reference, case):
    """The same ids without the image rows miss by far; the forward taking the merged
    embeddings directly matches (per-layer inputs read the ids as padding there too)."""
    prompt = media_prompt(model, reference, case)
    ids = mx.array([list(prompt)])
    want = reference[f"{case}_logits"]
    assert max_err(model(ids)[0, -1], want) > 0.05
    embedded = prompt.embeddings(model, ids, 0)
    assert embedded is not None
    assert max_err(model(ids, embeddings=embedded)[0, -1], want) < TOLERANCE


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


def test_folders_without_a_vision_tower_have_no_encoders():
    text_only = HERE / "fixtures" / "e2b"
    assert mlxrunner.load_model(text_only).load_encoders(text_only) == {}


def test_config_token_ids_default_to_gemma4s():
    folder = HERE / "vision_fixtures" / "tiny_vision"  # config.json keeps the Hub's ids
    encoder = mlxrunner.load_model(folder).load_encoders(folder)["image"]
    assert encoder.placeholder == 258880


def test_bidirectional_vision_attention_prefills_images_whole(tmp_path):
    """The same folder saying ``use_bidirectional_attention: vision`` gives whole images
    (test_gemma4_bidirectional.py checks such a checkpoint against transformers)."""
    folder = tmp_path / "bidirectional"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (folder / "config.json").write_text(json.dumps(config))
    model = mlxrunner.load_model(folder)
    item = model.load_encoders(folder)["image"].prepare(read_image(IMAGES / "rgba.png"))
    assert item.whole


def test_speculative_decoding_of_an_image_prompt_equals_plain(model, reference):
    """A draft reads the target's taps: the prefill runs ``taps=`` with the embeddings."""
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.testing.speculative import random_draft

    want = reference["one_image_greedy"].tolist()
    prompt = media_prompt(model, reference, "one_image")
    draft = random_draft(model, seed=2)
    got = mlxrunner.generate(model, prompt, max_tokens=len(want), draft=draft, options=GREEDY)
    assert got.tokens == want


@pytest.mark.parametrize("case", CASES)
def test_a_repeated_image_prompt_hits_the_prefix_cache(model, reference, case):
    prompt = media_prompt(model, reference, case)
    cache = prefix_cache_for(model.make_cache)
    greedy = SamplerOptions(temperature=0.0)
    runs = [mlxrunner.generate(model, prompt, max_tokens=4, options=greedy, prefix_cache=cache)
            for _ in range(3)]
    assert runs[0].stats.cached_tokens == 0
    assert runs[1].stats.cached_tokens > 0 and runs[2].stats.cached_tokens > 0
    assert runs[1].tokens == runs[0].tokens == runs[2].tokens
