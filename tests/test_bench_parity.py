"""When a bench reports its ratio to mlx-lm (bench/harness.py ``parity_withheld``): float32
logits within the tolerance; or, on a GPU, the mapping within it and the core's kernels no
further from the reference than the reference's own GPU result from its CPU one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import harness  # noqa: E402  (the benches' module, imported as they import it)

WHERE = "parity_float32_where"


def split(mapping: float, spread: float) -> dict[str, float]:
    return {"ours without kernels vs reference": mapping, "reference GPU vs CPU": spread}


def test_within_tolerance_reports() -> None:
    results = {"parity_float32": 4e-4}
    assert harness.parity_withheld(results) is None
    assert "within" in results["parity_rule"]


def test_unmeasured_parity_withholds() -> None:
    assert harness.parity_withheld({}) == "parity not measured"


def test_over_tolerance_without_a_split_withholds() -> None:
    why = harness.parity_withheld({"parity_float32": 3.6e-3})
    assert why is not None and "0.0036 > 0.001" in why


def test_kernels_inside_the_references_own_spread_report() -> None:
    results = {"parity_float32": 3.57e-3, WHERE: split(7.8e-4, 6.3e-3)}
    assert harness.parity_withheld(results) is None
    assert "(0.00078)" in results["parity_rule"] and "0.0063" in results["parity_rule"]


@pytest.mark.parametrize("mapping,spread", [(2e-3, 6.3e-3),   # the mapping itself differs
                                            (7.8e-4, 1e-3)])  # the kernels move them further
def test_a_wrong_mapping_or_kernels_past_the_spread_withhold(mapping: float,
                                                              spread: float) -> None:
    results = {"parity_float32": 3.57e-3, WHERE: split(mapping, spread)}
    why = harness.parity_withheld(results)
    assert why is not None and "parity_rule" not in results


@pytest.mark.parametrize("text,why", [
    ("kernels=norm", "unknown kernel 'norm'"),
    ("compile=yes", "use 0 or 1"),
    ("attention=fast", "use one of"),
    ("lockstep=1", "NAME one of"),
])
def test_a_switched_row_refuses_what_the_environment_would(text: str, why: str,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    """``--switched NAME=VALUE`` parses as ``MLXRUNNER_<NAME>``: a misspelt kernel is one
    clear line, not a row that quietly turns every kernel off; refused as the bench's
    arguments are parsed, before a model is built."""
    with pytest.raises(SystemExit, match=why):
        harness._setting(text)
    parser = argparse.ArgumentParser(prog="bench")
    harness.add_switched_argument(parser, "compile=0")
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--switched", text])
    assert refused.value.code == 2
    assert why in capsys.readouterr().err
    assert parser.parse_args(["--switched", "compile=0"]).switched == ["compile=0"]
    assert harness._setting("kernels=attention,products") == (
        "kernels", frozenset({"attention", "products"}))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_float32_logits_casts_copies_and_puts_the_weights_back(dtype: str) -> None:
    """The float32 pass reads cast copies (made on the default device, so a CPU pass never
    reads the bench's own arrays) and leaves the model holding the very arrays it held."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.head = nn.Linear(8, 32)

        def __call__(self, ids: mx.array) -> mx.array:
            return self.head(self.embed(ids))

    model = Tiny()
    model.set_dtype(getattr(mx, dtype))
    before = dict(tree_flatten(model.parameters()))
    ids = mx.array([[1, 5, 7]])
    want = (before["embed.weight"].astype(mx.float32)[ids] @ before["head.weight"].astype(
        mx.float32).T + before["head.bias"].astype(mx.float32))
    for stream in (None, mx.cpu):
        got = harness.float32_logits(model, ids, stream)
        assert got.dtype == mx.float32
        assert mx.allclose(got, want, atol=1e-6).item()
        after = dict(tree_flatten(model.parameters()))
        assert all(after[k] is v for k, v in before.items())
        assert {v.dtype for v in after.values()} == {getattr(mx, dtype)}
