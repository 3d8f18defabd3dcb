"""Helpers shared by the cross-package tests (importable as `mlxrunner_test_support`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def logged(caplog) -> str:
    """The messages logged since the last call, one a line (what ``mlxrunner`` prints on
    stderr), read like ``capsys.readouterr().err``: the records are then forgotten."""
    text = "".join(f"{record.getMessage()}\n" for record in caplog.records)
    caplog.clear()
    return text


def graph_labels(*outputs) -> list[str]:
    """The operation names of the (unevaluated) graph behind ``outputs``, one a node (MLX's
    DOT export): which kernels a call would launch."""
    import re
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        labels = re.findall(r'label ="([^"]+)"', dot.read())
    assert labels, "no operations: the outputs were evaluated before their graph was read"
    return labels


def folded_masks_on_cuda(monkeypatch, attention) -> list:
    """The mask of each ``folded_attention`` call, recorded (the calls still run) while
    ``attention`` (``mlxrunner.nn.attention``, handed in by a white-box test) sees CUDA."""
    masks = []
    real = attention.folded_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "folded_attention", spy)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    return masks


def read_as_one(rows: list[dict]) -> list[dict]:
    """A launch's rows (each link's, by role) all read through one ``StopGradient``: a
    stand-in launch's outputs, so that each launch a graph reads shows in it once."""
    import mlx.core as mx

    flat = [(i, role, out) for i, link_rows in enumerate(rows)
            for role, out in link_rows.items()]
    joined = mx.stop_gradient(mx.concatenate([out.reshape(-1) for *_, out in flat]))
    at = 0
    marked: list[dict] = [{} for _ in rows]
    for i, role, out in flat:
        marked[i][role] = joined[at:at + out.size].reshape(out.shape)
        at += out.size
    return marked


def on_cuda_and_emulated():
    """pytest marks: ``(needs MLX's CUDA backend, needs g++ for the CUDA emulation)``."""
    import mlx.core as mx
    import pytest

    from mlxrunner.testing.cuda_emulation import emulation_available

    return (pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                               reason="needs MLX's CUDA backend"),
            pytest.mark.skipif(not emulation_available(),
                               reason="needs g++ for the CUDA emulation"))


def shared_data() -> Path | None:
    path = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
    return path if path.is_dir() else None


EXAMPLE_CONFIG = {
    "architectures": ["ExampleLlamaForCausalLM"],
    "model_type": "example_llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 320,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
    "eos_token_id": 1,
    "bos_token_id": 0,
}

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\nprint(os.getcwd())\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Hello world! The quick brown fox jumps over the lazy dog.",
] * 4


def write_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))


def write_model_folder(folder: Path, config: dict | None = None, seed: int = 0) -> Path:
    """A complete model folder for the example architecture with random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxrunner import host as plugins
    from mlxrunner.model import text_config

    config = dict(config or EXAMPLE_CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = plugins.architecture_for(config)(text_config(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    write_tokenizer(folder)
    return folder



class ToyImageEncoder:
    """A toy image encoder (mlxrunner.plugin.Encoder) for tests of the media path: each 4x4
    patch of an image becomes one embedding row, a fixed random linear map of its pixels;
    the item's tokens are ``begin``, one ``slot`` per patch, ``end``."""

    modality = "image"

    def __init__(self, hidden: int, placeholder: int, begin: int, slot: int, end: int) -> None:
        import mlx.core as mx

        self.placeholder, self.begin, self.slot, self.end = placeholder, begin, slot, end
        self.proj = mx.random.normal((48, hidden), key=mx.random.key(7)) * 0.2
        self.runs = 0

    def prepare(self, media):
        import mlx.core as mx
        import numpy as np

        from mlxrunner.plugin import MediaItem, content_digest

        h, w = media.shape[0] // 4, media.shape[1] // 4
        patches = media[:h * 4, :w * 4].reshape(h, 4, w, 4, 3).transpose(0, 2, 1, 3, 4)
        patches = patches.reshape(h * w, 48).astype(np.float32) / 255.0

        def encode():
            self.runs += 1
            return mx.array(patches) @ self.proj

        n = h * w
        return MediaItem("image", (self.begin, *[self.slot] * n, self.end),
                         tuple(range(1, n + 1)), content_digest(media), encode)


class ToyAudioEncoder:
    """A toy audio encoder: each 1,600 samples (0.1 s at 16 kHz) become one embedding row,
    a fixed random linear map of 16 of their statistics; tokens ``begin``, slots, ``end``."""

    modality = "audio"

    def __init__(self, hidden: int, placeholder: int, begin: int, slot: int, end: int) -> None:
        import mlx.core as mx

        self.placeholder, self.begin, self.slot, self.end = placeholder, begin, slot, end
        self.proj = mx.random.normal((16, hidden), key=mx.random.key(8)) * 0.5

    def prepare(self, media):
        import mlx.core as mx
        import numpy as np

        from mlxrunner.plugin import MediaError, MediaItem, content_digest

        n = len(media) // 1600
        if n < 1:
            raise MediaError("audio shorter than 0.1 s")
        frames = np.asarray(media[:n * 1600], np.float32).reshape(n, 16, 100)
        features = np.abs(frames).mean(axis=-1)

        return MediaItem("audio", (self.begin, *[self.slot] * n, self.end),
                         tuple(range(1, n + 1)), content_digest(features),
                         lambda: mx.array(features) @ self.proj)


def media_llama(config: dict, ids: tuple[int, int, int, int],
                audio_ids: tuple[int, int, int, int] | None = None):
    """The example architecture with a :class:`ToyImageEncoder` (``ids``: placeholder,
    begin, slot, end) and, given ``audio_ids``, a :class:`ToyAudioEncoder`, as a third party
    would add them."""
    from mlxrunner_example_architecture.model import ExampleLlama

    class MediaLlama(ExampleLlama):
        def load_encoders(self, folder):
            encoders = {"image": ToyImageEncoder(self.hidden_size, *ids)}
            if audio_ids is not None:
                encoders["audio"] = ToyAudioEncoder(self.hidden_size, *audio_ids)
            return encoders

    return MediaLlama(config)


MEDIA_SPECIALS = ["<|image|>", "<|begin_image|>", "<|slot|>", "<|end_image|>",
                  "<|audio|>", "<|begin_audio|>", "<|end_audio|>"]
#: a chat template that writes ``<|image|>`` for an image part
MEDIA_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{% if p.type in ['image', 'image_url'] %}<|image|>"
    "{% elif p.type in ['audio', 'input_audio'] %}<|audio|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def media_bundle(folder: Path):
    """A loaded bundle whose model takes images: the example architecture's folder with
    ``MEDIA_SPECIALS`` in its tokenizer and ``MEDIA_TEMPLATE``, its model a
    :func:`media_llama` with random weights that make replies depend on the image."""
    import dataclasses

    from tokenizers import Tokenizer

    import mlxrunner
    from mlxrunner.testing.speculative import randomize

    write_model_folder(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(MEDIA_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(MEDIA_TEMPLATE)
    bundle = mlxrunner.load(folder)
    ids = [bundle.tokenizer.token_to_id(t) for t in MEDIA_SPECIALS]
    model = media_llama(dict(EXAMPLE_CONFIG), (ids[0], ids[1], ids[2], ids[3]),
                        (ids[4], ids[5], ids[2], ids[6]))
    randomize(model, seed=5)
    model.eval()
    return dataclasses.replace(bundle, model=model)


def png_bytes(seed: int, size: tuple[int, int] = (12, 8)) -> bytes:
    """A random RGB PNG of ``size`` (width, height) (needs Pillow)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def wav_bytes(seed: int, seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A random 16-bit mono WAV file."""
    import io
    import wave

    import numpy as np

    samples = np.random.default_rng(seed).integers(-20000, 20000, int(seconds * rate))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()
