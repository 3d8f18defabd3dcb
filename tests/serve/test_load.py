"""Bounded load on loopback: many concurrent streams, clients that leave midway, a few hundred
requests in a row."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import tracemalloc
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

BODY = {"messages": [{"role": "user", "content": "class Test"}], "max_tokens": 8,
        "temperature": 0}


def _streamed_text(lines: list[str]) -> str:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def test_32_concurrent_streams_all_complete_as_each_would_alone(served: Any) -> None:
    alone = httpx.post(served.url + "/v1/chat/completions", json=BODY, timeout=120).json()
    want = alone["choices"][0]["message"]["content"]

    async def one(client: Any) -> str:
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**BODY, "stream": True}) as reply:
            assert reply.status_code == 200
            return _streamed_text([line async for line in reply.aiter_lines()])

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=served.url, timeout=300, limits=limits) as c:
            return list(await asyncio.gather(*(one(c) for _ in range(32))))

    assert asyncio.run(run()) == [want] * 32


@pytest.mark.parametrize("stream", [True, False])
def test_clients_that_leave_midway_are_cancelled_and_the_rest_finish(served: Any,
                                                                     stream: bool) -> None:
    engine = served.service.engine
    want = httpx.post(served.url + "/v1/chat/completions", json=BODY,
                      timeout=120).json()["choices"][0]["message"]["content"]
    before = dict(engine.counts)
    long = json.dumps({**BODY, "max_tokens": 100000, "temperature": 0.9,
                       "stream": stream}).encode()
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    everyone_queued = threading.Event()
    stayed: list[Any] = []

    def leaver() -> None:
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " +
                         str(len(long)).encode() + b"\r\n\r\n" + long)
            everyone_queued.wait(120)
        # the connection closes here, mid-reply

    def stayer() -> None:
        reply = httpx.post(served.url + "/v1/chat/completions", json=BODY, timeout=300)
        stayed.append(reply.json()["choices"][0]["message"]["content"])

    threads = [threading.Thread(target=leaver if i % 2 == 0 else stayer) for i in range(16)]
    for thread in threads:
        thread.start()
    while engine.counts["submitted"] < before["submitted"] + 16:
        everyone_queued.wait(0.01)
    everyone_queued.set()
    for thread in threads:
        thread.join()
    while engine.busy:  # every job has ended or been skipped
        everyone_queued.wait(0.01)
    assert stayed == [want] * 8
    counts = {k: engine.counts[k] - before[k] for k in before}
    assert counts["done"] == 8 and counts["failed"] == 0  # no leaver ran to its end
    assert counts["cancelled"] + counts["skipped"] == 8


def test_300_requests_in_a_row_leave_memory_flat(served: Any) -> None:
    body = {"prompt": "import", "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        def batch(n: int) -> None:
            for i in range(n):
                reply = client.post("/v1/completions", json={**body, "stream": i % 2 == 1})
                assert reply.status_code == 200

        batch(50)  # warm: traces, caches, pools
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            batch(250)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert grown < 1 << 20, f"{grown} bytes more after 250 requests"
