"""``train-draft`` (mlxrunner_dflash.train): masks, labels, the training forward against the
draft's own inference session, a short training run that must learn, and exact resume."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

train = pytest.importorskip("mlxrunner_dflash.train",
                            reason="the DFlash plugin (mlxrunner-dflash) is not installed")

from mlxrunner import SamplerOptions, load_model  # noqa: E402
from mlxrunner.plugin import Sampler  # noqa: E402
from mlxrunner.testing.speculative import ToyTarget, random_draft  # noqa: E402

mx.set_default_device(mx.cpu)


# -- anchors, masks, labels -------------------------------------------------------------------


def _mask_by_definition(anchors: np.ndarray, seq_len: int, bs: int, causal: bool,
                        window: int | None) -> np.ndarray:
    B, N = anchors.shape
    Q = N * bs
    out = np.zeros((B, 1, Q, seq_len + Q), dtype=bool)
    for b in range(B):
        for q in range(Q):
            n, r = divmod(q, bs)
            a = anchors[b, n]
            for j in range(seq_len):  # context rows: strictly before the anchor
                out[b, 0, q, j] = j < a and (window is None or (a + r) - j < window)
            for k in range(Q):  # block rows: own block only
                m, s = divmod(k, bs)
                out[b, 0, q, seq_len + k] = m == n and (not causal or s <= r)
    return out


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 3)])
def test_block_mask_sees_context_before_the_anchor_and_its_own_block(causal, window):
    rng = np.random.default_rng(1)
    anchors = train.sample_anchors(rng, batch=2, seq_len=12, block_size=3, count=4)
    assert (anchors >= 1).all() and (anchors <= 12 - 3).all()
    assert all(len(set(row)) == len(row) for row in anchors.tolist())
    got = train.block_attention_mask(anchors, 12, 3, causal=causal, window=window)
    np.testing.assert_array_equal(got, _mask_by_definition(anchors, 12, 3, causal, window))


def test_target_labels_count_only_while_the_corpus_follows_the_greedy_chain():
    ids = np.array([[10, 11, 12, 13, 14, 15, 16, 17]])
    greedy = np.array([[11, 12, 99, 14, 15, 16, 17, 18]])  # greedy[t]: the target's token after t
    anchors = np.array([[1, 3]])
    labels, valid = train.block_labels(ids, greedy, anchors, block_size=4, mode="target")
    # anchor 1: rows 1..3 label greedy[1], greedy[2], greedy[3] = 12, 99, 14; the corpus
    # token at 3 (13) is not greedy[2] (99), so row 3 (after it) is unknown.
    assert labels[0, 0].tolist() == [11, 12, 99, 14]
    assert valid[0, 0].tolist() == [False, True, True, False]
    # anchor 3: greedy 14, 15, 16 and the corpus agrees all along
    assert labels[0, 1].tolist() == [13, 14, 15, 16]
    assert valid[0, 1].tolist() == [False, True, True, True]
    labels, valid = train.block_labels(ids, greedy, anchors, block_size=4, mode="corpus")
    assert labels[0, 0].tolist() == [11, 12, 13, 14]
    assert valid[0, 0].tolist() == [False, True, True, True]


def test_anchors_where_allowed_fill_short_windows_with_weightless_slots():
    rng = np.random.default_rng(2)
    allowed = np.zeros((3, 16), dtype=bool)
    allowed[0, [0, 3, 5, 8, 12, 13]] = True  # 0 has no context, 13 no room (bs 4)
    allowed[1, :] = True
    anchors, real = train.sample_anchors_where(rng, allowed, block_size=4, count=3)
    assert set(anchors[0].tolist()) <= {3, 5, 8, 12} and real[0].all()
    assert len(set(anchors[1].tolist())) == 3 and real[1].all()
    assert (anchors[1] >= 1).all() and (anchors[1] <= 12).all()
    assert not real[2].any()  # nothing allowed: shape kept, no weight
    anchors, real = train.sample_anchors_where(rng, allowed[:1], block_size=4, count=6)
    assert sorted(anchors[0, real[0]].tolist()) == [3, 5, 8, 12]
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    greedy = np.array([[6, 7, 0, 9, 10, 11, 12, 13]])  # position 3 is not the target's pick
    assert train.in_target_text(ids, greedy).tolist() == [
        [False, True, True, False, True, True, True, True]]


def test_continuations_are_measured_only_up_to_their_first_eos():
    """Decoding stops at the stop token: the estimate's blocks anchor between the prompt and
    the first EOS of each continuation, and no label after that EOS counts (what the target
    writes past the end of its reply is no text a round ever verifies)."""
    vocab, bs = 64, 4
    target = ToyTarget({"vocab_size": vocab, "hidden_size": 32, "seed": 3})
    stream = np.random.default_rng(0).integers(0, vocab, size=200).astype(np.int32)
    settings = train.TrainSettings(target="", corpus=[], out="", batch=1, seq_len=40,
                                   prompt_len=8, anchors=6, eval_blocks=6, block_size=bs)
    plain = train.heldout_continuations(target, stream, settings, None)
    row = plain.sequences[0]
    assert plain.start.tolist() == [8] and plain.end.tolist() == [39]
    eos = int(row[20])  # a token of the continuation taken for EOS: it ends there
    first = 8 + int(np.flatnonzero(row[8:] == eos)[0])
    cut = train.heldout_continuations(target, stream, settings, eos)
    assert (cut.sequences == plain.sequences).all() and cut.end.tolist() == [first]
    after_start, live = cut.spans(slice(0, 1))
    _, greedy = train.target_forward(target, mx.array(cut.sequences), [0])
    greedy = np.array(greedy)
    allowed = train.in_target_text(cut.sequences, greedy) & after_start & live
    batch, anchors, labels, valid = train.make_batch(
        cut.sequences, greedy, np.random.default_rng(1), settings, 0,
        train.position_weights(bs, 2.0), False, None, allowed=allowed, live=live)
    rows = anchors[:, :, None] + np.arange(bs)
    assert (rows[valid] <= first).all() and valid[..., 1:].any()
    assert (anchors[valid[:, :, 1]] >= 8).all()
    assert (np.array(batch.weights)[~valid] == 0).all()


def test_position_weights_decay_from_the_first_draft_row():
    w = train.position_weights(5, gamma=2.0)
    np.testing.assert_allclose(w, [0.0, 1.0, np.exp(-0.5), np.exp(-1.0), np.exp(-1.5)],
                               rtol=1e-6)


def test_accepted_lengths_stop_at_the_first_miss_or_unknown_label():
    labels = np.array([[[0, 5, 6, 7, 8]]])
    valid = np.array([[[False, True, True, True, False]]])
    assert train.accepted_lengths(np.array([[[5, 6, 9, 8]]]), labels, valid).tolist() == [[2]]
    assert train.accepted_lengths(np.array([[[5, 6, 7, 8]]]), labels, valid).tolist() == [[3]]
    assert train.accepted_lengths(np.array([[[4, 6, 7, 8]]]), labels, valid).tolist() == [[0]]


def test_auto_taps_spread_to_the_last_layer():
    assert train.choose_taps(8, "auto") == [1, 4, 7]
    assert train.choose_taps(4, "auto") == [1, 3]
    assert train.choose_taps(36, "auto") == [1, 10, 18, 26, 35]
    assert train.choose_taps(8, "6,2") == [2, 6]
    with pytest.raises(train.TrainDraftError):
        train.choose_taps(8, "8")


def test_rope_at_positions_matches_mlx_rope():
    import mlx.nn as nn

    x = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    rope = nn.RoPE(8, traditional=False, base=10000.0)
    expected = rope(x, offset=7)
    got = train.rope_at(x, mx.array([[7, 8, 9, 10, 11]]), 10000.0)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5)


# -- the training forward is the inference forward -----------------------------------------------


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_training_forward_matches_the_drafts_inference_session(architecture):
    """Every block of one masked training forward equals a session's round at that anchor:
    the same hidden states (1e-5) and, greedily, the same proposals."""
    vocab, L, bs = 64, 20, 4
    target = ToyTarget({"vocab_size": vocab, "hidden_size": 32, "seed": 3})
    draft = random_draft(target, architecture, layers=2, block_size=bs, heads=4, kv_heads=2,
                         head_dim=8, seed=5, input_embedding_scale=1.5)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(2, L)).astype(np.int32)
    _, tapped = target(mx.array(ids), taps=list(draft.taps))
    anchors = train.sample_anchors(rng, 2, L, bs, 5)
    labels, _ = train.block_labels(ids, None, anchors, bs, "corpus")
    block_ids = np.full(labels.shape, draft.mask_token_id, dtype=np.int32)
    block_ids[:, :, 0] = labels[:, :, 0]
    hidden = train.draft_hidden_train(draft, tapped, mx.array(block_ids.reshape(2, -1)),
                                      mx.array(train.block_positions(anchors, bs)),
                                      mx.array(train.block_attention_mask(anchors, L, bs)))
    hidden = hidden.reshape(2, anchors.shape[1], bs, -1)
    proposals = np.array(train.greedy_proposals(draft, hidden, mx.array(labels[:, :, 0])))
    hidden = np.array(hidden)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            session = draft.new_session(Sampler(SamplerOptions(temperature=0), vocab))
            session.prefill(tapped[b:b + 1, :a])
            expected = np.array(session.block(int(ids[b, a]), a, bs - 1))
            np.testing.assert_allclose(hidden[b, n, 1:], expected, atol=1e-5, rtol=1e-5)
            session = draft.new_session(Sampler(SamplerOptions(temperature=0), vocab))
            session.prefill(tapped[b:b + 1, :a])
            proposal = session.propose(int(ids[b, a]), a, bs - 1)
            assert proposal.tokens.tolist() == proposals[b, n].tolist()


def test_compiled_training_step_matches_the_eager_step():
    """The mx.compile'd step (GPU default) takes the same steps as the eager one, learning
    rate changes between steps included."""
    import mlx.optimizers as optim

    vocab, L, bs = 64, 24, 4
    target = ToyTarget({"vocab_size": vocab, "hidden_size": 32, "seed": 3})
    settings = train.TrainSettings(target="", corpus=[], out="", batch=2, seq_len=L, anchors=3,
                                   block_size=bs, selector_weight=1.0)
    weights_by_row = train.position_weights(bs, bs / 2)
    losses: dict[bool, list[float]] = {}
    params: dict[bool, dict[str, np.ndarray]] = {}
    for compiled in (False, True):
        draft = random_draft(target, "DFlash2DraftModel", layers=1, block_size=bs, heads=4,
                             kv_heads=2, head_dim=8, seed=5)
        optimizer = optim.AdamW(learning_rate=1e-3)
        step = train.make_train_step(draft, optimizer, settings, compiled)
        rng = np.random.default_rng(0)
        losses[compiled] = []
        for i in range(3):
            ids = rng.integers(0, vocab, size=(2, L)).astype(np.int32)
            tapped, greedy = train.target_forward(target, mx.array(ids), list(draft.taps))
            batch, *_ = train.make_batch(ids, np.array(greedy), rng, settings,
                                         draft.mask_token_id, weights_by_row, False, None)
            optimizer.learning_rate = 1e-2 * (i + 1)
            loss, _ = step(tapped, batch)
            mx.eval(loss, draft.parameters(), optimizer.state)
            losses[compiled].append(loss.item())
        params[compiled] = {k: np.array(v) for k, v in tree_flatten(draft.parameters())}
    for name, value in params[True].items():
        np.testing.assert_allclose(value, params[False][name], atol=1e-5, rtol=1e-4)
    assert losses[False][0] != losses[False][2]  # the steps did change the draft
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    assert not train.use_compile("off") and train.use_compile("on")
    assert train.use_compile("auto") == (mx.default_device() != mx.cpu)


def test_greedy_generation_gives_up_at_its_deadline():
    import time

    target = ToyTarget({"vocab_size": 64, "hidden_size": 32, "seed": 3})
    prompts = np.array([[1, 2, 3]], dtype=np.int32)  # ToyTarget caches hold one row
    done = train.generate_greedy(target, prompts, 8)
    assert done.shape == (1, 8) and (done[:, :3] == prompts).all()
    assert train.generate_greedy(target, prompts, 8, deadline=time.perf_counter() - 1) is None


# -- training ---------------------------------------------------------------------------------


def _settings(folder: Path, train_files: list[Path], held_files: list[Path], out: Path,
              **changes) -> train.TrainSettings:
    base = train.TrainSettings(
        target=str(folder), corpus=[str(f) for f in train_files],
        heldout=[str(f) for f in held_files], out=str(out), kind="dflash2", steps=60, batch=4,
        seq_len=48, anchors=6, lr=3e-3, layers=1, intermediate_size=64, selector_rank=8,
        self_distill=16, eval_blocks=96, eval_prompts=2, eval_tokens=24, save_every=0,
        quiet=True, seed=0)
    return replace(base, **changes)


def test_train_draft_learns_loss_falls_and_acceptance_rises(tiny_target, tmp_path):
    import mlxrunner

    folder, train_files, held_files = tiny_target
    settings = _settings(folder, train_files, held_files, tmp_path / "draft")
    # The untrained draft: the same construction and initialisation training starts from.
    bundle = mlxrunner.load(str(folder), use_draft=False)
    target, tok = bundle.model, bundle.tokenizer
    taps = train.choose_taps(target.num_layers, settings.taps)
    mask_id = train.find_mask_token(tok, None, target.vocab_size)
    assert mask_id == tok.token_to_id("<|mask|>")
    config = train.make_draft_config(settings, target, taps, mask_id, "bfloat16")
    untrained = train.build_draft(settings, config, target)
    train.save_draft(untrained, config, tmp_path / "untrained", mx.bfloat16)
    data = train.load_data(settings, tok, tok.eos_id)
    evaluation = train.heldout_continuations(target, data.heldout, settings, tok.eos_id)
    untrained = mlxrunner.load(str(folder), draft=str(tmp_path / "untrained")).draft
    before = train.estimate_acceptance(untrained, target, taps, evaluation, settings, mask_id)
    prompts = train.heldout_prompts(data.heldout, 2, tok.eos_id, 0)
    before_loop = train.measure_speculative(str(folder), tmp_path / "untrained", prompts, 24)

    report = train.train_draft(settings)
    after = {k: report[k] for k in ("first_loss_ce", "final_loss_ce", "heldout_loss",
                                    "tau_estimate")}
    print(f"untrained {before}, loop tau {before_loop['tau']:.2f}; trained {after}, "
          f"loop tau {report['speculative']['tau']:.2f}")

    assert report["steps"] == 60
    assert report["final_loss_ce"] < 0.5 * report["first_loss_ce"], report["history"]
    assert report["heldout_loss"] < before["heldout_loss"] - 1.0, (before, report)
    assert report["tau_estimate"] > before["tau_estimate"] + 0.5, (before, report)
    # On its own training text the estimate gives the training batches' figures (the first
    # H200 build's estimate read what the target wrote past its replies' ends: held-out loss
    # 8.41 against 3.06 in training)
    trained = mlxrunner.load(str(folder), draft=str(saved := tmp_path / "draft")).draft
    own_text = train.heldout_documents(
        train.encode_documents(tok, train.read_documents(train_files)), settings, tok.eos_id)
    on_train = train.estimate_acceptance(trained, target, taps, own_text, settings, mask_id)
    final_acc = float(np.mean([h["accuracy"] for h in report["history"][-3:]]))
    assert abs(on_train["heldout_loss"] - report["final_loss_ce"]) < \
        0.5 + 0.3 * report["final_loss_ce"], (on_train, report["history"][-3:])
    assert abs(on_train["heldout_accuracy"] - final_acc) < 0.15, (on_train, final_acc)
    loop = report["speculative"]
    assert loop["identical_to_plain"] and before_loop["identical_to_plain"]
    assert loop["tau"] > before_loop["tau"] + 0.5, (before_loop, loop)
    # The folder --draft loads: config and plain-named weights.
    assert (saved / "config.json").exists() and (saved / "model.safetensors").exists()
    names = set(mx.load(str(saved / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.attention_conv.base_kernel",
            "candidate_selector.successor_codebook.weight"} <= names


def test_resume_continues_exactly_where_the_run_stopped(tiny_target, tmp_path):
    folder, train_files, held_files = tiny_target
    common = dict(steps=6, self_distill=0, eval_prompts=0, eval_blocks=8, save_every=0)
    whole = train.train_draft(_settings(folder, train_files, held_files, tmp_path / "whole",
                                        **common))
    first = train.train_draft(_settings(folder, train_files, held_files, tmp_path / "split",
                                        stop_at=3, **common))
    assert first["steps"] == 3
    resumed = train.train_draft(_settings(folder, train_files, held_files, tmp_path / "split",
                                          resume=True, **common))
    assert resumed["steps"] == 6
    a = mx.load(str(tmp_path / "whole" / CHECKPOINT / "draft.safetensors"))
    b = mx.load(str(tmp_path / "split" / CHECKPOINT / "draft.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.array(a[name]), np.array(b[name]), err_msg=name)
    assert [h["loss"] for h in whole["history"]] == [h["loss"] for h in resumed["history"]]
    with pytest.raises(train.TrainDraftError, match="differ from the checkpoint"):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / "split",
                                    resume=True, **{**common, "layers": 2}))


CHECKPOINT = train.CHECKPOINT_DIR


def test_command_line_options_reach_the_settings(tmp_path):
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["./model", "--corpus", "a.py", "b.py", "--out", str(tmp_path),
                              "--kind", "dflash", "--steps", "7", "--batch", "3",
                              "--seq-len", "32", "--lr", "0.01", "--block-size", "6",
                              "--layers", "3", "--taps", "1,2", "--resume", "--seed", "5",
                              "--eval-blocks", "96"])
    s = train.settings_from_args(args)
    assert (s.target, s.corpus, s.kind, s.steps, s.batch, s.seq_len, s.lr, s.block_size,
            s.layers, s.taps, s.resume, s.seed, s.eval_blocks) == (
        "./model", ["a.py", "b.py"], "dflash", 7, 3, 32, 0.01, 6, 3, "1,2", True, 5, 96)
    with pytest.raises(train.TrainDraftError, match="corpus"):
        train.settings_from_args(parser.parse_args(["./model", "--out", str(tmp_path)]))
    with pytest.raises(train.TrainDraftError, match="not found"):
        train.expand_corpus([str(tmp_path / "missing.py")])


@pytest.mark.parametrize("change", [{"distill_openings": 2.0}, {"distill_mix": -0.1}])
def test_shares_outside_0_to_1_are_refused_before_any_work(tiny_target, tmp_path, change):
    folder, train_files, held_files = tiny_target
    out = tmp_path / "d"
    with pytest.raises(train.TrainDraftError, match="between 0 and 1"):
        train.train_draft(_settings(folder, train_files, held_files, out, **change))
    assert not out.exists()


def test_a_checkpoint_holds_weights_optimizer_and_data_state(tiny_target, tmp_path):
    folder, train_files, held_files = tiny_target
    train.train_draft(_settings(folder, train_files, held_files, tmp_path / "d", steps=2,
                                self_distill=0, eval_prompts=0, eval_blocks=8))
    ckpt = tmp_path / "d" / CHECKPOINT
    opt = mx.load(str(ckpt / "optimizer.safetensors"))
    draft = mx.load(str(ckpt / "draft.safetensors"))
    assert int(opt["step"].item()) == 2
    assert {f"{name}.m" for name in draft} <= set(opt) and {f"{name}.v" for name in draft} \
        <= set(opt)
    assert all(v.dtype == mx.float32 for v in draft.values())
    saved = mx.load(str(tmp_path / "d" / "model.safetensors"))  # the draft in the target's dtype
    assert {v.dtype for v in saved.values()} == {load_model(folder).dtype}
    assert dict(tree_flatten(saved)).keys() == draft.keys()


def test_document_openings_start_where_documents_do():
    eos = 0
    stream = np.array([5, 6, 7, 0, 8, 9, 10, 11, 0, 12, 13, 14, 15, 16], dtype=np.int32)
    rng = np.random.default_rng(0)
    prompts = train.document_openings(rng, stream, 40, 3, eos)
    assert prompts.shape == (40, 3)
    assert {tuple(p) for p in prompts.tolist()} == {(5, 6, 7), (8, 9, 10), (12, 13, 14)}


def test_the_pool_mixes_short_document_openings_with_corpus_windows():
    """Half the batches (distill_openings 0.5) continue a document's first 4-32 tokens, the
    rest a window of seq_len / 4; every row is its prompt plus the target's greedy tokens."""
    vocab, eos = 64, 0
    target = ToyTarget({"vocab_size": vocab, "hidden_size": 16, "seed": 1})
    rng = np.random.default_rng(3)
    docs = [rng.integers(3, vocab, size=int(n)) for n in rng.integers(40, 80, size=30)]
    stream = np.concatenate([np.append(d, eos) for d in docs]).astype(np.int32)
    settings = train.TrainSettings(target="", corpus=[], out="", seq_len=48, self_distill=8,
                                   distill_batch=1, distill_openings=0.5, quiet=True)
    pool = train.build_pool(target, stream, settings, eos, seed=0, seconds=0,
                            progress=train.Progress(1, quiet=True))
    assert pool.shape == (8, 48)
    doc_starts = {tuple(d[:4].tolist()) for d in docs}
    opened = [tuple(row[:4].tolist()) in doc_starts for row in pool]
    assert [opened[i] for i in (0, 2, 4, 6)] == [True] * 4  # rows alternate, openings first
    assert sum(opened) <= 5  # a window (12 tokens from anywhere) rarely opens a document
    for row in pool:  # past the longest prompt (32) every token is the target's greedy one
        greedy = np.array(mx.argmax(target(mx.array(row[None])), axis=-1))[0]
        assert (row[33:] == greedy[32:-1]).all()


class _Killed(Exception):
    """Stands for the process dying at the patched call."""


def _kill_at(monkeypatch, module, name: str, when) -> None:
    """Make ``module.name`` raise ``_Killed`` on the first call for which ``when(*args)``."""
    real = getattr(module, name)

    def patched(*args, **kwargs):
        if when(*args):
            raise _Killed(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_kill_while_checkpointing_leaves_the_previous_checkpoint_to_resume(
        tiny_target, tmp_path, monkeypatch):
    folder, train_files, held_files = tiny_target
    common = dict(steps=4, self_distill=0, eval_prompts=0, eval_blocks=8, save_every=0)
    out = tmp_path / "d"
    ckpt = out / CHECKPOINT
    whole = train.train_draft(_settings(folder, train_files, held_files, tmp_path / "whole",
                                        **common))
    train.train_draft(_settings(folder, train_files, held_files, out, stop_at=2, **common))
    at_step_2 = _files(ckpt)
    # Killed between the weights and the optimizer state (the files of step 3).
    with monkeypatch.context() as m:
        _kill_at(m, train.mx, "save_safetensors", lambda path, *_: "optimizer" in str(path))
        with pytest.raises(_Killed):
            train.train_draft(_settings(folder, train_files, held_files, out, stop_at=3,
                                        resume=True, **common))
    assert _files(ckpt) == at_step_2
    # Killed with step 3 written whole, between moving step 2 aside and moving step 3 in.
    with monkeypatch.context() as m:
        _kill_at(m, train.os, "replace", lambda src, dst: Path(dst) == ckpt)
        with pytest.raises(_Killed):
            train.train_draft(_settings(folder, train_files, held_files, out, stop_at=3,
                                        resume=True, **common))
    assert not ckpt.exists() and list(out.glob(f"{CHECKPOINT}.tmp-*"))
    resumed = train.train_draft(_settings(folder, train_files, held_files, out, resume=True,
                                          **common))
    assert resumed["steps"] == 4 and not list(out.glob(f"{CHECKPOINT}.*"))
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in whole["history"]]
    assert _files(ckpt)["draft.safetensors"] == \
        _files(tmp_path / "whole" / CHECKPOINT)["draft.safetensors"]


def test_resume_refuses_a_checkpoint_whose_files_are_from_different_steps(tiny_target,
                                                                          tmp_path):
    folder, train_files, held_files = tiny_target
    common = dict(steps=4, self_distill=0, eval_prompts=0, eval_blocks=8, save_every=0)
    for name, stop_at in (("at2", 2), ("at4", 0)):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / name,
                                    stop_at=stop_at, **common))
    # What writing in place left when killed between files: state.json at step 2, weights at 4.
    mixed = tmp_path / "at2" / CHECKPOINT
    (mixed / "draft.safetensors").write_bytes(
        (tmp_path / "at4" / CHECKPOINT / "draft.safetensors").read_bytes())
    with pytest.raises(train.TrainDraftError, match="different steps.*draft.safetensors at "
                                                    "step 4"):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / "at2",
                                    resume=True, **common))


def test_a_kill_while_saving_the_draft_never_leaves_new_weights_under_an_old_config(
        tiny_target, tmp_path, monkeypatch):
    import mlxrunner

    folder, _, _ = tiny_target
    out = tmp_path / "draft"
    target = mlxrunner.load(str(folder), use_draft=False).model
    settings = _settings(folder, [], [], out)
    config = train.make_draft_config(settings, target, [1], 0, "float32")
    train.save_draft(train.build_draft(settings, config, target), config, out, mx.float32)
    before = _files(out)
    mx.random.seed(1)
    other = train.build_draft(settings, config, target)
    with monkeypatch.context() as m:  # killed writing the weights: the old draft is whole
        _kill_at(m, train.mx, "save_safetensors", lambda *_: True)
        with pytest.raises(_Killed):
            train.save_draft(other, config, out, mx.float32)
    assert _files(out) == before
    with monkeypatch.context() as m:  # killed between the renames: no config, nothing loads
        _kill_at(m, train.os, "replace", lambda src, dst: Path(dst).name == "config.json")
        with pytest.raises(_Killed):
            train.save_draft(other, config, out, mx.float32)
    assert not (out / "config.json").exists()
    train.save_draft(other, config, out, mx.float32)
    assert mlxrunner.load(str(folder), draft=str(out)).draft is not None
    assert not list(out.glob(".draft.tmp-*"))


def test_the_target_computes_in_the_dtype_asked_for(tiny_target, tmp_path):
    """--target-dtype: the frozen target runs in that dtype while training (the draft saved
    with --save-dtype auto takes it), whatever its folder declares."""
    import json

    import mlxrunner

    folder, train_files, held_files = tiny_target
    declared = str(mlxrunner.load(str(folder), use_draft=False).model.dtype)
    wanted = "float16" if "float16" not in declared else "float32"
    train.train_draft(_settings(folder, train_files, held_files, tmp_path / "d", steps=1,
                                self_distill=0, eval_prompts=0, eval_blocks=8, save_every=0,
                                target_dtype=wanted))
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dtype"] == wanted
    with pytest.raises(mlxrunner.MLXRunnerError, match="unknown dtype"):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / "e", steps=1,
                                    self_distill=0, eval_prompts=0, target_dtype="float8"))


def test_keep_best_saves_the_evaluated_step_of_the_best_estimate(tiny_target, tmp_path,
                                                                monkeypatch):
    """Held-out estimates of 2, 3 and 1 at steps 10, 20 and 30: the saved draft is step
    20's weights (a draft that overfits peaks before its last step)."""
    folder, train_files, held_files = tiny_target
    real, seen = train.estimate_acceptance, []

    def scripted(draft, *args, **kwargs):
        out = real(draft, *args, **kwargs)
        seen.append({k: np.array(v.astype(mx.float32)) for k, v in
                     tree_flatten(draft.parameters())})
        return {**out, "tau_estimate": [2.0, 3.0, 1.0, 3.0][len(seen) - 1]}

    monkeypatch.setattr(train, "estimate_acceptance", scripted)
    out = tmp_path / "draft"
    report = train.train_draft(_settings(folder, train_files, held_files, out, steps=30,
                                         eval_every=10, keep_best=True, self_distill=0,
                                         eval_prompts=0))
    assert report["steps"] == 30 and report["kept_step"] == 20
    saved = mx.load(str(out / "model.safetensors"))
    step_20 = seen[1]
    for name, value in saved.items():  # saved in bfloat16: step 20's weights rounded
        want = np.array(mx.array(step_20[name]).astype(value.dtype).astype(mx.float32))
        np.testing.assert_array_equal(np.array(value.astype(mx.float32)), want, err_msg=name)
    assert any(not np.array_equal(seen[1][k], seen[2][k]) for k in seen[1])  # it trained on
    with pytest.raises(train.TrainDraftError, match="--eval-every"):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / "d2",
                                    keep_best=True))
    with pytest.raises(train.TrainDraftError, match="--eval-every -3"):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / "d2",
                                    eval_every=-3))
    # (it trained no step and failed formatting its report, a traceback)
    with pytest.raises(train.TrainDraftError, match="--stop-at -2"):
        train.train_draft(_settings(folder, train_files, held_files, tmp_path / "d2",
                                    stop_at=-2))
