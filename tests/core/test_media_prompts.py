"""Prompts that hold media (mlxrunner.media: the encoder contract, MediaPrompt, place_media):
the core places an encoder's rows at their slots in every decoding path, and the prefix cache
keys them by content.

The model is the example architecture with a toy image encoder written against the public
API, as a third party would: each 4x4 patch of an image becomes one embedding row (a linear
map of its pixels); the item's tokens are a begin marker, one slot per patch, an end marker.
The reference is the model's own uncached forward over the whole sequence with the rows
placed by hand (no cache, no chunks), greedy token by token."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

mx.set_default_device(mx.cpu)

pytest.importorskip("mlxrunner_example_architecture",
                    reason="the example-architecture plugin is not installed")

from mlxrunner_example_architecture.model import ExampleLlama  # noqa: E402

import mlxrunner  # noqa: E402
from mlxrunner import MediaPrompt, SamplerOptions, place_media  # noqa: E402
from mlxrunner.errors import MediaError  # noqa: E402
from mlxrunner.plugin import MediaItem  # noqa: E402
from mlxrunner_test_support import media_llama  # noqa: E402

CONFIG = {
    "architectures": ["ExampleLlamaForCausalLM"], "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96, "tie_word_embeddings": False,
}
PLACEHOLDER, BEGIN, SLOT, END = 90, 91, 92, 93
GREEDY = SamplerOptions(temperature=0.0)


def MediaLlama(config: dict) -> ExampleLlama:  # noqa: N802 (a class, to the reader)
    return media_llama(config, (PLACEHOLDER, BEGIN, SLOT, END))


@pytest.fixture(scope="module")
def model() -> ExampleLlama:
    from mlxrunner.testing.speculative import randomize

    m = MediaLlama(dict(CONFIG))
    randomize(m, seed=3)
    m.eval()
    return m


def _image(seed: int, h: int = 8, w: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _prompt(model: ExampleLlama, *images: np.ndarray, text: tuple[int, ...] = (5, 6, 7)
            ) -> MediaPrompt:
    encoder = model.load_encoders(Path("."))["image"]
    tokens = [1, 2, *[t for _ in images for t in (PLACEHOLDER, 3)], *text]
    return place_media(tokens, [encoder.prepare(im) for im in images], {"image": PLACEHOLDER})


def _reference_greedy(model: ExampleLlama, prompt: MediaPrompt, n: int) -> list[int]:
    """The uncached forward over the whole sequence, the rows placed by hand, each step."""
    rows = {}
    for start, item in prompt.placed:
        encoded = item.encode()
        for r, slot in enumerate(item.slots):
            rows[start + slot] = encoded[r]
    ids = list(prompt)
    out = []
    for _ in range(n):
        embedded = model.embed_tokens(mx.array([ids]))
        for position, row in rows.items():
            embedded[0, position] = row
        logits = model(mx.array([ids]), embeddings=embedded)
        token = int(mx.argmax(logits[0, -1]))
        out.append(token)
        ids.append(token)
    return out


def test_place_media_splices_items_and_refuses_a_count_that_differs(model):
    prompt = _prompt(model, _image(0), _image(1, 4, 4))
    assert list(prompt[:3]) == [1, 2, BEGIN]
    assert [s for s, _ in prompt.placed] == [2, 2 + 6 + 2 + 1]  # 2x3 patches, then 1x1
    assert list(prompt).count(SLOT) == 6 + 1 and PLACEHOLDER not in prompt
    assert isinstance(prompt[:4], MediaPrompt) and len(prompt[:4].placed) == 1
    assert not isinstance(prompt[2:], MediaPrompt)  # a slice not from the start: ids only
    encoder = model.load_encoders(Path("."))["image"]
    with pytest.raises(MediaError, match="2 image placeholder"):
        place_media([PLACEHOLDER, 4, PLACEHOLDER], [encoder.prepare(_image(0))],
                    {"image": PLACEHOLDER})
    with pytest.raises(MediaError, match="no audio input"):
        item = encoder.prepare(_image(0))
        place_media([PLACEHOLDER], [MediaItem("audio", item.tokens, item.slots, item.digest,
                                              item.encode)], {"image": PLACEHOLDER})


def test_generate_places_the_rows_as_the_uncached_forward_does(model):
    prompt = _prompt(model, _image(0), _image(1, 4, 8))
    want = _reference_greedy(model, prompt, 12)
    got = mlxrunner.generate(model, prompt, max_tokens=12, options=GREEDY).tokens
    assert got == want
    # the same ids without the media rows decode otherwise: the rows were used
    assert mlxrunner.generate(model, list(prompt), max_tokens=12, options=GREEDY).tokens != want


def test_chunked_prefill_splits_an_image_and_gives_the_same_logits(model):
    from mlxrunner.decode import prefill

    prompt = _prompt(model, _image(2, 12, 12))  # 9 slots
    whole, _ = prefill(model, prompt, model.make_cache())
    for chunk in (2, 3, 5):
        chunked, _ = prefill(model, prompt, model.make_cache(), chunk=chunk)
        np.testing.assert_allclose(np.array(chunked), np.array(whole), rtol=1e-5, atol=1e-5)


def test_the_prefix_cache_keys_media_by_content(model):
    from mlxrunner.cache import prefix_cache_for

    cache = prefix_cache_for(model.make_cache)
    first = _prompt(model, _image(0), text=tuple(range(4, 40)))
    want = mlxrunner.generate(model, first, max_tokens=6, options=GREEDY).tokens
    again = mlxrunner.generate(model, first, max_tokens=6, prefix_cache=cache, options=GREEDY)
    assert again.tokens == want and again.stats.cached_tokens == 0
    hit = mlxrunner.generate(model, first, max_tokens=6, prefix_cache=cache, options=GREEDY)
    assert hit.tokens == want and hit.stats.cached_tokens > 8
    # another image of the same size: same ids, other content: nothing past its first slot
    other = _prompt(model, _image(9), text=tuple(range(4, 40)))
    assert list(other) == list(first)
    alone = mlxrunner.generate(model, other, max_tokens=6, options=GREEDY).tokens
    missed = mlxrunner.generate(model, other, max_tokens=6, prefix_cache=cache, options=GREEDY)
    assert missed.tokens == alone and missed.stats.cached_tokens <= first.placed[0][0] + 1


def test_a_batch_of_media_and_text_rows_equals_generate_per_prompt(model):
    prompts = [_prompt(model, _image(0)), [1, 2, 3, 4, 5], _prompt(model, _image(4), _image(5)),
               _prompt(model, _image(6, 16, 16), text=tuple(range(10, 30)))]
    want = [mlxrunner.generate(model, p, max_tokens=8, options=GREEDY).tokens for p in prompts]
    got = mlxrunner.generate_batch(model, prompts, max_tokens=8, options=GREEDY)
    assert [r.tokens for r in got] == want


def test_speculative_decoding_of_a_media_prompt_equals_plain(model):
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.testing.speculative import random_draft

    prompt = _prompt(model, _image(0), _image(3, 8, 8))
    want = mlxrunner.generate(model, prompt, max_tokens=16, options=GREEDY).tokens
    draft = random_draft(model, seed=2)
    got = mlxrunner.generate(model, prompt, max_tokens=16, draft=draft, options=GREEDY)
    assert got.tokens == want
    batched = mlxrunner.generate_batch(model, [prompt, [4, 5, 6]], max_tokens=16, draft=draft,
                                       options=GREEDY)
    assert batched[0].tokens == want


def _positioned(item: MediaItem, rows: int, cols: int) -> MediaItem:
    """``item`` as a Qwen-style encoder gives it: each slot at (0, row, col) of its grid, the
    markers on the running position, the item taking max(rows, cols) + 2 positions."""
    n = len(item.tokens)
    grid = np.zeros((3, n), np.int64)
    grid[:, 0] = 0
    for k in range(rows * cols):
        grid[:, 1 + k] = (1, 1 + k // cols, 1 + k % cols)
    span = max(rows, cols) + 2
    grid[:, n - 1] = span - 1
    return MediaItem(item.modality, item.tokens, item.slots, item.digest, item.encode,
                     positions=grid, span=span)


def test_positions_run_on_after_items_that_take_fewer_positions_than_tokens(model):
    encoder = model.load_encoders(Path("."))["image"]
    a = _positioned(encoder.prepare(_image(0, 8, 12)), 2, 3)  # 8 tokens, 5 positions
    b = _positioned(encoder.prepare(_image(1, 4, 8)), 1, 2)   # 4 tokens, 4 positions
    prompt = place_media([1, PLACEHOLDER, 2, 3, PLACEHOLDER, 4], [a, b],
                         {"image": PLACEHOLDER})
    assert prompt.shift() == 3
    table = np.array(prompt.positions(0, len(prompt)))[:, 0]
    true = np.array([[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 8, 9, 9, 11, 12],   # t
                     [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 8, 9, 9, 11, 12],   # h
                     [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])  # w
    np.testing.assert_array_equal(table, true + 3)  # moved on: the next token sits at 16
    assert len(prompt) == 16
    np.testing.assert_array_equal(np.array(prompt.positions(4, 9)), (true + 3)[:, None, 4:9])
    part = prompt[:10]  # a prefill chunk's prefix keeps the whole prompt's positions
    np.testing.assert_array_equal(np.array(part.positions(0, 10)), (true + 3)[:, None, :10])
    # the shift is in the prefix cache's key; the same ids without positions share nothing
    plain = place_media([1, PLACEHOLDER, 2, 3, PLACEHOLDER, 4], [
        encoder.prepare(_image(0, 8, 12)), encoder.prepare(_image(1, 4, 8))],
        {"image": PLACEHOLDER})
    assert plain.positions(0, 4) is None and plain.shift() == 0
    assert prompt.cache_key()[1:] == plain.cache_key()[1:]
    assert prompt.cache_key()[0] != plain.cache_key()[0] == 1
    assert part.cache_key() == prompt.cache_key()[:10]
    with pytest.raises(ValueError, match="positions must be"):
        MediaItem("image", a.tokens, a.slots, a.digest, a.encode, positions=a.positions, span=3)


def test_an_item_prefilled_whole_is_never_split_between_chunks(model, monkeypatch):
    """(Gemma 4's larger checkpoints attend both ways among an image's tokens.) The chunks
    of generate's prefill and of the batch's step around a ``whole`` item."""
    from mlxrunner.batch import BatchRequest, Scheduler
    from mlxrunner.decode import prefill

    encoder = model.load_encoders(Path("."))["image"]
    item = encoder.prepare(_image(2, 12, 12))  # 9 slots: 11 tokens
    whole = MediaItem(item.modality, item.tokens, item.slots, item.digest, item.encode,
                      whole=True)
    prompt = place_media([1, 2, 3, 4, PLACEHOLDER, 5, 6, 7, 8, 9], [whole],
                         {"image": PLACEHOLDER})  # the item: tokens 4..14
    seen: list[tuple[int, int]] = []
    real = type(model).__call__

    def recording(self, ids, cache=None, **kwargs):
        seen.append((cache[0].offset if cache and cache[0] is not None else 0, ids.shape[1]))
        return real(self, ids, cache, **kwargs)

    monkeypatch.setattr(type(model), "__call__", recording)
    prefill(model, prompt, model.make_cache(), chunk=3)
    assert seen == [(0, 3), (3, 12), (15, 3), (18, 2)]  # 3..15 in one: past the item's end
    seen.clear()
    scheduler = Scheduler(model, prefill_chunk=3)
    scheduler.submit(BatchRequest(prompt, GREEDY, 1))
    scheduler.run_until_idle()
    assert [call for call in seen if call[1] > 1] == [(0, 3), (3, 12), (15, 3), (18, 2)]


def test_prefixes_ending_inside_an_item_are_stored_and_found(model):
    """The batch stores every prefill chunk's end in the prefix cache: a chunk may end inside
    an image. A prompt starting with an item builds; the shift's key keeps the first id."""
    from mlxrunner.batch import BatchRequest, Scheduler
    from mlxrunner.cache import prefix_cache_for

    prompt = _prompt(model, _image(0), text=tuple(range(4, 20)))  # the image: tokens 2..9
    cache = prefix_cache_for(model.make_cache)
    want = mlxrunner.generate(model, prompt, max_tokens=4, options=GREEDY).tokens
    runs = []
    for _ in range(2):
        scheduler = Scheduler(model, prefill_chunk=4)
        request = scheduler.submit(BatchRequest(prompt, GREEDY, 4, prefix_cache=cache))
        scheduler.run_until_idle()
        runs.append(request.result())
    assert [r.tokens for r in runs] == [want, want]
    assert runs[1].stats.cached_tokens > 0
    encoder = model.load_encoders(Path("."))["image"]
    first = place_media([PLACEHOLDER, 3], [encoder.prepare(_image(1, 4, 4))],
                        {"image": PLACEHOLDER})
    assert first.placed[0][0] == 0 and list(first[:1]) == [BEGIN]
    a = _positioned(encoder.prepare(_image(0, 8, 12)), 2, 3)
    keys = [place_media([lead, PLACEHOLDER, 4], [a], {"image": PLACEHOLDER}).cache_key()
            for lead in (1, 7)]
    assert keys[0][1:] == keys[1][1:] and keys[0][0] != keys[1][0]
