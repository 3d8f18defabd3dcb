"""Write the tiny Qwen3.5 vision-language checkpoint and its vision tower's reference outputs.

``vision_fixtures/tiny_vl/`` holds what transformers' ``Qwen3_5ForConditionalGeneration
.save_pretrained`` writes (config.json, model.safetensors; float32, CPU torch): the text
model of the ``tiny_hk2_hv4_tied`` fixture (make_fixtures.py's text config) and a tiny
vision tower (``VISION_CONFIG``: 2 blocks, width 32, 2 heads, 4x4 patches of 2 frames,
2x2 merge windows, a 4x4 learned position grid, output width 32 = the text width).

``reference.npz`` holds, for each case of ``CASES`` (one or more images given by their
``(t, h, w)`` patch grids), ``{case}_patches`` (random normal rows ``[N, C*T*P*P]``, fixed
seed), ``{case}_grid`` ``[images, 3]``, and what ``model.model.visual(patches, grid_thw)``
returns: ``{case}_hidden`` (``last_hidden_state``, the blocks' output ``[N, 32]``) and
``{case}_merged`` (``pooler_output``, the merger's ``[N / 4, 32]``).

Run from the repository root (needs torch and transformers):
    /tmp/ci/.ci-venv/bin/python architectures/qwen3_5/tests/make_vision_fixtures.py

The weights are drawn wider than transformers' initialisation (std 0.2, LayerNorm weights
``1 + 0.2 N(0, 1)``, non-zero biases, a position table of std 0.5) and the RoPE base is 100
(not 10000) so that, over a few patches, every part moves the outputs well above the
comparison tolerance.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "vision_fixtures"
NAME = "tiny_vl"
TEXT_FIXTURE = "tiny_hk2_hv4_tied"
KEEP = ("config.json", "model.safetensors", "reference.npz")

VISION_CONFIG: dict[str, Any] = dict(
    depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64,
    num_heads=2, in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
    out_hidden_size=32, num_position_embeddings=16, initializer_range=0.2,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)

#: case -> the (t, h, w) patch grid of each image, in input order
CASES: dict[str, list[tuple[int, int, int]]] = {
    "one_image": [(1, 4, 6)],
    # attention split between images, the position grid resampled to two other sizes
    "two_images": [(1, 4, 4), (1, 2, 6)],
    # two frames of one clip: attention within each frame, positions repeated per frame
    "two_frames": [(2, 2, 4)],
}


def _text_config() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("qwen3_5_make_fixtures",
                                                  HERE / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config: dict[str, Any] = module.text_config(TEXT_FIXTURE)
    return config


def build_model(seed: int = 0) -> Any:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = _text_config()
    config = Qwen3_5Config(text_config=text, vision_config=dict(VISION_CONFIG),
                           tie_word_embeddings=text["tie_word_embeddings"])
    model = Qwen3_5ForConditionalGeneration(config).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if ".visual." in pname:
                if pname.endswith("pos_embed.weight"):
                    param.copy_(0.5 * noise)
                elif "norm" in pname and pname.endswith(".weight"):  # LayerNorm scales
                    param.copy_(1.0 + 0.2 * noise)
                else:
                    param.copy_(0.2 * noise)
            # the text model as make_fixtures.py draws it
            elif pname.endswith("A_log"):
                n = param.numel()
                param.copy_(torch.linspace(-7.0, 0.0, n) + 0.1 * noise.flatten())
            elif pname.endswith("dt_bias"):
                param.copy_(noise * 0.5)
            elif pname.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif pname.endswith("conv1d.weight"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.2 * noise)
    return model


def inputs(seed: int = 1234) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """case -> (patches [N, C*T*P*P] float32, grid [images, 3] int64)."""
    rng = np.random.default_rng(seed)
    c = VISION_CONFIG
    width = c["in_channels"] * c["temporal_patch_size"] * c["patch_size"] ** 2
    out = {}
    for case, grids in CASES.items():
        rows = sum(t * h * w for t, h, w in grids)
        patches = rng.standard_normal((rows, width)).astype(np.float32)
        out[case] = (patches, np.array(grids, dtype=np.int64))
    return out


def reference_outputs(model: Any, patches: np.ndarray, grid: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    import torch

    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(patches), grid_thw=torch.from_numpy(grid))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def write_fixture(folder: Path) -> None:
    model = build_model()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    arrays: dict[str, np.ndarray] = {}
    for case, (patches, grid) in inputs().items():
        hidden, merged = reference_outputs(model, patches, grid)
        arrays[f"{case}_patches"] = patches
        arrays[f"{case}_grid"] = grid.astype(np.int32)
        arrays[f"{case}_hidden"] = hidden.astype(np.float32)
        arrays[f"{case}_merged"] = merged.astype(np.float32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in KEEP:
            extra.unlink()


def main(argv: list[str]) -> int:
    folder = FIXTURES / NAME
    write_fixture(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
