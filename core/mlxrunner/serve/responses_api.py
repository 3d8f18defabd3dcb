"""OpenAI's Responses API, stateless: ``POST /v1/responses`` (streamed as its events or not).
Nothing is stored, so ``previous_response_id`` is refused; the conversation comes whole in
``input`` (messages, ``function_call``, ``function_call_output`` and ``reasoning`` items)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..chat.formats import ParsedMessage
from .chat import ChatTurn, arguments_json, call_id, chat_prompt
from .common import (
    Count,
    Seed,
    Streamed,
    TopK,
    complete,
    dumps,
    no_reply,
    service_for,
    streamed,
)
from .engine import Reply, RequestError, Service
from .openai_api import output_format, think_of, tools_for

router = APIRouter()

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Seed | None = Field(default=None, description="mlxrunner: reproducible sampling")
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None


def _text(content: Any, where: str) -> list[dict[str, Any]] | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of parts",
                           param="input")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", part.get("refusal", "")))})
        elif kind == "input_image":  # (its image_url: a data URL, as OpenAI's image_url)
            parts.append({"type": "image_url", "image_url": part.get("image_url")})
        else:
            raise RequestError(f"{where}: a {kind!r} part is not supported", param="input")
    return parts


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` in the renderers' shape."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    reasoning = ""

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input {i}"
        if kind == "message":
            message = {"role": item.get("role"), "content": _text(item.get("content"), where)}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "reasoning":
            texts = item.get("content") or item.get("summary") or []
            if not isinstance(texts, list):
                raise RequestError(f"{where}: a reasoning item's content must be a list",
                                   param="input")
            reasoning += "".join(str(t.get("text", "")) for t in texts if isinstance(t, dict))
        elif kind == "function_call":
            message = assistant()
            if reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            message.setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else _text(output, where)})
        else:
            raise RequestError(f"{where}: items of type {kind!r} are not supported",
                               param="input")
    return out


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise RequestError(f"tools.{i}: only function tools are supported",
                               param="tools")
        tools.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {}}})
    return tools_for(tools or None, body.tool_choice)


def _check(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise RequestError("previous_response_id: this server stores no responses; send the "
                           "whole conversation in input", param="previous_response_id")
    if body.background:
        raise RequestError("background responses are not supported", param="background")


def _ident(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _items(parsed: ParsedMessage) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if parsed.thinking:
        items.append({"type": "reasoning", "id": _ident("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": parsed.thinking}]})
    if parsed.content or not parsed.tool_calls:
        items.append(_message_item(_ident("msg"), parsed.content))
    items += [_call_item(c.name, arguments_json(c)) for c in parsed.tool_calls]
    return items


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _ident("fc"), "call_id": call_id(), "name": name,
            "arguments": arguments, "status": "completed"}


def _response(service: Service, body: ResponsesRequest, response_id: str, created: int,
              output: list[dict[str, Any]], reply: Reply | None) -> dict[str, Any]:
    status, incomplete = "in_progress", None
    usage = None
    if reply is not None:
        done = reply.finish_reason == "stop" or any(i["type"] == "function_call"
                                                    for i in output)
        status = "completed" if done else "incomplete"
        incomplete = None if done else {"reason": "max_output_tokens"}
        usage = {"input_tokens": reply.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": reply.cached_tokens},
                 "output_tokens": len(reply.tokens),
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": reply.prompt_tokens + len(reply.tokens)}
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": incomplete, "model": service.name,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "truncation": body.truncation or "disabled",
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": False, "metadata": body.metadata or {}, "usage": usage}


@router.post("/v1/responses", tags=["openai"])
async def responses(body: ResponsesRequest, request: Request) -> Response:
    _check(body)
    service = await service_for(request, body.model)
    effort = (body.reasoning or {}).get("effort")
    turn, ids = await chat_prompt(service, _messages(body), _tools(body),
                                  think_of(None, effort))
    sampler = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
               "min_p": body.min_p, "seed": body.seed}
    form = output_format((body.text or {}).get("format"), "text.format")
    generation = service.generation(ids, sampler, max_tokens=body.max_output_tokens,
                                    output_format=form, format_field="text.format")
    response_id, created = _ident("resp"), int(time.time())
    if body.stream:
        items = service.engine.stream(generation)  # queued now: a full queue is a 503
        return streamed(request, _events(request, service, body, turn, items, response_id,
                                         created), "text/event-stream", _event_error)
    reply = await complete(request, service, generation)
    if reply is None:
        return no_reply()
    return Response(dumps(_response(service, body, response_id, created,
                                    _items(turn.parse(reply.text)), reply)),
                    media_type="application/json")


def _event_error(message: str) -> str:
    return f"event: error\ndata: {dumps({'type': 'error', 'message': message})}\n\n"


async def _events(request: Request, service: Service, body: ResponsesRequest, turn: ChatTurn,
                  items: AsyncIterator[str | Reply], response_id: str, created: int
                  ) -> AsyncIterator[str]:
    sequence = 0
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the message or reasoning item being streamed
    open_text = ""

    def event(name: str, **payload: Any) -> str:
        nonlocal sequence
        sequence += 1
        data = dumps({"type": name, "sequence_number": sequence, **payload})
        return f"event: {name}\ndata: {data}\n\n"

    def close() -> list[str]:
        nonlocal open_item, open_text
        if open_item is None:
            return []
        index, item_id = len(output), open_item["id"]
        if open_item["type"] == "message":
            part = {"type": "output_text", "text": open_text, "annotations": []}
            done = _message_item(item_id, open_text)
            lines = [event("response.output_text.done", item_id=item_id, output_index=index,
                           content_index=0, text=open_text, logprobs=[]),
                     event("response.content_part.done", item_id=item_id, output_index=index,
                           content_index=0, part=part)]
        else:
            done = {**open_item, "content": [{"type": "reasoning_text", "text": open_text}]}
            lines = [event("response.reasoning_text.done", item_id=item_id,
                           output_index=index, content_index=0, text=open_text)]
        lines.append(event("response.output_item.done", output_index=index, item=done))
        output.append(done)
        open_item, open_text = None, ""
        return lines

    def to_events(pieces: list[ParsedMessage]) -> list[str]:
        nonlocal open_item, open_text
        lines: list[str] = []
        for piece in pieces:
            kind = "message" if piece.kind == "content" else piece.kind
            if kind == "tool_call":
                lines += close()
                for call in piece.tool_calls:
                    item = _call_item(call.name, arguments_json(call))
                    index = len(output)
                    lines += [event("response.output_item.added", output_index=index,
                                    item={**item, "arguments": "", "status": "in_progress"}),
                              event("response.function_call_arguments.delta",
                                    item_id=item["id"], output_index=index,
                                    delta=item["arguments"]),
                              event("response.function_call_arguments.done",
                                    item_id=item["id"], output_index=index,
                                    arguments=item["arguments"]),
                              event("response.output_item.done", output_index=index,
                                    item=item)]
                    output.append(item)
                continue
            text = piece.thinking if kind == "thinking" else piece.content
            if not text:
                continue
            if open_item is not None and open_item["type"] != ("reasoning" if kind == "thinking"
                                                               else "message"):
                lines += close()
            index = len(output)
            if open_item is None:
                if kind == "thinking":
                    open_item = {"type": "reasoning", "id": _ident("rs"), "summary": [],
                                 "content": []}
                    lines.append(event("response.output_item.added", output_index=index,
                                       item=open_item))
                else:
                    open_item = _message_item(_ident("msg"), "", "in_progress")
                    open_item["content"] = []
                    lines += [event("response.output_item.added", output_index=index,
                                    item=open_item),
                              event("response.content_part.added", item_id=open_item["id"],
                                    output_index=index, content_index=0,
                                    part={"type": "output_text", "text": "",
                                          "annotations": []})]
            open_text += text
            name = "response.reasoning_text.delta" if kind == "thinking" \
                else "response.output_text.delta"
            extra: dict[str, Any] = {} if kind == "thinking" else {"logprobs": []}
            lines.append(event(name, item_id=open_item["id"], output_index=index,
                               content_index=0, delta=text, **extra))
        return lines

    started = _response(service, body, response_id, created, [], None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    stream = Streamed(items, turn)
    async for parsed in stream:
        for line in to_events(parsed):
            yield line
    for line in close():
        yield line
    reply = stream.reply
    if not output:  # an empty reply is still one message
        item = _message_item(_ident("msg"), "")
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.output_item.done", output_index=0, item=item)
        output.append(item)
    request.state.tokens = len(reply.tokens)
    final = _response(service, body, response_id, created, output, reply)
    yield event("response.completed" if final["status"] == "completed"
                else "response.incomplete", response=final)
