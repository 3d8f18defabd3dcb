"""``mlxrunner serve`` from the command line."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest


def test_a_taken_port_is_one_clear_error(served: Any, capsys: Any) -> None:
    from mlxrunner.cli import main

    port = served.url.rsplit(":", 1)[1]
    assert main(["serve", "--port", port]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlxrunner: error: cannot listen on 127.0.0.1:")


def test_a_port_out_of_range_is_refused_by_the_command_line() -> None:
    run = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "serve", "--port", "70000"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("'70000' is not a port (0-65535)")


def test_serving_beyond_this_machine_without_a_key_warns_and_answers(demo_bundle: Any
                                                                     ) -> None:
    """A fresh process, as a user starts it: each request arrives on a new connection, and
    the second replays what the first traced (generation stays on the model's thread)."""
    httpx = pytest.importorskip("httpx")
    process = subprocess.Popen([sys.executable, "-m", "mlxrunner.cli", "serve", "--host",
                                "0.0.0.0", "--port", "0", "--verbose"],
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        lines = []
        while not (line := process.stderr.readline()).startswith("mlxrunner: serving"):
            assert line, "".join(lines)
            lines.append(line)
        assert any("without an API key" in line for line in lines), lines
        port = line.split("http://0.0.0.0:")[1].split()[0]
        for prompt in ("def fibonacci(n):", "import os"):
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                               json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                               timeout=120)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] \
                == 12
        # bound beyond loopback, any host name may reach it (its own, its addresses)
        named = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                          headers={"Host": "models.lan:8080"})
        assert named.status_code == 200
        access = process.stderr.readline()
        assert "POST /v1/completions 200" in access
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_a_bad_keep_alive_is_one_clear_error_before_any_work(capsys: Any) -> None:
    from mlxrunner.cli import main

    assert main(["serve", "--port", "0", "--keep-alive", "soon"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mlxrunner: error: keep_alive 'soon' is not a duration (e.g. '5m', 30, -1)"]


def test_the_key_and_origins_are_read_once_from_the_environment() -> None:
    from mlxrunner.settings import Settings

    found = Settings.from_environment({"MLXRUNNER_API_KEY": "sesame",
                                       "MLXRUNNER_ORIGINS": "https://a.example, app://*,"})
    assert found.api_key == "sesame" and found.origins == ("https://a.example", "app://*")
    assert "sesame" not in repr(found)  # a secret stays out of logs and tracebacks
    assert Settings.from_environment({}).api_key is None


def test_ctrl_c_ends_open_streams_with_an_error_event_and_exits_cleanly(demo_bundle: Any
                                                                        ) -> None:
    """Ctrl-C while a reply streams: the stream's last event says the server is shutting
    down (it is not cut off), the process exits within seconds (status 130), and no traceback is
    printed."""
    import signal
    import threading

    httpx = pytest.importorskip("httpx")
    process = subprocess.Popen([sys.executable, "-m", "mlxrunner.cli", "serve", "demo-qwen3.5",
                                "--port", "0"], stderr=subprocess.PIPE, text=True)
    events: list[str] = []
    streaming = threading.Event()

    def client(url: str) -> None:
        body = {"prompt": "def fibonacci(n):", "max_tokens": 8000, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.strip():
                    events.append(line)
                    streaming.set()

    try:
        assert process.stderr is not None
        while not (line := process.stderr.readline()).startswith("mlxrunner: serving"):
            assert line
        url = "http://" + line.split("http://")[1].split()[0]
        reader = threading.Thread(target=client, args=(url,), daemon=True)
        reader.start()
        assert streaming.wait(120)
        process.send_signal(signal.SIGINT)
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert process.wait(timeout=30) == 130  # as a shell reports Ctrl-C
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in err and "CancelledError" not in err, err
    last = [e for e in events if e != "data: [DONE]"][-1]
    assert "the server is shutting down" in last, events[-3:]
