"""Gemma 4 renderers: ``gemma4-small``, ``gemma4-large``, ``gemma4-nemotron`` and ``gemma4``.

Plain Python reproductions of Google's published Gemma 4 chat templates
(2026-07-09), byte-identical (as transformers renders them) on every
conversation ``mlxrunner.validate_conversation`` accepts:

- ``gemma4-small`` (E2B, E4B) and ``gemma4-large`` (26B, 31B) differ only in
  the generation prompt: with thinking off, large opens an empty thought
  channel after ``<|turn>model\\n``;
- ``gemma4-nemotron`` is ``gemma4-small`` with an assistant turn's content
  written before its tool calls (content, tool calls, tool responses), for
  models trained that way; it is chosen by name only;
- ``gemma4`` picks small or large from the model's name (a size like ``26b``
  or ``31b``, 12B or more) or parameter count (>= 12e9), small by default.

There are no intentional differences. The template's quirks are kept on
purpose, because the model saw them in training:

- thinking is off unless ``think=True`` (the template's default);
- tool results are folded into the assistant turn that called them and
  closing ``<turn|>`` is left out when the conversation ends in tool results
  (no generation prompt follows them unless thinking is on, which opens a
  thought channel);
- a tool result whose ``tool_call_id`` matches no call takes its own ``name``
  (else ``unknown``); one without ``tool_call_id`` takes the name of the last
  call that has no ``id`` either (the template compares the two missing
  values as equal); tool messages that follow no tool-calling assistant
  message are dropped;
- keys of argument objects are sorted case-insensitively (Jinja's
  ``dictsort``) and strings are wrapped in ``<|"|>`` without escaping;
- a schema's non-string values are written the way Jinja writes Python
  values (``str``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxrunner.plugin import ConversationError, RenderContext, validate_conversation

Q = '<|"|>'  # Gemma's string delimiter token
STANDARD_SCHEMA_KEYS = ("description", "type", "properties", "required", "nullable")
_MISSING = object()


# -- Jinja's view of values ----------------------------------------------------------------


def _get(value: Any, key: str) -> Any:
    """``value[key]`` as the template sees it: missing (or not a dict) is undefined."""
    if isinstance(value, Mapping):
        return value.get(key, _MISSING)
    return _MISSING


def _truthy(value: Any) -> bool:
    return value is not _MISSING and bool(value)


def _text(value: Any) -> str:
    """``{{ value }}``."""
    return "" if value is _MISSING else str(value)


def _upper(value: Any) -> str:
    """``value | upper``."""
    return _text(value).upper()


def _dictsort(mapping: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Jinja's ``dictsort``: by key, case-insensitively, stable."""
    return sorted(mapping.items(), key=lambda item: item[0].lower()
                  if isinstance(item[0], str) else item[0])


def _iterate(value: Any, where: str) -> list[Any]:
    if value is _MISSING:
        return []
    if isinstance(value, Mapping):
        return list(value.keys())
    if isinstance(value, (str, list, tuple)):
        return list(value)
    raise ConversationError(f"{where}: {value!r} cannot be listed in the gemma4 format")


def _is_sequence(value: Any) -> bool:
    """Jinja's ``sequence`` test for JSON values: strings, lists and dicts."""
    return isinstance(value, (str, list, tuple, Mapping))


def format_argument(value: Any, escape_keys: bool = True) -> str:
    if value is _MISSING:  # Jinja's undefined passes the template's sequence test, empty
        return "[]"
    if value is None:
        return "null"
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        items = []
        for key, item in _dictsort(value):
            name = Q + key + Q if escape_keys else key
            items.append(name + ":" + format_argument(item, escape_keys))
        return "{" + ",".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_argument(item, escape_keys) for item in value) + "]"
    return _text(value)


# -- tool declarations ---------------------------------------------------------------------


def _quoted_list(values: list[Any]) -> str:
    return ",".join(Q + _text(item) + Q for item in values)


def _format_items(items: Mapping[str, Any], where: str) -> str:
    pieces = []
    for key, value in _dictsort(items):
        if value is None:
            continue
        if key == "properties":
            body = format_parameters(value, where) if isinstance(value, Mapping) else ""
            pieces.append("properties:{" + body + "}")
        elif key == "required":
            pieces.append("required:[" + _quoted_list(_iterate(value, where)) + "]")
        elif key == "type":
            if isinstance(value, str):
                pieces.append("type:" + format_argument(value.upper()))
            else:
                uppers = [_upper(v) for v in _iterate(value, where)]
                pieces.append("type:" + format_argument(uppers))
        else:
            pieces.append(key + ":" + format_argument(value))
    return "items:{" + ",".join(pieces) + "}"


def format_parameters(properties: Mapping[str, Any], where: str,
                      filter_keys: bool = False) -> str:
    declarations = []
    for key, value in _dictsort(properties):
        if filter_keys and key in STANDARD_SCHEMA_KEYS:
            continue
        fields = []
        if _truthy(_get(value, "description")):
            fields.append("description:" + Q + _text(value["description"]) + Q)
        kind = _upper(_get(value, "type"))
        if kind == "STRING":
            if _truthy(_get(value, "enum")):
                fields.append("enum:" + format_argument(value["enum"]))
        elif kind == "ARRAY":
            items = _get(value, "items")
            if isinstance(items, Mapping) and items:
                fields.append(_format_items(items, where))
        if _truthy(_get(value, "nullable")):
            fields.append("nullable:true")
        if kind == "OBJECT":
            nested = _get(value, "properties")
            if isinstance(nested, Mapping):
                fields.append("properties:{" + format_parameters(nested, where) + "}")
            elif isinstance(value, Mapping):
                fields.append("properties:{" + format_parameters(value, where, True) + "}")
            required = _get(value, "required")
            if _truthy(required):
                fields.append("required:[" + _quoted_list(_iterate(required, where)) + "]")
        fields.append("type:" + Q + kind + Q)
        declarations.append(_text(key) + ":{" + ",".join(fields) + "}")
    return ",".join(declarations)


def format_function_declaration(tool: Mapping[str, Any], where: str) -> str:
    function = tool["function"]
    out = ["declaration:" + _text(_get(function, "name")) + "{description:" + Q
           + _text(_get(function, "description")) + Q]
    params = _get(function, "parameters")
    if _truthy(params):
        out.append(",parameters:{")
        if _truthy(_get(params, "properties")):
            out.append("properties:{" + format_parameters(params["properties"], where) + "},")
        if _truthy(_get(params, "required")):
            out.append("required:[" + _quoted_list(_iterate(params["required"], where)) + "],")
        if _truthy(_get(params, "type")):
            out.append("type:" + Q + _upper(params["type"]) + Q + "}")
    if "response" in function:
        response = function["response"]
        out.append(",response:{")
        if _truthy(_get(response, "description")):
            out.append("description:" + Q + _text(response["description"]) + Q + ",")
        if _upper(_get(response, "type")) == "OBJECT":
            out.append("type:" + Q + _upper(response["type"]) + Q + "}")
    out.append("}")
    return "".join(out).strip()


# -- messages ------------------------------------------------------------------------------


def strip_thinking(text: str) -> str:
    """Drop ``<|channel>...<channel|>`` spans from model content, then trim."""
    kept = []
    for part in text.split("<channel|>"):
        kept.append(part.split("<|channel>")[0] if "<|channel>" in part else part)
    return "".join(kept).strip()


MEDIA = {"image": "<|image|>", "image_url": "<|image|>", "audio": "<|audio|>",
         "input_audio": "<|audio|>", "video": "<|video|>"}


def tool_response_block(name: str, response: Any) -> str:
    if isinstance(response, Mapping):
        fields = ",".join(key + ":" + format_argument(value, escape_keys=False)
                          for key, value in _dictsort(response))
        body = "response:" + name + "{" + fields + "}"
    else:
        body = "response:" + name + "{value:" + format_argument(response, escape_keys=False) + "}"
    return "<|tool_response>" + body + "<tool_response|>"


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    for key in ("reasoning", "reasoning_content", "thinking"):
        if message.get(key):
            return message[key]
    return None


class Gemma4Renderer:
    """One Gemma 4 variant; see the module docstring."""

    stop_markers = ("<turn|>", "<|tool_response>")

    def __init__(self, context: RenderContext | None = None, *, variant: str = "small") -> None:
        if variant not in ("small", "large", "nemotron"):
            raise ValueError(f"unknown gemma4 variant {variant!r}")
        self.variant = variant
        self.name = "gemma4-" + variant
        self.context = context
        bos = context.bos_token if context is not None else None
        self.bos_token = "<bos>" if bos is None else bos

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None, *,
               think: bool | None = None, add_generation_prompt: bool = True) -> str:
        messages, tools = validate_conversation(messages, tools)
        thinking = bool(think)
        out = [self.bos_token]
        prev_type: str | None = None
        loop_messages = messages
        first = messages[0]
        if thinking or tools or first["role"] in ("system", "developer"):
            out.append("<|turn>system\n")
            if thinking:
                out.append("<|think|>\n")
                prev_type = "think"
            if first["role"] in ("system", "developer"):
                content = first.get("content")
                if isinstance(content, str):
                    out.append(content.strip())
                elif content is not None:
                    for part in content:
                        out.append(_text(part.get("text", _MISSING)).strip() + " ")
                loop_messages = messages[1:]
            if tools:
                for i, tool in enumerate(tools):
                    out.append("<|tool>" + format_function_declaration(tool, f"tool {i}")
                               + "<tool|>")
                prev_type = "tool"
            out.append("<turn|>\n")

        last_user = -1
        for i, message in enumerate(loop_messages):
            if message["role"] == "user":
                last_user = i

        prev_non_tool_role = None
        for index, message in enumerate(loop_messages):
            if message["role"] == "tool":
                continue  # written with the assistant message that called it
            prev_type = None
            role = "model" if message["role"] == "assistant" else message["role"]
            if not (role == "model" and prev_non_tool_role == "assistant"):
                out.append("<|turn>" + role + "\n")
            reasoning = reasoning_of(message)
            if reasoning and index > last_user:
                out.append("<|channel>thought\n" + reasoning + "\n<channel|>")

            calls = message.get("tool_calls")
            content = self._content(message, role)
            if self.variant == "nemotron":
                out.append(content)
            if calls:
                for call in calls:
                    function = call["function"]
                    arguments = ",".join(key + ":" + format_argument(value, escape_keys=False)
                                         for key, value in _dictsort(function["arguments"]))
                    out.append("<|tool_call>call:" + function["name"] + "{" + arguments
                               + "}<tool_call|>")
                prev_type = "tool_call"

            responded = False
            if message.get("tool_responses"):
                for response in message["tool_responses"]:
                    name = response.get("name") or "unknown"
                    if not isinstance(name, str):
                        where = index + len(messages) - len(loop_messages)
                        raise ConversationError(f"message {where}: a tool response name must "
                                                "be a string")
                    out.append(tool_response_block(name, response.get("response", _MISSING)))
                    responded = True
                    prev_type = "tool_response"
            elif calls:
                for follow in loop_messages[index + 1:]:
                    if follow["role"] != "tool":
                        break
                    out.append(self._tool_result(follow, calls))
                    responded = True
                    prev_type = "tool_response"

            if self.variant != "nemotron":
                out.append(content)
            has_content = bool(content.strip())

            next_role = next((m["role"] for m in loop_messages[index + 1:]
                              if m["role"] != "tool"), None)
            continues = (role == "model" and next_role == "assistant"
                         and (not calls or responded))
            if prev_type == "tool_call" and not responded:
                out.append("<|tool_response>")
            elif continues:
                pass
            elif not (responded and not has_content and next_role is None):
                out.append("<turn|>\n")
            prev_non_tool_role = message["role"]

        if add_generation_prompt:
            if prev_type not in ("tool_response", "tool_call"):
                out.append("<|turn>model\n")
                if self.variant == "large" and not thinking:
                    out.append("<|channel>thought\n<channel|>")
            elif prev_type == "tool_response" and thinking:
                out.append("<|channel>thought\n")
        return "".join(out)

    @staticmethod
    def _content(message: Mapping[str, Any], role: str) -> str:
        content = message.get("content")
        if isinstance(content, str):
            return strip_thinking(content) if role == "model" else content.strip()
        pieces = []
        for part in content or ():
            kind = part.get("type")
            if kind == "text":
                text = part["text"]
                pieces.append(strip_thinking(text) if role == "model" else text.strip())
            elif kind in MEDIA:
                pieces.append(MEDIA[kind])
        return "".join(pieces)

    @staticmethod
    def _tool_result(follow: Mapping[str, Any], calls: list[dict[str, Any]]) -> str:
        name = follow.get("name") or "unknown"
        for call in calls:
            if call.get("id") == follow.get("tool_call_id"):
                name = call["function"]["name"]
        body = follow.get("content")
        if isinstance(body, str) or body is None:
            return tool_response_block(name, body)
        text = "".join(part.get("text", "") for part in body if part.get("type") == "text")
        media = "".join(MEDIA[part["type"]] for part in body if part.get("type") in MEDIA)
        return tool_response_block(name, text) + media


_SIZE = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)b(?![a-z0-9])")
LARGE_PARAMETERS = 12e9


def is_large(context: RenderContext | None) -> bool:
    """Large (26B, 31B) by the name's size tag or the parameter count; small otherwise."""
    if context is None:
        return False
    if context.num_parameters is not None and context.num_parameters >= LARGE_PARAMETERS:
        return True
    name = (context.model_name or "").lower()
    return any(float(size) * 1e9 >= LARGE_PARAMETERS for size in _SIZE.findall(name))


def small(context: RenderContext | None = None) -> Gemma4Renderer:
    return Gemma4Renderer(context, variant="small")


def large(context: RenderContext | None = None) -> Gemma4Renderer:
    return Gemma4Renderer(context, variant="large")


def nemotron(context: RenderContext | None = None) -> Gemma4Renderer:
    return Gemma4Renderer(context, variant="nemotron")


def auto(context: RenderContext | None = None) -> Gemma4Renderer:
    """``gemma4``: small or large, chosen from the model (see ``is_large``)."""
    return Gemma4Renderer(context, variant="large" if is_large(context) else "small")
