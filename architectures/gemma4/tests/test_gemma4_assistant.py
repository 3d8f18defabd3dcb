"""Gemma 4 assistant drafts (``Gemma4AssistantForCausalLM``): transformers parity of a step,
exact greedy and sampled speculative decoding, the ways a draft is attached, bad drafts.

Fixtures (tests/make_assistant_fixtures.py): transformers' own ``Gemma4AssistantForCausalLM``
built with random weights and written by ``save_pretrained`` (so the tensors have the
published names and shapes), with and without ordered embeddings, paired with the committed
``e2b`` target (vocabulary 128, KV sharing) or a ``small`` one (vocabulary 32, for the
chi-square test's exact enumeration). ``reference.npz`` holds transformers' logits and
projected states of three chained steps after each prompt, driven as its candidate
generator drives them: ``inputs_embeds = concat(target embedding of the token, state)``,
``position_ids`` = the prompt length, ``shared_kv_states`` from the target's forward over
the prompt, cut to what the target's caches hold (every full-attention position, the last
``sliding_window`` sliding ones). We compute the same step from our target's own caches.
Tolerance: float32 on the CPU both sides, logits O(1), max abs error < 1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrunner
from mlxrunner import DraftConfigError, ModelFolderError, SamplerOptions
from mlxrunner.plugin import DraftModel, Model, Sampler
from mlxrunner.testing.speculative import (
    ToyTarget,
    build_draft,
    check_speculative_greedy,
    check_speculative_sampled,
    chi_square,
    plain_tokens,
    speculative_tokens,
)

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ASSISTANT = FIXTURES / "assistant"
TARGET_OF = {"e2b_plain": "e2b", "e2b_ordered": "e2b", "small_plain": "small",
             "small_ordered": "small"}
TARGET_FIXTURES = {"e2b": FIXTURES / "e2b", "small": ASSISTANT / "small_target"}
NAMES = tuple(TARGET_OF)
LENGTHS = (1, 9, 20)
TOLERANCE = 1e-4
GREEDY = SamplerOptions(temperature=0.0)


def reference(name: str, folder: Path = ASSISTANT) -> dict[str, np.ndarray]:
    with np.load(folder / name / "reference.npz") as data:
        return dict(data)


def _model_folder(src: Path, folder: Path) -> Path:
    """A target fixture as a model folder mlxrunner.load takes (with a tokenizer)."""
    from mlxrunner_test_support import write_tokenizer

    shutil.copytree(src, folder)
    (folder / "reference.npz").unlink(missing_ok=True)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4_targets")
    return {name: _model_folder(src, root / name) for name, src in TARGET_FIXTURES.items()}


def attach(models: dict[str, Path], draft: Path, target: str = "e2b"):
    """(target, draft) as ``mlxrunner.load(folder, draft=...)`` gives them (``--draft``)."""
    bundle = mlxrunner.load(models[target], draft=draft)
    return bundle.model, bundle.draft


@pytest.fixture(scope="module")
def pairs(models) -> dict[str, tuple[Model, DraftModel]]:
    return {name: attach(models, ASSISTANT / name, target) for name, target in TARGET_OF.items()}


def chained_steps(target, draft, prompt: np.ndarray, token: int, steps: int):
    """Our target over the prompt (through its caches), then ``steps`` greedy draft steps
    read from those caches: (dense logits [steps, V], projected states [steps, backbone])."""
    caches = target.make_cache()
    _, tapped = target(mx.array(prompt)[None], caches, taps=[target.num_layers - 1])
    state = draft.seed_state(tapped)
    kv = draft.target_kv(target.shared_caches(), len(prompt), mx.float32)
    current = mx.array([token], dtype=mx.int32)
    logits, states = [], []
    for _ in range(steps):
        out, state = draft.step(current, state, len(prompt), kv)
        row = draft.logits(out)
        logits.append(row[0])
        states.append(state[0, 0])
        current = mx.argmax(row, axis=-1).astype(mx.int32)
    return np.array(mx.stack(logits)), np.array(mx.stack(states))


def assert_matches(name: str, ref: dict[str, np.ndarray], logits: np.ndarray,
                   states: np.ndarray, length: int) -> None:
    expected = ref[f"logits_{length}"]
    if "ordered" in name:
        # transformers fills the tokens outside the chosen centroids with min - 1; we use -inf
        scored = np.isfinite(logits)
        assert (scored == (expected > expected.min(axis=-1, keepdims=True))).all()
        assert 0 < scored.sum(axis=-1).min() < logits.shape[-1]
    else:
        scored = np.ones(logits.shape, dtype=bool)
    assert np.abs(logits[scored] - expected[scored]).max() < TOLERANCE
    assert np.abs(states - ref[f"hidden_{length}"]).max() < TOLERANCE
    assert (np.where(scored, logits, -np.inf).argmax(-1) == expected.argmax(-1)).all()


def test_assistant_fixtures_have_the_published_layout():
    for name in NAMES:
        folder = ASSISTANT / name
        assert sum(p.stat().st_size for p in folder.iterdir()) < 500_000
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["Gemma4AssistantForCausalLM"]
        text = config["text_config"]
        assert text["num_kv_shared_layers"] == text["num_hidden_layers"]
        names = set(mx.load(str(folder / "model.safetensors")))
        attention = {n.split(".self_attn.")[1] for n in names if ".self_attn." in n}
        assert attention == {"q_proj.weight", "q_norm.weight", "o_proj.weight"}
        assert {"pre_projection.weight", "post_projection.weight", "model.embed_tokens.weight",
                "model.norm.weight", "model.layers.0.layer_scalar"} <= names
        assert ("masked_embedding.centroids.weight" in names) == config["use_ordered_embeddings"]
        assert "lm_head.weight" not in names  # tied


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", LENGTHS)
def test_assistant_steps_match_transformers(pairs, name, length):
    """(a) Three chained steps after prompts of 1, 9 and 20 tokens (the target's sliding
    window is 8: its ring has wrapped)."""
    target, draft = pairs[name]
    ref = reference(name)
    logits, states = chained_steps(target, draft, ref[f"ids_{length}"],
                                   int(ref[f"token_{length}"]), steps=3)
    assert_matches(name, ref, logits, states, length)


@pytest.mark.parametrize("name", NAMES)
def test_a_greedy_round_proposes_transformers_tokens(pairs, name):
    """The session, fed as the speculative loop feeds it, proposes the argmax chain of
    transformers' steps."""
    target, draft = pairs[name]
    ref = reference(name)
    prompt, token = ref["ids_20"], int(ref["token_20"])
    caches = target.make_cache()
    session = draft.new_session(Sampler(GREEDY, target.vocab_size))
    for chunk in (prompt[:13], prompt[13:]):  # a prefill in two chunks
        _, tapped = target(mx.array(chunk)[None], caches, taps=list(draft.taps))
        session.prefill(tapped)
    proposal = session.propose(token, len(prompt), 3)
    assert proposal.tokens.tolist() == ref["logits_20"].argmax(-1).tolist()
    # nothing of the round stays: the same round again proposes the same tokens
    assert session.propose(token, len(prompt), 3).tokens.tolist() == proposal.tokens.tolist()


@pytest.mark.parametrize("name", ["e2b_plain", "e2b_ordered"])
def test_greedy_speculative_output_equals_plain_output(pairs, name):
    """(b) 200 tokens on two prompts at the depth the controller chooses, one at depth 4
    (the fixture drafts are rarely right: next test for accepted drafts)."""
    target, draft = pairs[name]
    runs = check_speculative_greedy(target, lambda _: draft, max_tokens=200, prompts=2,
                                    prompt_len=8, scripted=False, random_drafts=False)
    runs += check_speculative_greedy(target, lambda _: draft, max_tokens=200, prompts=1,
                                     seed=4, depth=4, scripted=False, random_drafts=False)
    assert all(s.drafted > 0 and s.rounds > 0 for s in runs)


def _repeating(draft, target) -> None:
    """Weights under which every step proposes ``current`` again: the first half of
    ``pre_projection`` a random map R of the target's embedding, the state half zero, every
    layer's ``o_proj`` and ``down_proj`` zero (each layer passes its input on), and the tied
    head's rows ``rms_norm(R e_j)``: the logit of token j is the dot product of two vectors
    of one norm, largest at j = ``current``. The tiny targets' greedy output repeats tokens
    often (and not always), so rounds accept every number of drafts."""
    backbone, hidden = draft.assistant.backbone_hidden_size, draft.args.hidden_size
    rng = np.random.default_rng(0)
    project = mx.array(rng.standard_normal((hidden, backbone)).astype(np.float32))
    table = target.embed_tokens(mx.arange(target.vocab_size))
    rows = table @ project.T
    rows = rows * mx.rsqrt(mx.mean(rows * rows, axis=-1, keepdims=True) + 1e-6)
    weights = {"pre_projection.weight": mx.concatenate(
                   [project, mx.zeros((hidden, backbone))], axis=1),
               "model.embed_tokens.weight": rows,
               "model.norm.weight": mx.ones((hidden,))}
    for i, layer in enumerate(draft.model.layers):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"] = \
            mx.zeros(layer.self_attn.o_proj.weight.shape)
        weights[f"model.layers.{i}.mlp.down_proj.weight"] = \
            mx.zeros(layer.mlp.down_proj.weight.shape)
        weights[f"model.layers.{i}.layer_scalar"] = mx.ones((1,))
    draft.load_weights(list(weights.items()), strict=False)


def test_greedy_speculative_output_equals_plain_output_when_drafts_are_accepted(models):
    """(b) with a draft that is often right: every accepted length and rollback point
    occurs, 200 tokens, the controller's depth and depth 4."""
    target, draft = attach(models, ASSISTANT / "e2b_plain")
    _repeating(draft, target)
    prompts = [np.random.default_rng(seed).integers(3, 128, 8) for seed in (1, 2)]
    runs = []
    for depth in (None, 4):
        runs += check_speculative_greedy(target, lambda _: draft, np.stack(prompts),
                                         max_tokens=200, depth=depth, scripted=False,
                                         random_drafts=False)
    assert sum(s.accepted for s in runs) > 100
    seen = set().union(*(s.accepted_lengths for s in runs))
    assert set(range(5)) <= seen, seen


@pytest.mark.parametrize("name", ["small_plain", "small_ordered"])
def test_sampled_output_follows_plain_decoding(pairs, name):
    """(c) 400 seeded generations at depth 3: the first tokens follow plain decoding's exact
    distribution (chi-square, p > 0.001); the ordered draft's q is sparse over its
    candidates."""
    target, draft = pairs[name]
    options = SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    result = check_speculative_sampled(target, draft, options, prompt=[5, 9, 3], runs=400,
                                       depth=3)
    assert 0.02 < result["acceptance_rate"] < 0.95


def _proposal_fit(target, draft, name: str) -> float:
    """The p-value of 3000 one-token proposals of one round against the q the session
    records for that row."""
    prompt = [5, 9, 3, 7]
    caches = target.make_cache()
    session = draft.new_session(Sampler(SamplerOptions(temperature=0.7, seed=1),
                                        target.vocab_size))
    _, tapped = target(mx.array(prompt)[None], caches, taps=list(draft.taps))
    session.prefill(tapped)
    first = session.propose(11, len(prompt), 3)
    if "ordered" in name:
        groups = 32 // 8 * 3  # centroid_intermediate_top_k groups of vocab / num_centroids
        assert first.ids is not None and first.ids.shape == (3, groups)
    q = np.array(first.distribution().dense(target.vocab_size)[0], dtype=np.float64)
    assert abs(q.sum() - 1) < 1e-5 and (q > 0).sum() > 4
    assert (q > 0).sum() == (groups if "ordered" in name else target.vocab_size)
    counts = np.zeros(target.vocab_size)
    for _ in range(3000):
        counts[int(session.propose(11, len(prompt), 1).tokens[0])] += 1
    return chi_square(counts, q)[2]


@pytest.mark.parametrize("name", ["small_plain", "small_ordered"])
def test_proposals_are_drawn_from_the_q_they_record(pairs, name):
    """q_i is what the token was drawn from (chi-square, p > 0.001); the ordered draft's q is
    sparse over its candidates."""
    target, draft = pairs[name]
    assert _proposal_fit(target, draft, name) > 1e-3


def test_the_q_check_catches_draws_from_another_distribution(pairs, monkeypatch):
    from mlxrunner_gemma4.assistant import AssistantSession

    draw = AssistantSession.draw

    def sharper(self, probs, ids=None):
        q = probs ** 1.3
        return draw(self, q / q.sum(axis=-1, keepdims=True), ids)

    monkeypatch.setattr(AssistantSession, "draw", sharper)
    target, draft = pairs["small_ordered"]
    assert _proposal_fit(target, draft, "small_ordered") < 1e-6


# -- attaching ------------------------------------------------------------------------------


def _copy_draft(name: str, to: Path) -> Path:
    shutil.copytree(ASSISTANT / name, to)
    (to / "reference.npz").unlink()
    return to


def test_the_assistant_attaches_as_any_draft(tmp_path):
    folder = _model_folder(FIXTURES / "e2b", tmp_path / "model")
    prompt = [5, 6, 7, 8, 40, 41]
    plain = plain_tokens(mlxrunner.load_model(folder), prompt, 40)

    elsewhere = _copy_draft("e2b_ordered", tmp_path / "assistant")
    (folder / "Modelfile").write_text(f"FROM .\nDRAFT {elsewhere}\n")
    from_modelfile = mlxrunner.load(folder)
    (folder / "Modelfile").unlink()
    _copy_draft("e2b_plain", folder / "draft")
    from_folder = mlxrunner.load(folder)
    from_argument = mlxrunner.load(folder, draft=elsewhere)  # what --draft passes
    for bundle, ordered in ((from_folder, False), (from_modelfile, True),
                            (from_argument, True)):
        assert type(bundle.draft).__name__ == "Gemma4AssistantDraft"
        assert bundle.draft.assistant.ordered is ordered
        result = mlxrunner.generate(bundle.model, prompt, options=GREEDY, max_tokens=40,
                                    draft=bundle.draft)
        assert result.tokens == plain
        assert result.stats.as_dict()["draft"] == "Gemma4AssistantDraft"
    assert mlxrunner.load(folder, use_draft=False).draft is None


# -- bad drafts ------------------------------------------------------------------------------


def _edited_draft(tmp_path: Path, name: str, edit_config=None, edit_weights=None) -> Path:
    folder = _copy_draft(name, tmp_path / "bad")
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        weights = mx.load(str(folder / "model.safetensors"))
        edit_weights(weights)
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def test_a_draft_for_another_target_is_one_clear_error(tmp_path, models):
    with pytest.raises(DraftConfigError, match="vocabulary 128 differs from the target's 32"):
        attach(models, ASSISTANT / "e2b_plain", "small")

    def wider(config):
        config["backbone_hidden_size"] = 64

    with pytest.raises(DraftConfigError, match="hidden size 64 differs"):
        attach(models, _edited_draft(tmp_path, "e2b_plain", wider))
    from mlxrunner_gemma4.assistant import Gemma4AssistantDraft

    toy = ToyTarget({"vocab_size": 128, "hidden_size": 32, "seed": 0})
    config = json.loads((ASSISTANT / "e2b_plain" / "config.json").read_text())
    with pytest.raises(DraftConfigError, match="must be a Gemma 4 model"):
        build_draft(Gemma4AssistantDraft, config, toy)


def test_bad_assistant_configs_and_weights_are_one_clear_error(tmp_path, models):
    def head_dim(config):
        config["text_config"]["head_dim"] = 8

    with pytest.raises(DraftConfigError, match="head dim 8, the target's sliding_attention"):
        attach(models, _edited_draft(tmp_path / "a", "e2b_plain", head_dim))

    def centroids(config):
        config["num_centroids"] = 12

    with pytest.raises(DraftConfigError, match="12 centroids must divide"):
        attach(models, _edited_draft(tmp_path / "b", "e2b_ordered", centroids))

    def repeated_token(weights):
        ordering = np.array(weights["masked_embedding.token_ordering"])
        ordering[0] = ordering[1]
        weights["masked_embedding.token_ordering"] = mx.array(ordering)

    with pytest.raises(ModelFolderError, match="not an ordering of the 128 tokens"):
        attach(models, _edited_draft(tmp_path / "c", "e2b_ordered",
                                     edit_weights=repeated_token))

    def huge(config):
        config["num_assistant_tokens"] = 10**6

    with pytest.raises(ModelFolderError, match="num_assistant_tokens"):
        attach(models, _edited_draft(tmp_path / "d", "e2b_plain", huge))


def test_the_session_refuses_caches_of_another_generation(pairs):
    target, draft = pairs["e2b_plain"]
    caches = target.make_cache()
    session = draft.new_session(Sampler(GREEDY, target.vocab_size))
    _, tapped = target(mx.array([[5, 6, 7]]), caches, taps=list(draft.taps))
    target.make_cache()  # another generation's caches, made after this one's
    with pytest.raises(RuntimeError, match="not this generation's"):
        session.prefill(tapped)


def test_shared_caches_are_read_not_kept(pairs):
    """The target keeps weak references only: a finished generation's caches are freed."""
    target, _ = pairs["e2b_plain"]
    caches = target.make_cache()
    shared = target.shared_caches()
    assert shared is not None and set(shared) == {"sliding_attention", "full_attention"}
    assert all(any(c is s for c in caches) for s in shared.values())
    del caches, shared
    assert target.shared_caches() is None


def test_quantized_assistant_runs_exactly(tmp_path, models):
    """An 8-bit assistant (the projections whose input width MLX's group size of 32
    divides) loads from its folder and still decodes exactly."""
    import mlx.nn as nn

    folder = _copy_draft("e2b_ordered", tmp_path / "q8")
    _, fresh = attach(models, folder)
    nn.quantize(fresh, group_size=32, bits=8,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    assert type(fresh.pre_projection).__name__ != "Linear"
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(fresh.parameters())))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    target, loaded = attach(models, folder)
    assert loaded.weight_precision == "8-bit affine"
    prompt = [5, 6, 7, 8, 40, 41, 90, 3, 17]
    tokens, stats = speculative_tokens(target, loaded, prompt, 60)
    assert tokens == plain_tokens(target, prompt, 60) and stats.drafted > 0


@pytest.mark.reference
@pytest.mark.parametrize("name", ["e2b_ordered", "small_plain"])
def test_regenerated_assistant_fixture_matches(tmp_path, name):
    """Regenerate the draft and transformers' reference; we match it, and the committed
    fixture is what the script writes today."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location(
        "gemma4_make_assistant_fixtures", Path(__file__).with_name("make_assistant_fixtures.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    folder = maker.write_draft(name, tmp_path)
    target_folder = maker.target_folder(maker.DRAFTS[name][0], tmp_path)
    target, draft = attach({"t": _model_folder(target_folder, tmp_path / "t")}, folder, "t")
    fresh = reference(name, tmp_path / "assistant")
    for length in maker.PROMPT_LENGTHS:
        logits, states = chained_steps(target, draft, fresh[f"ids_{length}"],
                                       int(fresh[f"token_{length}"]), steps=maker.STEPS)
        assert_matches(name, fresh, logits, states, length)
    committed = reference(name)
    for key in fresh:
        # within the parity tolerance: another CPU sums float32 in another order
        # (seen up to 1.5e-5 between two machines)
        np.testing.assert_allclose(fresh[key], committed[key], rtol=0, atol=TOLERANCE)
