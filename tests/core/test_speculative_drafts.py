"""The draft bases: a DraftModel declares its taps and depth, and each mismatch with the
target is one clear DraftConfigError; a BlockDraft reads its block settings (top level; the
dflash plugin's own format keeps them in ``dflash_config``: its tests) and borrows the
target's embedding and head unless its checkpoint has its own; DraftProposal."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner import DraftConfigError
from mlxrunner.model import build_draft
from mlxrunner.plugin import BlockDraft, DraftModel, DraftProposal
from mlxrunner.testing.speculative import ScriptedDraft, ToyTarget

mx.set_default_device(mx.cpu)


def _target(vocab: int = 32) -> ToyTarget:
    return ToyTarget({"vocab_size": vocab, "hidden_size": 16})


class _Block(BlockDraft):
    """A block draft's settings alone (never run)."""


def _config(**settings):
    base = {"architectures": ["_Block"], "target_layer_ids": [0], "block_size": 4,
            "mask_token_id": 3}
    base.update(settings)
    return base


@pytest.mark.parametrize("config, message", [
    ({"taps": []}, "ScriptedDraft: taps is empty"),
    ({"taps": [0, 0]}, r"taps \[0, 0\] are not strictly ascending"),
    ({"taps": [2]}, r"taps \[2\] are outside the target's 1 layers"),
    ({"block_size": 1}, "must draft at least 1 token"),
])
def test_a_drafts_taps_and_depth_are_checked_in_one_line(config, message):
    with pytest.raises(DraftConfigError, match=message) as info:
        build_draft(ScriptedDraft, {"architectures": ["ScriptedDraft"], **config}, _target())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("settings, message", [
    ({"target_layer_ids": [0, 0]}, "target_layer_ids .* not strictly ascending"),
    ({"target_layer_ids": []}, "target_layer_ids is empty"),
    ({"target_layer_ids": [2]}, r"\[2\] are outside the target's 1 layers"),
    ({"mask_token_id": 32}, "mask_token_id 32 is outside the target's vocabulary of 32"),
    ({"mask_token_id": -1}, "mask_token_id -1 is outside"),
    ({"block_size": 1}, "block_size must be at least 2, got 1"),
    ({"vocab_size": 31}, "vocabulary 31 differs from the target's 32"),
    ({"hidden_size": 8}, "hidden size 8 differs from the target's embedding width 16"),
    ({"num_target_layers": 2}, "made for a target with 2 layers, this one has 1"),
    ({"target_layer_ids": None}, "no target_layer_ids"),
    ({"block_size": "eight"}, "malformed setting"),
])
def test_each_block_setting_mismatch_is_one_clear_draft_config_error(settings, message):
    with pytest.raises(DraftConfigError, match=message) as info:
        build_draft(_Block, _config(**settings), _target())
    assert "\n" not in str(info.value)


def test_a_target_without_taps_is_refused():
    target = _target()
    target.supports_taps = False
    with pytest.raises(DraftConfigError, match="does not expose layer taps"):
        build_draft(ScriptedDraft, {"architectures": ["ScriptedDraft"]}, target)


def test_block_settings_and_the_depth_they_give():
    draft = build_draft(_Block, _config(block_size=6), _target())
    assert (draft.taps, draft.block_size, draft.max_depth, draft.mask_token_id) == \
        ((0,), 6, 5, 3)
    # the target stays out of the draft's parameters
    assert draft.parameters() == {}
    scripted = ScriptedDraft.for_script(_target(), [1, 2, 3], block_size=5)
    assert (scripted.taps, scripted.max_depth) == ((0,), 4)


def test_embedding_and_head_are_borrowed_unless_the_checkpoint_has_its_own():
    import mlx.nn as nn

    target = _target()
    ids = mx.array([[1, 2]])
    h = mx.ones((1, 16))
    for cls, config in ((ScriptedDraft, {"architectures": ["ScriptedDraft"]}),
                        (_Block, _config())):
        draft = build_draft(cls, config, target)
        np.testing.assert_array_equal(np.array(draft.embed_tokens(ids)),
                                      np.array(target.embed_tokens(ids)))
        np.testing.assert_array_equal(np.array(draft.raw_logits(h)),
                                      np.array(target.raw_logits(h)))

    own = _Block.config_for_checkpoint(_config(), ["embed_tokens.weight"])
    assert own["draft_own_embedding"] and not own["draft_own_head"]
    draft = build_draft(_Block, own, target)
    draft["embed_tokens"] = nn.Embedding(32, 16)
    table = np.array(draft["embed_tokens"].weight)
    np.testing.assert_allclose(np.array(draft.embed_tokens(ids)), table[[1, 2]][None])
    # (an absolute floor too: a row sum of 16 random entries may cancel to near 0, where
    # float32's summation order alone moves the relative error past 1e-5)
    np.testing.assert_allclose(np.array(draft.raw_logits(h)), np.ones((1, 16)) @ table.T,
                               rtol=1e-5, atol=1e-6)


def test_point_mass_proposals_are_one_hot():
    p = DraftProposal.point_mass(mx.array([4, 9]))
    assert len(p) == 2
    q = p.distribution()
    np.testing.assert_array_equal(np.array(q.prob_of(mx.array([4, 9]))), [1.0, 1.0])
    np.testing.assert_array_equal(np.array(q.prob_of(mx.array([9, 4]))), [0.0, 0.0])


def test_the_base_class_leaves_taps_depth_and_sessions_to_subclasses():
    class Bare(DraftModel):
        taps = (0,)
        max_depth = 2

    draft = build_draft(Bare, {}, _target())
    with pytest.raises(NotImplementedError):
        draft.new_session(None)
    with pytest.raises(NotImplementedError):
        _ = DraftModel({}, _target()).taps


def test_a_draft_that_declares_no_taps_or_depth_is_one_clear_line():
    class Old(DraftModel):  # written for a base that read target_layer_ids itself
        pass

    with pytest.raises(DraftConfigError, match="declares its taps and max_depth") as info:
        build_draft(Old, {"dflash_config": {"target_layer_ids": [0], "block_size": 4}},
                    _target())
    assert "\n" not in str(info.value)
