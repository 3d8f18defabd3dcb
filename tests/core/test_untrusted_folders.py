"""A model folder is untrusted: each crafted value or file is one MLXRunnerError line,
found before anything large is allocated or built."""

from __future__ import annotations

import json
import resource
import struct
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlxrunner
from mlxrunner.errors import ModelFolderError
from mlxrunner.model import build_draft, check_safetensors, weight_files
from mlxrunner.plugin import ConfigBound, DraftModel, check_config
from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder

# ---------------------------------------------------------------- config.json bounds

BAD_CONFIGS = [
    ({"vocab_size": 10**12}, ("vocab_size", "16777216", "1000000000000")),
    ({"num_hidden_layers": 10**6}, ("num_hidden_layers", "1 to 1024")),
    ({"hidden_size": -128}, ("hidden_size", "-128")),
    ({"num_attention_heads": 0}, ("num_attention_heads", "from 1")),
    ({"rope_theta": "abc"}, ("rope_theta", "a number above 0", "'abc'")),
    ({"rms_norm_eps": float("nan")}, ("rms_norm_eps", "nan")),
    ({"intermediate_size": [64, 2**40]}, ("intermediate_size", str(2**40))),
    ({"rope_parameters": {"rope_theta": -1.0}}, ("rope_parameters.rope_theta",)),
    ({"tie_word_embeddings": "false"}, ("tie_word_embeddings", "a boolean")),
    ({"num_key_value_heads": 3}, ("num_attention_heads (4)", "multiple of num_key_value_heads")),
    ({"hidden_size": 66, "head_dim": None},
     ("hidden_size (66)", "multiple of num_attention_heads (4)")),
]


@pytest.fixture
def example_folder(tmp_path: Path) -> Path:
    pytest.importorskip("mlxrunner_example_architecture")
    return write_model_folder(tmp_path / "m")


def _with_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@pytest.mark.parametrize(("changes", "needles"), BAD_CONFIGS,
                         ids=[next(iter(c)) for c, _ in BAD_CONFIGS])
def test_config_out_of_bounds_is_refused_before_the_model_is_built(
        example_folder, monkeypatch, changes, needles):
    from mlxrunner_example_architecture.model import ExampleLlama

    def never_built(self, config):
        raise AssertionError("the model was built from an out-of-bounds config")

    monkeypatch.setattr(ExampleLlama, "__init__", never_built)
    _with_config(example_folder, **changes)
    before = _max_rss_bytes()
    with pytest.raises(ModelFolderError) as info:
        mlxrunner.load_model(example_folder)
    assert _max_rss_bytes() - before < 64 * 2**20
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{example_folder}/config.json: ")
    for needle in needles:
        assert needle in message, message


def test_config_within_bounds_still_loads(example_folder):
    _with_config(example_folder, rope_theta=500000, max_position_embeddings=131072)
    assert mlxrunner.load_model(example_folder).num_layers == EXAMPLE_CONFIG["num_hidden_layers"]


def test_an_architecture_declares_its_own_bounds():
    class Declared:
        config_bounds = {"experts_per_group": ConfigBound(int, 1, 8)}

    check_config({"experts_per_group": 8}, Declared)
    with pytest.raises(ModelFolderError, match=r"experts_per_group must be an integer "
                                               r"from 1 to 8, got 9"):
        check_config({"experts_per_group": 9}, Declared)


def test_a_draft_config_out_of_bounds_is_refused_before_the_draft_is_built():
    class NeverBuilt(DraftModel):
        def __init__(self, config, target):
            raise AssertionError("the draft was built from an out-of-bounds config")

    with pytest.raises(ModelFolderError, match="draft config: num_hidden_layers"):
        build_draft(NeverBuilt, {"num_hidden_layers": 10**6}, target=None)


# ---------------------------------------------------------------- safetensors files

def _raw_safetensors(path: Path, entries: dict, data_bytes: int,
                     header: bytes | None = None) -> Path:
    body = header if header is not None else json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * data_bytes)
    return path


def _f32(shape: list[int], start: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, end]}


BAD_FILES = {
    "overlap": ({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, 12, "'b' overlaps"),
    "gap": ({"a": _f32([2], 0, 8), "b": _f32([2], 12, 20)}, 20, "4 bytes before tensor 'b'"),
    "past_the_end": ({"a": _f32([4], 0, 16)}, 8, "truncated: tensor 'a'"),
    "trailing": ({"a": _f32([2], 0, 8)}, 16, "8 bytes after the last tensor"),
    "size_mismatch": ({"a": _f32([3], 0, 8)}, 8, "needs 12 bytes, its range holds 8"),
    "negative_dim": ({"a": _f32([-2], 0, 8)}, 8, "corrupt entry for tensor 'a'"),
    "dtype": ({"a": {"dtype": "Q2", "shape": [2], "data_offsets": [0, 2]}}, 2,
              "unsupported dtype 'Q2'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_tensors_must_tile_the_data_region(tmp_path, case):
    entries, data_bytes, needle = BAD_FILES[case]
    path = _raw_safetensors(tmp_path / "w.safetensors", entries, data_bytes)
    with pytest.raises(ModelFolderError) as info:
        check_safetensors(path)
    assert str(info.value).startswith(str(path)) and needle in str(info.value)


@pytest.mark.parametrize(("header", "needle"), [
    (b"[1, 2]", "not a JSON object"),
    (b"{not json", "not JSON"),
    (b"[" * 100_000, "not JSON"),
])
def test_safetensors_header_is_a_json_object(tmp_path, header, needle):
    path = _raw_safetensors(tmp_path / "w.safetensors", {}, 0, header=header)
    with pytest.raises(ModelFolderError, match=needle):
        check_safetensors(path)


def test_huge_declared_header_is_refused_unread(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ModelFolderError, match="the limit is"):
        check_safetensors(path)


def test_mlx_written_files_and_metadata_pass(tmp_path):
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((3, 5)), "b": mx.ones((7,), mx.bfloat16),
                                    "c": mx.zeros((0,)), "d": mx.zeros((2,), mx.int8)},
                        metadata={"format": "mlx"})
    assert sorted(check_safetensors(path)) == ["a", "b", "c", "d"]


def test_overlapping_tensors_in_a_model_folder_are_refused(example_folder):
    path = example_folder / "model.safetensors"
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    first, second = sorted(names, key=lambda k: header[k]["data_offsets"][0])[:2]
    header[second] = dict(header[first])  # the same shape, the same bytes
    data = path.read_bytes()[8 + n:]
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: tensor '.*' overlaps"):
        mlxrunner.load_model(example_folder)


# ---------------------------------------------------------------- weight files stay inside

def _index(folder: Path, *names: str) -> None:
    weight_map = {f"t{i}": name for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((2,))})
    return path


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    return folder


def test_index_naming_a_parent_path_is_refused(tmp_path):
    _outside(tmp_path)
    folder = _folder(tmp_path)
    _index(folder, "../outside.safetensors")
    with pytest.raises(ModelFolderError, match=r"entry '\.\./outside\.safetensors' points "
                                               "outside the model folder"):
        weight_files(folder)


def test_index_naming_an_absolute_path_is_refused(tmp_path):
    outside = _outside(tmp_path)
    folder = _folder(tmp_path)
    _index(folder, str(outside))
    with pytest.raises(ModelFolderError, match="points outside the model folder"):
        weight_files(folder)


def test_index_naming_a_link_that_leaves_the_folder_is_refused(tmp_path):
    outside = _outside(tmp_path)
    folder = _folder(tmp_path)
    (folder / "model-1.safetensors").symlink_to(outside)
    _index(folder, "model-1.safetensors")
    with pytest.raises(ModelFolderError, match="'model-1.safetensors' leads outside"):
        weight_files(folder)


def test_single_weight_file_linking_outside_is_refused(tmp_path):
    outside = _outside(tmp_path)
    folder = _folder(tmp_path)
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(ModelFolderError, match="'model.safetensors' leads outside"):
        weight_files(folder)


def test_the_hugging_face_cache_layout_is_inside(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / "0123abcd"
    # (MLX adds the .safetensors suffix a name lacks; the cache's blobs have none)
    mx.save_safetensors(str(blob) + ".safetensors", {"a": mx.zeros((2,))})
    (repo / "blobs" / "0123abcd.safetensors").rename(blob)
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    assert weight_files(snapshot) == [snapshot / "model.safetensors"]
