"""Concurrent requests share the engine's batch: each reply is the one the request gets
alone, and the batch takes fewer forwards than the requests' tokens one at a time."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(", "x = [",
           "# a comment"]
OPTIONS = [{"temperature": 0}, {"temperature": 0.9, "seed": 11}]


def test_concurrent_requests_are_each_their_solo_reply_in_fewer_steps(demo_bundle: Any,
                                                                      serve_with: Any) -> None:
    import mlxrunner
    from mlxrunner.serve import Service

    # A model of its own (its traced steps replay only on the thread of the engine that
    # traced them), without the demo's draft: a drafted request with the prefix cache
    # decodes alone.
    bundle = dataclasses.replace(mlxrunner.load("demo-qwen3.5"), draft=None)
    served = serve_with(Service(bundle, name="demo", max_batch=8))
    engine = served.service.engine
    bodies = [{"prompt": p, "max_tokens": 8, **OPTIONS[i % 2]} for i, p in enumerate(PROMPTS)]

    def reply(body: dict[str, Any]) -> tuple[str, int]:
        got = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()
        return got["choices"][0]["text"], got["usage"]["completion_tokens"]

    alone = [reply(b) for b in bodies]
    assert engine.scheduler is not None
    before = engine.scheduler.steps

    async def together() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            async def one(body: dict[str, Any]) -> tuple[str, int]:
                got = (await client.post("/v1/completions", json=body)).json()
                return got["choices"][0]["text"], got["usage"]["completion_tokens"]
            return list(await asyncio.gather(*(one(b) for b in bodies)))

    concurrent = asyncio.run(together())
    steps = engine.scheduler.steps - before
    assert concurrent == alone
    tokens = sum(n for _, n in concurrent)
    assert tokens > len(bodies)
    # one at a time, each token is one step of its own (each prompt's prefill one more)
    assert steps < tokens
