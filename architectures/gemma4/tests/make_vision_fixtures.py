"""Write the tiny Gemma 4 vision-language checkpoint and its vision tower's reference outputs.

``vision_fixtures/tiny_vision/`` holds what transformers' ``Gemma4ForConditionalGeneration
.save_pretrained`` writes (config.json, model.safetensors; float32, CPU torch, eager
attention): the text model of make_fixtures.py's ``dense`` config, no audio tower, and a
tiny vision tower (``VISION_CONFIG``: 2 layers, width 32, 2 query heads sharing 1 KV head of
16, 4x4-pixel patches, 2x2 pooling to soft tokens, a 16-entry position table per axis,
clipped linears and standardized soft tokens, as the Hub's E2B/E4B and 26B/31B towers have
them one or the other).

``reference.npz`` holds, for each case of ``CASES`` (one or more images given by their
``(rows, columns)`` patch grids, padded to ``max_patches`` rows as the image processor pads
them), the inputs in the processor's format and transformers' outputs:

- ``{case}_pixels`` ``[images, max_patches, 3 * P * P]``: each patch's pixels in ``[0, 1)``
  (patch row, patch column, channel; random, fixed seed), padding rows zero;
- ``{case}_positions`` ``[images, max_patches, 2]`` int32: each patch's ``(x, y)`` =
  (column, row), padding rows ``(-1, -1)``;
- ``{case}_encoder`` ``[images, max_patches, 32]``: the encoder's output
  (``vision_tower.encoder``'s ``last_hidden_state``, before pooling) with padding rows zeroed
  (the pooler zeroes them; they are never used);
- ``{case}_pooled`` ``[soft tokens, 32]``: ``vision_tower(...)``'s ``last_hidden_state``
  (pooled, scaled by sqrt(32), standardized, padding stripped);
- ``{case}_embeds`` ``[soft tokens, 32]``: ``model.get_image_features(...)``'s
  ``pooler_output`` (``embed_vision`` of the above), every image's in order: what
  ``Gemma4Model`` puts at the image placeholder positions.

Run from the repository root (needs torch and transformers):
    /tmp/ci/.ci-venv/bin/python architectures/gemma4/tests/make_vision_fixtures.py

The weights are drawn as make_fixtures.py draws the text model's (linear maps
``N(0, 1 / fan_in)``, RMSNorm scales ``1 + 0.2 N(0, 1)``, q/k norm scales near 0.5: the
tower's attention is unscaled), then the position table ``0.5 N(0, 1)``, the clip bounds
(``+-`` 1.5 to 2.5: each clips a few percent of its values), ``std_bias`` ``N(0, 1)`` and
``std_scale`` from 0.5 to 1.5, so that every part moves the outputs well above the
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
NAME = "tiny_vision"
TEXT_FIXTURE = "dense"
KEEP = ("config.json", "model.safetensors", "reference.npz")

VISION_CONFIG: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, patch_size=4, pooling_kernel_size=2, position_embedding_size=16,
    use_clipped_linears=True, standardize=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0},
)

#: case -> (max_patches, the (rows, columns) patch grid of each image, in input order)
CASES: dict[str, tuple[int, list[tuple[int, int]]]] = {
    # one wide image filling its rows: 6 soft tokens
    "one_image": (24, [(4, 6)]),
    # a tall and a wide image padded to 20 rows: 3 + 4 soft tokens
    "two_images": (20, [(6, 2), (2, 8)]),
}


def _text_fixtures() -> Any:
    spec = importlib.util.spec_from_file_location("gemma4_make_fixtures",
                                                  HERE / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(seed: int = 0) -> Any:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text_fixtures = _text_fixtures()
    torch.manual_seed(seed)
    config = Gemma4Config(text_config=dict(text_fixtures.CONFIGS[TEXT_FIXTURE]),
                          vision_config=dict(VISION_CONFIG), audio_config=None,
                          tie_word_embeddings=True, attn_implementation="eager")
    model = Gemma4ForConditionalGeneration(config).eval().to(torch.float32)
    text_fixtures._randomize(model, seed=seed + 1)
    randomize_vision(model, seed=seed + 2)
    return model


def randomize_vision(model: Any, seed: int) -> None:
    """The tower's position table, clip bounds and standardization (after the text
    fixtures' ``_randomize``, which draws every parameter)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tower = model.model.vision_tower
        table = tower.patch_embedder.position_embedding_table
        table.copy_(0.5 * torch.randn(table.shape, generator=gen))
        for name, buffer in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.5 - torch.rand((), generator=gen).item())
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5 + torch.rand((), generator=gen).item())
            elif name == "std_bias":
                buffer.copy_(torch.randn(buffer.shape, generator=gen))
            elif name == "std_scale":
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))


def inputs(seed: int = 1234) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """case -> (pixels [images, max_patches, 3 P^2] float32, positions [images,
    max_patches, 2] int32), laid out as Gemma4ImageProcessor lays them out."""
    rng = np.random.default_rng(seed)
    width = 3 * VISION_CONFIG["patch_size"] ** 2
    out = {}
    for case, (max_patches, grids) in CASES.items():
        pixels = np.zeros((len(grids), max_patches, width), dtype=np.float32)
        positions = np.full((len(grids), max_patches, 2), -1, dtype=np.int32)
        for i, (rows, cols) in enumerate(grids):
            n = rows * cols
            pixels[i, :n] = rng.random((n, width), dtype=np.float32)
            ys, xs = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            positions[i, :n] = np.stack([xs.reshape(-1), ys.reshape(-1)], axis=-1)
        out[case] = (pixels, positions)
    return out


def reference_outputs(model: Any, pixels: np.ndarray, positions: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(encoder output with padding rows zeroed, the tower's soft tokens, embed_vision's)."""
    import torch

    captured: list[torch.Tensor] = []
    tower = model.model.vision_tower
    hook = tower.encoder.register_forward_hook(
        lambda module, args, out: captured.append(out.last_hidden_state))
    pixel_values = torch.from_numpy(pixels)
    position_ids = torch.from_numpy(positions.astype(np.int64))
    try:
        with torch.no_grad():
            pooled = tower(pixel_values=pixel_values,
                           pixel_position_ids=position_ids).last_hidden_state
            features = model.model.get_image_features(pixel_values, position_ids)
    finally:
        hook.remove()
    encoder = captured[0].numpy().copy()
    encoder[(positions == -1).all(axis=-1)] = 0.0
    embeds = torch.cat(list(features.pooler_output), dim=0).numpy()
    return encoder, pooled.numpy(), embeds


def write_fixture(folder: Path) -> None:
    model = build_model()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    arrays: dict[str, np.ndarray] = {}
    for case, (pixels, positions) in inputs().items():
        encoder, pooled, embeds = reference_outputs(model, pixels, positions)
        arrays[f"{case}_pixels"] = pixels
        arrays[f"{case}_positions"] = positions
        arrays[f"{case}_encoder"] = encoder.astype(np.float32)
        arrays[f"{case}_pooled"] = pooled.astype(np.float32)
        arrays[f"{case}_embeds"] = embeds.astype(np.float32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in KEEP:
            extra.unlink()


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) / NAME if argv else FIXTURES / NAME
    write_fixture(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
