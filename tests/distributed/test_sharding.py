"""How layers split (mlxrunner.nn's declarations) and where pipeline stages cut, without
starting processes."""

from __future__ import annotations

import pytest

import mlxrunner.nn as mnn
from mlxrunner.distributed import DistributedError, stage_cuts


def test_heads_split_evenly_and_fewer_heads_than_ranks_are_replicated():
    q = mnn.Split(0, ((8 * 4, 8),))  # 8 heads of 4
    assert [q.ranges(r, 2) for r in range(2)] == [[(0, 16)], [(16, 32)]]
    kv = mnn.Split(0, ((1 * 4, 1),))  # one key/value head: every rank keeps it
    assert [kv.ranges(r, 2) for r in range(2)] == [[(0, 4)], [(0, 4)]]
    kv2 = mnn.Split(0, ((2 * 4, 2),))  # two over four ranks: ranks 0, 1 read head 0
    assert [kv2.ranges(r, 4) for r in range(4)] == [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]


def test_packed_projections_split_each_segment():
    qkv = mnn.Split(0, ((4, 2), (4, 2), (8, 4)))  # q | k | v, each cut on its own
    assert qkv.ranges(1, 2) == [(2, 4), (6, 8), (12, 16)]
    assert qkv.local_length(2) == 8


def test_a_split_that_does_not_divide_is_one_error():
    with pytest.raises(mnn.ShardError, match="3 heads do not split over 2 ranks"):
        mnn.Split(0, ((12, 3),)).ranges(0, 2)


def test_linear_layers_declare_their_split():
    assert mnn.GatedMLP(8, 16).down_proj.parallel == mnn.Row()
    assert mnn.Linear(8, 16, False, mnn.Column(4)).parallel == mnn.Column(4)
    assert mnn.Linear(8, 16).parallel is None  # replicated


def test_pipeline_cuts_are_even_and_keep_kv_sharing_layers_together():
    assert stage_cuts(4, 2) == [0, 2, 4]
    assert stage_cuts(10, 3) == [0, 3, 7, 10]
    # Gemma 4 E2B-like: layers 6-9 read the keys and values of layers 4 and 5
    sources = [0, 1, 2, 3, 4, 5, 4, 5, 4, 5]
    assert stage_cuts(10, 2, sources) == [0, 4, 10]
    # the nearest even cut (3 of 8, over 3 ranks) would leave no cut allowed after it
    assert stage_cuts(8, 3, [0, 1, 2, 3, 4, 4, 4, 3]) == [0, 2, 3, 8]
    assert stage_cuts(5, 1) == [0, 5]
    with pytest.raises(DistributedError, match="share keys"):
        stage_cuts(3, 2, [0, 0, 0])
    with pytest.raises(DistributedError, match="cannot be split over 3 ranks"):
        stage_cuts(2, 3)


def test_a_draft_that_reads_the_target_caches_is_refused_beside_a_sharded_target(tmp_path):
    pytest.importorskip("mlxrunner_gemma4", reason="the Gemma 4 plugin is not installed")
    import shutil
    from pathlib import Path

    from mlxrunner import load
    from mlxrunner.errors import ModelFolderError
    from mlxrunner_test_support import write_tokenizer

    fixtures = Path(__file__).resolve().parents[2] / "architectures" / "gemma4" / "tests" / \
        "fixtures" / "assistant"
    if not (fixtures / "small_target" / "config.json").exists():
        pytest.skip(f"no Gemma 4 assistant fixtures under {fixtures}")
    target = tmp_path / "target"
    shutil.copytree(fixtures / "small_target", target)
    write_tokenizer(target)
    assert load(target, draft=fixtures / "small_plain").draft is not None
    with pytest.raises(ModelFolderError, match="attends over the target's caches"):
        load(target, draft=fixtures / "small_plain", distributed="tensor")


@pytest.mark.skipif(not (__import__("mlx.core").core.default_device() == __import__(
    "mlx.core").core.cpu and __import__("sys").platform != "darwin"),
    reason="half precision computes in float32 only on MLX's CPU device off macOS")
def test_a_rank_computes_half_precision_in_float32_on_the_cpu_as_load_model_does(tmp_path):
    """A rank's part of a bfloat16 folder computes in float32 where products run on the
    host BLAS (mlxrunner.model.host_dtype), as the whole model does; an asked dtype wins."""
    import json
    import shutil
    from pathlib import Path

    import mlx.core as mx

    from mlxrunner import load_model
    from mlxrunner.distributed import load_sharded

    demo = Path(__file__).resolve().parents[2] / "plugins" / "demo" / "mlxrunner_demo" / "model"
    folder = tmp_path / "m"
    shutil.copytree(demo, folder, ignore=shutil.ignore_patterns("draft"))
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    group = mx.distributed.init()
    assert group.size() == 1
    whole = load_model(folder)
    assert whole.dtype == mx.float32
    for mode in ("tensor", "pipeline"):
        part = load_sharded(folder, mode, group)
        assert part.dtype == mx.float32
        ids = mx.array([[3, 7, 11, 2]])
        assert mx.array_equal(part(ids), whole(ids)).item()
    assert load_sharded(folder, "tensor", group, dtype="bfloat16").dtype == mx.bfloat16
