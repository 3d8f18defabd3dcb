"""Write the tiny Qwen3.5 image-and-text checkpoints (dense and mixture of experts) and
transformers' outputs for prompts holding images.

``vision_fixtures/tiny_media/`` and ``vision_fixtures/tiny_media_moe/`` hold what
transformers' ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
``.save_pretrained`` writes (config.json, model.safetensors; float32, CPU torch) and a
``preprocessor_config.json``:

- the text models (:data:`TEXT_CONFIGS`) alternate Gated DeltaNet and full-attention layers;
  their heads rotate 16 of 32 dimensions (8 frequencies, so every position component turns
  some) with base 100 (every frequency turns well over a few dozen positions); the dense
  model interleaves the components as the released configs do (``mrope_section [11, 11,
  10]``), the mixture of experts as ``[2, 1, 1]`` (height and width one frequency each);
- the vision tower is make_vision_fixtures.py's (4x4 patches of 2 frames, 2x2 merge
  windows, rows of the text width), drawn as that script draws it;
- the image, video and vision start / end token ids (:data:`TOKEN_IDS`) lie inside the
  256-token vocabulary;
- the image processor (:data:`PROCESSOR`): 4-pixel patches, images scaled to 1024 to 4096
  pixels, so the committed test images become merged grids of 4 x 5 (rgba.png), 2 x 11
  (gray.png) and 5 x 4 (palette.gif) tokens.

``reference.npz`` holds, for each case of :data:`CASES` (Qwen3.5's committed test images,
read by path, in a prompt with text before, between and after them):

- ``{case}_images``: the images' file names, in prompt order;
- ``{case}_text``: the prompt as a chat template writes it: ``vision_start``, one
  ``image_token_id``, ``vision_end`` per image;
- ``{case}_grid`` ``[images, 3]``: transformers' ``image_grid_thw`` (``text_only`` holds
  none: the text model alone, its positions the tokens' indices);
- ``{case}_ids``: the prompt the processor makes of it (each ``image_token_id`` repeated
  once per merge window);
- ``{case}_positions`` ``[3, L]``: transformers' ``get_rope_index`` for those ids;
- ``{case}_logits`` ``[vocab]``: the last position's logits of the model on those ids with
  the processor's ``pixel_values`` (no cache);
- ``{case}_greedy``: ``generate``'s first :data:`GREEDY_STEPS` greedy tokens after them
  (decoding at the positions ``rope_deltas`` moves on), and ``{case}_greedy_logits``
  ``[GREEDY_STEPS, vocab]``: the logits each of them was chosen from.

Run from the repository root (needs torch, transformers and Pillow):
    /tmp/ci/.ci-venv/bin/python architectures/qwen3_5/tests/make_media_fixtures.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
KEEP = ("config.json", "model.safetensors", "preprocessor_config.json", "reference.npz")
GREEDY_STEPS = 8

_L, _F = "linear_attention", "full_attention"
_TEXT: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
    max_position_embeddings=4096, num_hidden_layers=4, layer_types=[_L, _F, _L, _F],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8,
)
#: fixture name -> its text config
TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny_media": dict(
        _TEXT, intermediate_size=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [11, 11, 10]}),
    "tiny_media_moe": dict(
        _TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}),
}
TOKEN_IDS = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 248,
             "vision_end_token_id": 249}
PROCESSOR: dict[str, Any] = {
    "size": {"shortest_edge": 1024, "longest_edge": 4096}, "patch_size": 4,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
}
IMAGE = TOKEN_IDS["image_token_id"]
START, END = TOKEN_IDS["vision_start_token_id"], TOKEN_IDS["vision_end_token_id"]
#: case -> (the images of make_image_fixtures.py, in prompt order; the prompt's ids)
CASES: dict[str, tuple[tuple[str, ...], list[int]]] = {
    "one_image": (("rgba",), [10, 20, 30, START, IMAGE, END, 40, 50, 60]),
    # a wide image (2 x 11), then a tall one (5 x 4)
    "two_images": (("gray", "palette"),
                   [11, 12, START, IMAGE, END, 70, 71, 72, START, IMAGE, END, 80, 81]),
    # no image: the model's plain positions
    "text_only": ((), [13, 14, 90, 91, 92, 93, 94, 95, 96, 97]),
}


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"qwen3_5_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(name: str, seed: int = 0) -> Any:
    import torch
    import transformers

    vision = dict(_module("make_vision_fixtures").VISION_CONFIG)
    text = TEXT_CONFIGS[name]
    moe = "num_experts" in text
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{prefix}Config")(
        text_config=dict(text), vision_config=vision,
        tie_word_embeddings=text["tie_word_embeddings"], **TOKEN_IDS)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    model = model.eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if ".visual." in pname:  # as make_vision_fixtures.py draws the tower
                if pname.endswith("pos_embed.weight"):
                    param.copy_(0.5 * noise)
                elif "norm" in pname and pname.endswith(".weight"):  # LayerNorm scales
                    param.copy_(1.0 + 0.2 * noise)
                else:
                    param.copy_(0.2 * noise)
            # the text model as make_fixtures.py / make_moe_fixtures.py draw it
            elif pname.endswith("A_log"):
                n = param.numel()
                param.copy_(torch.linspace(-7.0, 0.0, n) + 0.1 * noise.flatten())
            elif pname.endswith("dt_bias"):
                param.copy_(noise * 0.5)
            elif pname.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif pname.endswith("conv1d.weight"):
                param.copy_(0.5 * noise)
            elif pname.endswith("mlp.gate.weight"):  # routers: clear top-k margins
                param.copy_(0.5 * noise)
            else:
                param.copy_((0.1 if moe else 0.2) * noise)
    return model


def expand(text: list[int], grids: np.ndarray, merge: int) -> list[int]:
    """The prompt with each image token repeated as the processor repeats it."""
    counts = iter(int(np.prod(g)) // merge ** 2 for g in grids)
    out: list[int] = []
    for token in text:
        out += [IMAGE] * next(counts) if token == IMAGE else [token]
    return out


def write_fixture(name: str, folder: Path) -> None:
    import torch

    images = _module("make_image_fixtures")
    model = build_model(name)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")
    processor = images.processor(PROCESSOR)
    arrays: dict[str, np.ndarray] = {}
    for case, (names, text) in CASES.items():
        files = [next(f for f in images.IMAGE_FILES if f.startswith(n + ".")) for n in names]
        vision: dict[str, Any] = {}
        grid = torch.zeros((0, 3), dtype=torch.int64)
        if files:
            out = processor(images=[images.upright(images.IMAGES / f) for f in files],
                            return_tensors="pt")
            grid = out["image_grid_thw"]
        ids = torch.tensor([expand(text, grid.numpy(), PROCESSOR["merge_size"])])
        if files:
            vision = {"pixel_values": out["pixel_values"], "image_grid_thw": grid,
                      "mm_token_type_ids": (ids == IMAGE).int()}
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, **vision).logits[0, -1]
            positions = model.model.get_rope_index(ids, **vision)[0] if files else \
                torch.arange(ids.shape[1]).expand(3, 1, -1)
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=GREEDY_STEPS, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True,
                                       **vision)
        greedy = generated.sequences[0, ids.shape[1]:].numpy()
        if len(greedy) != GREEDY_STEPS:
            raise RuntimeError(f"{name} {case}: generate stopped after {len(greedy)} tokens")
        arrays[f"{case}_images"] = np.array(files, dtype=str)
        arrays[f"{case}_text"] = np.array(text, dtype=np.int32)
        arrays[f"{case}_grid"] = grid.numpy().astype(np.int32)
        arrays[f"{case}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"{case}_positions"] = positions[:, 0].numpy().astype(np.int32)
        arrays[f"{case}_logits"] = logits.numpy().astype(np.float32)
        arrays[f"{case}_greedy"] = greedy.astype(np.int32)
        arrays[f"{case}_greedy_logits"] = torch.cat(generated.logits).numpy().astype(np.float32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in KEEP:
            extra.unlink()


def main(argv: list[str]) -> int:
    for name in argv or list(TEXT_CONFIGS):
        folder = FIXTURES / name
        write_fixture(name, folder)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
