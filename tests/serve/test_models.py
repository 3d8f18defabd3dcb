"""Models by name: the model a server started with stays; registered models and the folders of
a models directory load on demand, stay for their keep_alive, and at most max_loaded stay."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")


@pytest.fixture
def models_server(demo_service: Any, demo_bundle: Any, tmp_path: Path) -> Any:
    from mlxrunner.serve import Listener, Models, bind, create_app

    (tmp_path / "tiny").symlink_to(demo_bundle.path, target_is_directory=True)
    models = Models(demo_service, models_dir=tmp_path, max_loaded=1)
    listener = Listener(create_app(demo_service, models=models), bind("127.0.0.1", 0)).start()
    yield listener.url, models
    listener.stop()
    for name in [n for n in models.names() if n != demo_service.name]:
        models.unload(name)


def _loaded(url: str) -> list[str]:
    return [m["model"] for m in httpx.get(url + "/api/ps").json()["models"]]


def test_a_model_is_loaded_by_name_and_listed(models_server: Any) -> None:
    url, _ = models_server
    names = [m["model"] for m in httpx.get(url + "/api/tags").json()["models"]]
    assert names[0] == "demo" and {"tiny", "demo-qwen3.5"} <= set(names)
    assert _loaded(url) == ["demo"]
    reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "class Test"}],
        "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["model"] == "tiny"
    assert _loaded(url) == ["demo", "tiny"]
    shapes = [m["traced_shapes"] for m in httpx.get(url + "/api/ps").json()["models"]]
    assert all(isinstance(n, int) and n >= 0 for n in shapes)  # an extension (batching.md)
    missing = httpx.post(url + "/api/generate", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and "tiny" in missing.json()["error"]


def test_at_most_max_loaded_stay_and_keep_alive_0_unloads(models_server: Any) -> None:
    url, _ = models_server
    body = {"prompt": "import", "raw": True, "stream": False, "options": {"num_predict": 2}}
    assert httpx.post(url + "/api/generate", json={**body, "model": "tiny"},
                      timeout=120).status_code == 200
    assert httpx.post(url + "/api/generate", json={**body, "model": "demo-qwen3.5"},
                      timeout=120).status_code == 200
    assert _loaded(url) == ["demo", "demo-qwen3.5"]  # tiny made room (max_loaded 1)
    unload = httpx.post(url + "/api/generate", json={"model": "demo-qwen3.5", "keep_alive": 0})
    assert unload.json()["done_reason"] == "unload" and _loaded(url) == ["demo"]
    assert httpx.post(url + "/api/generate", json={"model": "demo", "keep_alive": 0}
                      ).json()["done_reason"] == "load"  # the starting model stays
    reply = httpx.post(url + "/api/generate", json={**body, "model": "tiny", "keep_alive": 0},
                       timeout=120)
    assert reply.status_code == 200
    gone = threading.Event()
    for _ in range(600):  # it goes once its generation has ended
        if _loaded(url) == ["demo"]:
            gone.set()
            break
        gone.wait(0.05)
    assert gone.is_set(), _loaded(url)


def test_a_bad_keep_alive_is_a_400(models_server: Any) -> None:
    url, _ = models_server
    reply = httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "x",
                                                    "keep_alive": "soon"})
    assert reply.status_code == 400 and "keep_alive" in reply.json()["error"]


def test_max_loaded_0_serves_the_one_model(demo_service: Any) -> None:
    from mlxrunner.serve import Listener, Models, bind, create_app

    models = Models(demo_service, max_loaded=0)
    listener = Listener(create_app(demo_service, models=models), bind("127.0.0.1", 0)).start()
    try:
        assert [m["id"] for m in httpx.get(listener.url + "/v1/models").json()["data"]] == \
            ["demo"]
        reply = httpx.post(listener.url + "/v1/completions",
                           json={"model": "demo-qwen3.5", "prompt": "x", "max_tokens": 1})
        assert reply.status_code == 404
    finally:
        listener.stop()


def test_stored_models_are_offered_and_answer(demo_service: Any, demo_bundle: Any,
                                              tmp_path: Path, monkeypatch: Any) -> None:
    """What `mlxrunner list` shows (here a `cp` of a folder into the store) is listed on
    /api/tags and /v1/models and answers under its store name."""
    from mlxrunner import store
    from mlxrunner.cli import main
    from mlxrunner.serve import Listener, Models, bind, create_app

    monkeypatch.setenv("MLXRUNNER_MODELS", str(tmp_path / "store"))
    store.forget_root()
    try:
        assert main(["cp", str(demo_bundle.path), "mine:copy"]) == 0
        models = Models(demo_service, max_loaded=1)
        listener = Listener(create_app(demo_service, models=models),
                            bind("127.0.0.1", 0)).start()
        try:
            url = listener.url
            tagged = {m["model"]: m for m in httpx.get(url + "/api/tags").json()["models"]}
            listed = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
            assert "mine:copy" in tagged and "mine:copy" in listed
            # not loaded yet: what the store's manifest says
            entry = store.default_store().get("mine:copy")
            assert entry is not None
            unloaded = tagged["mine:copy"]
            assert unloaded["size"] == entry.manifest.size > 0
            assert unloaded["details"]["format"] == "safetensors"
            assert unloaded["details"]["family"] == entry.manifest.architecture
            reply = httpx.post(url + "/api/chat", timeout=120, json={
                "model": "mine:copy", "messages": [{"role": "user", "content": "class A"}],
                "stream": False, "options": {"num_predict": 3, "temperature": 0}})
            assert reply.status_code == 200 and reply.json()["model"] == "mine:copy"
        finally:
            listener.stop()
            models.unload("mine:copy")
    finally:
        store.forget_root()


def test_ps_and_stop_ask_the_running_server(models_server: Any, capsys: Any) -> None:
    from mlxrunner.cli import main

    url, _ = models_server
    assert httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "x", "raw": True,
                                                   "stream": False,
                                                   "options": {"num_predict": 1}},
                      timeout=120).status_code == 200
    capsys.readouterr()
    assert main(["ps", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "CONTEXT", "UNTIL"]
    assert [line.split()[0] for line in lines[1:]] == ["demo", "tiny"]
    assert main(["stop", "tiny", "--url", url]) == 0
    assert _loaded(url) == ["demo"]
    assert main(["stop", "tiny", "--url", url]) == 1  # no longer loaded: one line
    assert "tiny is not loaded" in capsys.readouterr().err
    assert main(["stop", "demo", "--url", url]) == 1  # the starting model stays
    assert "demo stays loaded" in capsys.readouterr().err
    assert _loaded(url) == ["demo"]
    assert main(["ps", "--url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no mlxrunner server at http://127.0.0.1:9" in err[0]
