"""Sharded tiny targets over two processes (MLX's ring backend on loopback) give exactly the
one-process greedy tokens, plain and speculative (a random DFlash draft replicated on
every rank, and a scripted draft that makes every rollback length happen on
the sharded caches), in tensor and in pipeline mode, in float32. Each rank holds fewer
parameters than one process.

Pipeline mode runs the same operations on the same values as one process: its logits are
the same bits. Tensor mode sums row-parallel partial products over the ranks, which
changes the order of additions: its logits agree to ``TENSOR_ATOL`` (seen: up to 1.1e-5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")

HERE = Path(__file__).resolve().parent
ARCHITECTURES = HERE.parent.parent / "architectures"
TENSOR_ATOL = 1e-4
DRAFTS = ("DFlashDraftModel",)  # (DFlash2 runs the same way: a block draft too)
TOKENS = 20

CASES = [
    # key/value heads fewer than ranks (1: replicated), Gated DeltaNet heads split
    pytest.param("qwen3_5", "tiny_fullfirst_untied", id="qwen3.5"),
    # sliding rings that wrap (window 8), KV-shared layers, per-layer inputs, 1 KV head
    pytest.param("gemma4", "e2b", id="gemma4"),
    # 8 query heads over 2 key/value heads, untied head, yarn RoPE
    pytest.param("llama", "mistral_gqa4_yarn", id="llama"),
    # experts split over the ranks (routed and shared experts; Gemma 4's beside its MLP)
    pytest.param("qwen3_5", "../moe_fixtures/tiny_moe", id="qwen3.5-moe"),
    pytest.param("gemma4", "moe", id="gemma4-moe"),
]


def _worker(folder: Path, mode: str, out: Path) -> list[str]:
    return [sys.executable, str(HERE / "rank_worker.py"), str(folder), mode, str(out),
            "--tokens", str(TOKENS), *(a for d in DRAFTS for a in ("--draft", d))]


def _check_parity(ring, tmp_path: Path, folder: Path) -> None:
    """One process, then two ranks in each mode: the same greedy tokens everywhere."""
    single_out = tmp_path / "single.json"
    subprocess.run(_worker(folder, "tensor", single_out), check=True, timeout=60, cwd=HERE)
    single = json.loads(single_out.read_text())
    assert single["size"] == 1
    for mode in ("tensor", "pipeline"):
        out = tmp_path / f"{mode}.json"
        job = ring(_worker(folder, mode, out))
        assert job.returncodes == [0, 0], "\n".join(job.outputs)
        ranks = [json.loads(out.read_text()), json.loads(Path(f"{out}.rank1").read_text())]
        for got in ranks:
            assert got["size"] == 2
            assert got["parameters"] < single["parameters"], f"{mode}: not sharded"
            for run in ("plain", "scripted", *DRAFTS):
                assert got[run] == single["plain"], f"{mode}, {run}, rank {got['rank']}"
            for key in ("logits", "chunked"):
                diff = np.abs(np.array(got[key]) - np.array(single[key])).max()
                if mode == "pipeline":
                    assert diff == 0.0, f"pipeline {key} differ by {diff}"
                else:
                    assert diff <= TENSOR_ATOL, f"tensor {key} differ by {diff}"


@pytest.mark.parametrize(("plugin", "fixture"), CASES)
def test_sharded_greedy_equals_one_process(ring, tmp_path, plugin, fixture):
    pytest.importorskip(f"mlxrunner_{plugin}", reason=f"the {plugin} plugin is not installed")
    folder = ARCHITECTURES / plugin / "tests" / "fixtures" / fixture
    if not (folder / "config.json").exists():
        pytest.skip(f"no tiny checkpoint at {folder}")
    _check_parity(ring, tmp_path, folder)


def test_one_deltanet_key_head_is_replicated(ring, tmp_path):
    """Gated DeltaNet with one key head over two ranks: each rank keeps it and half the
    value heads."""
    pytest.importorskip("mlxrunner_qwen3_5", reason="the Qwen3.5 plugin is not installed")
    from mlxrunner_test_support import write_model_folder

    fixture = ARCHITECTURES / "qwen3_5" / "tests" / "fixtures" / "tiny_fullfirst_untied"
    config = json.loads((fixture / "config.json").read_text())
    text = config.get("text_config", config)
    text.update(linear_num_key_heads=1, linear_num_value_heads=2)
    _check_parity(ring, tmp_path, write_model_folder(tmp_path / "hk1", config, seed=2))


@pytest.fixture(scope="module")
def quantized_llama(tmp_path_factory) -> Path:
    """A 4-bit (group 32) Llama big enough that its packed gate/up product runs on the host
    BLAS (a forward that evaluates partway)."""
    pytest.importorskip("mlxrunner_llama", reason="the llama plugin is not installed")
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    import mlxrunner
    from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder

    config = {**EXAMPLE_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
    folder = write_model_folder(tmp_path_factory.mktemp("q4") / "model", config, seed=1)
    model = mlxrunner.load_model(folder)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(
        {**config, "quantization": {"group_size": 32, "bits": 4}}))
    return folder


def test_quantized_sharded_greedy_equals_one_process(ring, tmp_path, quantized_llama):
    _check_parity(ring, tmp_path, quantized_llama)


@pytest.mark.skipif(sys.platform == "darwin", reason="half precision computes in float32 only "
                    "on MLX's CPU device off macOS")
def test_ranks_agree_on_the_dtype_they_compute_in(ring, tmp_path):
    """A half-precision folder computes in float32 on MLX's CPU only where every rank would:
    a rank whose host products are off keeps bfloat16, and so then does every other rank
    (their collectives need one dtype); with both on, both take float32."""
    import shutil

    demo = HERE.parent.parent / "plugins" / "demo" / "mlxrunner_demo" / "model"
    folder = tmp_path / "m"
    shutil.copytree(demo, folder, ignore=shutil.ignore_patterns("draft"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16")))
    code = ("import os, sys; import mlx.core as mx; mx.set_default_device(mx.cpu)\n"
            "if os.environ['MLX_RANK'] == '1': "
            "os.environ['MLXRUNNER_HOST_PRODUCTS'] = sys.argv[2]\n"
            "from mlxrunner import distributed\n"
            "m = distributed.load_sharded(sys.argv[1], 'tensor', distributed.world())\n"
            "print('dtype', m.dtype)")
    for second, want in (("1", "float32"), ("0", "bfloat16")):
        job = ring([sys.executable, "-c", code, str(folder), second])
        assert job.returncodes == [0, 0], "\n".join(job.outputs)
        for out in job.outputs:
            assert f"dtype mlx.core.{want}" in out, out
