"""mlxrunner.plugin.ConfigFields: a config.json field declared once, with its bounds.

Required keys, defaults (absent or null), another key name, kinds from the annotation
(ints given as 2048.0 become ints; booleans are not ints), bounds with one ModelFolderError
line naming the key, per-layer lists, strings, unchecked structures, and the bounds handed
to ``Model.config_bounds``.
"""

from __future__ import annotations

import pytest

from mlxrunner.plugin import ConfigBound, ConfigFields, ModelFolderError, config_field


class TinyConfig(ConfigFields):
    vocab_size: int = config_field(low=1, high=2**24)
    hidden_size: int = config_field(low=1, high=2**17)
    num_key_value_heads: int | None = config_field(None, low=1, high=1024)
    rms_norm_eps: float = config_field(1e-6, low=0, above_low=True, high=1)
    tie_word_embeddings: bool = config_field(False)
    hidden_act: str = config_field("silu")
    layer_widths: tuple[int, ...] | int | None = config_field(None)
    window: int = config_field(0, low=0, high=2**20, key="sliding_window")
    intermediate_size: int = config_field(64, low=1, high=2**20, per_layer=True)


def test_fields_read_with_defaults_and_kinds():
    cfg = TinyConfig.from_config({"vocab_size": 2048.0, "hidden_size": 64,
                                  "rms_norm_eps": None, "sliding_window": 128,
                                  "tie_word_embeddings": 1, "unknown": [1, 2]})
    assert cfg.vocab_size == 2048 and type(cfg.vocab_size) is int
    assert cfg.num_key_value_heads is None and cfg.rms_norm_eps == 1e-6
    assert cfg.window == 128 and cfg.tie_word_embeddings is True and cfg.hidden_act == "silu"
    per_layer = TinyConfig.from_config({"vocab_size": 8, "hidden_size": 8,
                                        "intermediate_size": [16, 32.0]})
    assert per_layer.intermediate_size == (16, 32)
    with pytest.raises(AttributeError):
        cfg.vocab_size = 3  # type: ignore[misc]  # (frozen)


@pytest.mark.parametrize("config,message", [
    ({"hidden_size": 64}, "config.json lacks 'vocab_size', which TinyConfig needs"),
    ({"vocab_size": 0, "hidden_size": 64},
     "config.json: vocab_size must be an integer from 1 to 16777216, got 0"),
    ({"vocab_size": True, "hidden_size": 64}, "vocab_size must be an integer"),
    ({"vocab_size": 8, "hidden_size": 64.5}, "hidden_size must be an integer"),
    ({"vocab_size": 8, "hidden_size": 8, "rms_norm_eps": 0},
     "rms_norm_eps must be a number above 0"),
    ({"vocab_size": 8, "hidden_size": 8, "sliding_window": -1}, "sliding_window must be"),
    ({"vocab_size": 8, "hidden_size": 8, "hidden_act": 3}, "hidden_act must be a string"),
    ({"vocab_size": 8, "hidden_size": 8, "intermediate_size": [8, 0]},
     "intermediate_size must be an integer from 1"),
    ({"vocab_size": 8, "hidden_size": 8, "tie_word_embeddings": "yes"},
     "tie_word_embeddings must be a boolean"),
])
def test_a_bad_value_is_one_line_naming_its_key(config, message):
    with pytest.raises(ModelFolderError) as raised:
        TinyConfig.from_config(config)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_bounds_for_the_model_class():
    bounds = TinyConfig.bounds()
    assert bounds["vocab_size"] == ConfigBound(int, 1, 2**24)
    assert bounds["sliding_window"] == ConfigBound(int, 0, 2**20)
    assert bounds["intermediate_size"].per_layer
    assert "hidden_act" not in bounds and "layer_widths" not in bounds


def test_mistakes_in_a_config_class_fail_where_it_is_defined():
    with pytest.raises(TypeError, match="bounds need an int or float annotation"):
        class Unchecked(ConfigFields):  # bounds on a type they cannot check
            sizes: list[int] = config_field(low=1)

    class PerLayer(ConfigFields):
        widths: int | tuple[int, ...] = config_field(low=1, high=64, per_layer=True)
        scale: float = config_field(1.0)

    assert PerLayer.from_config({"widths": [2, 3]}).widths == (2, 3)
    assert PerLayer.from_config({"widths": 4}).widths == 4
    with pytest.raises(ModelFolderError, match="widths must be an integer from 1 to 64"):
        PerLayer.from_config({"widths": [2, 65]})
    with pytest.raises(ModelFolderError, match="scale is too large"):
        PerLayer.from_config({"widths": 1, "scale": 10 ** 400})
