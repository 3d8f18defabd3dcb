"""`mlxrunner run --distributed` over two ranks: rank 0 alone prints, the reply is the
one-process reply, and a rank that dies ends the job with one line on rank 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder

pytest.importorskip("mlxrunner_llama", reason="the llama plugin is not installed")

HERE = Path(__file__).resolve().parent
RUN = ["run", "--raw", "--temperature", "0", "--max-tokens", "12", "--json"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    config = {**EXAMPLE_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return write_model_folder(tmp_path_factory.mktemp("llama") / "model", config, seed=3)


def _mlxrunner(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, timeout=90, **kw)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_ranks_reply_once_and_as_one_process(ring, folder, mode):
    alone = _mlxrunner(RUN[0], str(folder), "class Point", *RUN[1:])
    assert alone.returncode == 0, alone.stderr
    # --ranks 2: this process starts both ranks on loopback, rank 0 keeps the terminal;
    # the prompt comes piped in, which only rank 0 reads
    job = _mlxrunner(RUN[0], str(folder), *RUN[1:], "--distributed", mode, "--ranks", "2",
                     input="class Point")
    assert job.returncode == 0, job.stderr
    lines = job.stdout.splitlines()
    assert len(lines) == 1, job.stdout  # one JSON object: rank 1 printed nothing
    assert json.loads(lines[0])["tokens"] == json.loads(alone.stdout)["tokens"]
    # sampled with a seed: every rank draws rank 0's tokens, one process's
    sampled = ("--temperature", "0.9", "--seed", "7")
    alone = _mlxrunner(RUN[0], str(folder), "class Point", *RUN[1:], *sampled)
    job = _mlxrunner(RUN[0], str(folder), "class Point", *RUN[1:], *sampled,
                     "--distributed", mode, "--ranks", "2")
    assert job.returncode == 0, job.stderr
    assert json.loads(job.stdout)["tokens"] == json.loads(alone.stdout)["tokens"]


def test_a_dead_rank_ends_the_job_with_one_line(ring, folder):
    job = ring([sys.executable, str(HERE / "dying_rank.py"), *RUN[:1], str(folder),
                "class Point", *RUN[1:], "--distributed", "tensor"])
    assert job.returncodes[1] == 3, job.outputs[1]
    assert job.returncodes[0] == 1, job.outputs[0]
    assert job.outputs[0].strip().splitlines() == [
        "mlxrunner: error: another rank of this 2-rank job stopped (MLX lost its connection "
        "to it): ending the job"], job.outputs[0]
