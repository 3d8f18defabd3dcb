"""What the three APIs' routes share: the service, client disconnects, streamed bodies."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, StrictInt, StringConstraints

from ..errors import MLXRunnerError, PluginFailedError
from .engine import Generation, Reply, Service
from .errors import GENERIC_500
from .models import Models

# Request values every API shares: strict integers (JSON true is not 1) and bounds far above
# what any model can use, far below where anything overflows or allocates.
#: a token count
Count = Annotated[StrictInt, Field(ge=1, le=1 << 31)]
#: a sampler seed (64 bits)
Seed = Annotated[StrictInt, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
#: top_k (0: off), at most a vocabulary's size
TopK = Annotated[StrictInt, Field(ge=0, le=1 << 24)]
#: repeat_last_n (-1: all, 0: off)
RecentTokens = Annotated[StrictInt, Field(ge=-1, le=1 << 31)]
#: the stop strings of one request
STOP_STRINGS = 64
StopString = Annotated[str, StringConstraints(min_length=1, max_length=1024)]

log = logging.getLogger("mlxrunner.serve")
#: answered to a client that has gone (only the access log sees it)
CLIENT_GONE = 499


def models_of(request: Request) -> Models:
    models: Models = request.app.state.models
    return models


async def service_for(request: Request, name: str | None, keep_alive: Any = None) -> Service:
    """The service of model ``name`` (loaded on demand; a 404 for a name not served)."""
    return await models_of(request).get(name, keep_alive)


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False)


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def complete(request: Request, service: Service, generation: Generation
                   ) -> Reply | None:
    """The whole reply, or None when the client went away first (generation cancelled)."""
    reply = await service.engine.complete(
        generation, lambda: until_disconnected(request))
    if reply is not None:
        request.state.tokens = len(reply.tokens)
    return reply


class Streamed:
    """A streamed generation read through a chat turn: iterating gives the turn's parsed
    pieces as the text arrives, then what the end of the text releases; ``reply`` is the
    generation's Reply once the iteration is over."""

    def __init__(self, items: AsyncIterator[str | Reply], turn: Any) -> None:
        self.items, self.turn, self.reply = items, turn, Reply()

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for item in self.items:
            if isinstance(item, Reply):
                self.reply = item
            else:
                yield self.turn.feed(item)
        yield self.turn.finish()


def failure_message(exc: BaseException) -> str:
    """What a stream's last event says about a failure after its status went out."""
    if isinstance(exc, PluginFailedError):
        log.warning("mlxrunner: %s (reported in the stream)", exc)
        return str(exc)
    if isinstance(exc, MLXRunnerError):
        log.error("mlxrunner: %s (reported in the stream)", exc)
        return str(exc).splitlines()[0]
    log.error("mlxrunner: a streamed reply failed", exc_info=exc)
    return GENERIC_500


def streamed(request: Request, lines: AsyncIterator[str], media_type: str,
             on_failure: Callable[[str], str]) -> Response:
    """A streamed body of ``lines``; a failure midway ends it with ``on_failure(message)``."""

    async def body() -> AsyncIterator[str]:
        try:
            async for line in lines:
                yield line
        except Exception as exc:  # the status is out: the stream's last line says it
            yield on_failure(failure_message(exc))

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type=media_type, headers=headers)


def no_reply() -> Response:
    return Response(status_code=CLIENT_GONE)
