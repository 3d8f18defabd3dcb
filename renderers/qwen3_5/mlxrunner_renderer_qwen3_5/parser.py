"""The ``qwen3.5`` parser: thinking, content and ``<tool_call>`` blocks from Qwen3.5 output.

Output looks like ``REASONING\\n</think>\\n\\nCONTENT<tool_call>\\n<function=NAME>\\n
<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`` when the
prompt ended inside ``<think>`` (thinking on), or starts at CONTENT otherwise;
a ``<think>`` in the output opens thinking too. Thinking and content come back
with their surrounding whitespace trimmed (the template trims both). A
parameter value loses the one newline the format puts on each side; it is
JSON when it parses (``True``/``False``/``None``, the way the template writes
Python values, too), else a string; a parameter the declared tool types as
``string`` stays a string. ``<|im_end|>`` / ``<|endoftext|>``, a ``</think>``
outside thinking and a ``<think>`` inside it are dropped (text already passed
on as content stays content: give ``reset`` the prompt so that output starting
inside thinking is read as thinking). A tool-call block that does not parse
comes back as content, unchanged; one the output never closed is parsed if it
can be.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxrunner.plugin import ParseEvents, ReplyParser, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_PY_LITERALS = {"True": True, "False": False, "None": None}


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _is_string_type(schema: Any) -> bool:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return kind == "string" or (isinstance(kind, list) and bool(kind) and
                                all(k in ("string", "null") for k in kind))


def _convert(value: str, schema: Any) -> Any:
    if _is_string_type(schema):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return _PY_LITERALS.get(value, value)


class Qwen35Parser(ReplyParser):
    """Streams a Qwen3.5 reply apart; see the module docstring for the format."""

    MARKERS = {
        "think": (THINK_OPEN, THINK_CLOSE, *END_MARKERS),
        "content": (THINK_OPEN, THINK_CLOSE, CALL_OPEN, *END_MARKERS),
        "call": (CALL_CLOSE,),
    }
    BLOCK_STATES = frozenset({"call"})
    THINKING_STATE = "think"
    CALL_OPEN, CALL_CLOSE = CALL_OPEN, CALL_CLOSE

    def prompt_opens_thinking(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(THINK_OPEN)

    def read_tools(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        for tool in tools:
            function = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                properties = parameters.get("properties") if isinstance(parameters, Mapping) \
                    else None
                self.schemas[function["name"]] = dict(properties or {})

    # -- handlers ----------------------------------------------------------------------
    def on_marker(self, marker: str, block: str, events: ParseEvents) -> None:
        if marker == THINK_CLOSE:
            if self.state == "think":
                self.thinking_text.close()
                self.state = "content"
        elif marker == THINK_OPEN:
            if self.state != "think":  # a repeated <think> inside thinking is dropped
                self.thinking_text = self.new_thinking_text()
                self.state = "think"
        elif marker == CALL_OPEN:
            self.state = "call"
        elif marker == CALL_CLOSE:
            self.state = "content"
            self.emit_call(block, events)
        # END_MARKERS: dropped.

    def on_finish(self, block: str | None, events: ParseEvents) -> None:
        if block is not None:  # a tool call the output never closed
            self.emit_call(block, events, closed=False)
        self.restart()  # ready for the next reply with the same settings

    def parse_call(self, block: str) -> ToolCall | None:
        function = _FUNCTION.search(block)
        if function is None:
            return None
        name = function.group(1)
        schema = self.schemas.get(name, {})
        arguments: dict[str, Any] = {}
        for match in _PARAMETER.finditer(block, function.end()):
            key = match.group(1)
            arguments[key] = _convert(_strip_one_newline(match.group(2)), schema.get(key))
        return ToolCall(name=name, arguments=arguments)
