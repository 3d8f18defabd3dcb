"""One renderer/parser path for every API: a conversation (the renderer's message shape) in,
the prompt out; the reply's text in, content, thinking and tool calls out."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..chat.formats import ParsedMessage, ToolCall, validate_conversation
from ..errors import ConversationError
from ..host import plugin_code
from .engine import RequestError, Service
from .media import attached_media


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatTurn:
    """One assistant turn: the rendered prompt and a parser of its own for the reply."""

    def __init__(self, service: Service, messages: list[dict[str, Any]],
                 tools: list[Any] | None = None, think: bool | None = None) -> None:
        bundle = service.bundle
        if bundle.renderer is None:
            raise RequestError(f"model {service.name} has no chat format: send a raw prompt "
                               "(/v1/completions, /api/generate with raw)")
        try:
            self.messages, self.tools = validate_conversation(messages, tools)
            with plugin_code("renderers", bundle.renderer_name):
                self.prompt = bundle.renderer.render(self.messages, self.tools, think=think,
                                                     add_generation_prompt=True)
            # no parser to find calls in the reply (the default model's): tools would be
            # dropped unseen; refused, as Ollama refuses them
            if self.tools and bundle.parser_name is None:
                raise RequestError(f"{service.name} does not support tools (it has no tool "
                                   "call parser)", param="tools")
        except ConversationError as exc:
            raise RequestError(str(exc).splitlines()[0], param="messages") from None
        self._parser_name = bundle.parser_name
        self.parser = parser = bundle.new_parser()
        if parser is not None:
            self._parsing(lambda: parser.reset(self.prompt, tools=self.tools))

    def _parsing(self, call: Callable[[], Any]) -> Any:
        with plugin_code("parsers", self._parser_name):
            return call()

    def parse(self, text: str) -> ParsedMessage:
        """The whole reply split (no parser: all of it is content)."""
        if self.parser is None:
            return ParsedMessage(content=text)
        parser = self.parser
        return self._parsing(lambda: parser.parse(text))

    def feed(self, text: str) -> list[ParsedMessage]:
        if self.parser is None:
            return [ParsedMessage(content=text)] if text else []
        parser = self.parser
        return self._parsing(lambda: parser.feed(text))

    def finish(self) -> list[ParsedMessage]:
        if self.parser is None:
            return []
        parser = self.parser
        return self._parsing(parser.finish)


async def chat_prompt(service: Service, messages: list[dict[str, Any]],
                      tools: list[Any] | None = None, think: bool | None = None
                      ) -> tuple[ChatTurn, Sequence[int]]:
    """The turn and its prompt ids (the media its messages hold placed), rendered and
    encoded off the event loop (a long conversation takes a while, an image's preprocessing
    too, and other clients' streams go on meanwhile)."""
    def build() -> tuple[ChatTurn, Sequence[int]]:
        turn = ChatTurn(service, messages, tools, think)
        media = attached_media(turn.messages)
        return turn, service.place_media(service.encode(turn.prompt, rendered=True), media)

    return await asyncio.to_thread(build)


async def raw_prompt(service: Service, text: str,
                     media: Sequence[tuple[str, bytes]] = ()) -> Sequence[int]:
    """A raw prompt's ids (``media`` at the placeholders it writes), encoded off the event
    loop."""
    def build() -> Sequence[int]:
        return service.place_media(service.encode(text, rendered=False), media, "images")

    return await asyncio.to_thread(build)


def arguments_json(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)
