"""Fixtures of the demo plugin's tests: the recipe script as a module and a tiny target.

Test modules reach these through fixtures only (with ``--import-mode=importlib`` a
sibling helper module is not importable by name).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipe" / "build_demo.py"


def load_recipe() -> ModuleType:
    """``plugins/demo/recipe/build_demo.py`` as a module (it is a script, not a package)."""
    name = "mlxrunner_demo_build_recipe"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def demo_recipe() -> ModuleType:
    pytest.importorskip("mlxrunner_qwen3_5", reason="the Qwen3.5 plugin is not installed")
    return load_recipe()


# A cycle of distinct words: a target trained on it briefly has a simple greedy chain (the
# cycle), so a few draft steps are enough to show learning.
CYCLE = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def write_cycle_corpus(folder: Path, files: int = 6, seed: int = 0) -> list[Path]:
    """Text files that run through ``CYCLE`` from random starting words, a line per 6 words."""
    import random

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        start = rng.randrange(len(CYCLE))
        words = [CYCLE[(start + k) % len(CYCLE)] for k in range(600)]
        lines = [" ".join(words[j:j + 6]) for j in range(0, len(words), 6)]
        path = folder / f"cycle_{i}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def tiny_target(demo_recipe: ModuleType, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[Path, list[Path], list[Path]]:
    """A tiny Qwen3.5 target (4 layers, hidden 32, its own BPE tokenizer) made by the recipe's
    own functions and trained briefly on a cyclic text. Returns (folder, training files,
    held-out files)."""
    r = demo_recipe
    base = tmp_path_factory.mktemp("tiny-target")
    out = base / "model"
    corpus = write_cycle_corpus(base / "corpus")
    train_files, held_files = corpus[:-1], corpus[-1:]
    preset = r.PRESETS["tiny"]
    tok = r.train_tokenizer(train_files, 320, out)
    config = r.target_config(preset)
    config["vocab_size"] = tok.get_vocab_size()
    model = r.build_target(config, 0, embed_std=0.5)
    stream = r.encode_files(tok, train_files)
    held = r.encode_files(tok, held_files)
    preset = r.replace(preset, target_lr=1e-2)
    r.train_target(model, stream, held, preset, 40, 0.0, 0, r.Log(base / "log.jsonl"))
    r.save_target(model, config, out, preset)
    return out, train_files, held_files
