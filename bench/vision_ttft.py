"""Time to first token for a Qwen3.5 prompt holding one image: mlxrunner against mlx-vlm.

Issue 39's GPU point: a 0.8B-shape Qwen3.5 (the shared config's text model and vision tower)
with one 1024x1024 image, ours against mlx-vlm on the same random weights; the goal is not
slower.

What it does:

1. writes one random-weight model folder in a temporary directory, laid out as a Hub
   checkpoint (config.json with ``text_config`` and ``vision_config``, ``model.visual.*`` and
   ``model.language_model.*`` tensors in bf16, the Conv3d patch kernel ``[D, C, T, P, P]``,
   the DeltaNet convolutions ``[C, 1, K]``, zero-centred norms), plus Qwen's published image
   processor settings (patch 16, merge 2, mean/std 0.5, 256^2 to 4096^2 pixels) in both
   ``preprocessor_config.json`` and ``processor_config.json``;
2. loads it in both tools with their own loaders (``mlxrunner.load_model`` +
   ``load_encoders``; ``mlx_vlm.utils.load_model``, its sanitize included);
3. parity, float32 (both loaded from the same bf16 file, so the weights are equal): the last
   position's logits for the image prompt. Both get *our* preprocessed patches and grid, so
   the check is about the models; the two preprocessors' outputs for the image are compared
   on their own (``preprocess_max_abs_diff``). Where the logits differ by more than 1e-3, no
   ratio is reported and the exit code is 1 (the timings are still printed);
4. times, in ``--dtype`` (bf16), from the decoded ``[H, W, 3]`` uint8 pixels to the first
   greedy token, each tool through its own path: ours ``encoder.prepare`` (preprocessing),
   ``place_media``, ``mlxrunner.generate(max_tokens=1)`` (the vision tower runs at prefill);
   theirs the numpy ``Qwen3VLImageProcessor`` mlx-vlm builds for this checkpoint (its
   ``Qwen3VLProcessor.from_pretrained`` does the same), then ``generate_step`` (the vision
   tower in ``get_input_embeddings``, chunked prefill, the first token). The prompt's ids
   with the image tokens expanded are built by hand on both sides (there is no tokenizer);
   mlx-vlm's processor would do that in its ``__call__``. Warm-up runs first, then the
   tools take turns (the order shifting each repeat); medians with their range, and the
   ours/theirs ratio as the median (and range) of the per-repeat ratios. Each row also
   splits out preprocessing; "model" is the rest (tower, prefill, first token).

Runs:

    /work/venv/bin/python bench/vision_ttft.py --quick --repeats 3      # CPU: tiny shape
    python bench/vision_ttft.py --repeats 5 --json out.json             # GPU: 0.8B, 1024^2
    bash bench/gpu_contract.sh vision                                   # the GPU contract

``--quick``: a tiny shape of the same kinds for the CPU: 4 text layers (3 DeltaNet + 1
attention) of width 256, vocabulary 4096, a 2-block vision tower of width 128, a 512x512
image (1024 patches, 256 image tokens).

The GPU machine has no package registry: carry mlx-vlm's wheel in ``.whl/`` (``pip download
mlx-vlm==0.7.10 --no-deps -d .whl``; bench/gpu_setup.sh installs it ``--no-deps``). Checked
here in a venv holding only mlx, transformers 5.17.0 (the GPU image's) with its own
dependencies and our core's: mlx-vlm's import then also wanted requests (with urllib3) and
Pillow (which our preprocessing needs too); the GPU image is expected to hold both
(torchvision needs Pillow, tiktoken requests), else carry their wheels as well. mlx-vlm's
Qwen3.5 runs its Metal kernels only where Metal is available, plain MLX operations elsewhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
import numpy as np
from harness import DTYPES, SHARED
from mlx.utils import tree_flatten

import mlxrunner
from mlxrunner import SamplerOptions, place_media

DEFAULT_CONFIG = SHARED / "configs" / "Qwen3.5-0.8B-Base.config.json"
#: Qwen's published Qwen3.5 image processor settings (as its checkpoints ship them)
PROCESSOR = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
}
GREEDY = SamplerOptions(temperature=0.0)
TOLERANCE = 1e-3


# -- the model folder -----------------------------------------------------------------------
def bench_config(config: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The composite config to write: the shared one, cut to the CPU shape with ``quick``
    (the special tokens then moved inside the smaller vocabulary)."""
    config = json.loads(json.dumps(config))
    text, vision = config["text_config"], config["vision_config"]
    config["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    text["dtype"] = "bfloat16"
    if quick:  # every width cut too: this CPU does a few GFLOP/s
        text.update(num_hidden_layers=4, layer_types=text["layer_types"][:4], vocab_size=4096,
                    hidden_size=256, intermediate_size=512, num_attention_heads=2,
                    num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64)
        # head_dim stays 256: its rotated quarter is what mrope_section [11, 11, 10] splits
        vision.update(depth=2, hidden_size=128, num_heads=4, intermediate_size=256,
                      out_hidden_size=256)
        top = text["vocab_size"]
        config.update(vision_start_token_id=top - 5, vision_end_token_id=top - 4,
                      image_token_id=top - 3, video_token_id=top - 2)
        text["eos_token_id"] = top - 1
    return config


def random_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """Random bf16 tensors under the Hub checkpoint's names and layouts, drawn from our
    modules' parameter shapes: N(0, 0.02) everywhere except the DeltaNet decay parameters
    and the norms, which keep their initial values (a trained model's scale keeps bf16
    activations finite through 24 random layers)."""
    from mlxrunner_qwen3_5 import Qwen3_5Vision

    mx.random.seed(seed)
    text_model = mlxrunner.build_model(config)
    vision = Qwen3_5Vision(config["vision_config"])

    def draw(name: str, value: mx.array) -> mx.array:
        if name.endswith(("A_log", "dt_bias")) or "norm" in name:
            return value.astype(mx.bfloat16)
        return (mx.random.normal(value.shape) * 0.02).astype(mx.bfloat16)

    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(text_model.parameters()):
        value = draw(name, value)
        if name.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)  # ours [C, K, 1]; Hub [C, 1, K]
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        weights[name] = value
    cfg = vision.config
    for name, value in tree_flatten(vision.parameters()):
        value = draw(name, value)
        if name == "patch_embed.proj.weight":  # ours flat; Hub the Conv3d's [D, C, T, P, P]
            value = value.reshape(value.shape[0], cfg.in_channels, cfg.temporal_patch_size,
                                  cfg.patch_size, cfg.patch_size)
        weights["model.visual." + name] = value
    mx.eval(weights)
    del text_model, vision
    return weights


def write_folder(folder: Path, config: dict[str, Any], seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    del weights
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # both files, so neither tool looks further (mlx-vlm would ask the Hub for a missing one)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")
    (folder / "processor_config.json").write_text(
        json.dumps({"image_processor": PROCESSOR}, indent=2) + "\n")


# -- the two tools ------------------------------------------------------------------------
def prompt_text(config: dict[str, Any], before: int, after: int, seed: int) -> list[int]:
    """A chat-shaped prompt: ``before`` random text ids, one image (vision start, image pad,
    vision end), ``after`` random text ids; the ids kept clear of the special tokens."""
    vocab = config["text_config"]["vocab_size"]
    rng = np.random.default_rng(seed)
    text = rng.integers(0, min(vocab - 16, 240000), before + after).tolist()
    image = [config["vision_start_token_id"], config["image_token_id"],
             config["vision_end_token_id"]]
    return text[:before] + image + text[before:]


def expand(text: list[int], image_token: int, count: int) -> list[int]:
    """The prompt with its image pad repeated once per merged patch (what a processor does)."""
    out: list[int] = []
    for token in text:
        out += [image_token] * count if token == image_token else [token]
    return out


class Ours:
    name = "mlxrunner"

    def __init__(self, folder: Path, dtype: mx.Dtype, text: list[int]) -> None:
        self.model = mlxrunner.load_model(folder, dtype)
        self.encoder = self.model.load_encoders(folder)["image"]
        self.text = text

    def first_token(self, rgb: np.ndarray) -> tuple[int, float]:
        """The first greedy token after the prompt with ``rgb``, and the seconds spent
        preprocessing (the caller times the whole)."""
        start = time.perf_counter()
        item = self.encoder.prepare(rgb)
        prepared = time.perf_counter() - start
        prompt = place_media(self.text, [item], {"image": self.encoder.placeholder})
        result = mlxrunner.generate(self.model, prompt, max_tokens=1, options=GREEDY)
        return result.tokens[0], prepared

    def last_logits(self, rgb: np.ndarray) -> mx.array:
        """The prompt's last logits, prefilled as generation does (our preprocessing)."""
        from mlxrunner.testing import prefill

        item = self.encoder.prepare(rgb)
        prompt = place_media(self.text, [item], {"image": self.encoder.placeholder})
        logits, _ = prefill(self.model, prompt, self.model.make_cache())
        return logits.reshape(-1)

    def patches(self, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        from mlxrunner_qwen3_5 import image_inputs

        return image_inputs(rgb, self.encoder.processor)


class Theirs:
    name = "mlx-vlm"

    def __init__(self, folder: Path, dtype: mx.Dtype, text: list[int],
                 config: dict[str, Any]) -> None:
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
            Qwen3VLImageProcessor,
            _qwen_vl_image_kwargs,
        )
        from mlx_vlm.utils import load_model

        self.model = load_model(folder)
        if dtype != mx.bfloat16:  # the file's dtype is what mlx-vlm loads
            self.model.set_dtype(dtype)
            mx.eval(self.model.parameters())
        # what Qwen3VLProcessor.from_pretrained builds for this folder's image settings
        self.processor = Qwen3VLImageProcessor(
            **_qwen_vl_image_kwargs(str(folder), default_patch_size=16))
        self.text = text
        self.image_token = config["image_token_id"]
        self.merge = config["vision_config"]["spatial_merge_size"]

    def inputs(self, pixel_values: np.ndarray, grid: np.ndarray
               ) -> tuple[mx.array, mx.array, mx.array]:
        count = int(np.prod(grid[0])) // self.merge ** 2
        ids = mx.array([expand(self.text, self.image_token, count)])
        return ids, mx.array(pixel_values), mx.array(grid)

    def preprocess(self, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # channels first, a view, as mlx-vlm's own image loading hands it over
        out = self.processor(images=[rgb.transpose(2, 0, 1)])
        return out["pixel_values"], out["image_grid_thw"]

    def first_token(self, rgb: np.ndarray) -> tuple[int, float]:
        from mlx_vlm.generate.ar import generate_step

        start = time.perf_counter()
        pixel_values, grid = self.preprocess(rgb)
        prepared = time.perf_counter() - start
        ids, pixels, grid_mx = self.inputs(pixel_values, grid)
        steps = generate_step(ids, self.model, pixels, None, image_grid_thw=grid_mx,
                              max_tokens=1, temperature=0.0)
        token, _ = next(steps)  # an int, or a one-element array
        steps.close()
        return int(token.item() if hasattr(token, "item") else token), prepared

    def last_logits(self, pixel_values: np.ndarray, grid: tuple[int, int, int]) -> mx.array:
        """The prompt's last logits from one forward (mlx-vlm's ``Model.__call__``), fed
        the given patches and grid."""
        ids, pixels, grid_mx = self.inputs(pixel_values, np.array([grid]))
        out = self.model(ids, pixels, image_grid_thw=grid_mx)
        logits = out.logits if hasattr(out, "logits") else out
        return logits[0, -1].reshape(-1)


# -- measuring --------------------------------------------------------------------------------
def parity(folder: Path, text: list[int], config: dict[str, Any], rgb: np.ndarray
           ) -> dict[str, Any]:
    """float32 last-position logits of both models on the image prompt, both fed our patches;
    and how far the two preprocessors' outputs for the image differ."""
    ours = Ours(folder, mx.float32, text)
    theirs = Theirs(folder, mx.float32, text, config)
    patches, grid = ours.patches(rgb)
    their_pixels, their_grid = theirs.preprocess(rgb)
    same_grid = [int(v) for v in their_grid[0]] == list(grid)
    a = ours.last_logits(rgb).astype(mx.float32)
    b = theirs.last_logits(patches, grid).astype(mx.float32)
    diff = float(mx.abs(a - b).max().item())
    # the check means something only where the image moves the logits well beyond it
    moved = float(mx.abs(ours.last_logits(255 - rgb).astype(mx.float32) - a).max().item())
    result = {
        "max_abs_logit_diff": diff, "tolerance": TOLERANCE, "passed": diff <= TOLERANCE,
        "logit_scale": float(mx.abs(a).max().item()), "inverted_image_moves_ours_by": moved,
        "same_argmax": int(mx.argmax(a).item()) == int(mx.argmax(b).item()),
        "fed": "both models got our patches and grid",
        "preprocess_same_grid": same_grid,
        "preprocess_max_abs_diff": float(np.abs(their_pixels - patches).max())
        if same_grid and their_pixels.shape == patches.shape else None,
    }
    del ours, theirs
    gc.collect()
    mx.clear_cache()
    return result


def timed(tool: Any, rgb: np.ndarray) -> dict[str, float]:
    gc.collect()
    mx.synchronize()
    start = time.perf_counter()
    token, prepared = tool.first_token(rgb)
    total = time.perf_counter() - start
    return {"ttft_ms": 1e3 * total, "preprocess_ms": 1e3 * prepared,
            "model_ms": 1e3 * (total - prepared), "token": token}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def measure(tools: list[Any], rgb: np.ndarray, repeats: int, warmup: int
            ) -> dict[str, dict[str, Any]]:
    """Each tool's runs, the tools taking turns, the first one shifting each repeat (a change
    of load or of the allocator's state hits them alike)."""
    for tool in tools:
        for _ in range(warmup):  # kernels built, buffers allocated
            timed(tool, rgb)
    runs: dict[str, list[dict[str, float]]] = {tool.name: [] for tool in tools}
    for repeat in range(repeats):
        shift = repeat % len(tools)
        for tool in tools[shift:] + tools[:shift]:
            runs[tool.name].append(timed(tool, rgb))
    rows = {}
    for name, got in runs.items():
        rows[name] = {key: spread([r[key] for r in got])
                      for key in ("ttft_ms", "preprocess_ms", "model_ms")}
        rows[name]["runs_ms"] = [round(r["ttft_ms"], 3) for r in got]
        rows[name]["tokens"] = sorted({int(r["token"]) for r in got})
        rows[name]["_runs"] = got
    return rows


def per_repeat_ratio(ours: list[dict[str, float]], theirs: list[dict[str, float]],
                     key: str) -> dict[str, float]:
    return spread([a[key] / b[key] for a, b in zip(ours, theirs)])


def fmt(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:9.{digits}f} [{s['min']:.{digits}f} - {s['max']:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="the timed models' dtype (parity is always float32)")
    parser.add_argument("--image", type=harness.at_least(32), help="the image's side in pixels "
                        "(default 1024; quick 512)")
    parser.add_argument("--text", type=harness.at_least(0), default=24,
                        help="text tokens around the image (a third before it)")
    parser.add_argument("--repeats", type=harness.at_least(1), default=5,
                        help="timed runs per tool")
    parser.add_argument("--warmup", type=harness.at_least(0), default=2,
                        help="untimed runs per tool first")
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized run: 4 narrow text layers, vocabulary 4096, 2 narrow "
                             "vision blocks, a 512x512 image")
    parser.add_argument("--no-mlx-vlm", action="store_true", help="time ours alone")
    parser.add_argument("--folder", type=Path,
                        help="write the model folder here (kept) instead of a temporary one")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    side = args.image or (512 if args.quick else 1024)
    if not args.config.is_file():
        print(f"vision_ttft bench: config not found: {args.config}", file=sys.stderr)
        return 2
    config = bench_config(json.loads(args.config.read_text()), args.quick)
    text_cfg, vision_cfg = config["text_config"], config["vision_config"]
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    before = args.text // 3
    text = prompt_text(config, before, args.text - before, args.seed)
    rgb = np.random.default_rng(args.seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    shape = (f"{text_cfg['num_hidden_layers']} text layers of {text_cfg['hidden_size']}, vocab "
             f"{text_cfg['vocab_size']}, {vision_cfg['depth']} vision blocks of "
             f"{vision_cfg['hidden_size']}")
    print(f"vision TTFT bench: {args.config.name} ({shape}), one {side}x{side} image, "
          f"{args.dtype}, device {device} ({mx.device_info().get('device_name', '?')}), "
          f"mlx {mx.__version__}", flush=True)
    print(f"  MLX settings for every row: {harness.mlx_settings()}", flush=True)

    results: dict[str, Any] = {
        "config": args.config.name, "quick": args.quick, "text_layers":
        text_cfg["num_hidden_layers"], "vocab": text_cfg["vocab_size"],
        "hidden": text_cfg["hidden_size"], "vision_depth": vision_cfg["depth"],
        "vision_hidden": vision_cfg["hidden_size"], "image": [side, side], "dtype": args.dtype,
        "device": device, "device_info": {k: str(v) for k, v in mx.device_info().items()},
        "mlx": mx.__version__, "platform": platform.platform(),
        "mlx_settings": harness.mlx_settings(), "repeats": args.repeats,
        "warmup": args.warmup, "mlx_vlm_version": None,
    }
    with tempfile.TemporaryDirectory(prefix="vision-ttft-") as scratch:
        folder = args.folder or Path(scratch) / "model"
        start = time.perf_counter()
        write_folder(folder, config, args.seed)
        print(f"  wrote the random-weight folder in {time.perf_counter() - start:.1f} s",
              flush=True)

        status = 0
        theirs_ok = not args.no_mlx_vlm
        if theirs_ok:
            try:
                import mlx_vlm

                results["mlx_vlm_version"] = mlx_vlm.__version__
            except ImportError as error:
                print(f"  mlx-vlm not importable ({error}): comparison skipped", flush=True)
                theirs_ok = False
        if theirs_ok:
            start = time.perf_counter()
            check = parity(folder, text, config, rgb)
            check["seconds"] = round(time.perf_counter() - start, 1)
            results["parity"] = check
            print(f"  parity (float32, both fed our patches): max |logit difference| "
                  f"{check['max_abs_logit_diff']:.3g} (logits up to "
                  f"{check['logit_scale']:.3g}, moved {check['inverted_image_moves_ours_by']:.3g} "
                  f"by the inverted image; tolerance {TOLERANCE:g}), same argmax "
                  f"{check['same_argmax']}; preprocessors: same grid "
                  f"{check['preprocess_same_grid']}, max |pixel difference| "
                  f"{check['preprocess_max_abs_diff']} ({check['seconds']} s)", flush=True)

        tools: list[Any] = [Ours(folder, dtype, text)]
        if theirs_ok:
            tools.append(Theirs(folder, dtype, text, config))
        patches, grid = tools[0].patches(rgb)
        tokens = len(expand(text, config["image_token_id"],
                            int(np.prod(grid)) // vision_cfg["spatial_merge_size"] ** 2))
        results.update(grid=list(grid), patches=int(patches.shape[0]), prompt_tokens=tokens)
        rows = measure(tools, rgb, args.repeats, args.warmup)

    print(f"  time to first token, prompt {tokens} tokens ({int(patches.shape[0])} patches "
          f"-> {tokens - args.text - 2} image tokens), {args.dtype}; ms, median of "
          f"{args.repeats} [min - max]:", flush=True)
    print(f"    {'':10s} {'TTFT':>28s} {'preprocess':>26s} {'model':>26s}   first token")
    for name, row in rows.items():
        print(f"    {name:10s} {fmt(row['ttft_ms']):>28s} {fmt(row['preprocess_ms']):>26s} "
              f"{fmt(row['model_ms']):>26s}   {row['tokens']}", flush=True)
    # the first tokens may differ in bf16: random weights leave the top logits close
    results["rows"] = {name: {k: v for k, v in row.items() if k != "_runs"}
                       for name, row in rows.items()}
    if theirs_ok:
        ratio = {key: per_repeat_ratio(rows["mlxrunner"]["_runs"], rows["mlx-vlm"]["_runs"],
                                       key) for key in ("ttft_ms", "model_ms", "preprocess_ms")}
        if results["parity"]["passed"]:
            results["ratio_ours_over_theirs"] = ratio
            print(f"  ratio ours/theirs (per-repeat, median [min - max]; below 1: ours "
                  f"faster): TTFT {fmt(ratio['ttft_ms'], 3)}   model "
                  f"{fmt(ratio['model_ms'], 3)}   preprocess {fmt(ratio['preprocess_ms'], 3)}",
                  flush=True)
        else:
            results["ratio_ours_over_theirs"] = None
            print(f"  no ratio: the float32 logits differ by "
                  f"{results['parity']['max_abs_logit_diff']:.3g} > {TOLERANCE:g}", flush=True)
            status = 1
    harness.write_json(args.json, results)
    return status


if __name__ == "__main__":
    sys.exit(main())
