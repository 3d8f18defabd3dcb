"""`mlxrunner serve --distributed` over two ranks: rank 0 serves, rank 1 follows each
request in lockstep (greedy replies equal one process's; a stop string ends both ranks'
generation, and the next request still agrees)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder

pytest.importorskip("mlxrunner_llama", reason="the llama plugin is not installed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, **body) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]


def test_rank_0_serves_and_rank_1_follows(ring, tmp_path):
    config = {**EXAMPLE_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    folder = write_model_folder(tmp_path / "model", config, seed=3)
    alone = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", str(folder),
                            "class Point", "--raw", "--temperature", "0", "--max-tokens", "10",
                            "--json"], capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0, alone.stderr
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "mlxrunner.cli", "serve", str(folder),
                               "--port", str(port), "--distributed", "tensor", "--ranks", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert server.poll() is None, server.communicate()
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        greedy = dict(prompt="class Point", max_tokens=10, temperature=0)
        assert _complete(port, **greedy)["text"] == json.loads(alone.stdout)["text"]
        first = _complete(port, **greedy)["text"]
        stopped = _complete(port, **greedy, stop=[first[2:4]])
        assert stopped["finish_reason"] == "stop"
        assert _complete(port, **greedy)["text"] == first  # still in lockstep
        sampled = dict(prompt="class Point", max_tokens=10, temperature=0.8, seed=4)
        assert _complete(port, **sampled)["text"] == _complete(port, **sampled)["text"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # every rank: a rank left behind holds the pipes open, and communicate waits
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate()
