"""Write the tiny Gemma 4 image-and-text checkpoint and transformers' outputs for prompts
holding images.

``vision_fixtures/tiny_media/`` holds what transformers' ``Gemma4ForConditionalGeneration
.save_pretrained`` writes (config.json, model.safetensors; float32, CPU torch, eager
attention) and a ``processor_config.json``:

- the text model is E2B-shaped (:data:`TEXT_CONFIG`: 6 layers, sliding window 8, per-layer
  inputs, the last 2 layers attending over earlier layers' keys and values, double-wide MLPs
  there), its weights drawn as make_fixtures.py draws them;
- the vision tower is make_vision_fixtures.py's with a 64-entry position table per axis (a
  wide image's patch grid here is 44 columns), drawn as that script draws it;
- the image, audio and video token ids and the image's begin and end markers
  (:data:`TOKEN_IDS`) lie inside the 128-token vocabulary;
- the image processor (:data:`PROCESSOR`): 4-pixel patches, 2 x 2 pooling, at most 70 soft
  tokens, Gemma 4's bicubic resize and 1/255 rescale.

``reference.npz`` holds, for each case of :data:`CASES` (Qwen3.5's committed test images,
read by path, in a prompt with text before, between and after them):

- ``{case}_images``: the images' file names, in prompt order;
- ``{case}_text``: the prompt as a chat template writes it, one ``image_token_id`` per image
  (``two_images`` also holds a stray ``audio_token_id``, which transformers embeds as
  padding);
- ``{case}_soft``: each image's soft token count from transformers' image processor;
- ``{case}_ids``: the prompt ``Gemma4Processor`` makes of it: each image's token as
  ``boi_token_id``, that many ``image_token_id``, ``eoi_token_id``;
- ``{case}_logits`` ``[vocab]``: the last position's logits of ``Gemma4ForConditionalGeneration``
  on those ids with the processor's ``pixel_values`` and ``image_position_ids`` (no cache);
- ``one_image_greedy``: ``generate``'s first :data:`GREEDY_STEPS` greedy tokens after it
  (checked to hold none of the ids Gemma 4 stops at).

Run from the repository root (needs torch, transformers and Pillow):
    /tmp/ci/.ci-venv/bin/python architectures/gemma4/tests/make_media_fixtures.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision_fixtures" / "tiny_media"
KEEP = ("config.json", "model.safetensors", "processor_config.json", "reference.npz")
GREEDY_STEPS = 10
#: ids Gemma4Model stops at (<eos>, <turn|>, <|tool_response>): greedy must not reach them
STOP_IDS = (1, 50, 106)

_S, _F = "sliding_attention", "full_attention"
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 32,
    "num_hidden_layers": 6, "layer_types": [_S, _S, _F, _S, _S, _F],
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "global_head_dim": 32, "rms_norm_eps": 1e-6, "sliding_window": 8,
    "final_logit_softcapping": 30.0, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
    "attention_k_eq_v": False,
}
TOKEN_IDS = {"image_token_id": 120, "audio_token_id": 121, "video_token_id": 122,
             "boi_token_id": 123, "eoi_token_id": 124, "boa_token_id": 125,
             "eoa_token_index": 126}
PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Gemma4ImageProcessor", "patch_size": 4,
    "pooling_kernel_size": 2, "max_soft_tokens": 70, "resample": 3, "do_resize": True,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "do_convert_rgb": True,
}
IMAGE, AUDIO = TOKEN_IDS["image_token_id"], TOKEN_IDS["audio_token_id"]
#: case -> (the images of make_image_fixtures.py, in prompt order; the prompt's ids)
CASES: dict[str, tuple[tuple[str, ...], list[int]]] = {
    # rgba.png (27 x 18): 12 x 20 patches, 60 soft tokens
    "one_image": (("rgba",), [2, 45, 17, 88, IMAGE, 33, 9, 71, 104, 12]),
    # gray.png (64 x 9): 6 x 44 patches, 66 soft tokens; palette.gif (21 x 25)
    "two_images": (("gray", "palette"),
                   [2, 12, 77, IMAGE, 64, 23, AUDIO, 99, IMAGE, 7, 81, 30]),
}


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"gemma4_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(seed: int = 0) -> Any:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision_fixtures = _module("make_vision_fixtures")
    torch.manual_seed(seed)
    vision = dict(vision_fixtures.VISION_CONFIG, position_embedding_size=64)
    config = Gemma4Config(text_config=dict(TEXT_CONFIG), vision_config=vision,
                          audio_config=None, tie_word_embeddings=True,
                          attn_implementation="eager", **TOKEN_IDS)
    model = Gemma4ForConditionalGeneration(config).eval().to(torch.float32)
    _module("make_fixtures")._randomize(model, seed=seed + 1)
    vision_fixtures.randomize_vision(model, seed=seed + 2)
    return model


def expand(text: list[int], soft: list[int]) -> list[int]:
    """The prompt with each image token as Gemma4Processor expands it."""
    counts = iter(soft)
    out: list[int] = []
    for token in text:
        out += ([TOKEN_IDS["boi_token_id"], *[IMAGE] * next(counts), TOKEN_IDS["eoi_token_id"]]
                if token == IMAGE else [token])
    return out


def write_fixture(folder: Path) -> None:
    import torch

    images = _module("make_image_fixtures")
    model = build_model()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_processor": PROCESSOR, "image_seq_length": PROCESSOR["max_soft_tokens"]},
        indent=2) + "\n")
    processor = images.processor(PROCESSOR)
    arrays: dict[str, np.ndarray] = {}
    for case, (names, text) in CASES.items():
        out = processor(images=[images.upright(name) for name in names], return_tensors="pt")
        soft = [int(n) for n in np.ravel(out["num_soft_tokens_per_image"])]
        ids = torch.tensor([expand(text, soft)])
        vision = {"pixel_values": out["pixel_values"],
                  "image_position_ids": out["image_position_ids"]}
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, **vision).logits[0, -1]
        arrays[f"{case}_images"] = np.array(
            [next(f for f in images.IMAGE_FILES if f.startswith(name + ".")) for name in names])
        arrays[f"{case}_text"] = np.array(text, dtype=np.int32)
        arrays[f"{case}_soft"] = np.array(soft, dtype=np.int32)
        arrays[f"{case}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"{case}_logits"] = logits.numpy().astype(np.float32)
        if case == "one_image":
            with torch.no_grad():
                generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=GREEDY_STEPS, do_sample=False,
                                           **vision)
            greedy = generated[0, ids.shape[1]:].numpy()
            if len(greedy) != GREEDY_STEPS or set(greedy.tolist()) & set(STOP_IDS):
                raise RuntimeError(f"greedy tokens {greedy.tolist()} stop early: change the "
                                   "prompt or the seed")
            arrays[f"{case}_greedy"] = greedy.astype(np.int32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in KEEP:
            extra.unlink()


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) / FOLDER.name if argv else FOLDER
    write_fixture(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
