"""Write the tiny 31B-style Gemma 4 image-and-text checkpoint (images attend to themselves
both ways in the sliding layers) and transformers' outputs for prompts holding images.

``vision_fixtures/tiny_bidirectional/`` is make_media_fixtures.py's checkpoint with a
31B-shaped text model (:data:`TEXT_CONFIG`: no per-layer inputs, no KV sharing, K=V full
layers, ``use_bidirectional_attention: "vision"``, a sliding window of 8, far less than an
image's 60 to 66 soft tokens), written the same way (save_pretrained, float32, CPU torch,
eager attention), with the same processor_config.json.

``reference.npz`` holds, for each case of make_media_fixtures.CASES, the same arrays as
that script (``{case}_images``, ``_text``, ``_soft``, ``_ids``, ``_logits``;
``one_image_greedy``), the model run with the processor's ``mm_token_type_ids`` (1 at each
``image_token_id``, 3 at the stray ``audio_token_id``) so that transformers builds its
vision masks (``create_masks_for_vision_model``), and ``{case}_causal_logits``: the same
forward without them (causal masks everywhere), to show what the blocks move.

Run from the repository root (needs torch, transformers and Pillow):
    /tmp/ci/.ci-venv/bin/python architectures/gemma4/tests/make_bidirectional_fixtures.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision_fixtures" / "tiny_bidirectional"

_S, _F = "sliding_attention", "full_attention"
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 4, "layer_types": [_S, _S, _S, _F],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "rms_norm_eps": 1e-6, "sliding_window": 8,
    "final_logit_softcapping": 30.0, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
    "use_bidirectional_attention": "vision",
}


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"gemma4_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mm_token_type_ids(ids: Any, media: Any) -> Any:
    """As ``ProcessorMixin.create_mm_token_type_ids``: 1 at image ids, 2 at video ids, 3 at
    audio ids (Gemma4Processor marks only the soft tokens, not boi / eoi)."""
    types = ids.new_zeros(ids.shape)
    types[ids == media.TOKEN_IDS["image_token_id"]] = 1
    types[ids == media.TOKEN_IDS["video_token_id"]] = 2
    types[ids == media.TOKEN_IDS["audio_token_id"]] = 3
    return types


def write_fixture(folder: Path) -> None:
    import torch

    media = _module("make_media_fixtures")
    images = _module("make_image_fixtures")
    media.TEXT_CONFIG = dict(TEXT_CONFIG)  # build_model reads it
    model = media.build_model()
    assert model.config.text_config.use_bidirectional_attention == "vision"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "processor_config.json").write_text(
        (media.FOLDER / "processor_config.json").read_text())
    processor = images.processor(media.PROCESSOR)
    arrays: dict[str, np.ndarray] = {}
    for case, (names, text) in media.CASES.items():
        out = processor(images=[images.upright(name) for name in names], return_tensors="pt")
        soft = [int(n) for n in np.ravel(out["num_soft_tokens_per_image"])]
        ids = torch.tensor([media.expand(text, soft)])
        vision = {"pixel_values": out["pixel_values"],
                  "image_position_ids": out["image_position_ids"]}
        types = mm_token_type_ids(ids, media)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, mm_token_type_ids=types,
                           **vision).logits[0, -1]
            causal = model(input_ids=ids, use_cache=False, **vision).logits[0, -1]
        arrays[f"{case}_images"] = np.array(
            [next(f for f in images.IMAGE_FILES if f.startswith(name + ".")) for name in names])
        arrays[f"{case}_text"] = np.array(text, dtype=np.int32)
        arrays[f"{case}_soft"] = np.array(soft, dtype=np.int32)
        arrays[f"{case}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"{case}_logits"] = logits.numpy().astype(np.float32)
        arrays[f"{case}_causal_logits"] = causal.numpy().astype(np.float32)
        if case == "one_image":
            with torch.no_grad():
                generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           mm_token_type_ids=types,
                                           max_new_tokens=media.GREEDY_STEPS, do_sample=False,
                                           **vision)
            greedy = generated[0, ids.shape[1]:].numpy()
            if len(greedy) != media.GREEDY_STEPS or set(greedy.tolist()) & set(media.STOP_IDS):
                raise RuntimeError(f"greedy tokens {greedy.tolist()} stop early: change the "
                                   "prompt or the seed")
            arrays[f"{case}_greedy"] = greedy.astype(np.int32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in media.KEEP:
            extra.unlink()


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) / FOLDER.name if argv else FOLDER
    write_fixture(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
