"""Anthropic's Messages API: ``/v1/messages`` (streamed as its events or not) and
``/v1/messages/count_tokens``. Content blocks map onto the renderers' messages: ``text``,
``image``, ``thinking``, ``tool_use`` (an assistant's tool call) and ``tool_result`` (a tool
message)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..chat.formats import ParsedMessage
from .chat import ChatTurn, call_id, chat_prompt
from .common import (
    STOP_STRINGS,
    Count,
    Seed,
    StopString,
    Streamed,
    TopK,
    complete,
    dumps,
    no_reply,
    service_for,
    streamed,
)
from .engine import Reply, RequestError, Service

router = APIRouter()


class Thinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(BaseModel):
    # Agents send fields of newer API versions (cache_control, context_management, ...)
    # that change nothing here: taken and unused, where the other APIs refuse them.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Count
    stream: StrictBool = False
    stop_sequences: Annotated[list[StopString], Field(max_length=STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = None
    seed: Seed | None = Field(default=None, description="mlxrunner: reproducible sampling")
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of blocks",
                           param="messages")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise RequestError(f"{where}: only text blocks are allowed here", param="messages")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system and messages in the renderers' shape."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        where = f"message {i}"
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}: role must be 'user' or 'assistant', not {role!r}",
                               param="messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}: content must be a string or a list of blocks",
                               param="messages")
        parts: list[dict[str, Any]] = []
        thinking, calls = "", []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(block.get("text", ""))})
            elif kind == "image":
                parts.append(_image(block, where))
            elif kind == "thinking" and role == "assistant":
                thinking += str(block.get("thinking", ""))
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                text = result if isinstance(result, str) else _text_of(result, where)
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": text})
            else:
                raise RequestError(f"{where}: a {kind!r} block is not allowed in a {role} "
                                   "message", param="messages")
        if parts or thinking or calls:
            entry: dict[str, Any] = {"role": role, "content": parts}
            if thinking:
                entry["reasoning_content"] = thinking
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    choice = (body.tool_choice or {}).get("type", "auto")
    if choice == "none" or not body.tools:
        return None
    if choice != "auto":
        raise RequestError("tool_choice: only 'auto' and 'none' are supported",
                           param="tool_choice")
    return [{"type": "function", "function": {"name": t.get("name"),
                                              "description": t.get("description", ""),
                                              "parameters": t.get("input_schema") or {}}}
            for t in body.tools]


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as our image part: base64 data (a URL source is not fetched)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64" or \
            not isinstance(source.get("data"), str):
        raise RequestError(f"{where}: an image block needs a base64 source (URL sources are "
                           "not fetched)", param="messages")
    return {"type": "image", "data": source["data"]}


def _think(body: CountTokensRequest) -> bool | None:
    return None if body.thinking is None else body.thinking.type != "disabled"


async def _prompt(service: Service, body: CountTokensRequest
                  ) -> tuple[ChatTurn, Sequence[int]]:
    return await chat_prompt(service, _messages(body), _tools(body), _think(body))


def _blocks(parsed: ParsedMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if parsed.thinking:
        blocks.append({"type": "thinking", "thinking": parsed.thinking, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content})
    blocks += [{"type": "tool_use", "id": call_id(), "name": c.name, "input": c.arguments}
               for c in parsed.tool_calls]
    return blocks


def _stop_reason(reply: Reply, tool_calls: int) -> tuple[str, str | None]:
    if tool_calls:
        return "tool_use", None
    if reply.finish_reason != "stop":
        return "max_tokens", None
    if reply.stop_string is not None:
        return "stop_sequence", reply.stop_string
    return "end_turn", None


@router.post("/v1/messages/count_tokens", tags=["anthropic"])
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    service = await service_for(request, body.model)
    _, ids = await _prompt(service, body)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages", tags=["anthropic"])
async def messages(body: MessagesRequest, request: Request) -> Response:
    service = await service_for(request, body.model)
    turn, ids = await _prompt(service, body)
    sampler = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
               "seed": body.seed}
    stops = list(body.stop_sequences or [])
    generation = service.generation(ids, sampler, max_tokens=body.max_tokens, stops=stops)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        items = service.engine.stream(generation)  # queued now: a full queue is a 503
        return streamed(request, _events(request, service, turn, items, message_id,
                                         len(ids)), "text/event-stream", _event_error)
    reply = await complete(request, service, generation)
    if reply is None:
        return no_reply()
    parsed = turn.parse(reply.text)
    reason, sequence = _stop_reason(reply, len(parsed.tool_calls))
    return Response(dumps({"id": message_id, "type": "message", "role": "assistant",
                           "model": service.name, "content": _blocks(parsed),
                           "stop_reason": reason, "stop_sequence": sequence,
                           # Anthropic's input_tokens leave out those read from a cache
                           "usage": {"input_tokens": reply.prompt_tokens - reply.cached_tokens,
                                     "cache_read_input_tokens": reply.cached_tokens,
                                     "output_tokens": len(reply.tokens)}}),
                    media_type="application/json")


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {dumps({'type': name, **payload})}\n\n"


def _event_error(message: str) -> str:
    return _event("error", {"error": {"type": "api_error", "message": message}})


async def _events(request: Request, service: Service, turn: ChatTurn,
                  items: AsyncIterator[str | Reply], message_id: str, prompt_tokens: int
                  ) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": service.name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    index, open_kind, calls = -1, None, 0

    def to_events(pieces: list[ParsedMessage]) -> list[str]:
        nonlocal index, open_kind, calls
        out = []
        for piece in pieces:
            kind = piece.kind
            if kind == "tool_call" or kind != open_kind:
                if open_kind is not None:
                    out.append(_event("content_block_stop", {"index": index}))
                    open_kind = None
            if kind == "tool_call":
                for call in piece.tool_calls:
                    index += 1
                    calls += 1
                    out.append(_event("content_block_start", {"index": index, "content_block": {
                        "type": "tool_use", "id": call_id(), "name": call.name, "input": {}}}))
                    out.append(_event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": dumps(call.arguments)}}))
                    out.append(_event("content_block_stop", {"index": index}))
                continue
            text = piece.thinking if kind == "thinking" else piece.content
            if not text:
                continue
            if open_kind is None:
                index += 1
                open_kind = kind
                block = {"type": "thinking", "thinking": "", "signature": ""} \
                    if kind == "thinking" else {"type": "text", "text": ""}
                out.append(_event("content_block_start", {"index": index,
                                                          "content_block": block}))
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
                else {"type": "text_delta", "text": text}
            out.append(_event("content_block_delta", {"index": index, "delta": delta}))
        return out

    stream = Streamed(items, turn)
    async for parsed in stream:
        for line in to_events(parsed):
            yield line
    reply = stream.reply
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    request.state.tokens = len(reply.tokens)
    reason, sequence = _stop_reason(reply, calls)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": len(reply.tokens),
                                             "cache_read_input_tokens": reply.cached_tokens}})
    yield _event("message_stop", {})
