"""``mlxrunner run MODEL`` without a prompt, at a terminal: a multi-turn chat.

Each turn renders the whole conversation with the model's renderer, decodes the reply
(speculatively when the model has a draft), streams it through the model's parser (thinking
shown dimmed, tool calls as JSON lines) and keeps the parsed reply as the assistant's
message for the next turn. ``/clear`` forgets the conversation, ``/bye`` (or end of input)
leaves.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..chat.formats import ParsedMessage
from ..chat.streaming import TextStream
from ..decode.generation import generate
from ..errors import MLXRunnerError
from ..host import plugin_code

PROMPT = ">>> "
HELP = "Type a message; /clear forgets the conversation, /bye leaves."
DIM, RESET = "\x1b[2m", "\x1b[0m"


def chat_loop(bundle: Any, options: Any, *, max_tokens: int, think: bool | None = None,
              system: str | None = None, read: Callable[[str], str] = input,
              write: Callable[[str], Any] | None = None, color: bool = False) -> list[dict]:
    """Run the chat until ``/bye`` or end of input; returns the conversation."""
    import sys

    write = write or sys.stdout.write
    renderer = bundle.renderer
    if renderer is None:
        raise MLXRunnerError(f"{bundle.path}: no chat format to chat with (pass a prompt, "
                             "or --renderer NAME)")
    stop_ids = bundle.stop_token_ids()
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    write(HELP + "\n")
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            write("\n")
            break
        text = line.strip()
        if text in ("/bye", "/exit"):
            break
        if text == "/clear":
            messages = list(opening)
            write("(conversation cleared)\n")
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line})
        with plugin_code("renderers", bundle.renderer_name):
            prompt = renderer.render(messages, None, think=think, add_generation_prompt=True)
        reply = stream_reply(bundle, prompt, options, max_tokens, stop_ids, write, color)
        messages.append(reply.to_message())
    return messages


def stream_reply(bundle: Any, prompt: str, options: Any, max_tokens: int,
                 stop_ids: frozenset[int], write: Callable[[str], Any],
                 color: bool) -> ParsedMessage:
    """Decode one reply to the rendered ``prompt``, writing it as it comes; returns it parsed."""
    parser, tok = bundle.parser, bundle.tokenizer
    reply = ParsedMessage()
    in_thinking = False

    def show(pieces: list[ParsedMessage]) -> None:
        nonlocal in_thinking
        for piece in pieces:
            reply.add(piece)
            if piece.tool_calls:
                for call in piece.tool_calls:
                    write(json.dumps({"tool_call": {"name": call.name,
                                                    "arguments": call.arguments}},
                                     ensure_ascii=False) + "\n")
                continue
            thinking = bool(piece.thinking)
            if color and thinking != in_thinking:
                write(DIM if thinking else RESET)
            in_thinking = thinking
            write(piece.thinking or piece.content)

    def parsed(call: Callable[..., Any], *args: Any) -> Any:
        with plugin_code("parsers", bundle.parser_name):
            return call(*args)

    def feed(chunk: str) -> None:
        show(parsed(parser.feed, chunk) if parser is not None else
             [ParsedMessage(content=chunk)])

    text = TextStream(tok, stop_ids, bundle.stop_strings(), on_text=feed)
    if parser is not None:
        parsed(parser.reset, prompt)
    ids = tok.encode(prompt, add_special_tokens=False)
    generate(bundle.model, ids, options=options, max_tokens=max_tokens, eos_ids=stop_ids,
             on_token=text.add, draft=bundle.draft)
    text.finish()
    if parser is not None:
        show(parsed(parser.finish))
    if color and in_thinking:
        write(RESET)
    write("\n")
    return reply
