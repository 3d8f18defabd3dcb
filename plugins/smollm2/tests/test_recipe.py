"""The default draft's recipe: prompts split by subject, and answers written chunk by chunk,
continued by the next run, each what the target gives that prompt alone."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import pytest

mx.set_default_device(mx.cpu)

import mlxrunner  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipe"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _module(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, RECIPE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_held_out_prompts_share_no_subject_with_training_ones():
    prompts = _module("prompts")
    train, held = prompts.prompts("train", 3000), prompts.prompts("heldout", 200)
    assert len(set(train)) == 3000 and len(set(held)) == 200 and not set(train) & set(held)
    for values in prompts.SUBJECTS.values():
        cut = len(values) - max(2, len(values) // 5)
        for subject in values[cut:]:  # a held-out subject appears in no training prompt
            assert not any(subject in p for p in train), subject


def test_answers_are_solo_greedy_written_per_chunk_and_continued(tmp_path):
    pytest.importorskip("mlxrunner_example_architecture",
                        reason="the example-architecture plugin is not installed")
    from mlxrunner_test_support import write_model_folder

    folder = write_model_folder(tmp_path / "model", seed=2)
    (folder / "chat_template.jinja").write_text(CHATML)
    bundle = mlxrunner.load(folder)
    recipe = _module("build_draft")
    texts = [f"question {i}: {'why ' * (i % 5)}?" for i in range(20)]
    path = tmp_path / "answers.jsonl"
    # batch 1: chunks of 16 prompts; a 1 ms limit ends the run after its first chunk
    first = recipe.answer(bundle, texts, 6, path, 1, time_s=0.001)
    assert [r["prompt"] for r in first] == texts[:16]
    assert len(path.read_text().splitlines()) == 16
    stop = bundle.stop_token_ids()
    for record in first[:4]:
        ids = bundle.tokenizer.encode(bundle.renderer.render(
            [{"role": "user", "content": record["prompt"]}]))
        alone = mlxrunner.generate(bundle.model, ids, max_tokens=6, eos_ids=stop,
                                   options=mlxrunner.SamplerOptions(temperature=0))
        reply = [t for t in alone.tokens if t not in stop]
        assert record["answer"] == bundle.tokenizer.decode(reply, skip_special_tokens=True)
        assert record["tokens"] == len(reply)
        # a reply cut at max_tokens gets no end of turn
        assert record["text"].endswith("<|im_end|>\n") == (alone.finish_reason == "stop")
    assert recipe.answer(bundle, texts, 6, path, 1, more=False) == first
    whole = recipe.answer(bundle, texts, 6, path, 1)
    assert whole[:16] == first and [r["prompt"] for r in whole] == texts
    assert [json.loads(line) for line in path.read_text().splitlines()] == whole
    # other prompts: answered afresh, not appended to another run's records
    other = recipe.answer(bundle, ["something else"], 6, path, 1)
    assert [r["prompt"] for r in other] == ["something else"]
