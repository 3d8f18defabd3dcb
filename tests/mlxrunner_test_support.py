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

