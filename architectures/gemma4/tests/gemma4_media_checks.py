"""What the Gemma 4 media tests share: the test images, reading a fixture's reference, a
case's prompt with its media placed, the first step's log-probabilities as ``generate``
reports them, and the comparisons."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxrunner
from mlxrunner import MediaPrompt, SamplerOptions, place_media
from mlxrunner.plugin import Model, read_image

HERE = Path(__file__).resolve().parent
#: the images the fixtures' references were made from (the Qwen3.5 plugin's test images)
IMAGES = HERE.parents[1] / "qwen3_5" / "tests" / "vision_fixtures" / "images"
TOLERANCE = 1e-4
GREEDY = SamplerOptions(temperature=0.0)


def read_reference(folder: Path) -> dict[str, np.ndarray]:
    with np.load(folder / "reference.npz", allow_pickle=False) as data:
        return dict(data)


def media_prompt(model: Model, folder: Path, reference: dict[str, np.ndarray], case: str,
                 read_clip: Callable[[str], np.ndarray] | None = None) -> MediaPrompt:
    """The case's prompt as a chat template writes it (``{case}_text``), each placeholder
    taking the next of the case's images (``{case}_images``) or clips (``{case}_clips``,
    read by ``read_clip``)."""
    encoders = model.load_encoders(folder)
    names = {"image": iter(reference.get(f"{case}_images", ())),
             "audio": iter(reference.get(f"{case}_clips", ()))}
    kinds = {encoder.placeholder: kind for kind, encoder in encoders.items()}
    items = []
    for token in reference[f"{case}_text"].tolist():
        kind = kinds.get(token)
        if kind == "image":
            items.append(encoders[kind].prepare(read_image(IMAGES / str(next(names[kind])))))
        elif kind == "audio" and read_clip is not None:
            items.append(encoders[kind].prepare(read_clip(str(next(names[kind])))))
    return place_media(reference[f"{case}_text"].tolist(), items,
                       {kind: encoder.placeholder for kind, encoder in encoders.items()})


def generation_logprobs(model: Model, prompt: MediaPrompt) -> np.ndarray:
    """The first step's log-probabilities over the vocabulary as ``mlxrunner.generate``
    reports them: the last row of the core's prefill of ``prompt``, log-softmaxed."""
    options = SamplerOptions(temperature=0.0, logprobs=True, top_logprobs=model.vocab_size)
    result = mlxrunner.generate(model, prompt, max_tokens=1, options=options)
    out = np.full(model.vocab_size, -np.inf)
    for token, value in result.logprobs[0]["top_logprobs"]:
        out[token] = value
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def max_err(got: mx.array | np.ndarray, want: np.ndarray) -> float:
    values = np.array(got.astype(mx.float32)) if isinstance(got, mx.array) else got
    return float(np.abs(values.reshape(-1) - want.reshape(-1)).max())
