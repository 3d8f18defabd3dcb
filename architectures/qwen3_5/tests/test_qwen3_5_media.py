"""Qwen3.5 prompts holding images, through the core's media path, against transformers.

Reference: ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration`` on
CPU torch float32 (tests/make_media_fixtures.py, folders ``vision_fixtures/tiny_media`` and
``tiny_media_moe``: Gated DeltaNet and full-attention layers whose heads rotate 8
frequencies interleaved over the three position components, and a tiny vision tower), on
prompts with one image and with two images of different sizes (a wide one, then a tall one),
text before, between and after them, and on a prompt without an image. Ours: the model as
``mlxrunner.load_model`` loads it, float32 on the CPU, its image encoder from
``load_encoders``, the images read with ``mlxrunner.plugin.read_image`` and placed with
``mlxrunner.place_media``; the core prefills with the encoder's rows and the items'
multimodal positions (moved on by the prompt's shift, so decoding goes on from the cache's
offset).

Tolerance: max abs logit difference 1e-4 (logits are O(1); we measured at most 4.8e-6 at
the prompt's last position, whole or in chunks, and 3.7e-5 over the greedy steps, where the
text-only prompt's is 1.6e-5 too). What each part moves the last logits by,
measured (dense one / two images; experts one / two images): the forward without
``positions`` (every component the token's index) 0.66 / 0.88, 0.24 / 0.42; height and
width swapped 0.22 / 0.28, 0.06 / 0.20; every component the temporal one 0.09 / 0.15,
0.21 / 0.11; the other fixture's ``mrope_section`` 0.022 / 0.033, 0.028 / 0.023.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlxrunner_qwen3_5.mrope import DEFAULT_SECTION, frequency_components

import mlxrunner
from mlxrunner import MediaPrompt, SamplerOptions, place_media
from mlxrunner.plugin import MediaError, Model, ModelFolderError, read_image
from mlxrunner.testing import prefill, prefix_cache_for

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
IMAGES = FIXTURES / "images"
NAMES = ("tiny_media", "tiny_media_moe")
CASES = ("one_image", "two_images")
TOLERANCE = 1e-4
GREEDY = SamplerOptions(temperature=0.0)
IMAGE_ID = 250  # the fixtures' image_token_id (<|image_pad|>)


@pytest.fixture(scope="module", params=NAMES)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz", allow_pickle=False) as data:
        return dict(data)


@pytest.fixture(scope="module")
def model(name: str) -> Model:
    return mlxrunner.load_model(FIXTURES / name)


def media_prompt(model: Model, name: str, reference: dict[str, np.ndarray], case: str
                 ) -> MediaPrompt:
    """The case's prompt as a chat template writes it, its images placed."""
    encoder = model.load_encoders(FIXTURES / name)["image"]
    items = [encoder.prepare(read_image(IMAGES / str(file)))
             for file in reference[f"{case}_images"]]
    prompt = place_media(reference[f"{case}_text"].tolist(), items,
                         {"image": encoder.placeholder})
    assert isinstance(prompt, MediaPrompt)
    return prompt


def max_err(logits: mx.array, want: np.ndarray) -> float:
    return float(np.abs(np.array(logits.astype(mx.float32)).reshape(-1) - want).max())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (x.max(axis=-1, keepdims=True)
                + np.log(np.exp(x - x.max(axis=-1, keepdims=True)).sum(-1, keepdims=True)))


def generation_logprobs(model: Model, prompt: list[int] | MediaPrompt, steps: int
                        ) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's log-probabilities over the whole vocabulary as
    ``mlxrunner.generate`` reports them."""
    options = SamplerOptions(temperature=0.0, logprobs=True, top_logprobs=model.vocab_size)
    result = mlxrunner.generate(model, prompt, max_tokens=steps, options=options)
    out = np.full((steps, model.vocab_size), -np.inf)
    for step, info in enumerate(result.logprobs):
        for token, value in info["top_logprobs"]:
            out[step, token] = value
    return result.tokens, out


def test_the_fixtures_are_small_and_hold_both_layer_kinds_and_a_vision_tower(name):
    folder = FIXTURES / name
    assert sum(p.stat().st_size for p in folder.iterdir()) < 1_000_000
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    assert set(text["layer_types"]) == {"linear_attention", "full_attention"}
    assert "vision_config" in config and config["image_token_id"] == IMAGE_ID
    assert ("num_experts" in text) == name.endswith("moe")


def test_the_encoder_expands_an_image_as_the_processor_does(model, name, reference):
    encoder = model.load_encoders(FIXTURES / name)["image"]
    assert encoder.modality == "image" and encoder.placeholder == IMAGE_ID
    rgba = read_image(IMAGES / "rgba.png")
    item = encoder.prepare(rgba)
    t, h, w = (int(v) for v in reference["one_image_grid"][0])
    rows, cols = h // 2, w // 2  # 2 x 2 merge windows
    count = t * rows * cols
    assert (rows, cols) == (4, 5)  # not square: height and width stay apart
    assert item.tokens == (IMAGE_ID,) * count and item.slots == tuple(range(count))
    # transformers' positions of the image's tokens, from its first one; then max(h', w') on
    start = list(reference["one_image_ids"]).index(IMAGE_ID)
    want = reference["one_image_positions"][:, start:start + count]
    assert item.positions is not None
    np.testing.assert_array_equal(item.positions, want - want[0, 0])
    assert item.span == max(rows, cols) == reference["one_image_positions"][0, start + count] \
        - want[0, 0]
    rows_out = item.encode()
    assert rows_out.shape == (count, model.hidden_size) and rows_out.dtype == model.dtype
    assert encoder.prepare(rgba.copy()).digest == item.digest
    assert encoder.prepare(rgba[:, ::-1].copy()).digest != item.digest
    with pytest.raises(MediaError, match="uint8 RGB"):
        encoder.prepare(rgba.astype(np.float32))


@pytest.mark.parametrize("case", CASES)
def test_prompt_positions_are_transformers_moved_on_by_the_shift(model, name, reference, case):
    prompt = media_prompt(model, name, reference, case)
    assert list(prompt) == reference[f"{case}_ids"].tolist()
    table = np.array(prompt.positions(0, len(prompt)))[:, 0]
    np.testing.assert_array_equal(table - prompt.shift(), reference[f"{case}_positions"])
    # the next token sits at its index: decoding goes on from the cache's offset
    assert table.max() + 1 == len(prompt) and prompt.shift() > 0


@pytest.mark.parametrize("case", [*CASES, "text_only"])
def test_generation_matches_transformers_logits_and_greedy_tokens(model, name, reference,
                                                                  case):
    """The first step reads the prefill; the later ones decode at the cache's offset, which
    the prompt's shift makes transformers' positions moved on (its ``rope_deltas``)."""
    prompt = media_prompt(model, name, reference, case) if case != "text_only" else \
        reference["text_only_text"].tolist()
    want = reference[f"{case}_greedy"].tolist()
    tokens, logprobs = generation_logprobs(model, prompt, len(want))
    assert tokens == want
    assert np.abs(logprobs[0] - log_softmax(reference[f"{case}_logits"])).max() < TOLERANCE
    assert np.abs(logprobs - log_softmax(reference[f"{case}_greedy_logits"])).max() \
        < TOLERANCE


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [64, 16, 5])  # 5: each image spans 4 to 6 chunks
def test_chunked_prefill_logits_match_transformers(model, name, reference, case, chunk):
    prompt = media_prompt(model, name, reference, case)
    logits, _ = prefill(model, prompt, model.make_cache(), chunk=chunk)
    assert max_err(logits[0], reference[f"{case}_logits"]) < TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_the_rows_and_positions_are_what_move_the_logits(model, name, reference, case):
    prompt = media_prompt(model, name, reference, case)
    ids = mx.array([list(prompt)])
    want = reference[f"{case}_logits"]
    embedded = prompt.embeddings(model, ids, 0)
    positions = prompt.positions(0, len(prompt))
    assert embedded is not None and positions is not None
    assert max_err(model(ids, embeddings=embedded, positions=positions)[0, -1], want) \
        < TOLERANCE
    assert max_err(model(ids, positions=positions)[0, -1], want) > 0.05  # no image rows
    assert max_err(model(ids, embeddings=embedded)[0, -1], want) > 0.05  # no positions
    swapped = positions[mx.array([0, 2, 1])]  # height and width apart, as transformers
    assert max_err(model(ids, embeddings=embedded, positions=swapped)[0, -1], want) > 0.02


def test_text_only_positions_rotate_as_the_plain_rope(model, reference):
    """A text chunk of a prompt holding images gets ``positions``: its three components
    agree there, and the rotation is the one the model runs from the cache's offset."""
    ids = mx.array([reference["text_only_ids"].tolist()])
    plain = model(ids)
    assert max_err(plain[0, -1], reference["text_only_logits"]) < TOLERANCE
    index = mx.broadcast_to(mx.arange(ids.shape[1], dtype=mx.int32)[None, None],
                            (3, *ids.shape))
    np.testing.assert_allclose(np.array(model(ids, positions=index)), np.array(plain),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="positions must be"):
        model(ids, positions=index[:2])


def test_a_batch_of_image_and_text_prompts_equals_generate_per_prompt(model, name, reference):
    prompts = [media_prompt(model, name, reference, "one_image"),
               reference["text_only_text"].tolist(),
               media_prompt(model, name, reference, "two_images")]
    want = [mlxrunner.generate(model, p, max_tokens=8, options=GREEDY).tokens for p in prompts]
    assert want[0] == reference["one_image_greedy"].tolist()
    got = mlxrunner.generate_batch(model, prompts, max_tokens=8, options=GREEDY)
    assert [r.tokens for r in got] == want


@pytest.mark.parametrize("case", CASES)
def test_speculative_decoding_of_an_image_prompt_equals_plain(model, name, reference, case):
    """A draft reads the target's taps: the prefill runs ``taps=`` with the embeddings and
    positions; verify blocks run from the cache's offset."""
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.testing.speculative import random_draft

    want = reference[f"{case}_greedy"].tolist()
    prompt = media_prompt(model, name, reference, case)
    draft = random_draft(model, seed=2)
    got = mlxrunner.generate(model, prompt, max_tokens=len(want), draft=draft, options=GREEDY)
    assert got.tokens == want


@pytest.mark.parametrize("case", CASES)
def test_the_mtp_head_drafting_for_an_image_prompt_leaves_greedy_output_as_plain(
        model, name, reference, case):
    """The checkpoint's own draft: it reads the target's taps from the image prefill and
    drafts from its cache's offsets; its rounds are verified, so the tokens are plain's."""
    from mlxrunner_qwen3_5.mtp import Qwen3_5MTP

    from mlxrunner.testing.speculative import build_draft, randomize

    config = json.loads((FIXTURES / name / "config.json").read_text())["text_config"]
    draft = build_draft(Qwen3_5MTP, dict(config, mtp_num_hidden_layers=1), model)
    randomize(draft, 3)
    draft.eval()
    want = reference[f"{case}_greedy"].tolist()
    prompt = media_prompt(model, name, reference, case)
    got = mlxrunner.generate(model, prompt, max_tokens=len(want), draft=draft, options=GREEDY)
    assert got.tokens == want and got.stats.rounds > 0


@pytest.mark.parametrize("case", CASES)
def test_a_repeated_image_prompt_hits_the_prefix_cache(model, name, reference, case):
    prompt = media_prompt(model, name, reference, case)
    cache = prefix_cache_for(model.make_cache)
    runs = [mlxrunner.generate(model, prompt, max_tokens=4, options=GREEDY, prefix_cache=cache)
            for _ in range(3)]
    assert runs[0].stats.cached_tokens == 0
    assert runs[1].stats.cached_tokens > 0 and runs[2].stats.cached_tokens > 0
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens \
        == reference[f"{case}_greedy"][:4].tolist()


def test_folders_without_a_vision_tower_have_no_encoders():
    text_only = HERE / "fixtures" / "tiny_hk2_hv4_tied"
    assert mlxrunner.load_model(text_only).load_encoders(text_only) == {}


def test_an_image_token_outside_the_vocabulary_is_refused(tmp_path):
    folder = tmp_path / "hub_ids"
    shutil.copytree(FIXTURES / "tiny_media", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["image_token_id"]  # the default is the Hub's, outside this 256-token vocabulary
    (folder / "config.json").write_text(json.dumps(config))
    model = mlxrunner.load_model(folder)
    assert model.config.image_token_id == 248056
    with pytest.raises(ModelFolderError, match="image_token_id 248056 is outside"):
        model.load_encoders(folder)


def test_a_processor_that_does_not_fit_the_tower_is_refused(tmp_path):
    folder = tmp_path / "mismatched"
    shutil.copytree(FIXTURES / "tiny_media", folder)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    settings["patch_size"] = 8
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    model = mlxrunner.load_model(folder)
    with pytest.raises(ModelFolderError, match="patch_size"):
        model.load_encoders(folder)


def test_mrope_sections_interleave_the_components():
    # transformers' slices: height at 1, 4, ... below 3 * section[1], width at 2, 5, ...
    # below 3 * section[2], temporal elsewhere
    assert frequency_components(8, (11, 11, 10)).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert frequency_components(8, (2, 1, 1)).tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    released = frequency_components(32, DEFAULT_SECTION)  # Qwen3.5's 64 rotary dimensions
    assert (released == 1).sum() == 11 and (released == 2).sum() == 10
    assert released[29:].tolist() == [2, 0, 1]


def test_mrope_section_is_read_from_the_config(tmp_path):
    folder = tmp_path / "sections"
    shutil.copytree(FIXTURES / "tiny_media_moe", folder)
    config = json.loads((folder / "config.json").read_text())
    assert mlxrunner.load_model(folder).config.mrope_section == (2, 1, 1)
    del config["text_config"]["rope_parameters"]["mrope_section"]
    (folder / "config.json").write_text(json.dumps(config))
    assert mlxrunner.load_model(folder).config.mrope_section == DEFAULT_SECTION
    config["text_config"]["rope_parameters"]["mrope_section"] = [11, 11]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="mrope_section"):
        mlxrunner.load_model(folder)
