"""Loading drafts: a `draft/` folder, a bundle's `draft.` tensors, published tensor names, an
own head, and one clear error for each thing that does not fit; then generation with the
loaded draft through mlxrunner.load / mlxrunner.generate."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

mx.set_default_device(mx.cpu)

pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")

import mlxrunner  # noqa: E402
from mlxrunner import (  # noqa: E402
    DraftConfigError,
    ModelFolderError,
    SamplerOptions,
    UnknownNameError,
)
from mlxrunner.model import load_draft  # noqa: E402
from mlxrunner.testing.speculative import (  # noqa: E402
    ToyTarget,
    plain_tokens,
    random_draft,
    random_draft_config,
    speculative_tokens,
)

GREEDY = SamplerOptions(temperature=0)


def _target() -> ToyTarget:
    return ToyTarget({"vocab_size": 32, "hidden_size": 16, "seed": 1})


def _write_draft(folder: Path, draft, config: dict, prefix: str = "",
                 rename=lambda name: name) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    weights = {prefix + rename(k): v for k, v in tree_flatten(draft.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / ("config.json" if not prefix else "draft_config.json")).write_text(
        json.dumps(config))
    return folder


def _proposals(draft, target, tokens=(1, 2, 3, 4, 5)):
    from mlxrunner.plugin import Sampler

    session = draft.new_session(Sampler(GREEDY, target.vocab_size))
    _, tapped = target(mx.array([list(tokens)]), taps=list(draft.taps))
    session.prefill(tapped)
    return session.propose(tokens[-1], len(tokens), draft.block_size - 1).tokens.tolist()


@pytest.mark.parametrize("arch", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_a_draft_folder_loads_strictly_and_proposes_the_same(tmp_path, arch):
    target = _target()
    config = random_draft_config(target, arch, layers=1, block_size=4, taps=[0])
    draft = random_draft(target, arch, layers=1, block_size=4, taps=[0], seed=4)
    folder = _write_draft(tmp_path / "draft", draft, config)
    loaded = load_draft(folder, target)
    assert type(loaded).__name__ == arch
    assert _proposals(loaded, target) == _proposals(draft, target)
    assert loaded.weight_precision == "float32"


def test_published_dflash2_codebook_names_load(tmp_path):
    target = _target()
    config = random_draft_config(target, "DFlash2DraftModel", layers=1, block_size=4, taps=[0])
    draft = random_draft(target, "DFlash2DraftModel", layers=1, block_size=4, taps=[0])
    folder = _write_draft(tmp_path / "d", draft, config,
                          rename=lambda k: k.removesuffix(".weight") if "codebook" in k else k)
    assert _proposals(load_draft(folder, target), target) == _proposals(draft, target)


def test_a_bundle_holds_its_draft_under_the_prefix(tmp_path):
    target = _target()
    config = random_draft_config(target, "DFlashDraftModel", layers=1, block_size=4, taps=[0])
    draft = random_draft(target, "DFlashDraftModel", layers=1, block_size=4, taps=[0], seed=2)
    bundle = tmp_path / "bundle"
    _write_draft(bundle, draft, config, prefix="draft.")
    (bundle / "config.json").write_text(json.dumps({"architectures": ["Toy"]}))
    loaded = load_draft(bundle, target, bundle=True)
    assert loaded is not None and _proposals(loaded, target) == _proposals(draft, target)
    plain = tmp_path / "plain"
    plain.mkdir()
    mx.save_safetensors(str(plain / "model.safetensors"), {"w": mx.zeros((2,))})
    (plain / "config.json").write_text(json.dumps({"architectures": ["Toy"]}))
    assert load_draft(plain, target, bundle=True) is None


def test_a_draft_with_its_own_head_uses_it(tmp_path):
    target = _target()
    config = random_draft_config(target, "DFlashDraftModel", layers=1, block_size=4, taps=[0])
    draft = random_draft(target, "DFlashDraftModel", layers=1, block_size=4, taps=[0])
    weights = dict(tree_flatten(draft.parameters()))
    head = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    weights["lm_head.weight"] = mx.array(head)
    folder = tmp_path / "own-head"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_draft(folder, target)
    assert loaded.own_head and not loaded.own_embedding
    hidden = mx.ones((1, 16))
    np.testing.assert_allclose(np.array(loaded.raw_logits(hidden)), np.array(hidden) @ head.T,
                               rtol=1e-5)


def test_broken_drafts_get_one_clear_error(tmp_path):
    target = _target()
    config = random_draft_config(target, "DFlashDraftModel", layers=1, block_size=4, taps=[0])
    draft = random_draft(target, "DFlashDraftModel", layers=1, block_size=4, taps=[0])

    unknown = _write_draft(tmp_path / "unknown", draft, dict(config, architectures=["Nope"]))
    with pytest.raises(UnknownNameError, match="unknown draft 'Nope'"):
        load_draft(unknown, target)

    bad_taps = dict(config, dflash_config={**config["dflash_config"], "target_layer_ids": [3]})
    with pytest.raises(DraftConfigError, match="outside the target's 1 layers"):
        load_draft(_write_draft(tmp_path / "taps", draft, bad_taps), target)

    missing = tmp_path / "missing"
    _write_draft(missing, draft, config)
    weights = dict(tree_flatten(draft.parameters()))
    del weights["fc.weight"]
    mx.save_safetensors(str(missing / "model.safetensors"), weights)
    with pytest.raises(ModelFolderError, match="missing tensor 'fc.weight'"):
        load_draft(missing, target)

    with pytest.raises(ModelFolderError, match="draft folder not found"):
        load_draft(tmp_path / "nowhere", target)


def test_load_finds_the_draft_folder_and_generate_uses_it(tmp_path):
    pytest.importorskip("mlxrunner_example_architecture",
                        reason="the example-architecture plugin is not installed")
    from mlxrunner_test_support import write_model_folder

    folder = write_model_folder(tmp_path / "model")
    target = mlxrunner.load_model(folder)
    config = random_draft_config(target, "DFlash2DraftModel", layers=1, block_size=4)
    draft = random_draft(target, "DFlash2DraftModel", layers=1, block_size=4)
    _write_draft(folder / "draft", draft, config)
    bundle = mlxrunner.load(folder)
    assert type(bundle.draft).__name__ == "DFlash2DraftModel"
    prompt = [5, 6, 7, 8]
    result = mlxrunner.generate(bundle.model, prompt, options=GREEDY, max_tokens=24,
                                draft=bundle.draft)
    assert result.tokens == plain_tokens(bundle.model, prompt, 24)
    assert result.stats.as_dict()["mode"] == "speculative" and result.stats.rounds > 0
    tokens, _ = speculative_tokens(bundle.model, bundle.draft, prompt, 24)
    assert tokens == result.tokens


def test_a_bfloat16_draft_computes_in_the_targets_dtype(tmp_path):
    """A draft stored in bfloat16 (as train-draft saves it) beside a float32 target runs in
    float32: on a CPU the bfloat16 draft missed the host's float32 products and made each
    round of the default model about three times dearer (bench/speculative.py)."""
    pytest.importorskip("mlxrunner_example_architecture",
                        reason="the example-architecture plugin is not installed")
    from mlxrunner_test_support import write_model_folder

    folder = write_model_folder(tmp_path / "model")
    target = mlxrunner.load_model(folder)
    assert target.dtype == mx.float32
    config = random_draft_config(target, "DFlash2DraftModel", layers=1, block_size=4)
    draft = random_draft(target, "DFlash2DraftModel", layers=1, block_size=4)
    draft.set_dtype(mx.bfloat16)
    _write_draft(folder / "draft", draft, config)
    assert load_draft(folder / "draft", target).compute_dtype == mx.bfloat16  # as stored
    bundle = mlxrunner.load(folder)
    assert bundle.draft.compute_dtype == mx.float32
    prompt = [5, 6, 7, 8]
    result = mlxrunner.generate(bundle.model, prompt, options=GREEDY, max_tokens=16,
                                draft=bundle.draft)
    assert result.tokens == plain_tokens(bundle.model, prompt, 16)
