"""Write the tiny tokenizer folders in core/mlxrunner/testdata/ (run from the repo root).

    /work/venv/bin/python tests/core/make_tokenizer_testdata.py

Two folders, each a few tens of KB, trained with ``tokenizers`` on the small
corpus below, shaped like the real tokenizers the project runs:

- ``tokenizer-bytelevel/``: byte-level BPE with an NFC normalizer and special
  markers added after the vocabulary (the Qwen3.5 layout);
- ``tokenizer-bytefallback/``: BPE over text whose spaces became U+2581, with
  ``<0x00>``..``<0xFF>`` byte-fallback tokens and specials first (the Gemma 4
  layout).

Each has tokenizer_config.json, config.json and generation_config.json with
end-of-sequence ids spread over the files, so tests can check that the
tokenizer reads their union.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TESTDATA = Path(__file__).resolve().parents[2] / "core" / "mlxrunner" / "testdata"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I'm fine, thanks.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n\tprint(i * i)\n",
    "Speculative decoding drafts a block of tokens and verifies them in one pass.",
    "The model reads the prompt, then writes the answer token by token.",
    "Привет, мир! Как дела?",
    "こんにちは世界。今日はいい天気ですね。",
    "你好，世界！我想吃苹果。",
    "Emoji: 🦙 🚀 ✅ and accents: café, naïve, São Paulo, Zürich.",
    "Numbers 3 33 333 3.14 1e-3 and symbols #$%&*()[]{}<>",
    "    indented line\n\n\nthree newlines above",
]


def corpus_lines(repeat: int = 20) -> list[str]:
    return CORPUS * repeat


def bytelevel_tokenizer() -> tuple[Tokenizer, list[str]]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|eot|>"]
    tokenizer.add_special_tokens(specials)
    return tokenizer, specials


def bytefallback_tokenizer() -> tuple[Tokenizer, list[str], list[str]]:
    space = "\u2581"
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", space)
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(
        vocab_size=300, max_token_length=8, show_progress=False
    )
    trainer_tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    trained = json.loads(trainer_tokenizer.to_str())

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
    plain_added = ["<|tool_call>"]  # an added token that is not special, as in Gemma 4
    vocab: dict[str, int] = {}
    for token in specials + plain_added + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[token] = len(vocab)
    for token, _ in sorted(trained["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)

    added = [
        {
            "id": vocab[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token in specials,
        }
        for token in specials + plain_added
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": space},
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": space}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": trained["model"]["merges"],
        },
    }
    return Tokenizer.from_str(json.dumps(spec)), specials, plain_added


def added_tokens_decoder(tokenizer: Tokenizer) -> dict[str, dict]:
    return {
        str(token_id): {
            "content": added.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": bool(added.special),
        }
        for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
    }


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def main() -> None:
    folder = TESTDATA / "tokenizer-bytelevel"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = bytelevel_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"), pretty=False)
    ids = {name: tokenizer.token_to_id(name) for name in ("<|endoftext|>", "<|im_end|>", "<|eot|>")}
    write_json(
        folder / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "added_tokens_decoder": added_tokens_decoder(tokenizer),
            "chat_template": CHATML,
            "model_max_length": 1024,
        },
    )
    # eos ids spread over the files: the tokenizer must take their union
    write_json(
        folder / "config.json",
        {
            "eos_token_id": ids["<|endoftext|>"],
            "text_config": {"eos_token_id": [ids["<|im_end|>"]]},
        },
    )
    write_json(
        folder / "generation_config.json", {"eos_token_id": [ids["<|im_end|>"], ids["<|eot|>"]]}
    )

    folder = TESTDATA / "tokenizer-bytefallback"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, _, _ = bytefallback_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"), pretty=False)
    write_json(
        folder / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "bos_token": "<bos>",
            "eos_token": {"content": "<eos>", "special": True},
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "added_tokens_decoder": added_tokens_decoder(tokenizer),
            "chat_template": [
                {"name": "default", "template": TURNS},
                {"name": "tool_use", "template": "{{ bos_token }}tools"},
            ],
        },
    )
    write_json(folder / "config.json", {"text_config": {"eos_token_id": 1}})
    write_json(
        folder / "generation_config.json",
        {"eos_token_id": [1, tokenizer.token_to_id("<turn|>")]},
    )
    for path in sorted(TESTDATA.rglob("*")):
        if path.is_file():
            print(f"{path.relative_to(TESTDATA)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
