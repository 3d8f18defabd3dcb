"""Gemma 4 audio, through the core's media path, against transformers 5.24.

Reference: ``Gemma4ForConditionalGeneration`` and ``Gemma4AudioFeatureExtractor`` on CPU torch
float32, eager attention (tests/make_audio_fixtures.py, folder ``audio_fixtures/tiny_audio``:
make_media_fixtures.py's E2B-shaped text model and vision tower with a tiny audio tower whose
clip bounds, residual clamp and logit cap all act), on two 16-bit WAV clips of 0.37 s and
1.1 s: their log-mel features, the tower's output and ``embed_audio``'s, and the last
logits and greedy tokens of prompts holding one clip, two clips, and an image and a clip;
and a lone tower whose steps also attend to later ones (``right_context_tower.npz``).
Ours: the model as ``mlxrunner.load_model`` loads it, float32 on the CPU, its encoders from
``load_encoders``, the clips read with ``mlxrunner.plugin.read_audio`` and placed with
``mlxrunner.place_media``.

Tolerances: features 1e-5 (we measured 0: the same float32 FFT and float64 filters); the
tower's and ``embed_audio``'s outputs 1e-5 (measured 1.7e-6 and 4.3e-6; values O(1));
logits 1e-4 (measured at most 1.2e-5 over the three prompts and every chunk size, 1.1e-5
for the log-probabilities ``generate`` reports).
"""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import gemma4_media_checks as checks
import mlx.core as mx
import numpy as np
import pytest
from gemma4_media_checks import (
    GREEDY,
    generation_logprobs,
    log_softmax,
    max_err,
    read_reference,
)
from mlxrunner_gemma4.audio import Gemma4Audio, load_audio
from mlxrunner_gemma4.audio_features import FeatureConfig, audio_features, log_mel_features

import mlxrunner
from mlxrunner import MediaPrompt
from mlxrunner.plugin import MediaError, Model, ModelFolderError, read_audio
from mlxrunner.testing import prefill, prefix_cache_for

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "audio_fixtures" / "tiny_audio"
CLIPS = HERE / "audio_fixtures" / "clips"
CLIP_NAMES = ("chord", "chirp")
CASES = ("one_clip", "two_clips", "image_and_clip")
#: make_audio_fixtures.py's VARIANTS: what transformers reads back of them (the frame and
#: hop lengths in milliseconds, which its saved config does not hold)
VARIANT_MS = {"htk_preemphasis": {}, "plain_preemphasis": {"frame_length_ms": 25.0,
                                                           "hop_length_ms": 12.5}}
AUDIO, IMAGE, BOA, EOA = 121, 120, 125, 126


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return read_reference(FOLDER)


@pytest.fixture(scope="module")
def model() -> Model:
    return mlxrunner.load_model(FOLDER)


def clip(name: str) -> np.ndarray:
    return read_audio(CLIPS / f"{name}.wav")


def media_prompt(model: Model, reference: dict[str, np.ndarray], case: str) -> MediaPrompt:
    """The case's prompt as a chat template writes it, its clips and images placed."""
    return checks.media_prompt(model, FOLDER, reference, case, clip)




def test_the_fixture_is_small_e2b_shaped_with_both_towers():
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) < 1_000_000
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["text_config"]["hidden_size_per_layer_input"] > 0
    assert config["text_config"]["num_kv_shared_layers"] > 0
    assert config["vision_config"] is not None and config["audio_config"] is not None
    assert config["audio_config"]["use_clipped_linears"]


def test_read_audio_gives_the_samples_transformers_was_given():
    with wave.open(str(CLIPS / "chord.wav")) as handle:
        assert (handle.getframerate(), handle.getnchannels(), handle.getsampwidth()) == \
            (16_000, 1, 2)
        stored = np.frombuffer(handle.readframes(handle.getnframes()), "<i2")
    assert np.array_equal(clip("chord"), stored.astype(np.float32) / np.float32(32768))


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_features_equal_the_feature_extractors(reference, name):
    """Our frames are its valid ones (it pads the clip to a multiple of 128 samples and
    masks the frames that reach into the padding); those it masks are zero."""
    want, mask = reference[f"{name}_features"], reference[f"{name}_mask"]
    got = log_mel_features(clip(name), FeatureConfig())
    assert got.dtype == np.float32 and got.shape == (int(mask.sum()), 128)
    assert mask[:len(got)].all() and not mask[len(got):].any() and len(got) < len(mask)
    assert max_err(got, want[mask]) <= 1e-5
    assert not want[~mask].any()


@pytest.mark.parametrize("variant", sorted(VARIANT_MS))
@pytest.mark.parametrize("name", CLIP_NAMES)
def test_features_follow_the_extractors_settings(reference, name, variant):
    """Pre-emphasis of both flavours, per-bin normalisation, input scaling, FFT overdrive,
    another frame length, band and floor, read from the config transformers saved."""
    saved = json.loads(str(reference[f"{variant}_settings"]))
    cfg = FeatureConfig.from_dict({**saved, **VARIANT_MS[variant]})
    want, mask = reference[f"{name}_{variant}_features"], reference[f"{name}_{variant}_mask"]
    got = log_mel_features(clip(name), cfg)
    assert got.shape == (int(mask.sum()), want.shape[1])
    assert max_err(got, want[mask]) <= 1e-5
    default = log_mel_features(clip(name), FeatureConfig())
    if default.shape == got.shape:  # (the settings matter)
        assert max_err(default, want[mask]) > 0.1


def test_the_saved_settings_are_the_defaults():
    saved = json.loads((FOLDER / "processor_config.json").read_text())
    assert FeatureConfig.from_dict(saved["feature_extractor"], saved["audio_seq_length"]) == \
        FeatureConfig()
    cfg = FeatureConfig()
    assert (cfg.frame_length, cfg.hop_length, cfg.fft_length) == (320, 160, 512)


@pytest.mark.parametrize("settings, message", [
    ({"dither": 0.1}, "dither"),
    ({"feature_size": "128"}, "feature_size must be a number"),
    ({"per_bin_mean": [0.0] * 3}, "per_bin_mean must hold 128 numbers"),
    ({"per_bin_stddev": [0.0] * 128}, "per_bin_stddev must not be 0"),
    ({"preemphasis_htk_flavor": "yes"}, "preemphasis_htk_flavor must be true or false"),
    ({"min_frequency": 9000.0}, "min_frequency must be a number from 0 to 8000"),
    ({"max_frequency": 0.0}, "min_frequency below max_frequency"),
    ({"sampling_rate": 16000.5}, "sampling_rate must be an integer"),
])
def test_bad_feature_settings_are_one_line(settings, message):
    with pytest.raises(ModelFolderError) as exc:
        FeatureConfig.from_dict(settings)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.fixture(scope="module")
def audio():
    return load_audio(FOLDER)


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_the_tower_and_embed_audio_equal_transformers(reference, audio, name):
    features = reference[f"{name}_features"][reference[f"{name}_mask"]]
    soft = audio.soft_tokens(features)
    assert soft.shape == reference[f"{name}_tower"].shape
    assert max_err(soft, reference[f"{name}_tower"]) <= 1e-5
    assert max_err(audio(features), reference[f"{name}_embedded"]) <= 1e-5


def test_a_tower_attending_to_later_steps_equals_transformers():
    """``attention_context_right`` 3 (the published towers' is 0): each step also attends
    to the 2 after it, the furthest of them past the relative embeddings (a zero logit
    term there, as transformers' blocks give). Measured 5.5e-7; reading the config's right
    context as 0 or 4 misses by 0.02."""
    with np.load(HERE / "audio_fixtures" / "right_context_tower.npz") as data:
        arrays = dict(data)
    tower = Gemma4Audio(json.loads(str(arrays["config"])), text_hidden_size=8)
    weights = tower.sanitize({name[len("weight:"):]: mx.array(value)
                              for name, value in arrays.items() if name.startswith("weight:")})
    tower.audio_tower.load_weights([(name[len("audio_tower."):], value)
                                    for name, value in weights.items()], strict=True)
    assert max_err(tower.soft_tokens(arrays["features"]), arrays["tower"]) <= 1e-5


@pytest.mark.parametrize("knob", ["clip bounds", "residual clamp", "logit cap",
                                  "relative positions"])
def test_every_part_of_the_tower_moves_its_output(reference, knob):
    """The fixture exercises each: undoing one misses the reference by far (we measured
    0.31, 0.25, 0.016 and 0.045 against a tolerance of 1e-5)."""
    audio = load_audio(FOLDER)
    for layer in audio.audio_tower.layers:
        if knob == "clip bounds":
            for _, module in layer.named_modules():
                if getattr(module, "clipped", False):
                    module.clipped = False
        elif knob == "residual clamp":
            layer.gradient_clipping = 1e10
        elif knob == "logit cap":
            layer.self_attn.cap = 1e6
        else:
            layer.self_attn.relative_k_proj.weight = mx.zeros_like(
                layer.self_attn.relative_k_proj.weight)
    features = reference["chirp_features"][reference["chirp_mask"]]
    assert max_err(audio.soft_tokens(features), reference["chirp_tower"]) > 1e-2


def test_the_encoder_expands_a_clip_as_the_processor_does(model, reference):
    encoder = model.load_encoders(FOLDER)["audio"]
    assert encoder.modality == "audio" and encoder.placeholder == AUDIO
    assert encoder.sample_rate == 16_000
    samples = clip("chord")
    item = encoder.prepare(samples)
    soft = len(reference["chord_tower"])  # the valid soft tokens transformers kept
    assert item.tokens == (BOA, *[AUDIO] * soft, EOA)
    assert item.slots == tuple(range(1, soft + 1))
    rows = item.encode()
    assert rows.shape == (soft, model.hidden_size) and rows.dtype == model.dtype
    assert max_err(rows, reference["chord_embedded"]) <= 1e-5
    assert encoder.prepare(samples.copy()).digest == item.digest
    assert encoder.prepare(samples.astype(np.float64)).digest == item.digest
    changed = samples.copy()
    changed[100] += 1e-3
    assert encoder.prepare(changed).digest != item.digest


def test_the_tower_runs_in_the_models_dtype(reference):
    """bfloat16 weights: rows in bfloat16, near float32's (its rounding through two layers:
    we measured 0.06 on values up to 3.1)."""
    model = mlxrunner.load_model(FOLDER, dtype="bfloat16")
    rows = model.load_encoders(FOLDER)["audio"].prepare(clip("chirp")).encode()
    assert rows.dtype == mx.bfloat16
    assert max_err(rows, reference["chirp_embedded"]) < 0.2


@pytest.mark.parametrize("samples, message", [
    (np.zeros((2, 16_000), np.float32), "1-D float samples"),
    (np.zeros(16_000, np.int16), "1-D float samples"),
    (np.zeros(160, np.float32), "too short"),
    (np.zeros(480_001, np.float32), "longer than the 30 s Gemma 4 takes"),
    (np.array([0.0, np.nan] * 1000, np.float32), "not finite"),
])
def test_clips_the_model_cannot_take_are_one_line(model, samples, message):
    encoder = model.load_encoders(FOLDER)["audio"]
    with pytest.raises(MediaError) as exc:
        encoder.prepare(samples)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_shortest_and_longest_clips():
    """161 samples make one frame and one soft token; 30 s make transformers' 750."""
    cfg = FeatureConfig()
    assert len(audio_features(np.zeros(161, np.float32), cfg)) == 1
    assert len(audio_features(np.zeros(480_000, np.float32), cfg)) == 2999  # 750 tokens
    with pytest.raises(MediaError, match="more than the 700 the processor allows"):
        audio_features(np.zeros(480_000, np.float32), FeatureConfig(audio_seq_length=700))






@pytest.mark.parametrize("case", CASES)
def test_generation_starts_from_transformers_logits(model, reference, case):
    prompt = media_prompt(model, reference, case)
    assert list(prompt) == reference[f"{case}_ids"].tolist()
    got = generation_logprobs(model, prompt)
    assert np.abs(got - log_softmax(reference[f"{case}_logits"])).max() < 1e-4


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [64, 16, 5, 3])  # a clip spans 1 to 10 chunks
def test_chunked_prefill_logits_match_transformers(model, reference, case, chunk):
    prompt = media_prompt(model, reference, case)
    logits, _ = prefill(model, prompt, model.make_cache(), chunk=chunk)
    assert max_err(logits[0], reference[f"{case}_logits"]) < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_the_audio_rows_are_what_moves_the_logits(model, reference, case):
    prompt = media_prompt(model, reference, case)
    ids = mx.array([list(prompt)])
    want = reference[f"{case}_logits"]
    assert max_err(model(ids)[0, -1], want) > 0.05
    embedded = prompt.embeddings(model, ids, 0)
    assert embedded is not None
    assert max_err(model(ids, embeddings=embedded)[0, -1], want) < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_transformers(model, reference, case):
    want = reference[f"{case}_greedy"].tolist()
    prompt = media_prompt(model, reference, case)
    assert mlxrunner.generate(model, prompt, max_tokens=len(want), options=GREEDY).tokens == want


def test_a_batch_of_audio_and_text_prompts_equals_generate_per_prompt(model, reference):
    prompts = [media_prompt(model, reference, "one_clip"), [2, 40, 41, 42, 43, 44],
               media_prompt(model, reference, "image_and_clip")]
    want = [mlxrunner.generate(model, p, max_tokens=8, options=GREEDY).tokens for p in prompts]
    assert want[0] == reference["one_clip_greedy"][:8].tolist()
    assert want[2] == reference["image_and_clip_greedy"][:8].tolist()
    got = mlxrunner.generate_batch(model, prompts, max_tokens=8, options=GREEDY)
    assert [r.tokens for r in got] == want


def test_a_repeated_audio_prompt_hits_the_prefix_cache(model, reference):
    prompt = media_prompt(model, reference, "two_clips")
    cache = prefix_cache_for(model.make_cache)
    runs = [mlxrunner.generate(model, prompt, max_tokens=4, options=GREEDY,
                               prefix_cache=cache) for _ in range(3)]
    assert runs[0].stats.cached_tokens == 0
    assert runs[1].stats.cached_tokens > 0 and runs[2].stats.cached_tokens > 0
    assert runs[1].tokens == runs[0].tokens == runs[2].tokens
    assert runs[0].tokens == reference["two_clips_greedy"][:4].tolist()


def test_folders_without_an_audio_tower_have_no_audio_encoder():
    image_only = HERE / "vision_fixtures" / "tiny_media"
    assert sorted(mlxrunner.load_model(image_only).load_encoders(image_only)) == ["image"]


def test_a_folder_without_processor_settings_takes_the_defaults(tmp_path, reference):
    folder = tmp_path / "no_processor_config"
    shutil.copytree(FOLDER, folder)
    (folder / "processor_config.json").unlink()
    model = mlxrunner.load_model(folder)
    encoders = model.load_encoders(folder)
    assert encoders["audio"].features == FeatureConfig()
    rows = encoders["audio"].prepare(clip("chirp")).encode()
    assert max_err(rows, reference["chirp_embedded"]) <= 1e-5


def rewrite_weights(folder: Path, change) -> None:
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), change(weights),
                        metadata={"format": "pt"})


def test_mlx_layout_weights_load_the_same_tower(tmp_path, reference):
    """An MLX checkpoint's names (no ``model.``) and convolution layouts."""
    folder = tmp_path / "mlx_layout"
    shutil.copytree(FOLDER, folder)

    def to_mlx(weights):
        out = {}
        for name, value in weights.items():
            if name.startswith(("model.audio_tower.", "model.embed_audio.")):
                name = name[len("model."):]
                if value.ndim == 4:
                    value = value.transpose(0, 2, 3, 1)
                elif value.ndim == 3:
                    value = value.transpose(0, 2, 1)
            out[name] = value
        return out

    rewrite_weights(folder, to_mlx)
    features = reference["chirp_features"][reference["chirp_mask"]]
    assert max_err(load_audio(folder)(features), reference["chirp_embedded"]) <= 1e-5


def test_a_quantized_or_misshapen_audio_tower_is_refused(tmp_path):
    folder = tmp_path / "quantized"
    shutil.copytree(FOLDER, folder)
    rewrite_weights(folder, lambda w: {**w, "model.audio_tower.output_proj.scales":
                                       mx.zeros((24, 1))})
    with pytest.raises(ModelFolderError, match="quantized audio tower"):
        load_audio(folder)
    folder = tmp_path / "misshapen"
    shutil.copytree(FOLDER, folder)
    name = "model.audio_tower.subsample_conv_projection.layer1.conv.weight"
    rewrite_weights(folder, lambda w: {**w, name: mx.zeros((8, 128, 3, 2))})
    with pytest.raises(ModelFolderError):
        load_audio(folder)


@pytest.mark.parametrize("change, message", [
    ({"attention_context_left": 1}, "attention_context_left"),
    ({"subsampling_conv_channels": [128]}, "subsampling_conv_channels"),
    ({"hidden_act": "swish2"}, "hidden_act"),
    ({"attention_invalid_logits_value": -1.0}, "attention_invalid_logits_value"),
    ({"subsampling_conv_channels": [64, 8]}, "mel columns"),
])
def test_bad_audio_configs_are_one_line(tmp_path, change, message):
    folder = tmp_path / "bad"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["audio_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError) as exc:
        load_audio(folder)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_speculative_decoding_of_an_audio_prompt_equals_plain(model, reference):
    """A draft reads the target's taps: the prefill runs ``taps=`` with the embeddings."""
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.testing.speculative import random_draft

    want = reference["image_and_clip_greedy"].tolist()
    prompt = media_prompt(model, reference, "image_and_clip")
    draft = random_draft(model, seed=2)
    got = mlxrunner.generate(model, prompt, max_tokens=len(want), draft=draft, options=GREEDY)
    assert got.tokens == want
