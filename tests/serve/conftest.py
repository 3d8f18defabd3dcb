"""One server over the embedded demo model (a DFlash2 draft, the qwen3.5 parser) for the
serve tests, on a free loopback port; further apps share its model's engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import mlxrunner
from mlxrunner import host as plugins

pytest.importorskip("fastapi")


@pytest.fixture(scope="session")
def demo_bundle() -> Any:
    if "demo-qwen3.5" not in plugins.host().registry("models"):
        pytest.skip("the demo plugin (mlxrunner-demo) is not installed")
    return mlxrunner.load("demo-qwen3.5")


@pytest.fixture(scope="session")
def demo_service(demo_bundle: Any) -> Any:
    from mlxrunner.serve import Service

    return Service(demo_bundle, name="demo")


class Served:
    """A running server: its URL and what it serves."""

    def __init__(self, service: Any, config: Any = None) -> None:
        from mlxrunner.serve import Listener, bind, create_app

        self.service = service
        self.listener = Listener(create_app(service, config), bind("127.0.0.1", 0)).start()
        self.url = self.listener.url

    def close(self) -> None:
        self.listener.stop()


@pytest.fixture(scope="session")
def served(demo_service: Any) -> Iterator[Served]:
    server = Served(demo_service)
    yield server
    server.close()


@pytest.fixture
def serve_with(demo_service: Any) -> Iterator[Any]:
    """Start further servers (another config, or another service sharing the engine)."""
    started: list[Served] = []

    def start(service: Any = None, config: Any = None) -> Served:
        server = Served(service or demo_service, config)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()
