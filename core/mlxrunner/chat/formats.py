"""Chat formats: the renderer and parser interfaces, conversation validation, lookup.

A *renderer* turns a conversation (OpenAI-style messages), a tool list and a
thinking choice into the prompt text a model was trained on. A *parser* turns
the model's output back into content, thinking and tool calls, also while it
streams. Both are registered by plugins under a name (hooks
``register_renderers`` / ``register_parsers``) as factories called with a
:class:`RenderContext`.

Messages, in the shape every renderer accepts (see ``validate_conversation``)::

    {"role": "system" | "developer" | "user" | "assistant" | "tool",
     "content": "text" | [{"type": "text", "text": "..."}, {"type": "image"}, ...] | None,
     "images": ["<base64>", ...],            # Ollama's form: image parts before the content
     "reasoning_content": "...",            # assistant only; also "reasoning" or "thinking"
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "f", "arguments": {...}}}],   # assistant only
     "name": "f", "tool_call_id": "call_1"}  # tool results

Content parts: ``text`` (with a string ``text``) and the media parts ``image`` /
``image_url``, ``audio`` / ``input_audio`` and ``video``. A renderer writes only the
model's placeholder for a media part; the media itself travels beside the prompt, matched
to the placeholders in the order :func:`media_parts` lists them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import ConversationError
from ..host import manager as plugins

ROLES = ("system", "developer", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "image_url", "video", "audio", "input_audio")
#: each media part type's modality. Templates recognise media by these names as part types
#: and (Qwen's) as keys, so a part may carry only keys of its own modality: then every
#: template, and media_parts, take it for the same thing.
MEDIA_MODALITY = {"image": "image", "image_url": "image", "video": "video",
                  "audio": "audio", "input_audio": "audio"}
# Names a message's reasoning may arrive under; transformers aliases them the same way.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = dict[str, Any]
Tool = dict[str, Any]


# -- context -------------------------------------------------------------------------------


@dataclass
class RenderContext:
    """What a renderer or parser factory may know about the model it serves.

    ``chat_template``: the model folder's Jinja template (the ``jinja`` renderer
    needs it). ``special_tokens``: the tokenizer's special-token map by role, as
    transformers' ``special_tokens_map`` (e.g. ``{"bos_token": "<bos>",
    "pad_token": "<pad>"}``); the ``jinja`` renderer hands it to the template.
    ``extra``: anything else; the ``jinja`` renderer reads
    ``extra["template_kwargs"]`` (a dict of extra template variables).
    """

    model_name: str | None = None
    num_parameters: int | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# -- renderer and parser interfaces --------------------------------------------------------


@runtime_checkable
class Renderer(Protocol):
    """Turns a conversation into prompt text.

    ``think``: ``None`` keeps the format's default, ``True``/``False`` switch
    thinking on or off. A malformed conversation raises ``ConversationError``.
    """

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None, *,
               think: bool | None = None, add_generation_prompt: bool = True) -> str: ...


@dataclass
class ToolCall:
    """One call the model asked for; ``arguments`` is always an object."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_message(self, call_id: str | None = None) -> dict[str, Any]:
        """The OpenAI-style entry for an assistant message's ``tool_calls``."""
        entry: dict[str, Any] = {"type": "function",
                                 "function": {"name": self.name, "arguments": self.arguments}}
        if call_id is not None:
            entry = {"id": call_id, **entry}
        return entry


@dataclass
class ParsedMessage:
    """A parsed model reply, or one streamed piece of it (a *delta*).

    Parsers stream deltas that each carry one piece, in output order: some
    ``content`` text, some ``thinking`` text, or one finished tool call in
    ``tool_calls``. ``add`` folds a delta into a running message.
    """

    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """For a delta: ``"tool_call"``, ``"thinking"`` or ``"content"``."""
        if self.tool_calls:
            return "tool_call"
        return "thinking" if self.thinking else "content"

    def add(self, delta: ParsedMessage) -> ParsedMessage:
        self.content += delta.content
        self.thinking += delta.thinking
        self.tool_calls.extend(delta.tool_calls)
        return self

    def to_message(self) -> dict[str, Any]:
        """An assistant message holding this reply (for the next turn's history)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.thinking:
            message["reasoning_content"] = self.thinking
        if self.tool_calls:
            message["tool_calls"] = [call.to_message() for call in self.tool_calls]
        return message


@runtime_checkable
class Parser(Protocol):
    """Splits model output into content, thinking and tool calls, incrementally.

    ``reset(prompt=None, *, start_in_thinking=None, tools=None)`` starts a new
    reply: whether output begins inside thinking is taken from
    ``start_in_thinking`` or, when that is ``None``, from the end of the
    rendered ``prompt`` (e.g. Qwen's ``<think>\\n``); ``tools`` (the tool list
    the prompt declared) lets a parser type argument values. ``feed(chunk)``
    returns the deltas (:class:`ParsedMessage`) that are certain so far; text
    that may be the start of a marker is held back until the next chunk.
    ``finish()`` flushes the rest. ``parse(text)`` does all three on one text
    (with the settings of the last ``reset``) and returns the whole message.
    No text is lost: what cannot be parsed comes back as content.
    """

    def reset(self, prompt: str | None = None, *, start_in_thinking: bool | None = None,
              tools: Sequence[Mapping[str, Any]] | None = None) -> None: ...

    def feed(self, chunk: str) -> list[ParsedMessage]: ...

    def finish(self) -> list[ParsedMessage]: ...

    def parse(self, text: str) -> ParsedMessage: ...


# -- validation ----------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def _check_json(value: Any, where: str) -> Any:
    """A plain-JSON copy of ``value`` (dict keys strings), or ConversationError."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConversationError(f"{where}: object key {key!r} is not a string")
            out[key] = _check_json(item, where)
        return out
    if isinstance(value, (list, tuple)):
        return [_check_json(item, where) for item in value]
    raise ConversationError(f"{where}: {type(value).__name__} is not a JSON value")


def _check_content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ConversationError(f"{where}: content must be a string, a list of parts or null, "
                                f"not {_type_name(content)}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ConversationError(f"{where}: content part {j} must be an object, "
                                    f"not {_type_name(part)}")
        kind = part.get("type")
        if kind not in PART_TYPES:
            expected = ", ".join(PART_TYPES)
            raise ConversationError(f"{where}: content part {j} has type {kind!r} "
                                    f"(expected one of {expected})")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ConversationError(f"{where}: content part {j} (text) needs a string 'text'")
        part = _check_json(part, f"{where}: content part {j}")
        _check_media_keys(part, kind, f"{where}: content part {j} ({kind})")
        parts.append(part)
    return parts


def _check_media_keys(part: Mapping[str, Any], kind: str, where: str) -> None:
    """The media keys a part carries: of its own modality, each in a shape clients send.
    Whether the media data is there at all is for whoever reads it (the server)."""
    modality = MEDIA_MODALITY.get(kind)
    for key, key_modality in MEDIA_MODALITY.items():
        if key in part and key_modality != modality:
            raise ConversationError(f"{where}: carries {key_modality} data ({key!r}); "
                                    "give each image, audio or video its own part")
    if "image_url" in part:  # OpenAI's {"url": ...}; some clients send the URL alone
        url = part["image_url"]
        if not isinstance(url, str) and not (
                isinstance(url, Mapping) and isinstance(url.get("url", ""), str)):
            raise ConversationError(f"{where}: 'image_url' must be a URL string or an "
                                    "object with a string 'url'")
    if "input_audio" in part:  # OpenAI's {"data": base64, "format": "wav"}
        audio = part["input_audio"]
        if not isinstance(audio, Mapping) or not all(
                isinstance(audio.get(k, ""), str) for k in ("data", "format")):
            raise ConversationError(f"{where}: 'input_audio' must be an object with string "
                                    "'data' and 'format'")
    for key in ("image", "audio", "data"):
        if modality is not None and key in part and not isinstance(part[key], str):
            raise ConversationError(f"{where}: {key!r} must be a string "
                                    f"(a URL, a path or base64), not {_type_name(part[key])}")
    if "video" in part and not (isinstance(part["video"], str) or (
            isinstance(part["video"], (list, tuple))
            and all(isinstance(frame, str) for frame in part["video"]))):
        raise ConversationError(f"{where}: 'video' must be a string or a list of frames")


def _image_parts(images: Any, where: str) -> list[dict[str, Any]]:
    """Ollama's ``images`` (base64 strings) as image parts carrying them as ``data``."""
    if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
        raise ConversationError(f"{where}: 'images' must be a list of base64 strings, "
                                f"not {_type_name(images)}")
    for j, image in enumerate(images):
        if not isinstance(image, str):
            raise ConversationError(f"{where}: image {j} must be a base64 string, "
                                    f"not {_type_name(image)}")
    return [{"type": "image", "data": image} for image in images]


def _parse_arguments(arguments: Any, where: str) -> dict[str, Any]:
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ConversationError(f"{where}: arguments are not valid JSON ({exc})") from None
    if not isinstance(arguments, Mapping):
        raise ConversationError(f"{where}: arguments must be a JSON object, "
                                f"not {_type_name(arguments)}")
    return _check_json(arguments, where)


def _check_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ConversationError(f"{where}: must be an object, not {_type_name(call)}")
    # Accept the flat form {"name", "arguments"} too; renderers get the nested one.
    function = call.get("function", call if "name" in call else None)
    if not isinstance(function, Mapping):
        raise ConversationError(f"{where}: needs a 'function' object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ConversationError(f"{where}: has no function name")
    out: dict[str, Any] = {}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise ConversationError(f"{where}: 'id' must be a string")
        out["id"] = call["id"]
    if call.get("type") is not None:
        if call["type"] != "function":
            raise ConversationError(f"{where}: type {call['type']!r} is not 'function'")
        out["type"] = "function"
    out["function"] = {"name": name,
                       "arguments": _parse_arguments(function.get("arguments"), where)}
    return out


def _check_schema(schema: Any, where: str) -> None:
    """The parts of a JSON schema renderers walk: properties of objects, required names."""
    if not isinstance(schema, Mapping):
        return
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, Mapping):
            raise ConversationError(f"{where}: 'properties' must be an object")
        for key, sub in properties.items():
            if not isinstance(sub, Mapping):
                raise ConversationError(f"{where}: property {key!r} must be a schema object, "
                                        f"not {_type_name(sub)}")
            _check_schema(sub, f"{where}.{key}")
    required = schema.get("required")
    if required is not None and (not isinstance(required, (list, tuple))
                                 or not all(isinstance(r, str) for r in required)):
        raise ConversationError(f"{where}: 'required' must be a list of names")
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, str) and not (
            isinstance(kind, (list, tuple)) and all(isinstance(k, str) for k in kind)):
        raise ConversationError(f"{where}: 'type' must be a string or a list of strings")
    if isinstance(schema.get("items"), Mapping):
        _check_schema(schema["items"], f"{where}.items")


def _check_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tool {index}"
    if not isinstance(tool, Mapping):
        raise ConversationError(f"{where}: must be an object, not {_type_name(tool)}")
    tool = _check_json(tool, where)
    if "function" not in tool and "name" in tool:
        tool = {"type": "function", "function": tool}  # the flat form, wrapped
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ConversationError(f"{where}: expected {{'type': 'function', 'function': {{...}}}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ConversationError(f"{where}: has no function name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ConversationError(f"{where}: 'description' must be a string")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise ConversationError(f"{where}: 'parameters' must be a JSON schema object")
        _check_schema(parameters, f"{where} ({function['name']}) parameters")
    return tool


def validate_conversation(messages: Any, tools: Any = None
                          ) -> tuple[list[Message], list[Tool] | None]:
    """Check a conversation and return normalised copies ``(messages, tools)``.

    Raises ``ConversationError`` with one line naming the message (or tool) and
    the problem. Normalising: keys whose value is null are dropped (as
    transformers does), tool-call arguments given as a JSON string become an
    object (null or empty: ``{}``), flat tool calls / tools
    (``{"name", "arguments"}``) get the nested ``function`` form, Ollama's ``images``
    become image parts (``{"type": "image", "data": ...}``) before the message's content.
    Media parts are checked for shape only (a part holds one modality; ``image_url`` is a
    URL or ``{"url"}``, ``input_audio`` is ``{"data", "format"}``), not for their data.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ConversationError(f"messages must be a list, not {_type_name(messages)}")
    if not messages:
        raise ConversationError("the conversation has no messages")
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"message {i}"
        if not isinstance(message, Mapping):
            raise ConversationError(f"{where}: must be an object, not {_type_name(message)}")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            if role is None:
                raise ConversationError(f"{where}: has no role")
            raise ConversationError(f"{where}: unknown role {role!r} "
                                    f"(expected one of {', '.join(ROLES)})")
        where = f"message {i} ({role})"
        for key in message:
            if not isinstance(key, str):
                raise ConversationError(f"{where}: key {key!r} is not a string")
        if "content" in message:
            message["content"] = _check_content(message["content"], where)
        if "images" in message:
            # Ollama writes each image's placeholder before the message's text
            images = _image_parts(message.pop("images"), where)
            content = message.get("content")
            if images:
                if isinstance(content, str):
                    content = [{"type": "text", "text": content}]
                message["content"] = images + (content or [])
        reasoning = [(k, message[k]) for k in REASONING_FIELDS if k in message]
        for key, value in reasoning:
            if role != "assistant":
                raise ConversationError(f"{where}: {key!r} is only allowed on assistant messages")
            if not isinstance(value, str):
                raise ConversationError(f"{where}: {key!r} must be a string, "
                                        f"not {_type_name(value)}")
        if len({value for _, value in reasoning}) > 1:
            names = " and ".join(k for k, _ in reasoning)
            raise ConversationError(f"{where}: {names} disagree; give the reasoning once")
        if "tool_calls" in message:
            calls = message["tool_calls"]
            if role != "assistant":
                raise ConversationError(f"{where}: only assistant messages have tool_calls")
            if not isinstance(calls, (list, tuple)):
                raise ConversationError(f"{where}: tool_calls must be a list, "
                                        f"not {_type_name(calls)}")
            message["tool_calls"] = [_check_tool_call(call, f"{where}: tool call {j}")
                                     for j, call in enumerate(calls)]
        if "tool_responses" in message:
            responses = message["tool_responses"]
            if role != "assistant" or not isinstance(responses, (list, tuple)) or not all(
                    isinstance(r, Mapping) for r in responses):
                raise ConversationError(f"{where}: tool_responses must be a list of objects "
                                        "on an assistant message")
            message["tool_responses"] = _check_json(responses, where)
        for key in ("name", "tool_call_id"):
            if key in message and not isinstance(message[key], str):
                raise ConversationError(f"{where}: {key!r} must be a string")
        out.append(message)
    if tools is None:
        return out, None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ConversationError(f"tools must be a list, not {_type_name(tools)}")
    return out, [_check_tool(tool, i) for i, tool in enumerate(tools)]


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """A validated message's reasoning, under whichever name it came."""
    for key in REASONING_FIELDS:
        if isinstance(message.get(key), str):
            return message[key]
    return None


def media_parts(messages: Any) -> list[tuple[str, dict[str, Any]]]:
    """The conversation's media content parts as ``(modality, part)``, in render order.

    ``modality`` is ``"image"`` (parts ``image``, ``image_url``, Ollama's ``images``),
    ``"audio"`` (``audio``, ``input_audio``) or ``"video"``; ``part`` is the part as
    :func:`validate_conversation` returns it (an ``images`` entry is ``{"type": "image",
    "data": base64}``). The order is the messages' and, in each, the parts': the order in
    which a template writes their placeholders, so the media attached to a conversation
    go to its prompt's placeholders one for one. A template may drop a part it has no place
    for (Gemma 4 writes none for media in the system message) or, for Gemma 4, write an
    assistant turn's own media after the tool results folded into it: whoever places the
    media should check that the prompt holds as many placeholders as this lists. A
    malformed conversation raises ``ConversationError`` as ``validate_conversation`` does.
    """
    checked, _ = validate_conversation(messages)
    found: list[tuple[str, dict[str, Any]]] = []
    for message in checked:
        content = message.get("content")
        if isinstance(content, list):
            found.extend((MEDIA_MODALITY[part["type"]], part) for part in content
                         if part["type"] in MEDIA_MODALITY)
    return found


def load_conversation_file(path: str | os.PathLike[str]
                           ) -> tuple[list[Message], list[Tool] | None]:
    """Read a conversation JSON file: a list of messages or ``{"messages", "tools"}``.

    Returns ``(messages, tools)`` as stored (render validates them); a missing
    file, malformed JSON or a wrong shape is one ``ConversationError`` line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConversationError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConversationError(f"{path}: not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversationError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                                f"{exc.msg}") from None
    if isinstance(data, list):
        return data, None
    if isinstance(data, dict):
        if "messages" not in data:
            raise ConversationError(f"{path}: the object has no 'messages' list")
        messages, tools = data["messages"], data.get("tools")
        if not isinstance(messages, list):
            raise ConversationError(f"{path}: 'messages' must be a list")
        if tools is not None and not isinstance(tools, list):
            raise ConversationError(f"{path}: 'tools' must be a list")
        unknown = sorted(set(data) - {"messages", "tools"})
        if unknown:
            raise ConversationError(f"{path}: unexpected keys {', '.join(unknown)} "
                                    "(expected 'messages' and 'tools')")
        return messages, tools
    raise ConversationError(f"{path}: expected a list of messages or an object with 'messages', "
                            f"not {_type_name(data)}")


# -- lookup --------------------------------------------------------------------------------


def get_renderer(name: str, context: RenderContext | None = None) -> Renderer:
    """The renderer registered as ``name``, built for ``context``. A factory that fails
    raises :class:`~mlxrunner.errors.PluginFailedError` naming the renderer and its plugin
    (its own :class:`~mlxrunner.errors.MLXRunnerError` passes as it is)."""
    factory = plugins.lookup("renderers", name).obj
    with plugins.plugin_code("renderers", name):
        return factory(context if context is not None else RenderContext())


def get_parser(name: str, context: RenderContext | None = None) -> Parser:
    """The parser registered as ``name``, built for ``context``; call ``reset`` per reply.
    A factory that fails raises as :func:`get_renderer`'s does."""
    factory = plugins.lookup("parsers", name).obj
    with plugins.plugin_code("parsers", name):
        return factory(context if context is not None else RenderContext())
