"""The MTP head a Qwen3.5 checkpoint carries, as the ``Qwen3_5MTP`` draft.

The fixture (mtp_fixtures/tiny_mtp, written by make_mtp_fixtures.py) is a tiny
``Qwen3_5ForCausalLM`` from transformers' ``save_pretrained`` with random ``mtp.*`` tensors
of the published names and shapes added to its safetensors (transformers builds no MTP
head); its reference logits come from transformers' own modules (a one-layer
``Qwen3_5TextModel`` as the head's layer, ``Qwen3_5RMSNorm`` for its norms). Float32 on the
CPU throughout:

- the head's logits, committed rows and chained steps alike, match the reference
  (max abs error < 1e-4);
- the session's cache after every round holds what a fresh head computes over the
  committed tokens, whatever the accepted length (max abs error < 2e-5 times the largest
  |value|), driven by hand and through the real loop, and its proposals are that fresh
  head's greedy chain;
- greedy speculative output equals plain greedy output over 200 tokens, with the depth
  controller and with a fixed depth of 3;
- sampled output follows plain decoding's exact distribution (chi-square, p > 0.001) on a
  small-vocabulary target, where the random head's proposals are accepted at times (and
  the same check fails for a round that skips the residual);
- the folder uses the head as its draft unless told not to, and ``show`` names it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlxrunner_qwen3_5.mtp import MTPSession, Qwen3_5MTP

import mlxrunner
from mlxrunner import SamplerOptions
from mlxrunner.plugin import DraftProposal, KVCache, Sampler
from mlxrunner.testing.speculative import (
    build_draft,
    check_speculative_greedy,
    check_speculative_sampled,
    plain_tokens,
    randomize,
    speculative_tokens,
)

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "mtp_fixtures" / "tiny_mtp"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def bundle() -> Any:
    return mlxrunner.load(FOLDER)


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


def prompt_of(reference: dict[str, np.ndarray]) -> list[int]:
    return [int(t) for t in reference["ids"][0]]


def target_states(model: Any, tokens: list[int], tap: int) -> mx.array:
    _, tapped = model(mx.array([tokens], dtype=mx.int32), model.make_cache(), taps=[tap])
    return tapped


def fresh_rows(draft: Qwen3_5MTP, tokens: list[int]) -> tuple[list[KVCache], mx.array]:
    """A fresh head over a committed sequence: its cache and output at the last row."""
    caches = [KVCache()]
    hidden = target_states(draft.target, tokens, draft.taps[0])
    out = draft.step(hidden[:, :-1], mx.array([tokens[1:]], dtype=mx.int32), caches)
    return caches, out[:, -1:]


def greedy_chain(draft: Qwen3_5MTP, tokens: list[int], n: int) -> list[int]:
    caches, out = fresh_rows(draft, tokens)
    chain: list[int] = []
    for i in range(n):
        if i:
            out = draft.step(out, mx.array([[chain[-1]]], dtype=mx.int32), caches)
        chain.append(int(mx.argmax(draft.logits(out)[0, -1])))
    return chain


# -- the head's math ----------------------------------------------------------------------


def test_head_logits_match_transformers_modules(bundle, reference):
    draft, model = bundle.draft, bundle.model
    prompt = prompt_of(reference)
    want = reference["logits"]
    hidden = target_states(model, prompt, draft.taps[0])
    caches = [KVCache()]
    out = draft.step(hidden[:, :-1], mx.array([prompt[1:]], dtype=mx.int32), caches)
    rows = len(prompt) - 1
    err = float(mx.abs(draft.logits(out)[0] - mx.array(want[:rows])).max())
    assert err < TOLERANCE, f"committed rows: max |error| {err:.3g}"
    for k, token in enumerate(int(t) for t in reference["chain_tokens"]):
        logits = draft.logits(out[:, -1:])[0, -1]
        assert int(mx.argmax(logits)) == token, f"chained step {k}"
        out = draft.step(out[:, -1:], mx.array([[token]], dtype=mx.int32), caches)
        err = float(mx.abs(draft.logits(out)[0, -1] - mx.array(want[rows + k])).max())
        assert err < TOLERANCE, f"chained step {k + 1}: max |error| {err:.3g}"


def test_head_reads_the_published_names_and_shapes(bundle):
    from safetensors import safe_open

    hidden = bundle.model.hidden_size
    with safe_open(str(FOLDER / "model.safetensors"), "np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("mtp.")}
    assert shapes["mtp.fc.weight"] == (hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert shapes[f"mtp.{norm}.weight"] == (hidden,)
    assert "mtp.layers.0.self_attn.q_proj.weight" in shapes
    assert "mtp.layers.0.mlp.down_proj.weight" in shapes
    # the target itself keeps none of them
    assert not any("mtp" in name for name, _ in bundle.model.parameters().items())


# -- the session's bookkeeping ------------------------------------------------------------


def assert_cache_equals(got: KVCache, want: KVCache) -> None:
    assert got.offset == want.offset
    n = got.offset
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        assert a is not None and b is not None
        err = float(mx.abs(a[..., :n, :] - b[..., :n, :]).max())
        # the target states come from forwards of other lengths, which round differently
        tolerance = 2e-5 * max(1.0, float(mx.abs(b[..., :n, :]).max()))
        assert err < tolerance, f"head cache differs from a fresh head's: {err:.3g}"


@pytest.mark.parametrize("accepted_lengths", [[0, 1, 2, 3, 0, 3, 1], [3, 3, 2, 0, 0, 1]])
def test_session_cache_after_each_round_is_a_fresh_heads(bundle, reference, accepted_lengths):
    """Rounds driven by hand with every accepted length: the cache after each commit and
    every proposal equal those of a fresh head over the committed tokens."""
    draft, model = bundle.draft, bundle.model
    tokens = prompt_of(reference)
    rng = np.random.default_rng(0)
    session = draft.new_session(Sampler(SamplerOptions(temperature=0.0), model.vocab_size))
    session.extend_tokens(tokens)
    session.prefill(target_states(model, tokens, draft.taps[0]))
    current = int(rng.integers(0, model.vocab_size))
    session.extend_tokens([current])
    tokens.append(current)
    for accepted in accepted_lengths:
        pos = len(tokens) - 1
        proposal = session.propose(current, pos, 3)
        drafts = [int(t) for t in proposal.tokens.tolist()]
        assert drafts == greedy_chain(draft, tokens, 3)
        fix = int(rng.integers(0, model.vocab_size))
        emitted = drafts[:accepted] + [fix]
        hidden = target_states(model, tokens + drafts, draft.taps[0])
        session.extend_tokens(emitted)
        session.commit(hidden[:, pos:pos + accepted + 1])
        tokens += emitted
        current = fix
        want, _ = fresh_rows(draft, tokens)
        assert_cache_equals(session.caches[0], want[0])


def test_session_through_the_loop_with_every_accepted_length(bundle, reference, monkeypatch):
    """The real loop with proposals scripted from the plain continuation (the first wrong
    one cycling through the positions, as ``ScriptedDraft`` does) while the head runs as
    usual underneath: after every commit its cache is a fresh head's over the committed
    tokens, and the output is plain decoding's."""
    model, draft = bundle.model, bundle.draft
    prompt = prompt_of(reference)
    plain = plain_tokens(model, prompt, 60)
    script = prompt + plain
    rounds = [0]
    commits = [0]
    propose, commit = MTPSession.propose, MTPSession.commit

    def scripted_propose(self: MTPSession, current: int, pos: int, n: int) -> DraftProposal:
        propose(self, current, pos, n)
        tokens = [script[pos + 1 + i] for i in range(n)]
        wrong = rounds[0] % (n + 1)
        if wrong < n:
            tokens[wrong] = (tokens[wrong] + 1) % model.vocab_size
        rounds[0] += 1
        return DraftProposal.point_mass(mx.array(tokens, dtype=mx.int32))

    def checked_commit(self: MTPSession, tapped: mx.array) -> None:
        commit(self, tapped)
        want, _ = fresh_rows(draft, self.tokens)
        assert_cache_equals(self.caches[0], want[0])
        commits[0] += 1

    monkeypatch.setattr(MTPSession, "propose", scripted_propose)
    monkeypatch.setattr(MTPSession, "commit", checked_commit)
    tokens, stats = speculative_tokens(model, draft, prompt, 60, depth=3)
    assert tokens == plain
    assert set(stats.accepted_lengths) == {0, 1, 2, 3}
    assert commits[0] == stats.rounds - 1  # every round but the one that ends the budget


def test_session_refuses_a_round_it_is_not_at(bundle, reference):
    draft, model = bundle.draft, bundle.model
    tokens = prompt_of(reference)
    session = draft.new_session(Sampler(SamplerOptions(temperature=0.0), model.vocab_size))
    session.extend_tokens(tokens)
    session.prefill(target_states(model, tokens, draft.taps[0]))
    session.extend_tokens([5])
    with pytest.raises(ValueError, match="round is at"):
        session.propose(5, len(tokens) + 1, 2)
    with pytest.raises(ValueError, match="drafts 1..3"):
        session.propose(5, len(tokens), 4)


# -- exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [None, 3])
def test_greedy_speculative_equals_plain_over_200_tokens(bundle, depth):
    stats = check_speculative_greedy(bundle.model, draft_factory=lambda target: bundle.draft,
                                     max_tokens=200, prompts=2, prompt_len=8, depth=depth,
                                     random_drafts=False, scripted=False)
    assert all(s.generated_tokens == 200 and s.drafted > 0 for s in stats)
    if depth == 3:  # every round drafts 3 (fewer only where the budget ends)
        assert all(max(s.depths, key=s.depths.get) == 3 for s in stats)


def test_the_head_drafts_in_a_batch_as_it_does_alone(bundle):
    """Drafted rows in one continuous batch (greedy and seeded, beside an undrafted row)
    give each prompt's solo output; the head drafted there."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, bundle.model.vocab_size, n).tolist() for n in (8, 5, 11)]
    options = [SamplerOptions(temperature=0), SamplerOptions(temperature=0.8, seed=3),
               SamplerOptions(temperature=0)]
    drafts = [bundle.draft, bundle.draft, None]
    alone = [mlxrunner.generate(bundle.model, p, options=o, max_tokens=12, draft=d)
             for p, o, d in zip(prompts, options, drafts)]
    together = mlxrunner.generate_batch(bundle.model, prompts, options=options, max_tokens=12,
                                        draft=drafts)
    for a, t in zip(alone, together):
        assert t.tokens == a.tokens
    assert together[0].stats.drafted > 0 and together[1].stats.drafted > 0


SMALL = dict(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
             linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
             tie_word_embeddings=True, mtp_num_hidden_layers=1,
             architectures=["Qwen3_5ForCausalLM"])


def small_target_and_head(seed: int = 0) -> tuple[Any, Qwen3_5MTP]:
    target = mlxrunner.build_model(dict(SMALL))
    randomize(target, seed)
    target.eval()
    draft = build_draft(Qwen3_5MTP, dict(SMALL), target)
    randomize(draft, seed + 1)
    draft.eval()
    return target, draft


@pytest.mark.parametrize("options", [
    SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplerOptions(temperature=0.8, top_k=8, top_p=0.9, repeat_penalty=1.3),
])
def test_sampled_output_follows_plain_decoding(options):
    target, draft = small_target_and_head()
    result = check_speculative_sampled(target, draft, options, prompt=[1, 2, 3], runs=600,
                                       length=3, depth=3)
    assert result["acceptance_rate"] > 0.02  # the residual and the bonus paths both ran


def test_the_sampled_check_catches_a_round_without_the_residual(monkeypatch):
    target, draft = small_target_and_head()
    monkeypatch.setattr(Sampler, "residual", lambda self, p, q: p)
    with pytest.raises(AssertionError, match="do not follow plain decoding"):
        check_speculative_sampled(target, draft, SamplerOptions(temperature=1.0, top_k=0,
                                                                top_p=1.0, min_p=0.0),
                                  prompt=[1, 2, 3], runs=600, length=3, depth=3)


# -- choosing the draft -------------------------------------------------------------------


def test_folder_uses_its_mtp_head_unless_told_not_to(bundle, tmp_path):
    assert isinstance(bundle.draft, Qwen3_5MTP)
    assert bundle.draft.taps == (bundle.model.num_layers - 1,)
    assert mlxrunner.load(FOLDER, use_draft=False).draft is None
    # a folder without mtp.* tensors has no draft
    plain = tmp_path / "no_mtp"
    shutil.copytree(FOLDER, plain)
    weights = mx.load(str(plain / "model.safetensors"))
    mx.save_safetensors(str(plain / "model.safetensors"),
                        {k: v for k, v in weights.items() if not k.startswith("mtp.")})
    assert mlxrunner.load(plain).draft is None


def test_a_misshapen_head_is_one_clear_error(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(FOLDER, broken)
    weights = dict(mx.load(str(broken / "model.safetensors")))
    weights["mtp.fc.weight"] = weights["mtp.fc.weight"][:, :8]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(mlxrunner.errors.ModelFolderError, match="mtp.fc.weight|fc.weight"):
        mlxrunner.load(broken)


@pytest.mark.parametrize("setting,match", [({"mtp_num_hidden_layers": 2}, "supports "
                                             "mtp_num_hidden_layers 1"),
                                            ({"mtp_use_dedicated_embeddings": True},
                                             "dedicated")])
def test_heads_of_other_shapes_are_refused_in_one_line(setting, match):
    target, _ = small_target_and_head()
    with pytest.raises(mlxrunner.errors.DraftConfigError, match=match):
        build_draft(Qwen3_5MTP, dict(SMALL, **setting), target)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_show_and_stats_name_the_draft(tmp_path):
    label = "mtp (built into the checkpoint)"
    info = json.loads(cli("show", str(FOLDER), "--json", cwd=tmp_path).stdout)
    assert info["draft"] == label
    assert any(line.split(None, 1) == ["draft", label]
               for line in cli("show", str(FOLDER), cwd=tmp_path).stdout.splitlines())
    run = cli("run", str(FOLDER), "hello", "--raw", "--temperature", "0", "--max-tokens", "12",
              "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout)["statistics"]["run"]
    assert stats["mode"] == "speculative" and stats["draft"] == label
    off = cli("run", str(FOLDER), "hello", "--raw", "--temperature", "0", "--max-tokens", "12",
              "--json", "--no-draft", cwd=tmp_path)
    assert off.returncode == 0, off.stderr
    plain = json.loads(off.stdout)
    assert plain["statistics"]["run"]["mode"] == "plain"
    assert plain["tokens"] == json.loads(run.stdout)["tokens"]


# -- a mixture-of-experts target ------------------------------------------------------------


def moe_target(base: dict) -> tuple[dict, object]:
    """A tiny qwen3_5_moe config over ``base`` and its target (skipped without the MoE)."""
    config = dict(base, architectures=["Qwen3_5MoeForCausalLM"], num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=8,
                  shared_expert_intermediate_size=8)
    try:
        return config, mlxrunner.build_model(config)
    except mlxrunner.errors.UnknownNameError:
        pytest.skip("this Qwen3.5 plugin has no qwen3_5_moe architecture")


def test_a_moe_target_gets_a_head_with_its_experts():
    """The head of a qwen3_5_moe target: its layer's feed-forward block is the target's
    experts, and per-expert checkpoint tensors are packed by the target's own sanitize."""
    config, target = moe_target(SMALL)
    draft = build_draft(Qwen3_5MTP, config, target)
    assert type(draft.layers[0].mlp) is type(target.layers[-1].mlp)
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(0)
    want = dict(tree_flatten(draft.parameters()))
    stored: dict[str, mx.array] = {}
    for name, value in want.items():
        if ".experts." in name:
            continue
        stored[f"mtp.{name}"] = mx.array(rng.standard_normal(value.shape).astype(np.float32))
    hidden, inner = config["hidden_size"], config["moe_intermediate_size"]
    for e in range(config["num_experts"]):
        for proj, shape in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden)),
                            ("down_proj", (hidden, inner))):
            stored[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"] = mx.array(
                rng.standard_normal(shape).astype(np.float32))
    sanitized = draft.sanitize(stored)
    assert set(sanitized) == set(want)
    assert all(sanitized[k].shape == want[k].shape for k in want)


def test_a_moe_config_without_a_dense_width_gets_a_head():
    """Mixture-of-experts configs need no ``intermediate_size`` (every layer sparse): the
    head's layer is built with the target's experts, not a dense MLP of width 0."""
    config, target = moe_target({k: v for k, v in SMALL.items() if k != "intermediate_size"})
    draft = build_draft(Qwen3_5MTP, config, target)
    assert type(draft.layers[0].mlp) is type(target.layers[-1].mlp)


# -- the fixture ----------------------------------------------------------------------------


def make_mtp_fixtures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("qwen3_5_make_mtp_fixtures",
                                                  HERE / "make_mtp_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.reference
def test_regenerated_fixture_matches_the_committed_one(tmp_path, reference):
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    folder = tmp_path / "tiny_mtp"
    make_mtp_fixtures().write_fixture(folder)
    with np.load(folder / "reference.npz") as fresh:
        for key, value in reference.items():
            # within the parity tolerance: another CPU sums float32 in another order
            # (seen up to 1.5e-5 between two machines)
            np.testing.assert_allclose(fresh[key], value, atol=TOLERANCE, err_msg=key)
    assert json.loads((folder / "config.json").read_text()) == \
        json.loads((FOLDER / "config.json").read_text())
