"""Ollama's API: ``/api/chat``, ``/api/generate`` (NDJSON streams by default), ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version`` and ``GET``/``HEAD /``.

One model is loaded for the server's life: ``keep_alive`` is accepted and does not unload it,
and ``/api/ps`` lists it as loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ..bundle import parameter_count
from ..chat.formats import ParsedMessage
from ..decode.grammar import Format, GrammarError
from ..decode.step import compiled_steps
from ..store.store import StoreError, default_store
from .chat import ChatTurn, chat_prompt, raw_prompt
from .common import (
    STOP_STRINGS,
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
from .media import attached_media

router = APIRouter()

try:
    VERSION = metadata.version("mlxrunner")
except metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "0.0.0"

#: Ollama's options with no meaning here (the runtime's own choices); accepted and unused
IGNORED_OPTIONS = ("num_keep", "typical_p", "tfs_z", "mirostat", "mirostat_tau",
                   "mirostat_eta", "penalize_newline", "numa", "num_batch", "num_gpu",
                   "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
                   "use_mlock", "num_thread", "num_ctx")


class Options(BaseModel):
    """Ollama's ``options``: the sampler fields by Ollama's names."""

    model_config = ConfigDict(extra="forbid")

    num_predict: Annotated[StrictInt, Field(ge=-2, le=1 << 31)] | None = Field(
        default=None, description="-1: until the context ends")
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_k: TopK | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Seed | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    repeat_last_n: RecentTokens | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: Annotated[list[StopString], Field(max_length=STOP_STRINGS)] | None = None
    num_keep: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: int | None = None
    num_ctx: Annotated[int, Field(ge=1)] | None = None

    def sampler(self) -> dict[str, Any]:
        return self.model_dump(exclude={"num_predict", "stop", *IGNORED_OPTIONS},
                               exclude_none=True)

    def max_tokens(self) -> int | None:
        if self.num_predict is None:
            return None
        return 1 << 30 if self.num_predict < 0 else max(1, self.num_predict)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    stream: StrictBool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None
    think: StrictBool | str | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def sampler(self) -> dict[str, Any]:
        options = self.options or Options()
        return {**options.sampler(), "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs}

    async def service(self, request: Request) -> Service:
        """The model asked for, loaded (after the checks that need none)."""
        return await service_for(request, self.model, self.keep_alive)

    def unloads(self, request: Request) -> bool:
        """A request with nothing to generate and ``keep_alive`` 0: Ollama's unload."""
        if self.keep_alive in (0, "0", "0s", "0m"):
            models = models_of(request)
            return models.unload(models.known(self.model))
        return False

    def output_format(self) -> Format | None:
        try:
            return Format.parse(self.format)
        except GrammarError as exc:
            raise RequestError(str(exc), param="format") from None

    def thinking(self) -> bool | None:
        if isinstance(self.think, str):  # "low" / "medium" / "high": thinking on
            return self.think.lower() not in ("false", "none", "off")
        return self.think


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Request):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: StrictBool = False
    images: list[str] | None = None


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def counters(reply: Reply) -> dict[str, Any]:
    """The final chunk's counters, as Ollama reports them (nanoseconds). Ollama counts the
    whole prompt in ``prompt_eval_count`` even where its runner's cache held most of it
    (``prompt_eval_duration`` is then the time of the rest) and has no counter of cached
    tokens: ``statistics.cached_tokens`` says how many there were."""
    return {"total_duration": _ns(reply.total_seconds), "load_duration": 0,
            "prompt_eval_count": reply.prompt_tokens,
            "prompt_eval_duration": _ns(reply.prefill_seconds),
            "eval_count": len(reply.tokens), "eval_duration": _ns(reply.decode_seconds),
            "statistics": reply.stats}


def _logprobs(service: Service, reply: Reply) -> dict[str, Any]:
    content = service.logprobs_content(reply)
    return {} if content is None else {"logprobs": content}


def _done_reason(reply: Reply) -> str:
    return "stop" if reply.finish_reason == "stop" else "length"


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages in the renderers' shape (``tool_name`` names a tool's result;
    ``images`` become image parts)."""
    out = []
    for message in messages:
        message = dict(message)
        if "tool_name" in message:
            message["name"] = message.pop("tool_name")
        if not message.get("images"):  # (a list: image parts before the content, made
            message.pop("images", None)  # by validate_conversation, as Ollama places them)
        out.append(message)
    return out


def _ollama_message(parsed: ParsedMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.thinking:
        message["thinking"] = parsed.thinking
    if parsed.tool_calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    return message


def _line(payload: Any) -> str:
    return dumps(payload) + "\n"


def _line_error(message: str) -> str:
    return _line({"error": message})


def _digest(service: Service) -> str:
    return hashlib.sha256(str(service.bundle.path).encode()).hexdigest()


def _details(service: Service) -> dict[str, Any]:
    config = service.bundle.config
    gguf = service.bundle.extra.get("gguf")
    if gguf is not None:  # llama.cpp's file: its own tensor types (the first, the weights')
        level = gguf.type_names()[0] if gguf.type_names() else ""
    elif config.get("quantization"):
        level = f"Q{config['quantization'].get('bits', 4)}"
    else:
        level = str(config.get("dtype", config.get("torch_dtype", "")))
    return {"parent_model": "", "format": "gguf" if gguf is not None else "safetensors",
            "family": str(config.get("model_type", "")),
            "families": [str(config.get("model_type", ""))],
            "parameter_size": _parameter_size(service),
            "quantization_level": level}


def _parameter_size(service: Service) -> str:
    count = parameter_count(service.bundle.model)
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _size(service: Service) -> int:
    """The model's weights on disk: its GGUF file, or its safetensors files."""
    gguf = service.bundle.extra.get("gguf")
    if gguf is not None:
        return int(Path(gguf.path).stat().st_size)
    return sum(f.stat().st_size for f in service.bundle.path.glob("*.safetensors"))


def _model_entry(service: Service) -> dict[str, Any]:
    modified = datetime.fromtimestamp(service.loaded_at, timezone.utc).isoformat()
    return {"name": service.name, "model": service.name, "modified_at": modified,
            "size": _size(service), "digest": _digest(service), "details": _details(service)}


@router.get("/", tags=["ollama"], response_class=PlainTextResponse)
@router.head("/", tags=["ollama"], response_class=PlainTextResponse)
async def root() -> str:
    return "mlxrunner is running"


@router.get("/api/version", tags=["ollama"])
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/api/tags", tags=["ollama"])
async def tags(request: Request) -> dict[str, Any]:
    models = models_of(request)
    entries = []
    for name in models.names():
        service = models.find(name)
        entries.append(_model_entry(service) if service is not None else _unloaded_entry(name))
    return {"models": entries}


def _unloaded_entry(name: str) -> dict[str, Any]:
    """A model not loaded: what the store's manifest says of it (size, when it changed, its
    architecture and precision), or only its name (a registered model not yet pulled, a
    folder of --models-dir)."""
    entry: dict[str, Any] = {"name": name, "model": name, "modified_at": _now(), "size": 0,
                             "digest": hashlib.sha256(name.encode()).hexdigest(),
                             "details": {}}
    try:
        stored = default_store().get(name)
    except StoreError:
        stored = None
    if stored is not None:
        m = stored.manifest
        precision = m.target_precision or ""
        entry.update(size=int(m.size), modified_at=datetime.fromtimestamp(
            m.modified, timezone.utc).isoformat(), details={
            "format": "gguf" if precision.startswith("gguf") else "safetensors",
            "family": m.architecture or "", "families": [m.architecture or ""],
            "quantization_level": precision.removeprefix("gguf ")})
    return entry


@router.get("/api/ps", tags=["ollama"])
async def ps(request: Request) -> dict[str, Any]:
    entries = []
    for service, expires in models_of(request).loaded():
        left = min(expires - time.monotonic(), 100 * 365 * 86400.0)  # inf: never unloaded
        entry = {**_model_entry(service), "size_vram": _size(service),
                 "expires_at": (datetime.now(timezone.utc) + timedelta(seconds=left)
                                ).isoformat()}
        if service.context is not None:
            entry["context_length"] = service.context
        # an extension: the traced step shapes held (bounded: docs/batching.md)
        entry["traced_shapes"] = compiled_steps(service.bundle.model).shapes
        entries.append(entry)
    return {"models": entries}


@router.post("/api/show", tags=["ollama"])
async def show(body: ModelRequest, request: Request) -> dict[str, Any]:
    name = body.model or body.name
    if not name:
        raise RequestError("model is required", param="model")
    service = await service_for(request, name)
    bundle = service.bundle
    info: dict[str, Any] = {"general.architecture": bundle.config.get("model_type", ""),
                            "general.parameter_count": parameter_count(bundle.model)}
    if service.context is not None:
        info["context_length"] = service.context
    capabilities = await asyncio.to_thread(bundle.capabilities)  # (may load encoders)
    defaults = bundle.defaults
    parameters = "\n".join(f"{k} {getattr(defaults, k)}" for k in
                           ("temperature", "top_k", "top_p", "min_p", "repeat_penalty"))
    return {"modelfile": "", "parameters": parameters, "template": "",
            "details": _details(service), "model_info": info, "capabilities": capabilities,
            "renderer": bundle.renderer_name or "", "parser": bundle.parser_name or "",
            "modified_at": _model_entry(service)["modified_at"]}


def _no_text(model: str, reason: str, **empty: Any) -> Response:
    """The one reply to a request that only loads (``reason`` "load") or unloads a model:
    ``empty`` is the route's empty text field."""
    return Response(_line({"model": model, "created_at": _now(), **empty,
                           "done_reason": reason, "done": True}),
                    media_type="application/json")


@router.post("/api/chat", tags=["ollama"])
async def chat(body: ChatRequest, request: Request) -> Response:
    options = body.options or Options()
    if not body.messages and body.unloads(request):
        return _no_text(body.model, "unload", message={"role": "assistant", "content": ""})
    service = await body.service(request)
    if not body.messages:  # Ollama's way to load a model
        return _no_text(service.name, "load", message={"role": "assistant", "content": ""})
    turn, ids = await chat_prompt(service, _messages(body.messages), body.tools,
                                  body.thinking())
    generation = service.generation(ids, body.sampler(), max_tokens=options.max_tokens(),
                                    stops=options.stop, output_format=body.output_format())
    if body.stream:
        items = service.engine.stream(generation)  # queued now: a full queue is a 503
        return streamed(request, _chat_lines(request, service, turn, items),
                        "application/x-ndjson", _line_error)
    reply = await complete(request, service, generation)
    if reply is None:
        return no_reply()
    return Response(dumps({"model": service.name, "created_at": _now(),
                           "message": _ollama_message(turn.parse(reply.text)),
                           "done_reason": _done_reason(reply), "done": True,
                           **_logprobs(service, reply), **counters(reply)}),
                    media_type="application/json")


async def _chat_lines(request: Request, service: Service, turn: ChatTurn,
                      items: AsyncIterator[str | Reply]) -> AsyncIterator[str]:
    def lines(pieces: list[ParsedMessage]) -> list[str]:
        return [_line({"model": service.name, "created_at": _now(),
                       "message": _ollama_message(piece), "done": False})
                for piece in pieces if piece.content or piece.thinking or piece.tool_calls]

    stream = Streamed(items, turn)
    async for parsed in stream:
        for line in lines(parsed):
            yield line
    reply = stream.reply
    request.state.tokens = len(reply.tokens)
    yield _line({"model": service.name, "created_at": _now(),
                 "message": {"role": "assistant", "content": ""},
                 "done_reason": _done_reason(reply), "done": True, **counters(reply)})


@router.post("/api/generate", tags=["ollama"])
async def generate(body: GenerateRequest, request: Request) -> Response:
    if body.template or body.suffix or body.context:
        raise RequestError("template, suffix and context are not supported",
                           param="template" if body.template else
                           "suffix" if body.suffix else "context")
    options = body.options or Options()
    if not body.prompt and body.unloads(request):
        return _no_text(body.model, "unload", response="")
    service = await body.service(request)
    if not body.prompt:  # Ollama's way to load a model
        return _no_text(service.name, "load", response="")
    turn: ChatTurn | None = None
    images = {"images": body.images} if body.images else {}
    if body.raw or service.bundle.renderer is None:
        ids = await raw_prompt(service, body.prompt, attached_media(
            [{"role": "user", "content": "", **images}]))
    else:
        system = body.system if body.system is not None else service.bundle.extra.get("system")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": body.prompt, **images}]
        turn, ids = await chat_prompt(service, messages, None, body.thinking())
    generation = service.generation(ids, body.sampler(), max_tokens=options.max_tokens(),
                                    stops=options.stop, output_format=body.output_format())
    if body.stream:
        items = service.engine.stream(generation)  # queued now: a full queue is a 503
        return streamed(request, _generate_lines(request, service, turn, items),
                        "application/x-ndjson", _line_error)
    reply = await complete(request, service, generation)
    if reply is None:
        return no_reply()
    parsed = turn.parse(reply.text) if turn is not None else ParsedMessage(content=reply.text)
    payload: dict[str, Any] = {"model": service.name, "created_at": _now(),
                               "response": parsed.content}
    if parsed.thinking:
        payload["thinking"] = parsed.thinking
    return Response(dumps({**payload, "done_reason": _done_reason(reply), "done": True,
                           **_logprobs(service, reply), **counters(reply)}),
                    media_type="application/json")


async def _generate_lines(request: Request, service: Service, turn: ChatTurn | None,
                          items: AsyncIterator[str | Reply]) -> AsyncIterator[str]:
    def lines(pieces: list[ParsedMessage]) -> list[str]:
        out = []
        for piece in pieces:
            chunk: dict[str, Any] = {"model": service.name, "created_at": _now(),
                                     "response": piece.content, "done": False}
            if piece.thinking:
                chunk["thinking"] = piece.thinking
            if piece.content or piece.thinking:
                out.append(_line(chunk))
        return out

    reply = Reply()
    async for item in items:
        if isinstance(item, Reply):
            reply = item
        else:
            for line in lines(turn.feed(item) if turn is not None
                              else [ParsedMessage(content=item)]):
                yield line
    if turn is not None:
        for line in lines(turn.finish()):
            yield line
    request.state.tokens = len(reply.tokens)
    yield _line({"model": service.name, "created_at": _now(), "response": "",
                 "done_reason": _done_reason(reply), "done": True, **counters(reply)})
