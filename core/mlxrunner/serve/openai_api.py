"""OpenAI's API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (and one
model), ``/v1/responses`` (stateless), ``/health``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from ..chat.formats import ParsedMessage
from ..decode.grammar import Format, GrammarError
from .chat import ChatTurn, arguments_json, call_id, chat_prompt, raw_prompt
from .common import (
    STOP_STRINGS,
    Count,
    RecentTokens,
    Seed,
    StopString,
    Streamed,
    TopK,
    complete,
    dumps,
    models_of,
    no_reply,
    service_for,
    streamed,
)
from .engine import Reply, RequestError, Service

router = APIRouter()

Probability = Annotated[float, Field(gt=0, le=1)]


class SamplerFields(BaseModel):
    """The sampler options a request may set (OpenAI's names and bounds; Ollama's extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    repeat_last_n: RecentTokens | None = None
    max_tokens: Count | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=STOP_STRINGS)] | None = None
    n: Count | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and (value == "" or (isinstance(value, list)
                                                  and not all(value))):
            raise ValueError("stop strings must not be empty")
        return value

    def sampler(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "seed": self.seed,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n}

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_supported(self) -> None:
        """Refuse what this server cannot honour rather than ignore it."""
        if self.n is not None and self.n > 1:
            raise RequestError("n: only 1 choice per request is supported", param="n")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias")

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(SamplerFields):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    think: StrictBool | None = Field(default=None, description="mlxrunner: thinking on/off")
    metadata: dict[str, Any] | None = None
    store: bool | None = None


class CompletionRequest(SamplerFields):
    prompt: str | list[str]
    logprobs: Annotated[int, Field(ge=0, le=5)] | StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


def output_format(value: Any, field: str) -> Format | None:
    """OpenAI's ``response_format`` (chat) or ``text.format`` (responses) as a format: None
    for text; a shape that is none of OpenAI's is a 400 naming ``field``."""
    try:
        return Format.from_openai(value, field=field)
    except GrammarError as exc:
        raise RequestError(str(exc), param=field) from None


def tools_for(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None
              ) -> list[dict[str, Any]] | None:
    """The tools the model sees under ``tool_choice`` (only "auto" and "none" are kept to)."""
    if choice in (None, "auto"):
        return tools
    if choice == "none":
        return None
    raise RequestError("tool_choice: only 'auto' and 'none' are supported", param="tool_choice")


def think_of(think: bool | None, effort: str | None) -> bool | None:
    if think is not None:
        return think
    return None if effort is None else effort not in ("none", "minimal")


def _envelope(service: Service, kind: str, request_id: str) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()),
            "model": service.name}


def usage(reply: Reply) -> dict[str, Any]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.tokens),
            "total_tokens": reply.prompt_tokens + len(reply.tokens),
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens}}


def _tool_call_entries(parsed: ParsedMessage, start: int = 0) -> list[dict[str, Any]]:
    return [{"index": start + i, "id": call_id(), "type": "function",
             "function": {"name": call.name, "arguments": arguments_json(call)}}
            for i, call in enumerate(parsed.tool_calls)]


def _finish(reply: Reply, tool_calls: int) -> str:
    return "tool_calls" if tool_calls else ("stop" if reply.finish_reason == "stop"
                                            else "length")


def _sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else dumps(payload)}\n\n"


def _sse_error(message: str) -> str:
    return _sse({"error": {"message": message, "type": "server_error", "param": None,
                           "code": None}})


@router.get("/health", tags=["mlxrunner"])
async def health() -> dict[str, str]:
    return {"status": "ok"}


def _model_entry(request: Request, name: str) -> dict[str, Any]:
    service = models_of(request).find(name)
    created = int(service.loaded_at) if service is not None else 0
    return {"id": name, "object": "model", "created": created, "owned_by": "mlxrunner"}


@router.get("/v1/models", tags=["openai"])
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list",
            "data": [_model_entry(request, name) for name in models_of(request).names()]}


@router.get("/v1/models/{model_id:path}", tags=["openai"])
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    return _model_entry(request, models_of(request).known(model_id))


@router.post("/v1/chat/completions", tags=["openai"])
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    body.check_supported()
    form = output_format(body.response_format, "response_format")
    service = await service_for(request, body.model)
    turn, ids = await chat_prompt(service, body.messages,
                                  tools_for(body.tools, body.tool_choice),
                                  think_of(body.think, body.reasoning_effort))
    sampler = {**body.sampler(), "logprobs": body.logprobs, "top_logprobs": body.top_logprobs}
    generation = service.generation(ids, sampler,
                                    max_tokens=body.max_completion_tokens or body.max_tokens,
                                    stops=body.stops(), output_format=form,
                                    format_field="response_format")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        items = service.engine.stream(generation)  # queued now: a full queue is a 503
        return streamed(request, _chat_events(request, service, turn, items, request_id,
                                              body.include_usage()),
                        "text/event-stream", _sse_error)
    reply = await complete(request, service, generation)
    if reply is None:
        return no_reply()
    parsed = turn.parse(reply.text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.thinking:
        message["reasoning_content"] = parsed.thinking
    if parsed.tool_calls:
        message["tool_calls"] = [{k: v for k, v in entry.items() if k != "index"}
                                 for entry in _tool_call_entries(parsed)]
    choice: dict[str, Any] = {"index": 0, "message": message,
                              "finish_reason": _finish(reply, len(parsed.tool_calls)),
                              "logprobs": None}
    content = service.logprobs_content(reply)
    if content is not None:
        choice["logprobs"] = {"content": content}
    return Response(dumps({**_envelope(service, "chat.completion", request_id),
                           "choices": [choice], "usage": usage(reply),
                           "statistics": reply.stats}), media_type="application/json")


async def _chat_events(request: Request, service: Service, turn: ChatTurn,
                       items: AsyncIterator[str | Reply], request_id: str,
                       include_usage: bool) -> AsyncIterator[str]:
    head = _envelope(service, "chat.completion.chunk", request_id)
    calls = 0

    def chunk(delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish}]})

    def pieces(parsed: list[ParsedMessage]) -> list[str]:
        nonlocal calls
        out = []
        for piece in parsed:
            if piece.tool_calls:
                entries = _tool_call_entries(piece, calls)
                calls += len(entries)
                out.append(chunk({"tool_calls": entries}))
            elif piece.thinking:
                out.append(chunk({"reasoning_content": piece.thinking}))
            elif piece.content:
                out.append(chunk({"content": piece.content}))
        return out

    yield chunk({"role": "assistant", "content": ""})
    stream = Streamed(items, turn)
    async for parsed in stream:
        for line in pieces(parsed):
            yield line
    reply = stream.reply
    request.state.tokens = len(reply.tokens)
    # Every token's logprobs come with the last chunk: the decoding loop reports them when
    # it ends (a client that joins the chunks' lists gets the whole list).
    content = service.logprobs_content(reply)
    yield chunk({}, _finish(reply, calls), None if content is None else {"content": content})
    if include_usage:
        yield _sse({**head, "choices": [], "usage": usage(reply)})
    yield _sse("[DONE]")


def _legacy_logprobs(service: Service, reply: Reply) -> dict[str, Any] | None:
    content = service.logprobs_content(reply)
    if content is None:
        return None
    offsets, at = [], 0
    for entry in content:
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": [e["token"] for e in content],
            "token_logprobs": [e["logprob"] for e in content],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in content],
            "text_offset": offsets, "content": content}


@router.post("/v1/completions", tags=["openai"])
async def completions(body: CompletionRequest, request: Request) -> Response:
    body.check_supported()
    service = await service_for(request, body.model)
    if body.best_of is not None and body.best_of > 1:
        raise RequestError("best_of: only 1 is supported", param="best_of")
    if body.echo or body.suffix:
        raise RequestError("echo and suffix are not supported", param="echo")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise RequestError("prompt: exactly one prompt per request is supported",
                           param="prompt")
    top = body.top_logprobs
    if isinstance(body.logprobs, int) and not isinstance(body.logprobs, bool):
        top = body.logprobs
    wants_logprobs = body.logprobs is not None and body.logprobs is not False
    ids = await raw_prompt(service, prompts[0])
    sampler = {**body.sampler(), "logprobs": wants_logprobs or None, "top_logprobs": top}
    # OpenAI's documented default for completions is 16 tokens
    generation = service.generation(ids, sampler, max_tokens=body.max_tokens or 16,
                                    stops=body.stops())
    head = _envelope(service, "text_completion", f"cmpl-{uuid.uuid4().hex}")
    if body.stream:
        items = service.engine.stream(generation)  # queued now: a full queue is a 503
        return streamed(request, _completion_events(request, service, items, head,
                                                    body.include_usage()),
                        "text/event-stream", _sse_error)
    reply = await complete(request, service, generation)
    if reply is None:
        return no_reply()
    choice = {"index": 0, "text": reply.text, "finish_reason": _finish(reply, 0),
              "logprobs": _legacy_logprobs(service, reply)}
    return Response(dumps({**head, "choices": [choice], "usage": usage(reply),
                           "statistics": reply.stats}), media_type="application/json")


async def _completion_events(request: Request, service: Service,
                             items: AsyncIterator[str | Reply], head: dict[str, Any],
                             include_usage: bool) -> AsyncIterator[str]:
    reply = Reply()
    async for item in items:
        if isinstance(item, Reply):
            reply = item
        else:
            yield _sse({**head, "choices": [{"index": 0, "text": item, "logprobs": None,
                                             "finish_reason": None}]})
    request.state.tokens = len(reply.tokens)
    yield _sse({**head, "choices": [{"index": 0, "text": "",
                                     "logprobs": _legacy_logprobs(service, reply),
                                     "finish_reason": _finish(reply, 0)}]})
    if include_usage:
        yield _sse({**head, "choices": [], "usage": usage(reply)})
    yield _sse("[DONE]")
