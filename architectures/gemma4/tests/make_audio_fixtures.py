"""Write the tiny Gemma 4 checkpoint with an audio tower, two test clips and transformers'
outputs for them.

``audio_fixtures/tiny_audio/`` holds what transformers' ``Gemma4ForConditionalGeneration
.save_pretrained`` writes (config.json, model.safetensors; float32, CPU torch, eager
attention) and a ``processor_config.json`` (the image processor of make_media_fixtures.py
and ``Gemma4AudioFeatureExtractor``'s defaults, the published checkpoints' settings: 128
log-mel bins of 20 ms frames every 10 ms at 16 kHz):

- the text model and the vision tower are make_media_fixtures.py's (E2B-shaped: per-layer
  inputs, KV sharing), drawn as that script draws them;
- the audio tower (:data:`AUDIO_CONFIG`): 2 conformer layers of width 16, 2 heads, chunks of
  4 frames attending 4 frames back, the subsampling convolutions at 128 and 8 channels,
  every clippable linear clamped to finite bounds (the published towers carry them), and
  a residual clamp and an attention logit cap of 2, low enough to act on these weights
  (the published 1e10 and 50 would not act here), the attention sharpened for the cap to
  act (:func:`randomize_audio`);
- the token ids (:data:`TOKEN_IDS`) lie inside the 128-token vocabulary.

``audio_fixtures/clips/``: :data:`CLIPS`, 16-bit PCM mono WAV at 16 kHz, drawn here (a
chord with noise, 0.37 s; a chirp with noise, 1.1 s). transformers is given the samples as
``int16 / 32768`` in float32, what ``read_audio`` gives.

``reference.npz`` holds, for each clip:

- ``{clip}_features`` ``[frames, 128]``, ``{clip}_mask`` ``[frames]``: the feature extractor's
  output for the clip alone (padded to a multiple of 128 samples, as it pads; the frames
  that reach into the padding masked and zero);
- ``{clip}_tower`` ``[n, 24]``: ``Gemma4AudioModel``'s ``last_hidden_state`` at the valid soft
  tokens; ``{clip}_embedded`` ``[n, 32]``: ``embed_audio``'s, what the prompt's audio slots
  take;
- ``{clip}_{variant}_features`` / ``_mask`` for each extractor setting of :data:`VARIANTS`
  (pre-emphasis of both flavours, per-bin normalisation, input scaling, FFT overdrive,
  another frame length, band and floor), its settings in ``{variant}_settings`` (JSON);

and for each case of :data:`CASES` (a prompt with text around one clip, two clips, an
image and a clip):

- ``{case}_clips``, ``{case}_images``: the media in prompt order; ``{case}_text``: the prompt
  as a chat template writes it (one ``audio_token_id`` / ``image_token_id`` per item);
- ``{case}_ids``: the prompt ``Gemma4Processor`` makes of it: each clip as ``boa_token_id``,
  as many ``audio_token_id`` as ``replace_audio_token`` writes, ``eoa_token_index``; each
  image as make_media_fixtures.py expands it;
- ``{case}_logits`` ``[vocab]``: the last position's logits of the model on those ids with
  the feature extractor's output for the case's clips together (the shorter padded to the
  longer) and the image processor's output (no cache);
- ``{case}_greedy``: ``generate``'s first :data:`GREEDY_STEPS` greedy tokens (checked to hold
  none of the ids Gemma 4 stops at).

``audio_fixtures/right_context_tower.npz``: a lone tower of :data:`RIGHT_CONTEXT`, whose
steps also attend to later steps (the published towers' ``attention_context_right`` is 0):
its weights, config, and its output for the chord's features (:func:`right_context_reference`).

Run from the repository root (needs torch, transformers and Pillow):
    /tmp/ci/.ci-venv/bin/python architectures/gemma4/tests/make_audio_fixtures.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
import wave
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "audio_fixtures"
FOLDER = FIXTURES / "tiny_audio"
CLIP_FOLDER = FIXTURES / "clips"
KEEP = ("config.json", "model.safetensors", "processor_config.json", "reference.npz")
GREEDY_STEPS = 10
SAMPLE_RATE = 16_000
#: ids Gemma4Model stops at (<eos>, <turn|>, <|tool_response>): greedy must not reach them
STOP_IDS = (1, 50, 106)

AUDIO_CONFIG: dict[str, Any] = {
    "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    "hidden_act": "silu", "subsampling_conv_channels": [128, 8], "conv_kernel_size": 5,
    "residual_weight": 0.5, "attention_chunk_size": 4, "attention_context_left": 5,
    "attention_context_right": 0, "attention_logit_cap": 2.0,
    "attention_invalid_logits_value": -1.0e9, "use_clipped_linears": True,
    "rms_norm_eps": 1e-6, "gradient_clipping": 2.0, "output_proj_dims": 24,
}
#: a tower whose steps also attend to later ones (chunks of 3, 2 steps back and forth; one
#: layer), checked on its own (``RIGHT_CONTEXT_FILE``)
RIGHT_CONTEXT = dict(AUDIO_CONFIG, num_hidden_layers=1, attention_chunk_size=3,
                     attention_context_left=4, attention_context_right=3)
RIGHT_CONTEXT_FILE = "right_context_tower.npz"
#: clip -> its length in seconds (drawn by :func:`clip_samples`)
CLIPS = {"chord": 0.37, "chirp": 1.1}
#: extractor settings other than the published ones, each checked on every clip
VARIANTS: dict[str, dict[str, Any]] = {
    "htk_preemphasis": {"preemphasis": 0.97, "input_scale_factor": 2.0,
                        "fft_overdrive": True, "per_bin": True},
    "plain_preemphasis": {"preemphasis": 0.5, "preemphasis_htk_flavor": False,
                          "frame_length_ms": 25.0, "hop_length_ms": 12.5,
                          "min_frequency": 60.0, "max_frequency": 7600.0, "mel_floor": 1e-5,
                          "feature_size": 64},
}


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"gemma4_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MEDIA = _module("make_media_fixtures")
TOKEN_IDS = MEDIA.TOKEN_IDS
IMAGE, AUDIO = TOKEN_IDS["image_token_id"], TOKEN_IDS["audio_token_id"]
#: case -> (clips in prompt order, images in prompt order, the prompt's ids)
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...], list[int]]] = {
    "one_clip": (("chord",), (), [2, 45, 17, 88, AUDIO, 33, 9, 71, 104, 12]),
    "two_clips": (("chord", "chirp"), (), [2, 12, AUDIO, 64, 23, AUDIO, 99, 7, 41]),
    "image_and_clip": (("chirp",), ("rgba",), [2, 12, 77, IMAGE, 64, 23, AUDIO, 99, 7, 81, 30]),
}


def clip_samples(name: str) -> np.ndarray:
    """The clip's 16-bit samples (deterministic)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    t = np.arange(int(round(CLIPS[name] * SAMPLE_RATE))) / SAMPLE_RATE
    if name == "chord":
        wave_ = sum(np.sin(2 * np.pi * f * t) for f in (220.0, 277.2, 329.6, 1760.0))
        wave_ = wave_ * np.minimum(1.0, 8 * t) / 4
    else:
        wave_ = np.sin(2 * np.pi * (200.0 * t + 1300.0 * t ** 2)) * (0.3 + 0.7 * t / t[-1])
    wave_ = 0.6 * wave_ + 0.05 * rng.standard_normal(len(t))
    return np.clip(np.round(wave_ * 32767), -32768, 32767).astype(np.int16)


def write_clip(path: Path, samples: np.ndarray) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(samples.astype("<i2").tobytes())


def as_float(samples: np.ndarray) -> np.ndarray:
    return (samples.astype(np.float32) / np.float32(32768)).astype(np.float32)


def randomize_audio(tower: Any, seed: int) -> None:
    """An audio tower's clip bounds and attention scales (after make_fixtures.py's
    ``_randomize``, which draws every parameter): finite bounds, so that each clamp acts on
    some inputs; ``per_dim_scale`` near 3 (softplus: x3 the queries), so that the logit
    cap and the relative positions move the output by 1e-2 or more."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.5 - torch.rand((), generator=gen).item())
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5 + torch.rand((), generator=gen).item())
        for layer in tower.layers:
            scale = layer.self_attn.per_dim_scale
            scale.copy_(3.0 + 0.3 * torch.randn(scale.shape, generator=gen))


def build_model(seed: int = 0) -> Any:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision_fixtures = _module("make_vision_fixtures")
    torch.manual_seed(seed)
    vision = dict(vision_fixtures.VISION_CONFIG, position_embedding_size=64)
    config = Gemma4Config(text_config=dict(MEDIA.TEXT_CONFIG), vision_config=vision,
                          audio_config=dict(AUDIO_CONFIG), tie_word_embeddings=True,
                          attn_implementation="eager", **TOKEN_IDS)
    model = Gemma4ForConditionalGeneration(config).eval().to(torch.float32)
    _module("make_fixtures")._randomize(model, seed=seed + 1)
    vision_fixtures.randomize_vision(model, seed=seed + 2)
    randomize_audio(model.model.audio_tower, seed=seed + 3)
    return model


def extractor(settings: dict[str, Any] | None = None) -> Any:
    from transformers import Gemma4AudioFeatureExtractor

    settings = dict(settings or {})
    if settings.pop("per_bin", False):
        size = settings.get("feature_size", 128)
        rng = np.random.default_rng(7)
        settings["per_bin_mean"] = rng.normal(-2.0, 1.0, size).tolist()
        settings["per_bin_stddev"] = rng.uniform(0.5, 2.0, size).tolist()
    return Gemma4AudioFeatureExtractor(**settings)


def soft_token_count(mask: np.ndarray) -> int:
    """How many audio tokens ``Gemma4Processor.replace_audio_token`` writes for a clip."""
    from transformers import Gemma4Processor

    markers = SimpleNamespace(boa_token="<boa>", audio_token="<a>", eoa_token="<eoa>")
    text = Gemma4Processor.replace_audio_token(markers, {"input_features_mask": [mask]}, 0)
    return text.count("<a>")


def expand(text: list[int], clips: list[int], images: list[int]) -> list[int]:
    """The prompt with each placeholder as Gemma4Processor expands it (``clips``,
    ``images``: the soft token counts in order)."""
    clip_counts, image_counts = iter(clips), iter(images)
    out: list[int] = []
    for token in text:
        if token == AUDIO:
            out += [TOKEN_IDS["boa_token_id"], *[AUDIO] * next(clip_counts),
                    TOKEN_IDS["eoa_token_index"]]
        elif token == IMAGE:
            out += [TOKEN_IDS["boi_token_id"], *[IMAGE] * next(image_counts),
                    TOKEN_IDS["eoi_token_id"]]
        else:
            out.append(token)
    return out


def clip_reference(model: Any, name: str, samples: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    out: dict[str, np.ndarray] = {}
    features = extractor()([samples], return_tensors="pt")
    mask = features["input_features_mask"]
    with torch.no_grad():
        audio = model.model.get_audio_features(features["input_features"], mask,
                                               return_dict=True)
    valid = audio.attention_mask[0]
    if int(valid.sum()) != soft_token_count(mask[0].numpy()):
        raise RuntimeError(f"{name}: the tower's valid tokens differ from the processor's count")
    out[f"{name}_features"] = features["input_features"][0].numpy()
    out[f"{name}_mask"] = mask[0].numpy()
    out[f"{name}_tower"] = audio.last_hidden_state[0][valid].numpy()
    out[f"{name}_embedded"] = audio.pooler_output[0][valid].numpy()
    for variant, settings in VARIANTS.items():
        got = extractor(settings)([samples], return_tensors="np")
        out[f"{name}_{variant}_features"] = got["input_features"][0]
        out[f"{name}_{variant}_mask"] = got["input_features_mask"][0]
    return out


def right_context_reference(samples: np.ndarray) -> dict[str, np.ndarray]:
    """A lone tower attending to later steps too (:data:`RIGHT_CONTEXT`; the published
    towers attend to none), its weights (``weight:{name}``, transformers' names under
    ``model.audio_tower.``), config and its output for the features of ``samples``."""
    import torch
    from transformers import Gemma4AudioConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

    torch.manual_seed(5)
    tower = Gemma4AudioModel(Gemma4AudioConfig(**RIGHT_CONTEXT)).eval().to(torch.float32)
    _module("make_fixtures")._randomize(tower, seed=6)
    randomize_audio(tower, seed=7)
    features = extractor()([samples], return_tensors="pt")
    with torch.no_grad():
        out = tower(features["input_features"], features["input_features_mask"])
    arrays = {f"weight:model.audio_tower.{name}": value.numpy()
              for name, value in tower.state_dict().items()}
    arrays["config"] = np.array(json.dumps(RIGHT_CONTEXT))
    arrays["features"] = features["input_features"][0][features["input_features_mask"][0]
                                                       ].numpy()
    arrays["tower"] = out.last_hidden_state[0][out.attention_mask[0]].numpy()
    return arrays


def write_fixture(folder: Path, clip_folder: Path) -> None:
    import torch

    images = _module("make_image_fixtures")
    model = build_model()
    folder.mkdir(parents=True, exist_ok=True)
    clip_folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_processor": MEDIA.PROCESSOR, "image_seq_length": MEDIA.PROCESSOR["max_soft_tokens"],
         "feature_extractor": json.loads(extractor().to_json_string()),
         "audio_seq_length": 750, "audio_ms_per_token": 40}, indent=2) + "\n")
    samples = {}
    arrays: dict[str, np.ndarray] = {}
    for name in CLIPS:
        pcm = clip_samples(name)
        write_clip(clip_folder / f"{name}.wav", pcm)
        samples[name] = as_float(pcm)
        arrays.update(clip_reference(model, name, samples[name]))
    for variant, settings in VARIANTS.items():  # (as transformers saves them)
        arrays[f"{variant}_settings"] = np.array(extractor(settings).to_json_string())
    image_processor = images.processor(MEDIA.PROCESSOR)
    for case, (clips, image_names, text) in CASES.items():
        inputs: dict[str, Any] = {}
        features = extractor()([samples[c] for c in clips], return_tensors="pt")
        inputs["input_features"] = features["input_features"]
        inputs["input_features_mask"] = features["input_features_mask"]
        clip_counts = [soft_token_count(m.numpy()) for m in features["input_features_mask"]]
        image_counts: list[int] = []
        if image_names:
            pixels = image_processor(images=[images.upright(n) for n in image_names],
                                     return_tensors="pt")
            image_counts = [int(n) for n in np.ravel(pixels["num_soft_tokens_per_image"])]
            inputs["pixel_values"] = pixels["pixel_values"]
            inputs["image_position_ids"] = pixels["image_position_ids"]
        ids = torch.tensor([expand(text, clip_counts, image_counts)])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, **inputs).logits[0, -1]
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=GREEDY_STEPS, do_sample=False, **inputs)
        greedy = generated[0, ids.shape[1]:].numpy()
        if len(greedy) != GREEDY_STEPS or set(greedy.tolist()) & set(STOP_IDS):
            raise RuntimeError(f"{case}: greedy tokens {greedy.tolist()} stop early: change "
                               "the prompt or the seed")
        arrays[f"{case}_clips"] = np.array(clips)
        arrays[f"{case}_images"] = np.array(
            [next(f for f in images.IMAGE_FILES if f.startswith(n + ".")) for n in image_names],
            dtype="<U16")
        arrays[f"{case}_text"] = np.array(text, dtype=np.int32)
        arrays[f"{case}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"{case}_logits"] = logits.numpy().astype(np.float32)
        arrays[f"{case}_greedy"] = greedy.astype(np.int32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    np.savez_compressed(folder.parent / RIGHT_CONTEXT_FILE,
                        **right_context_reference(samples["chord"]))
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in KEEP:
            extra.unlink()


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else FIXTURES
    folder, clips = root / FOLDER.name, root / CLIP_FOLDER.name
    write_fixture(folder, clips)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
