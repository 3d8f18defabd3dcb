"""Sampled exactness with DFlash (dense q) and DFlash2 (sparse q over its candidates)
drafts: over 800 (DFlash) or 600 (DFlash2) seeds, the first tokens of speculative decoding
follow plain decoding's exact distribution (chi-square, p > 0.001), with the sampler's
top_k / top_p / min_p / penalties off and on. A round with a broken residual fails the
same check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest

mx.set_default_device(mx.cpu)

pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")

from mlxrunner import SamplerOptions  # noqa: E402
from mlxrunner.decode import Sampler  # noqa: E402
from mlxrunner.testing.speculative import (  # noqa: E402
    ToyTarget,
    check_speculative_sampled,
    random_draft,
)

PROMPT = [1, 2, 3]
SETTINGS = {
    "off": SamplerOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "on": SamplerOptions(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, repeat_penalty=1.5,
                         presence_penalty=0.3, frequency_penalty=0.2),
}


@dataclass(frozen=True)
class DraftCase:
    kind: str
    runs: int
    depth: int | None  # None: the draft's own depth
    min_acceptance: float
    extra: dict[str, Any] = field(default_factory=dict)


DRAFTS = {
    # depth 3 every round: acceptance, residuals at every position and the bonus all occur
    "dflash": DraftCase("DFlashDraftModel", runs=800, depth=3, min_acceptance=0.1),
    # DFlash2 drafts block_size - 1 = 3 every round; q is sparse over 4 candidates
    "dflash2": DraftCase("DFlash2DraftModel", runs=600, depth=None, min_acceptance=0.05,
                         extra={"selector_top_k": 4}),
}


def _setup(case: DraftCase):
    target = ToyTarget({"vocab_size": 16, "hidden_size": 16, "seed": 0, "scale": 1.0})
    draft = random_draft(target, case.kind, layers=1, block_size=4, heads=2, kv_heads=1,
                         head_dim=8, taps=[0], **case.extra)
    return target, draft


@pytest.mark.parametrize("settings", ["off", "on"])
@pytest.mark.parametrize("draft_name", list(DRAFTS))
def test_sampled_output_follows_plain_decoding(draft_name, settings):
    case = DRAFTS[draft_name]
    target, draft = _setup(case)
    result = check_speculative_sampled(target, draft, SETTINGS[settings], prompt=PROMPT,
                                       runs=case.runs, depth=case.depth)
    assert case.min_acceptance < result["acceptance_rate"] < 0.9


def test_the_check_catches_a_round_without_the_residual(monkeypatch):
    target, draft = _setup(DRAFTS["dflash"])
    monkeypatch.setattr(Sampler, "residual", lambda self, p, q: p)
    with pytest.raises(AssertionError, match="do not follow plain decoding"):
        check_speculative_sampled(target, draft, SETTINGS["off"], prompt=PROMPT, runs=600,
                                  depth=3)
