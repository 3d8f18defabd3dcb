"""Layer taps, embeddings and the raw head against transformers' hidden states.

transformers' ``output_hidden_states`` gives the embeddings first and then the residual
stream after each layer, except that its last entry is after the final norm; tap ``t`` is
entry ``t + 1``. Float32: logits max abs error < 1e-4; hidden states, which grow to ~12
along the residual stream, max abs error < 2e-5 times the layer's largest |value| (and at
least 2e-5).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxrunner.testing import check_taps, check_taps_against

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
TOLERANCE = 1e-4


def hidden_tolerance(reference: np.ndarray) -> float:
    return 2e-5 * max(1.0, float(np.abs(reference).max()))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(FIXTURE_NAMES), length=st.sampled_from([7, 130]), data=st.data())
def test_random_taps_equal_transformers_hidden_states(name, length, data, fixture_model,
                                                      reference):
    model, ref = fixture_model(name), reference(name)
    n = model.num_layers
    taps = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True),
                     label="taps")
    hidden = ref[f"hidden_{length}"]  # [n + 1, L, H]
    logits, tapped = model(mx.array(ref[f"ids_{length}"]), taps=taps)
    assert tapped.shape == (1, length, len(taps) * model.hidden_size)
    # same forward: its logits are the reference logits too
    assert np.abs(np.array(logits[0]) - ref[f"logits_{length}"]).max() < TOLERANCE
    H = model.hidden_size
    for i, t in enumerate(taps):
        ours = tapped[0, :, i * H:(i + 1) * H]
        if t == n - 1:  # transformers' last entry is after the final norm
            ours = model.model.norm(ours)
        err = np.abs(np.array(ours) - hidden[t + 1]).max()
        assert err < hidden_tolerance(hidden[t + 1]), (taps, t, err)


def test_core_tap_checks(fixture_model, reference):
    name = "tiny_hk2_hv4_tied"
    model, ref = fixture_model(name), reference(name)
    ids = ref["ids_7"]
    check_taps_against(model, ids, [0, 1, 2, 3], list(ref["hidden_7"][:, None]),
                       atol=hidden_tolerance(ref["hidden_7"]))
    check_taps(model, ids, [0, 2, 3])  # incl. perturbing layer t and t + 1


def test_taps_through_caches_match_the_full_forward(fixture_model, reference):
    """Taps of a prefill and of single decode steps line up with one tapped forward."""
    name = "tiny_fullfirst_untied"
    model, ref = fixture_model(name), reference(name)
    ids = mx.array(ref["ids_130"][:, :20])
    taps = [0, 2]
    _, full = model(ids, taps=taps)
    cache = model.make_cache()
    parts = [model(ids[:, :15], cache, taps=taps)[1]]
    parts += [model(ids[:, t:t + 1], cache, taps=taps)[1] for t in range(15, 20)]
    assert float(mx.abs(mx.concatenate(parts, axis=1) - full).max()) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_embed_tokens_and_raw_logits(name, fixture_model, reference):
    model, ref = fixture_model(name), reference(name)
    ids = mx.array(ref["ids_7"])
    assert np.abs(np.array(model.embed_tokens(ids)[0]) - ref["hidden_7"][0]).max() < 1e-6
    # raw_logits is the head alone on already-normed hidden states
    normed = mx.array(ref["hidden_7"][-1][None])
    assert np.abs(np.array(model.raw_logits(normed)[0]) - ref["logits_7"]).max() < TOLERANCE
    logits, tapped = model(ids, taps=[model.num_layers - 1])
    again = model.raw_logits(model.model.norm(tapped))
    assert float(mx.abs(again - logits).max()) < 1e-5


def test_tap_order_and_bad_taps(fixture_model):
    model = fixture_model("tiny_alternating_hk1_hv3")
    ids = mx.array([[1, 2, 3]])
    _, ab = model(ids, taps=[0, 3])
    _, ba = model(ids, taps=[3, 0])
    H = model.hidden_size
    assert mx.array_equal(ab[..., :H], ba[..., H:]) and mx.array_equal(ab[..., H:], ba[..., :H])
    logits, none = model(ids, taps=[])
    assert none.shape == (1, 3, 0) and logits.shape == (1, 3, model.vocab_size)
    with pytest.raises(ValueError, match="out of range"):
        model(ids, taps=[4])
