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


def _rows_per_step(engine: Any) -> list[int]:
    """The rows decoding after each step of ``engine``'s scheduler from now on (a list the
    steps append to)."""
    scheduler, rows = engine.scheduler, []
    assert scheduler is not None
    step = scheduler.step

    def counted() -> bool:
        going = step()
        rows.append(scheduler.running)
        return going

    scheduler.step = counted
    return rows


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_concurrent_drafted_requests_decode_in_one_batch(serve_with: Any,
                                                         prefix_cache: bool) -> None:
    """The demo's draft with the prefix cache on and off: concurrent drafted requests (greedy,
    seeded, with a JSON format) are rows of one batch, each its solo reply."""
    import mlxrunner
    from mlxrunner import settings
    from mlxrunner.serve import Service

    with settings.overridden(prefix_cache=prefix_cache):
        bundle = mlxrunner.load("demo-qwen3.5")
        served = serve_with(Service(bundle, name="demo", max_batch=8))
    engine = served.service.engine
    assert bundle.draft is not None and (engine.prefix_cache is not None) == prefix_cache
    bodies = [{"prompt": p, "max_tokens": 10, **OPTIONS[i % 2]}
              for i, p in enumerate(PROMPTS[:4])]
    bodies.append({"model": "demo", "max_tokens": 16, "temperature": 0,
                   "messages": [{"role": "user", "content": "Give me a JSON object."}],
                   "response_format": {"type": "json_object"}})

    def path(body: dict[str, Any]) -> str:
        return "/v1/chat/completions" if "messages" in body else "/v1/completions"

    def text(got: dict[str, Any]) -> str:
        choice = got["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    alone = [httpx.post(served.url + path(b), json=b, timeout=120).json() for b in bodies]
    assert all(got["statistics"]["mode"] == "speculative" for got in alone)
    rows = _rows_per_step(engine)

    async def together() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            async def one(body: dict[str, Any]) -> dict[str, Any]:
                return (await client.post(path(body), json=body)).json()
            return list(await asyncio.gather(*(one(b) for b in bodies)))

    concurrent = asyncio.run(together())
    assert [text(g) for g in concurrent] == [text(g) for g in alone]
    assert max(rows) >= 3  # several drafted rows decoded together
    assert all(got["statistics"]["mode"] == "speculative" for got in concurrent)
    if prefix_cache:  # the second time round, every prompt was met before
        assert all(got["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0
                   for got in concurrent)


#: a Qwen3.5 folder whose checkpoint carries its MTP head (its draft unless told not to); the
#: Gemma 4 assistant in the batch: tests/batch/test_speculative_batch.py (its tiny target's
#: 128-token vocabulary takes no text tokenizer)
MTP_FOLDER = (__import__("pathlib").Path(__file__).resolve().parents[2] / "architectures" /
              "qwen3_5" / "tests" / "mtp_fixtures" / "tiny_mtp")


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_drafted_requests_of_the_mtp_head_share_the_batch(tmp_path: Any, serve_with: Any,
                                                          prefix_cache: bool) -> None:
    import shutil

    import mlxrunner
    from mlxrunner import settings
    from mlxrunner.serve import Service
    from mlxrunner_test_support import write_tokenizer

    pytest.importorskip("mlxrunner_qwen3_5", reason="the qwen3_5 plugin is not installed")
    folder = tmp_path / "model"
    shutil.copytree(MTP_FOLDER, folder)
    (folder / "reference.npz").unlink(missing_ok=True)
    config = __import__("json").loads((folder / "config.json").read_text())
    write_tokenizer(folder, (config.get("text_config") or config)["vocab_size"])
    with settings.overridden(prefix_cache=prefix_cache):
        bundle = mlxrunner.load(folder)
        served = serve_with(Service(bundle, name="tiny", max_batch=8))
    assert bundle.draft is not None
    engine = served.service.engine
    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS[:4]]

    def text(body: dict[str, Any]) -> str:
        got = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()
        assert got["statistics"]["mode"] == "speculative"
        return str(got["choices"][0]["text"])

    alone = [text(b) for b in bodies]
    plain = [mlxrunner.generate(bundle.model, bundle.tokenizer.encode(b["prompt"]),
                                options=mlxrunner.SamplerOptions(temperature=0),
                                max_tokens=12).tokens for b in bodies]
    assert alone == [bundle.tokenizer.decode(t) for t in plain]
    rows = _rows_per_step(engine)

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            async def one(body: dict[str, Any]) -> str:
                got = (await client.post("/v1/completions", json=body)).json()
                return str(got["choices"][0]["text"])
            return list(await asyncio.gather(*(one(b) for b in bodies)))

    assert asyncio.run(together()) == alone
    assert max(rows) >= 2
